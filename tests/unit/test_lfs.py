"""Model versions with real git-lfs: pointer blobs, content on read, push to a bare remote, warnings."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import git
import pytest

from helpers.concurrency import run_concurrently
from gwenlake_hpc.base.errors import GwenlakeError
from gwenlake_hpc.stores.registry import load_model
from gwenlake_hpc.stores.versioning import commit_model, export_version, is_lfs_pointer, push_versions, read_file

pytestmark = pytest.mark.skipif(shutil.which("git-lfs") is None, reason="git-lfs is not installed "
                                "(Debian: apt-get install git-lfs)")

ATTRS = "*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def g(cwd, *args, **kw) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@l", *args], cwd=cwd, check=True,
                          capture_output=True, text=True, **kw).stdout.strip()


def lfs_repo(path: Path, commit_attrs: bool = True) -> Path:
    """A dedicated model repository using git-lfs for *.safetensors."""
    path.mkdir(parents=True)
    g(path, "init", "-q", "-b", "main")
    (path / ".gitattributes").write_text(ATTRS)
    if commit_attrs:
        g(path, "add", ".gitattributes")
        g(path, "commit", "-q", "-m", "lfs")
    return path


def weights(path: Path, size: int, seed: int) -> bytes:
    data = (seed.to_bytes(4, "little") + os.urandom(64)) * (size // 68 + 1)
    data = data[:size]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("commit_attrs", [True, False])
def test_weights_committed_as_pointer_and_resolved_on_read(tmp_path, commit_attrs, monkeypatch):
    # commit_attrs=False: the attributes live only in the work tree, so the version's tree has none and
    # reading must still give the content (the pointer is smudged explicitly).
    repo = lfs_repo(tmp_path / "models", commit_attrs)
    src = tmp_path / "out"
    content = weights(src / "model.safetensors", 3_000_000, 1)
    (src / "config.json").write_text('{"a": 1}')
    sha = commit_model(repo, "crm.churn", src, message="v1", extra_files={"metrics.json": b'{"auc": 0.9}'})

    size = int(g(repo, "cat-file", "-s", f"{sha}:crm/churn/model.safetensors"))
    pointer = subprocess.run(["git", "cat-file", "blob", f"{sha}:crm/churn/model.safetensors"], cwd=repo,
                             check=True, capture_output=True).stdout
    print(f"pointer blob: {size} bytes for {len(content)} bytes of weights")
    assert size < 1024 and is_lfs_pointer(pointer)
    (tmp_path / "pointer").write_bytes(pointer)
    # git-lfs itself checks the pointer is well formed and matches the content
    g(tmp_path, "lfs", "pointer", f"--file={src / 'model.safetensors'}", f"--pointer={tmp_path / 'pointer'}")
    assert g(repo, "cat-file", "blob", f"{sha}:crm/churn/config.json") == '{"a": 1}'  # not through LFS

    # GIT_LFS_SKIP_SMUDGE=1 (set by many CI clones) must not leave pointers in what a read returns
    monkeypatch.setenv("GIT_LFS_SKIP_SMUDGE", "1")
    assert read_file(repo, "crm.churn", sha, "model.safetensors") == content
    dest = export_version(repo, "crm.churn", sha, tmp_path / "export")
    assert (dest / "model.safetensors").read_bytes() == content
    loaded = load_model("crm.churn", sha[:10], repo=repo)
    assert loaded.version == sha and (loaded.path / "model.safetensors").read_bytes() == content
    assert loaded.metrics == {"auc": 0.9}
    assert g(repo, "status", "--porcelain") == ("" if commit_attrs else "?? .gitattributes")


def test_concurrent_lfs_commits_all_land(tmp_path):
    repo = lfs_repo(tmp_path / "models")
    n = 8
    contents = {}
    for i in range(n):
        contents[i] = weights(tmp_path / f"out{i}" / "model.safetensors", 200_000, i)
    results = run_concurrently(n, lambda i: commit_model(git.Repo(repo), "crm.churn", tmp_path / f"out{i}",
                                                         message=f"w{i}"))
    chain = g(repo, "rev-list", "--first-parent", "models/crm.churn").split()
    assert set(results.values()) <= set(chain) and len(set(results.values())) == n
    for i, sha in results.items():
        assert int(g(repo, "cat-file", "-s", f"{sha}:crm/churn/model.safetensors")) < 1024
        assert read_file(repo, "crm.churn", sha, "model.safetensors") == contents[i]


def test_push_to_bare_remote_with_lfs_objects_then_read_from_a_clone(tmp_path):
    repo = lfs_repo(tmp_path / "models")
    content = weights(tmp_path / "out" / "model.safetensors", 500_000, 7)
    sha = commit_model(repo, "crm.churn", tmp_path / "out", message="v1")
    remote = tmp_path / "shared" / "models.git"
    remote.mkdir(parents=True)
    g(remote, "init", "-q", "--bare")
    refs = push_versions(repo, "crm.churn", str(remote))
    assert refs == ["refs/heads/models/crm.churn"]
    assert g(remote, "rev-parse", "models/crm.churn") == sha
    oid = next(line for line in g(repo, "cat-file", "blob", f"{sha}:crm/churn/model.safetensors").splitlines()
               if line.startswith("oid sha256:")).split(":")[1]
    assert (remote / "lfs" / "objects" / oid[:2] / oid[2:4] / oid).read_bytes() == content

    # A clone without the LFS objects: reading downloads them from the remote.
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", remote.as_uri(), str(clone)], check=True, capture_output=True,
                   env={**os.environ, "GIT_LFS_SKIP_SMUDGE": "1"})
    g(clone, "fetch", "-q", "origin", "models/crm.churn:models/crm.churn")
    assert not (clone / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid).exists()
    assert read_file(clone, "crm.churn", sha, "model.safetensors") == content


def test_large_file_without_lfs_warns(tmp_path, caplog):
    repo = tmp_path / "plain"
    repo.mkdir()
    g(repo, "init", "-q")
    weights(tmp_path / "out" / "model.safetensors", 20_000, 3)
    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.versioning"):
        commit_model(repo, "crm.churn", tmp_path / "out", message="v1", large_file_warning_bytes=10_000)
    assert "crm/churn/model.safetensors is 0.0 MB" in caplog.text and "git lfs track" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.versioning"):
        commit_model(repo, "crm.churn", tmp_path / "out", message="v2")  # 50 MiB default threshold
    assert caplog.text == ""


def test_lfs_repo_without_git_lfs_installed_refuses_and_keeps_files(tmp_path, monkeypatch):
    repo = lfs_repo(tmp_path / "models")
    content = weights(tmp_path / "out" / "model.safetensors", 10_000, 5)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(shutil.which("git"), bindir / "git")
    monkeypatch.setenv("PATH", str(bindir))  # a real PATH without git-lfs
    with pytest.raises(GwenlakeError, match="git-lfs is not installed"):
        commit_model(repo, "crm.churn", tmp_path / "out", message="v1")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == content
    monkeypatch.undo()
    assert subprocess.run(["git", "rev-parse", "--verify", "-q", "models/crm.churn"], cwd=repo).returncode != 0


def _children() -> list[str]:
    pid = os.getpid()
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += (task / "children").read_text().split()
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_many_commits_in_one_process_leave_no_git_processes(tmp_path):
    repo = lfs_repo(tmp_path / "models")
    handle = git.Repo(repo)  # one long-lived handle, as a long-running process would keep
    before = len(_children())
    for i in range(12):
        weights(tmp_path / "out" / "model.safetensors", 5_000, i)
        commit_model(handle, "crm.churn", tmp_path / "out", message=f"v{i}")
        read_file(handle, "crm.churn", "latest", "model.safetensors")
        assert len(_children()) <= before, _children()
    assert len(g(repo, "rev-list", "models/crm.churn").split()) == 12


def test_after_commit_pushes_to_the_configured_remote_and_sets_candidate(tmp_path):
    from gwenlake_hpc.stores.registry import after_commit, current_aliases

    repo = lfs_repo(tmp_path / "models")
    remote = tmp_path / "shared.git"
    remote.mkdir()
    g(remote, "init", "-q", "--bare")
    g(repo, "config", "gwenlake.remote", str(remote))
    content = weights(tmp_path / "out" / "model.safetensors", 100_000, 9)
    sha = commit_model(repo, "crm.churn", tmp_path / "out", message="v1")
    after_commit(repo=repo, model_name="crm.churn", version=sha, out_dir=tmp_path / "out",
                 lineage={"run_key": "fit-x"}, tracking_uri=None, run_id=None)
    assert current_aliases("crm.churn", repo) == {"candidate": sha}
    assert g(remote, "rev-parse", "models/crm.churn") == sha
    assert g(remote, "rev-parse", "refs/gwenlake/aliases/crm.churn") == g(repo, "rev-parse",
                                                                           "refs/gwenlake/aliases/crm.churn")
    assert current_aliases("crm.churn", remote) == {"candidate": sha}  # the alias log travels too
    assert read_file(remote, "crm.churn", sha, "model.safetensors") == content  # LFS objects pushed


def test_lfs_works_without_git_lfs_install(tmp_path, monkeypatch):
    # A compute node with git-lfs on PATH but no `git lfs install` (no filter.lfs.* in any config file).
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    repo = lfs_repo(tmp_path / "models")
    assert subprocess.run(["git", "config", "--get", "filter.lfs.process"], cwd=repo).returncode == 1
    content = weights(tmp_path / "out" / "model.safetensors", 50_000, 11)
    sha = commit_model(repo, "crm.churn", tmp_path / "out", message="v1")
    assert int(g(repo, "cat-file", "-s", f"{sha}:crm/churn/model.safetensors")) < 1024
    assert read_file(repo, "crm.churn", sha, "model.safetensors") == content
