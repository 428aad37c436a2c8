"""Code shipping for submission over SSH: the exact commit the job runs, made to exist on the cluster.

:func:`local_code` reads the workstation's HEAD (and the diff, with ``cluster.allow_dirty``); :func:`check_remote`
checks ``cluster.remote_dir`` in one round trip (a git checkout's top level, git, sbatch, a Python that imports
gwenlake_hpc); :func:`send_commit` uploads a git bundle of what the cluster lacks; :func:`make_worktree` makes
the job's own worktree, created under a temporary name and moved into place whole. Used by :mod:`.remote`.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shlex
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.errors import ConfigError, GwenlakeError
from ..stores.versioning.gitcmd import run_git
from .ssh import SshConnection

log = logging.getLogger("gwenlake_hpc.launch.remote")


# --- the workstation's code --------------------------------------------------------------------------------------

def _git(cwd: Path, command: str, *args: str, binary: bool = False) -> Any:
    """``git <command> <args>`` in ``cwd`` through the package's one git runner; stdout (bytes with ``binary``).
    Raises GwenlakeError with git's stderr on a non-zero exit."""
    _, out, _ = run_git(cwd, {}, command.replace("-", "_"), *args)
    return out if binary else out.decode().strip()


@dataclass
class LocalCode:
    """The workstation's code: repository root, HEAD commit, and the diff of tracked files (b"" if clean)."""

    root: Path
    commit: str
    patch: bytes
    untracked: list[str]


def local_code(cwd: Path, allow_dirty: bool) -> LocalCode:
    """Read the git state around ``cwd``.

    Raises:
        ConfigError: not in a git repository, no commit yet, or uncommitted changes to tracked files without
            ``cluster.allow_dirty=true`` (the files are named).
    """
    try:
        root = Path(_git(cwd, "rev-parse", "--show-toplevel"))
        commit = _git(root, "rev-parse", "--verify", "HEAD^{commit}")
    except GwenlakeError as exc:
        raise ConfigError(f"cluster=...: the code must be in a git repository with at least one commit (the job runs "
                          f"exactly a commit): {exc}") from exc
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    patch = b""
    if status:
        changed = [p for p in _git(root, "diff", "--name-only", "HEAD").splitlines() if p]
        if not allow_dirty:
            raise ConfigError(
                f"the working tree {root} has uncommitted changes to {len(changed)} tracked file(s) "
                f"({', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''}): commit them, so the job runs "
                f"exactly a commit, or set cluster.allow_dirty=true to send the diff along (applied on the cluster "
                f"on top of {commit[:12]} and recorded in the run's lineage)")
        patch = _git(root, "diff", "--binary", "HEAD", binary=True)
    untracked = [p for p in _git(root, "ls-files", "--others", "--exclude-standard").splitlines() if p]
    return LocalCode(root, commit, patch, untracked)



# --- the cluster side ---------------------------------------------------------------------------------------------

def setup_script(cc: Any) -> str:
    """``cluster.setup`` (of a :class:`gwenlake_hpc.job.config.ClusterConfig`) as script lines, each ending with a
    newline."""
    return "".join(f"{line}\n" for line in cc.setup)


def check_remote(conn: SshConnection, cc: Any, commit: str) -> tuple[str, bool, list[str]]:
    """Check the cluster side in one round trip; returns (absolute remote_dir, has the commit, its ref shas).

    Raises:
        ConfigError: remote_dir missing or not a git checkout, no git, no sbatch, no python with gwenlake_hpc.
    """
    rd = str(cc.remote_dir)
    if rd.startswith("~/"):
        rd = rd[2:]  # commands start in the home directory
    py = str(cc.python)
    # the `gwenlake-at:` marks on stderr are shown only when the check fails or hangs (where it was)
    script = (f"cd {shlex.quote(rd)} 2>/dev/null || {{ echo 'gwenlake-check: nodir'; exit 3; }}\n"
              "command -v git >/dev/null || { echo 'gwenlake-check: nogit'; exit 3; }\n"
              "git rev-parse --show-toplevel >/dev/null 2>&1 || { echo 'gwenlake-check: notgit'; exit 3; }\n"
              "test \"$(git rev-parse --show-toplevel)\" = \"$(pwd -P)\" || { echo 'gwenlake-check: notroot'; exit 3; }\n"
              "echo 'gwenlake-at: setup' >&2\n"
              + setup_script(cc) +
              "echo 'gwenlake-at: sbatch, python' >&2\n"
              "command -v sbatch >/dev/null || { echo 'gwenlake-check: nosbatch'; exit 3; }\n"
              f"{shlex.quote(py)} -c 'import gwenlake_hpc' >/dev/null 2>&1 || {{ echo 'gwenlake-check: nopython'; exit 3; }}\n"
              "echo 'gwenlake-at: refs' >&2\n"
              "echo \"gwenlake-dir: $(pwd -P)\"\n"
              f"if git cat-file -e {shlex.quote(commit + '^{commit}')} 2>/dev/null; then echo 'gwenlake-have: yes'; "
              "else echo 'gwenlake-have: no'; fi\n"
              "git for-each-ref --format='gwenlake-ref: %(objectname)' refs/heads refs/gwenlake/commits | head -n 200\n")
    rc, out, err = conn.script(script, check=False, timeout_s=120)
    name, host = conn.target.name, conn.target.host
    problems = {
        "nodir": f"cluster.remote_dir={cc.remote_dir} does not exist on {host}: clone the project there first "
                 f"(git clone <url> {cc.remote_dir}) or fix cluster.remote_dir",
        "nogit": f"git is not installed (or not in PATH) on {host}; add the line that loads it to cluster.setup",
        "notgit": f"cluster.remote_dir={cc.remote_dir} on {host} is not a git checkout: clone the project there "
                  f"(git clone <url> {cc.remote_dir}) and point cluster.remote_dir at it",
        "notroot": f"cluster.remote_dir={cc.remote_dir} on {host} is inside a git checkout but not its top level: "
                   "point cluster.remote_dir at the checkout's root",
        "nosbatch": f"sbatch is not found on {host} (cluster {name}) in a non-interactive shell's PATH: add the line "
                    "that makes it available (e.g. `module load slurm`) to cluster.setup, or check cluster.host is "
                    "the cluster's login node",
        "nopython": f"{cc.python} (cluster.python, after cluster.setup) on {host} cannot import gwenlake_hpc: install "
                    "it in the cluster's environment, or set cluster.python / cluster.setup (e.g. `source "
                    "~/venvs/train/bin/activate`) to that environment",
    }
    m = re.search(r"gwenlake-check: (\w+)", out)
    if m:
        raise ConfigError(f"cluster {name}: {problems[m.group(1)]}")
    if rc != 0:
        raise GwenlakeError(f"cluster {name}: checking {cc.remote_dir} on {host} failed ({rc}): {err.strip()[-1500:]}")
    abs_dir = re.search(r"^gwenlake-dir: (.*)$", out, re.M).group(1)  # type: ignore[union-attr]
    if re.search(r"\s", abs_dir):
        raise ConfigError(f"cluster.remote_dir={abs_dir} contains whitespace, which #SBATCH lines cannot carry: "
                          "use a path without spaces")
    have = "gwenlake-have: yes" in out
    refs = re.findall(r"^gwenlake-ref: ([0-9a-f]{40})$", out, re.M)
    return abs_dir, have, refs


def send_commit(conn: SshConnection, code: LocalCode, remote_dir: str, have: bool, remote_refs: list[str]) -> None:
    """Make ``code.commit`` exist on the cluster under ``refs/gwenlake/commits/<sha>``.

    A bundle of what the cluster lacks (``git bundle create ... HEAD --not <commits it has>``) is uploaded with
    SFTP (atomically) into ``<remote_dir>/.gwenlake/bundles`` and fetched, then removed.

    Raises:
        GwenlakeError: git failed on either side.
    """
    sha = code.commit
    ref = f"refs/gwenlake/commits/{sha}"
    gw = f"{remote_dir}/.gwenlake"
    if have:
        conn.run(["git", "-C", remote_dir, "update-ref", ref, sha])
        return
    known = [s for s in remote_refs
             if run_git(code.root, {}, "cat_file", "-e", f"{s}^{{commit}}", ok=(0, 1, 128))[0] == 0]
    with tempfile.TemporaryDirectory(prefix="gwenlake-bundle-") as tmp:
        bundle = Path(tmp) / f"{sha}.bundle"
        _git(code.root, "bundle", "create", "-q", str(bundle), "HEAD", *([f"^{s}" for s in known]))
        conn.makedirs(f"{gw}/bundles")
        remote_bundle = f"{gw}/bundles/{sha}-{uuid.uuid4().hex[:8]}.bundle"
        with open(bundle, "rb") as fh:
            conn.write_atomic(remote_bundle, fh)
    try:
        conn.run(["git", "-C", remote_dir, "fetch", "-q", "--no-tags", remote_bundle, f"HEAD:{ref}"], timeout_s=600)
    finally:
        conn.run(["rm", "-f", remote_bundle], check=False)
    log.info("sent commit %s to %s:%s (%d known commit(s) excluded from the bundle)", sha[:12],
             conn.target.host, remote_dir, len(known))


def make_worktree(conn: SshConnection, remote_dir: str, sha: str, patch: bytes) -> tuple[str, str | None]:
    """The job's checkout: ``<remote_dir>/.gwenlake/worktrees/<sha>[-<diff hash>]``, created once, reused.

    Created under a temporary name (worktree add, diff applied) and moved into place, so a half-made checkout is
    never used. Returns ``(path, sha256 of the diff or None)``.

    Raises:
        GwenlakeError: the worktree could not be made, or the diff does not apply (``git apply``'s message).
    """
    gw = f"{remote_dir}/.gwenlake"
    digest = hashlib.sha256(patch).hexdigest() if patch else None
    name = sha if digest is None else f"{sha}-{digest[:12]}"
    wt = f"{gw}/worktrees/{name}"
    conn.makedirs(f"{gw}/worktrees")
    patch_path = None
    if patch:
        conn.makedirs(f"{gw}/patches")
        patch_path = f"{gw}/patches/{digest}.diff"
        conn.write_atomic(patch_path, patch)
    tmp = f"{gw}/worktrees/.tmp-{uuid.uuid4().hex[:12]}"
    q = shlex.quote
    script = (f"set -e\ncd {q(remote_dir)}\n"
              # .gwenlake/ must not show as an untracked change of the main checkout
              "excl=\"$(git rev-parse --git-common-dir)/info/exclude\"; mkdir -p \"$(dirname \"$excl\")\"\n"
              "grep -qxF '/.gwenlake/' \"$excl\" 2>/dev/null || echo '/.gwenlake/' >> \"$excl\"\n"
              f"if [ -e {q(wt)}/.git ]; then\n"  # reuse it only if it still holds exactly that code
              f"  test \"$(git -C {q(wt)} rev-parse HEAD)\" = {q(sha)} || {{ echo 'HEAD moved' >&2; exit 4; }}\n"
              f"  d=\"$(git -C {q(wt)} diff --binary HEAD | sha256sum | cut -d' ' -f1)\"\n"
              f"  test \"$d\" = {q(hashlib.sha256(patch).hexdigest())} || {{ echo 'files changed' >&2; exit 4; }}\n"
              "  echo 'gwenlake-wt: reused'; exit 0\nfi\n"
              f"git worktree add -q --detach {q(tmp)} {q(sha)}\n"
              + (f"if ! git -C {q(tmp)} apply --binary --whitespace=nowarn {q(patch_path)}; then\n"
                 f"  git worktree remove --force {q(tmp)}; echo 'gwenlake-wt: patch' >&2; exit 5\nfi\n"
                 if patch_path else "")
              + f"if ! git worktree move {q(tmp)} {q(wt)} 2>/dev/null; then\n"
              f"  git worktree remove --force {q(tmp)}\n"
              f"  test -e {q(wt)}/.git || {{ echo 'gwenlake-wt: move' >&2; exit 6; }}\nfi\n"
              "echo 'gwenlake-wt: created'\n")
    rc, out, err = conn.script(script, check=False, timeout_s=300)
    if rc == 5:
        raise GwenlakeError(f"cluster {conn.target.name}: the uncommitted diff (cluster.allow_dirty=true) does not "
                            f"apply on top of {sha[:12]}: {err.strip()[-1500:]}")
    if rc == 4:
        raise GwenlakeError(f"cluster {conn.target.name}: the worktree {wt} no longer holds exactly {sha[:12]}"
                            f"{' + the diff' if patch else ''} ({err.strip()}): someone changed it on the cluster. "
                            f"Jobs of that code may still use it; once none does, remove it (git -C {remote_dir} "
                            f"worktree remove --force {wt}) and submit again")
    if rc != 0:
        raise GwenlakeError(f"cluster {conn.target.name}: could not make the worktree {wt}: {err.strip()[-1500:]}")
    log.info("code %s%s on %s: worktree %s (%s)", sha[:12], f" + diff {digest[:12]}" if digest else "",
             conn.target.host, wt, out.strip().rsplit(" ", 1)[-1])
    return wt, digest
