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
