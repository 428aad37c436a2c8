"""Tests of gwenlake_hpc.stores.versioning against real git repositories in tmp_path."""

from __future__ import annotations

import datetime
import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

import git
import pytest

from helpers.concurrency import run_concurrently
from gwenlake_hpc.base.errors import ConfigError, GwenlakeError
from gwenlake_hpc.stores.versioning import (
    CODE_TRAILER,
    FALLBACK_EMAIL,
    FALLBACK_NAME,
    MODEL_TRAILER,
    CodeState,
    code_state,
    commit_model,
    default_model_repo,
    export_version,
    list_versions,
    model_branch,
    model_prefix,
    open_model_repo,
    read_file,
)

REF = "refs/heads/models/crm.churn"
SHA = re.compile(r"[0-9a-f]{40}")


@pytest.fixture(autouse=True)
def no_git_identity(tmp_path, monkeypatch):
    """No global/system git config and no identity in the environment (like a fresh CI node)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for var in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME",
                "GIT_COMMITTER_EMAIL", "EMAIL", "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE",
                "GIT_CONFIG_COUNT", "GIT_CONFIG_GLOBAL", "GIT_CONFIG_PARAMETERS"):
        monkeypatch.delenv(var, raising=False)


def g(cwd, *args: str, check: bool = True) -> bytes:
    """Run real git in cwd and return stdout bytes."""
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=False)
    if check and proc.returncode:
        raise AssertionError(f"git {args} failed: {proc.stderr.decode()}")
    return proc.stdout


def gs(cwd, *args: str) -> str:
    return g(cwd, *args).decode().strip()


def init_repo(path: Path, identity: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    g(path, "init", "-q", "-b", "main")
    if identity:
        g(path, "config", "user.name", "Code Author")
        g(path, "config", "user.email", "code@example.com")
    return path


def code_repo(path: Path) -> tuple[Path, str]:
    """A code repository with one commit; returns (path, HEAD sha)."""
    init_repo(path)
    (path / "train.py").write_text("print('train v1')\n")
    (path / "lib").mkdir()
    (path / "lib" / "util.py").write_text("X = 1\n")
    g(path, "add", "-A")
    g(path, "commit", "-q", "-m", "code v1")
    return path, gs(path, "rev-parse", "HEAD")


def make_src(path: Path, files: dict[str, bytes], executable: tuple[str, ...] = ()) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    for rel in executable:
        (path / rel).chmod(0o755)
    return path


def tree_files(repo: Path, rev: str, under: str = "") -> dict[str, str]:
    """path -> mode of the blobs of rev (under a directory when given)."""
    args = ["ls-tree", "-r", "-z", rev] + (["--", under] if under else [])
    out = {}
    for item in g(repo, *args).split(b"\0"):
        if item:
            meta, _, name = item.partition(b"\t")
            out[name.decode()] = meta.split(b" ")[0].decode()
    return out


def parents(repo: Path, rev: str) -> list[str]:
    return gs(repo, "rev-list", "--parents", "-n", "1", rev).split()[1:]


BIN = bytes(range(256)) * 4 + b"\n"


# ------------------------------------------------------------------------------------------
# commit_model


def test_commit_into_fresh_repo_without_identity(tmp_path):
    models = tmp_path / "models"
    repo = open_model_repo(models)
    assert g(models, "config", "--get", "user.name", check=False) == b""
    head_ref = gs(models, "symbolic-ref", "HEAD")
    src = make_src(tmp_path / "out", {"model.bin": BIN, "sub/dir/w.pt": b"weights",
                                      "run.sh": b"#!/bin/sh\necho hi\n"}, executable=("run.sh",))

    sha = commit_model(repo, "crm.churn", src, message="first training",
                       extra_files={"metrics.json": b'{"auc": 0.91}\n', "lineage.json": b"{}"})

    assert SHA.fullmatch(sha)
    assert gs(models, "rev-parse", REF) == sha
    assert g(models, "show", f"{sha}:crm/churn/model.bin") == BIN
    assert g(models, "show", f"{sha}:crm/churn/sub/dir/w.pt") == b"weights"
    assert g(models, "show", f"{sha}:crm/churn/metrics.json") == b'{"auc": 0.91}\n'
    assert g(models, "show", f"{sha}:crm/churn/lineage.json") == b"{}"
    assert tree_files(models, sha) == {
        "crm/churn/model.bin": "100644", "crm/churn/sub/dir/w.pt": "100644",
        "crm/churn/run.sh": "100755", "crm/churn/metrics.json": "100644",
        "crm/churn/lineage.json": "100644"}
    assert gs(models, "log", "-1", "--format=%an <%ae>|%cn <%ce>", sha) == (
        f"{FALLBACK_NAME} <{FALLBACK_EMAIL}>|{FALLBACK_NAME} <{FALLBACK_EMAIL}>")
    assert parents(models, sha) == []
    raw = gs(models, "log", "-1", "--format=%B", sha)
    assert raw == f"first training\n\n{MODEL_TRAILER}: crm.churn"
    # HEAD is still unborn on its branch, and nothing was written into the work tree or index.
    assert gs(models, "symbolic-ref", "HEAD") == head_ref
    assert g(models, "rev-parse", "--verify", "-q", "HEAD", check=False) == b""
    assert g(models, "status", "--porcelain", "--untracked-files=all") == b""
    assert not (models / ".git" / "index").exists()


def test_commit_accepts_a_repo_path(tmp_path):
    models = init_repo(tmp_path / "models", identity=False)
    src = make_src(tmp_path / "out", {"a": b"1"})
    sha = commit_model(models, "crm.churn", src, message="m")
    assert g(models, "show", f"{sha}:crm/churn/a") == b"1"


@pytest.mark.parametrize("detached", [False, True])
def test_user_work_tree_index_and_head_untouched(tmp_path, detached):
    repo_dir, head = code_repo(tmp_path / "code")
    (repo_dir / "b.txt").write_text("b\n")
    g(repo_dir, "add", "b.txt")
    g(repo_dir, "commit", "-q", "-m", "b")
    head = gs(repo_dir, "rev-parse", "HEAD")
    if detached:
        g(repo_dir, "checkout", "-q", "--detach", head)
    (repo_dir / "train.py").write_text("print('modified, not staged')\n")
    (repo_dir / "b.txt").write_text("b staged\n")
    g(repo_dir, "add", "b.txt")
    (repo_dir / "untracked.txt").write_text("u\n")
    src = make_src(tmp_path / "out", {"model.bin": BIN})

    def snapshot() -> dict:
        return {
            "status": g(repo_dir, "status", "--porcelain"),
            "cached": g(repo_dir, "diff", "--cached", "--binary"),
            "diff": g(repo_dir, "diff", "--binary"),
            "head": g(repo_dir, "rev-parse", "HEAD"),
            "symref": g(repo_dir, "symbolic-ref", "-q", "HEAD", check=False),
            "files": sorted((str(p.relative_to(repo_dir)), p.read_bytes(), p.stat().st_mtime_ns)
                            for p in repo_dir.rglob("*") if p.is_file() and ".git" not in p.parts),
            "refs": g(repo_dir, "for-each-ref", "--format=%(refname) %(objectname)",
                      "refs/heads/main"),
        }

    before = snapshot()
    index_before = (repo_dir / ".git" / "index").read_bytes()
    sha = commit_model(git.Repo(repo_dir), "crm.churn", src, message="v1", code_commit=head)
    # Compare the raw index before any git command could refresh it.
    assert (repo_dir / ".git" / "index").read_bytes() == index_before
    assert snapshot() == before
    assert before["symref"] == (b"" if detached else b"refs/heads/main\n")
    assert g(repo_dir, "show", f"{sha}:crm/churn/model.bin") == BIN
    # The version has the committed code, not the user's uncommitted edits.
    assert g(repo_dir, "show", f"{sha}:train.py") == b"print('train v1')\n"
    assert g(repo_dir, "show", f"{sha}:b.txt") == b"b\n"


def test_code_repo_versions_hold_code_and_chain(tmp_path):
    repo_dir, c1 = code_repo(tmp_path / "code")
    repo = git.Repo(repo_dir)
    src = make_src(tmp_path / "out", {"model.bin": b"m1"})

    v1 = commit_model(repo, "crm.churn", src, message="v1", code_commit=c1)
    assert tree_files(repo_dir, v1) == {"train.py": "100644", "lib/util.py": "100644",
                                        "crm/churn/model.bin": "100644"}
    assert (gs(repo_dir, "rev-parse", f"{v1}:train.py")
            == gs(repo_dir, "rev-parse", f"{c1}:train.py"))
    assert parents(repo_dir, v1) == [c1]
    assert gs(repo_dir, "log", "-1", "--format=%an <%ae>", v1) == "Code Author <code@example.com>"
    assert f"{CODE_TRAILER}: {c1}" in gs(repo_dir, "log", "-1", "--format=%B", v1)

    (src / "model.bin").write_bytes(b"m2")
    v2 = commit_model(repo, "crm.churn", src, message="v2", code_commit=c1)
    assert parents(repo_dir, v2) == [v1]  # c1 is already an ancestor of the tip

    (repo_dir / "train.py").write_text("print('train v2')\n")
    g(repo_dir, "commit", "-q", "-am", "code v2")
    c2 = gs(repo_dir, "rev-parse", "HEAD")
    (src / "model.bin").write_bytes(b"m3")
    v3 = commit_model(repo, "crm.churn", src, message="v3", code_commit=c2)
    assert parents(repo_dir, v3) == [v2, c2]
    assert g(repo_dir, "show", f"{v3}:train.py") == b"print('train v2')\n"
    assert g(repo_dir, "show", f"{v3}:crm/churn/model.bin") == b"m3"
    # Only versions are listed, not the code commits v1 descends from.
    assert [v["version"] for v in list_versions(repo, "crm.churn")] == [v3, v2, v1]
    assert gs(repo_dir, "rev-parse", "main") == c2


def test_code_commit_missing_from_model_repo(tmp_path):
    models = init_repo(tmp_path / "models")
    src = make_src(tmp_path / "out", {"model.bin": b"m"})
    foreign = "ab" * 20
    v1 = commit_model(models, "crm.churn", src, message="v1", code_commit=foreign)
    assert parents(models, v1) == []
    assert tree_files(models, v1) == {"crm/churn/model.bin": "100644"}
    assert f"{CODE_TRAILER}: {foreign}" in gs(models, "log", "-1", "--format=%B", v1)
    v2 = commit_model(models, "crm.churn", src, message="v2", code_commit=foreign)
    assert parents(models, v2) == [v1]


def test_second_version_replaces_subtree(tmp_path):
    repo_dir, c1 = code_repo(tmp_path / "code")
    v1 = commit_model(repo_dir, "crm.churn", make_src(tmp_path / "o1", {
        "model.bin": b"1", "old/only_v1.txt": b"x"}), message="v1")
    v2 = commit_model(repo_dir, "crm.churn", make_src(tmp_path / "o2", {"model.bin": b"2"}),
                      message="v2", extra_files={"metrics.json": b"{}"})
    assert tree_files(repo_dir, v1, "crm/churn") == {"crm/churn/model.bin": "100644",
                                                     "crm/churn/old/only_v1.txt": "100644"}
    assert tree_files(repo_dir, v2, "crm/churn") == {"crm/churn/model.bin": "100644",
                                                     "crm/churn/metrics.json": "100644"}
    assert parents(repo_dir, v2) == [v1]
    # Without code_commit the base is the branch tip, which has no code files (empty base).
    assert set(tree_files(repo_dir, v2)) == {"crm/churn/model.bin", "crm/churn/metrics.json"}
    # Another model of the same repository is kept apart.
    w1 = commit_model(repo_dir, "crm.upsell", make_src(tmp_path / "o3", {"m": b"u"}),
                      message="u", code_commit=c1)
    assert set(tree_files(repo_dir, w1)) == {"train.py", "lib/util.py", "crm/upsell/m"}
    assert gs(repo_dir, "rev-parse", REF) == v2


def test_extra_files_override_src_files(tmp_path):
    models = init_repo(tmp_path / "models")
    src = make_src(tmp_path / "out", {"metrics.json": b"from src", "m": b"m"})
    sha = commit_model(models, "crm.churn", src, message="m",
                       extra_files={"metrics.json": b"from extra", "info/notes.txt": "h\u00e9"})
    assert g(models, "show", f"{sha}:crm/churn/metrics.json") == b"from extra"
    assert g(models, "show", f"{sha}:crm/churn/info/notes.txt") == "h\u00e9".encode()
    # extra files alone are enough when src_dir is empty
    empty = tmp_path / "empty"
    empty.mkdir()
    sha2 = commit_model(models, "crm.churn", empty, message="m2",
                        extra_files={"metrics.json": b"only"})
    assert tree_files(models, sha2) == {"crm/churn/metrics.json": "100644"}


@pytest.mark.parametrize("with_code", [False, True])
def test_concurrent_commits_all_land(tmp_path, with_code):
    if with_code:
        repo_dir, code = code_repo(tmp_path / "code")
    else:
        repo_dir, code = init_repo(tmp_path / "models", identity=False), None
    n = 20
    srcs = [make_src(tmp_path / f"out{i}", {"w.bin": f"worker {i}".encode(),
                                            f"only_{i}.txt": str(i).encode()}) for i in range(n)]
    # one repository handle per worker, like separate jobs
    results = run_concurrently(n, lambda i: commit_model(git.Repo(repo_dir), "crm.churn", srcs[i],
                                                         message=f"worker {i}", code_commit=code))
    assert len(set(results.values())) == n
    chain = gs(repo_dir, "rev-list", "--first-parent", REF).split()
    if with_code:
        assert chain[n:] == [code]  # the first version's only parent is the code commit
        chain = chain[:n]
    assert len(chain) == n and set(chain) == set(results.values())
    for i, sha in results.items():
        assert g(repo_dir, "show", f"{sha}:crm/churn/w.bin") == f"worker {i}".encode()
        assert set(tree_files(repo_dir, sha, "crm/churn")) == {"crm/churn/w.bin",
                                                               f"crm/churn/only_{i}.txt"}
    listed = list_versions(repo_dir, "crm.churn")
    assert [v["version"] for v in listed] == chain
    assert sorted(v["message"] for v in listed) == sorted(f"worker {i}" for i in range(n))


def test_held_ref_lock_gives_up_after_max_attempts(tmp_path):
    models = init_repo(tmp_path / "models")
    src = make_src(tmp_path / "out", {"m": b"1"})
    v1 = commit_model(models, "crm.churn", src, message="v1")
    lock = models / ".git" / "refs" / "heads" / "models" / "crm.churn.lock"
    lock.write_text("")  # another job is in the middle of moving the branch
    with pytest.raises(GwenlakeError, match=r"3 attempts.*crm\.churn\.lock"):
        commit_model(models, "crm.churn", src, message="v2", max_attempts=3)
    assert gs(models, "rev-parse", REF) == v1
    lock.unlink()
    v2 = commit_model(models, "crm.churn", src, message="v2", max_attempts=3)
    assert parents(models, v2) == [v1]


def test_blocking_ref_fails_without_retrying(tmp_path):
    repo_dir, _ = code_repo(tmp_path / "code")
    g(repo_dir, "branch", "models")  # refs/heads/models blocks refs/heads/models/...
    start = time.monotonic()
    with pytest.raises(GwenlakeError, match="cannot move branch models/crm.churn"):
        commit_model(repo_dir, "crm.churn", make_src(tmp_path / "out", {"m": b"1"}),
                     message="v1", max_attempts=50)
    assert time.monotonic() - start < 3.0  # 50 attempts with sleeps would take ~8 s


@pytest.mark.parametrize("name", ["crm", "crm.churn.x", ".crm.churn", "crm.", ".churn", "crm.-x",
                                  "crm._x", "crm.churn/x", "cr m.churn", "crm..churn", "",
                                  "crm.lock", "crm.ch\u00fcrn", 12])
def test_bad_model_names_refused(tmp_path, name):
    models = init_repo(tmp_path / "models")
    src = make_src(tmp_path / "out", {"m": b"1"})
    with pytest.raises(ConfigError, match="model name"):
        model_branch(name)
    with pytest.raises(ConfigError, match="model name"):
        model_prefix(name)
    with pytest.raises(ConfigError, match="model name"):
        commit_model(models, name, src, message="m")
    assert g(models, "for-each-ref") == b""


def test_model_names():
    assert model_branch("crm.churn") == "models/crm.churn"
    assert model_prefix("crm.churn") == "crm/churn"
    assert model_branch("Sales-2.churn_v2") == "models/Sales-2.churn_v2"
    assert model_prefix("Sales-2.churn_v2") == "Sales-2/churn_v2"


def test_bad_inputs_refused(tmp_path):
    models = init_repo(tmp_path / "models")
    ok = make_src(tmp_path / "ok", {"m": b"1"})

    with pytest.raises(ConfigError, match="does not exist"):
        commit_model(models, "crm.churn", tmp_path / "missing", message="m")
    with pytest.raises(ConfigError, match="not a directory"):
        commit_model(models, "crm.churn", ok / "m", message="m")
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)  # empty directories hold no files
    with pytest.raises(ConfigError, match="no files"):
        commit_model(models, "crm.churn", empty, message="m")

    linked = make_src(tmp_path / "linked", {"m": b"1"})
    (linked / "alias").symlink_to(linked / "m")
    with pytest.raises(ConfigError, match="symbolic link"):
        commit_model(models, "crm.churn", linked, message="m")
    linked_dir = make_src(tmp_path / "linked_dir", {"d/m": b"1"})
    (linked_dir / "d2").symlink_to(linked_dir / "d")
    with pytest.raises(ConfigError, match="symbolic link"):
        commit_model(models, "crm.churn", linked_dir, message="m")
    fifo_dir = make_src(tmp_path / "fifo", {"m": b"1"})
    os.mkfifo(fifo_dir / "pipe")
    with pytest.raises(ConfigError, match="not a regular file"):
        commit_model(models, "crm.churn", fifo_dir, message="m")
    nested_git = make_src(tmp_path / "nested", {"m": b"1", ".git/config": b""})
    with pytest.raises(ConfigError, match=r"\.git"):
        commit_model(models, "crm.churn", nested_git, message="m")

    for key in ["../escape.txt", "a/../../x", "/abs.txt", "./m", "a//b", "", ".git/hooks/x",
                "sub/.GIT/x"]:
        with pytest.raises(ConfigError, match="extra_files"):
            commit_model(models, "crm.churn", ok, message="m", extra_files={key: b"x"})
    with pytest.raises(ConfigError, match="both a file and a directory"):
        commit_model(models, "crm.churn", ok, message="m", extra_files={"m/x": b"x"})
    with pytest.raises(ConfigError, match="must be bytes"):
        commit_model(models, "crm.churn", ok, message="m", extra_files={"x": 3})
    with pytest.raises(ConfigError, match="message"):
        commit_model(models, "crm.churn", ok, message="  ")
    with pytest.raises(ConfigError, match="code_commit"):
        commit_model(models, "crm.churn", ok, message="m", code_commit="HEAD")
    with pytest.raises(ConfigError, match="max_attempts"):
        commit_model(models, "crm.churn", ok, message="m", max_attempts=0)
    assert g(models, "for-each-ref") == b""  # nothing was committed
    assert g(models, "status", "--porcelain", "--untracked-files=all") == b""


def test_process_count_does_not_grow_with_files(tmp_path, monkeypatch):
    """Each git process is logged by a shim in front of the real git on PATH."""
    real_git = shutil.which("git")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "git.log"
    shim = bindir / "git"
    shim.write_text(f'#!/bin/sh\necho "$1" >> "{log}"\nexec "{real_git}" "$@"\n')
    shim.chmod(0o755)
    models = init_repo(tmp_path / "models", identity=False)
    few = make_src(tmp_path / "few", {f"f{i}.bin": bytes([i]) for i in range(3)})
    many = make_src(tmp_path / "many", {f"d{i % 7}/f{i}.bin": str(i).encode()
                                        for i in range(400)})
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")

    def count(model: str, src: Path) -> tuple[int, str]:
        log.write_text("")
        sha = commit_model(models, model, src, message="m")
        return len(log.read_text().split()), sha

    n_few, _ = count("crm.few", few)
    n_many, sha = count("crm.many", many)
    assert 5 <= n_few <= 12  # the shim saw the calls
    assert n_many == n_few
    assert len(tree_files(models, sha)) == 400
    assert g(models, "show", f"{sha}:crm/many/d3/f10.bin") == b"10"


def test_gitattributes_filters_apply(tmp_path):
    repo_dir, _ = code_repo(tmp_path / "code")
    g(repo_dir, "config", "filter.upper.clean", "tr a-z A-Z")
    g(repo_dir, "config", "filter.upper.smudge", "tr A-Z a-z")
    (repo_dir / ".gitattributes").write_text("*.txt filter=upper\n")
    (repo_dir / "crm").mkdir()
    (repo_dir / "crm" / ".gitattributes").write_text("*.cfg filter=upper\n")
    g(repo_dir, "add", "-A")
    g(repo_dir, "commit", "-q", "-m", "attributes")
    code = gs(repo_dir, "rev-parse", "HEAD")
    src = make_src(tmp_path / "out", {"notes.txt": b"hello\n", "raw.bin": b"hello\n",
                                      "x.cfg": b"abc", "sub/y.dat": b"keep",
                                      "sub/.gitattributes": b"*.dat filter=upper\n"})
    sha = commit_model(repo_dir, "crm.churn", src, message="m", code_commit=code,
                       extra_files={"extra.txt": b"from memory"})
    assert g(repo_dir, "show", f"{sha}:crm/churn/notes.txt") == b"HELLO\n"
    assert g(repo_dir, "show", f"{sha}:crm/churn/raw.bin") == b"hello\n"
    assert g(repo_dir, "show", f"{sha}:crm/churn/x.cfg") == b"ABC"
    assert g(repo_dir, "show", f"{sha}:crm/churn/sub/y.dat") == b"KEEP"
    assert g(repo_dir, "show", f"{sha}:crm/churn/extra.txt") == b"FROM MEMORY"
    # Reading applies the smudge filter of the version's .gitattributes.
    assert read_file(repo_dir, "crm.churn", sha, "notes.txt") == b"hello\n"
    dest = export_version(repo_dir, "crm.churn", sha, tmp_path / "export")
    assert (dest / "notes.txt").read_bytes() == b"hello\n"
    assert (dest / "raw.bin").read_bytes() == b"hello\n"
    assert (dest / "sub" / "y.dat").read_bytes() == b"keep"


def test_gitattributes_from_work_tree_when_base_has_none(tmp_path):
    models = init_repo(tmp_path / "models")
    g(models, "config", "filter.upper.clean", "tr a-z A-Z")
    (models / ".gitattributes").write_text("*.txt filter=upper\n")  # not committed
    sha = commit_model(models, "crm.churn", make_src(tmp_path / "out", {"a.txt": b"abc"}),
                       message="m")
    assert g(models, "show", f"{sha}:crm/churn/a.txt") == b"ABC"


# ------------------------------------------------------------------------------------------
# reading versions


ODD_FILES = {
    "model.safetensors": BIN,
    "nested/deep/config.json": b'{"layers": 4}',
    "with space.txt": b"space",
    "caf\u00e9.txt": "caf\u00e9".encode(),
    'quote"and\\backslash.txt': b"quoted",
    "new\nline.txt": b"newline",
    "empty.txt": b"",
    "trailing_newlines.txt": b"x\n\n",
}


def test_export_and_read_round_trip(tmp_path):
    models = init_repo(tmp_path / "models")
    src = make_src(tmp_path / "out", ODD_FILES, executable=("nested/deep/config.json",))
    v1 = commit_model(models, "crm.churn", src, message="first\n\nwith a body",
                      extra_files={"metrics.json": b'{"auc": 0.5}'})
    (src / "model.safetensors").write_bytes(b"second weights")
    v2 = commit_model(models, "crm.churn", src, message="second",
                      extra_files={"metrics.json": b'{"auc": 0.7}'})

    expected = dict(ODD_FILES, **{"metrics.json": b'{"auc": 0.5}'})
    dest = export_version(models, "crm.churn", v1, tmp_path / "exports" / "v1")
    assert dest == tmp_path / "exports" / "v1"
    got = {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert got == expected
    assert os.stat(dest / "nested/deep/config.json").st_mode & stat.S_IXUSR
    assert not os.stat(dest / "with space.txt").st_mode & stat.S_IXUSR
    assert [p.name for p in (tmp_path / "exports").iterdir()] == ["v1"]  # staging removed
    for rel, data in expected.items():
        assert read_file(models, "crm.churn", v1, rel) == data

    assert read_file(models, "crm.churn", "latest", "model.safetensors") == b"second weights"
    assert read_file(models, "crm.churn", v2[:12], "metrics.json") == b'{"auc": 0.7}'
    latest = export_version(models, "crm.churn", "latest", tmp_path / "latest")
    assert (latest / "model.safetensors").read_bytes() == b"second weights"
    empty_dest = tmp_path / "empty_dest"
    empty_dest.mkdir()
    assert (export_version(models, "crm.churn", v1, empty_dest) / "empty.txt").read_bytes() == b""

    versions = list_versions(git.Repo(models), "crm.churn")
    assert [v["version"] for v in versions] == [v2, v1]
    assert [v["message"] for v in versions] == ["second", "first\n\nwith a body"]
    assert all(isinstance(datetime.datetime.fromisoformat(v["date"]), datetime.datetime)
               for v in versions)
    assert set(versions[0]) == {"version", "date", "message", "run"} and versions[0]["run"] is None
    # The user's work tree is not used for reads.
    assert g(models, "status", "--porcelain", "--untracked-files=all") == b""


def test_read_errors(tmp_path):
    models = init_repo(tmp_path / "models")
    assert list_versions(models, "crm.churn") == []
    with pytest.raises(ConfigError, match="no versions"):
        read_file(models, "crm.churn", "latest", "m")
    v1 = commit_model(models, "crm.churn", make_src(tmp_path / "out", {"m": b"1", "d/x": b"2"}),
                      message="v1")
    with pytest.raises(ConfigError, match="no file 'missing'"):
        read_file(models, "crm.churn", v1, "missing")
    with pytest.raises(ConfigError, match="no file 'd'"):
        read_file(models, "crm.churn", v1, "d")  # a directory
    with pytest.raises(ConfigError, match="read_file"):
        read_file(models, "crm.churn", v1, "../churn/m")
    with pytest.raises(ConfigError, match="must be a commit SHA"):
        read_file(models, "crm.churn", "HEAD~1", "m")
    with pytest.raises(ConfigError, match="not a commit"):
        read_file(models, "crm.churn", "deadbeef" * 5, "m")
    with pytest.raises(ConfigError, match="no files under crm/other/"):
        export_version(models, "crm.other", v1, tmp_path / "dest")
    busy = make_src(tmp_path / "busy", {"keep": b"k"})
    with pytest.raises(ConfigError, match="not an empty directory"):
        export_version(models, "crm.churn", v1, busy)
    assert (busy / "keep").read_bytes() == b"k"
    assert not (tmp_path / "dest").exists()


# ------------------------------------------------------------------------------------------
# code state and repositories


def test_code_state(tmp_path):
    assert code_state(tmp_path) == CodeState(None, None, False)
    with pytest.raises(ConfigError, match="does not exist"):
        code_state(tmp_path / "missing")

    unborn = init_repo(tmp_path / "unborn")
    (unborn / "f.txt").write_text("x")
    assert code_state(unborn) == CodeState(unborn, None, False)  # untracked only
    g(unborn, "add", "f.txt")
    assert code_state(unborn) == CodeState(unborn, None, True)  # staged in an unborn repo

    repo_dir, head = code_repo(tmp_path / "code")
    assert code_state(repo_dir) == CodeState(repo_dir, head, False)
    assert code_state(repo_dir / "lib") == CodeState(repo_dir, head, False)
    assert code_state(repo_dir / "lib" / "util.py") == CodeState(repo_dir, head, False)
    (repo_dir / "new.txt").write_text("untracked")
    assert code_state(repo_dir).dirty is False
    (repo_dir / "train.py").write_text("changed")
    assert code_state(repo_dir) == CodeState(repo_dir, head, True)
    g(repo_dir, "add", "train.py")
    assert code_state(repo_dir).dirty is True  # staged
    g(repo_dir, "commit", "-q", "-m", "c2")
    state = code_state(repo_dir)
    assert state.dirty is False and state.commit == gs(repo_dir, "rev-parse", "HEAD") != head


def test_open_model_repo(tmp_path):
    created = open_model_repo(tmp_path / "a" / "models")
    assert Path(created.working_tree_dir) == tmp_path / "a" / "models"
    assert (tmp_path / "a" / "models" / ".git").is_dir()
    assert open_model_repo(tmp_path / "a" / "models", create=False).git_dir == created.git_dir
    empty = tmp_path / "empty"
    empty.mkdir()
    assert Path(open_model_repo(empty).working_tree_dir) == empty

    with pytest.raises(ConfigError, match="paths.model_repo"):
        open_model_repo(tmp_path / "nope", create=False)
    assert not (tmp_path / "nope").exists()
    plain = make_src(tmp_path / "plain", {"x.py": b""})
    with pytest.raises(ConfigError, match="paths.model_repo.*not a git repository"):
        open_model_repo(plain)
    with pytest.raises(ConfigError, match="paths.model_repo"):
        open_model_repo(plain / "x.py")
    assert not (plain / ".git").exists()


def test_default_model_repo(tmp_path):
    repo_dir, _ = code_repo(tmp_path / "code")
    assert default_model_repo(repo_dir / "lib") == repo_dir
    assert default_model_repo(repo_dir) == repo_dir

    bare_dir = tmp_path / "project"
    bare_dir.mkdir()
    models = default_model_repo(bare_dir)
    assert models == bare_dir / "models"
    assert gs(models, "rev-parse", "--show-toplevel") == str(models)
    assert default_model_repo(bare_dir) == models  # idempotent

    clash = make_src(tmp_path / "clash", {"models/__init__.py": b""})
    with pytest.raises(ConfigError, match="paths.model_repo"):
        default_model_repo(clash)


def test_a_lock_left_by_a_killed_git_is_named_with_the_way_out(tmp_path):
    """The adversary's input: ``refs/heads/models/<model>.lock`` left by a git killed while it moved the branch
    (a SIGKILL of the whole job during ``update-ref``). Every rerun failed with "kept moving or stayed locked for
    50 attempts" and advice (``models commit``) that meets the same lock. Now the lock file is named with the way
    out, and once it is removed the next commit lands."""
    repo_dir, _ = code_repo(tmp_path / "code")
    v1 = commit_model(repo_dir, "crm.churn", make_src(tmp_path / "o1", {"model.bin": b"1"}), message="v1")
    lock = repo_dir / ".git" / "refs" / "heads" / "models" / "crm.churn.lock"
    lock.write_text(v1 + "\n")
    with pytest.raises(GwenlakeError) as err:
        commit_model(repo_dir, "crm.churn", make_src(tmp_path / "o2", {"model.bin": b"2"}), message="v2",
                     max_attempts=3)
    said = str(err.value)
    assert f"{lock} was there at each of 3 attempts and the branch never moved" in said, said
    assert f"rm {lock}" in said and "pgrep -a git" in said, said
    assert gs(repo_dir, "rev-parse", REF) == v1
    lock.unlink()
    v2 = commit_model(repo_dir, "crm.churn", make_src(tmp_path / "o2", {"model.bin": b"2"}), message="v2")
    assert parents(repo_dir, v2) == [v1]
