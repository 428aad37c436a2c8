"""gwenlake-train, sub-commands dispatched before Hydra, data import."""

from __future__ import annotations

from helpers.cli import train_cmd


def test_list_finds_decorated_functions(project):
    proc = train_cmd(project, "--list")
    assert proc.returncode == 0, proc.stderr
    assert "trainer.py:fit  -> t.model  steps=60 eval_every=10" in proc.stdout


def test_unknown_function_is_a_usage_error(project):
    proc = train_cmd(project, "nothing_here")
    assert proc.returncode == 2
    assert "trainer.py:fit" in proc.stderr  # says what exists


def test_subcommands_are_not_overrides(project):
    for cmd in (["tracking", "--help"], ["data", "import", "--help"], ["models", "list", "--help"]):
        proc = project.run(*cmd)
        assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr
    proc = project.run("tracking", "sync", str(project.root / "nowhere"))
    assert proc.returncode == 2 and "tracking" in proc.stderr
    proc = project.run("tracking", "sync", str(project.root / "trainer.py"))  # a file
    assert proc.returncode == 2 and "not the tracking folder of a run" in proc.stderr, proc.stderr


def test_list_finds_decorated_functions_by_syntax_not_by_text(tmp_path, monkeypatch):
    """`gwenlake-train --list` warned "skipping benchmarks/bench_startup.py:fit" for a @train inside a string
    template; a function decorated as gwenlake_hpc.train(...) is found, one in a string is not."""
    from gwenlake_hpc.cli.dispatch import _decorated_functions

    text = ('import gwenlake_hpc\nfrom gwenlake_hpc import train\nTEMPLATE = """\n@train(steps=3)\ndef fit(run):\n'
            '    pass\n"""\n\n@train(steps=5)\ndef real(run):\n    pass\n\n@gwenlake_hpc.train()\ndef other(run):\n'
            '    pass\n\ndef plain():\n    pass\n')
    assert _decorated_functions(text) == ["real", "other"]
    assert _decorated_functions("@train(steps=1)\ndef broken(run:\n") == ["broken"]  # reported when imported
