"""The one git runner of the model repository, and its compare-and-swap.

Decision: every operation on a model repository runs the git command line (plumbing: ``hash-object``,
``update-index``, ``commit-tree``, ``update-ref``...) against a private index and work tree, never
GitPython's object database. Why: the repository's ``.gitattributes`` filters (git-lfs clean and smudge,
eol conversion) run only inside git's own ``hash-object``/``checkout-index``; GitPython's pure-Python writers
would store a 5 GB weight file as a blob instead of an LFS pointer, and its readers would hand back pointers.
GitPython stays for two things only: the process launcher under :func:`run_git` (``git.Git.execute``: the
environment merged over ``os.environ``, C locale, ``GIT_PYTHON_GIT_EXECUTABLE``) and the repository handle
callers pass around (``git.Repo``: discovery of the repository around a path, ``git init``), which is the
public type of :func:`gwenlake_hpc.stores.versioning.open_model_repo`. ``git lfs smudge``, which streams a weight
file to disk, runs through :func:`stream_git` (a plain subprocess: GitPython would hold it in memory).

Versions (model branches) and aliases (alias logs) both move their ref with :func:`compare_and_swap`.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import subprocess
import tempfile
import time
from typing import IO, Callable, Mapping, TypeVar, Union

from ...base.errors import GwenlakeError
from ...base.processes import shield_children

with shield_children():  # GitPython runs `git version` on import: SLURM's warning (SIGUSR2) must not kill it
    import git

__all__ = ["PathLike", "FALLBACK_NAME", "FALLBACK_EMAIL", "run_git", "stream_git", "base_env", "git_dir", "rev",
           "rev_any", "cquote", "identity_env", "read_blobs", "compare_and_swap"]

PathLike = Union[str, "os.PathLike[str]"]
T = TypeVar("T")

#: Identity used for version commits when git has none configured (fresh CI or compute nodes).
FALLBACK_NAME = "gwenlake_hpc"
FALLBACK_EMAIL = "gwenlake_hpc@localhost"

# Settings that would make a temporary index behave differently from a plain one (sparse
# directory entries, shared index files written into .git, a file-system monitor daemon).
_SAFE_CONFIG = (
    ("core.sparseCheckout", "false"),
    ("index.sparse", "false"),
    ("core.splitIndex", "false"),
    ("core.fsmonitor", "false"),
)


def run_git(cwd: PathLike, env: Mapping[str, str], command: str, *args: str,
            stdin: bytes | None = None, ok: tuple[int, ...] = (0,)) -> tuple[int, bytes, str]:
    """Run one ``git <command> <args>`` process through GitPython.

    Returns (exit status, stdout bytes, stderr text).

    ``command`` is git's sub-command with ``_`` for ``-`` (``"rev_parse"``). ``env`` is added to
    os.environ. stdin, when given, is passed through a temporary file.
    Raises GwenlakeError with git's stderr when the exit status is not in ``ok``.
    """
    runner = git.Git(os.fspath(cwd))
    kwargs = dict(env=dict(env), with_extended_output=True, with_exceptions=False,
                  stdout_as_string=False, strip_newline_in_stdout=False)
    call = getattr(runner, command)
    with shield_children():  # in a job step, SLURM's stop signals reach every process: not git's to die of
        if stdin is None:
            status, out, err = call(*args, **kwargs)
        else:
            with tempfile.TemporaryFile() as fh:
                fh.write(stdin)
                fh.seek(0)
                status, out, err = call(*args, istream=fh, **kwargs)
    if status not in ok:
        shown = " ".join(args)
        if len(shown) > 300:
            shown = shown[:300] + "..."
        raise GwenlakeError(
            f"git {command.replace('_', '-')} {shown} failed (exit {status}): {err.strip()}")
    return status, out or b"", err or ""


def stream_git(cwd: PathLike, env: Mapping[str, str], args: list[str], stdin: bytes, stdout: IO[bytes],
               timeout_s: float = 3600) -> subprocess.CompletedProcess:
    """Run ``git <args>`` with its stdout written straight to the open file ``stdout`` (never in memory).

    ``env`` is the whole environment (not added to os.environ). Returns the finished process (stderr bytes
    captured); the caller judges its exit status. Raises subprocess.TimeoutExpired after ``timeout_s``.
    """
    with shield_children():  # SLURM's stop signals are not git's to die of (see run_git)
        return subprocess.run(["git", *args], input=stdin, stdout=stdout, stderr=subprocess.PIPE, cwd=cwd,
                              env=dict(env), timeout=timeout_s)


def base_env(git_dir: str, work_tree: PathLike, index_file: PathLike) -> dict[str, str]:
    """Environment naming the repository, work tree and index explicitly.

    Explicit values win over GIT_DIR/GIT_INDEX_FILE inherited from a caller (a git hook, say).
    """
    env = {
        "GIT_DIR": git_dir,
        "GIT_WORK_TREE": os.fspath(work_tree),
        "GIT_INDEX_FILE": os.fspath(index_file),
        "GIT_LITERAL_PATHSPECS": "1",  # paths are names, never globs
        "GIT_OPTIONAL_LOCKS": "0",  # reads must not take index.lock from the user
        "GIT_TERMINAL_PROMPT": "0",
    }
    # Append our settings after any GIT_CONFIG_COUNT entries the caller already set.
    base = int(os.environ.get("GIT_CONFIG_COUNT", "0") or 0)
    for i, (key, value) in enumerate(_SAFE_CONFIG):
        env[f"GIT_CONFIG_KEY_{base + i}"] = key
        env[f"GIT_CONFIG_VALUE_{base + i}"] = value
    env["GIT_CONFIG_COUNT"] = str(base + len(_SAFE_CONFIG))
    return env


def git_dir(repo: git.Repo) -> str:
    """Absolute path of the git directory of ``repo`` (``.git``, or the bare repository itself)."""
    return os.path.abspath(repo.git_dir)


def rev(cwd: PathLike, env: Mapping[str, str], revision: str) -> str | None:
    """Full SHA of ``revision`` (a commit), or None when it does not resolve."""
    status, out, _ = run_git(cwd, env, "rev_parse", "--verify", "--quiet", f"{revision}^{{commit}}",
                             ok=(0, 1, 128))
    return (out.decode().strip() or None) if status == 0 else None


def rev_any(cwd: PathLike, env: Mapping[str, str], ref: str) -> str | None:
    """Object id ``ref`` points to (any object type), or None when it does not resolve."""
    status, out, _ = run_git(cwd, env, "rev_parse", "--verify", "--quiet", ref, ok=(0, 1, 128))
    return (out.decode().strip() or None) if status == 0 else None


def cquote(path: str) -> bytes:
    """Quote a path for ``--stdin-paths`` (C style) when it holds characters git would unquote."""
    raw = os.fsencode(path)
    if not any(b < 0x20 or b in (0x22, 0x5C, 0x7F) for b in raw):
        return raw
    out = bytearray(b'"')
    for b in raw:
        if b in (0x22, 0x5C):
            out += b"\\" + bytes([b])
        elif b < 0x20 or b == 0x7F:
            out += b"\\%03o" % b
        else:
            out.append(b)
    return bytes(out + b'"')


def identity_env(cwd: PathLike, env: Mapping[str, str]) -> dict[str, str]:
    """GIT_AUTHOR_*/GIT_COMMITTER_* fallbacks for each field git has no configured value for.

    Configured means the environment variable itself, ``user.*``/``author.*``/``committer.*``
    in any git config file, or EMAIL for emails. One git process.
    """
    _, out, _ = run_git(cwd, env, "config", "-z", "--get-regexp",
                        r"^(user|author|committer)\.(name|email)$", ok=(0, 1))
    configured = set()
    for item in out.split(b"\0"):
        key, _, value = item.partition(b"\n")
        if key and value.strip():
            configured.add(key.decode().lower())
    result = {}
    for role in ("author", "committer"):
        for field, fallback in (("name", FALLBACK_NAME), ("email", FALLBACK_EMAIL)):
            var = f"GIT_{role.upper()}_{field.upper()}"
            if os.environ.get(var) or {f"{role}.{field}", f"user.{field}"} & configured:
                continue
            if field == "email" and os.environ.get("EMAIL"):
                continue
            result[var] = fallback
    return result


def read_blobs(cwd: PathLike, env: Mapping[str, str], specs: list[str]) -> list[bytes | None]:
    """Contents of ``<rev>:<path>`` specs in one ``cat-file --batch``; None when not a blob."""
    _, out, _ = run_git(cwd, env, "cat_file", "--batch",
                        stdin=b"".join(os.fsencode(s) + b"\n" for s in specs))
    result: list[bytes | None] = []
    pos = 0
    for _ in specs:
        end = out.index(b"\n", pos)
        header = out[pos:end].split(b" ")
        pos = end + 1
        if len(header) == 3 and header[1] != b"missing":
            size = int(header[2])
            data = out[pos:pos + size]
            pos += size + 1  # content is followed by a newline
            result.append(data if header[1] == b"blob" else None)
        else:
            result.append(None)
    return result


def compare_and_swap(run: Callable[..., tuple[int, bytes, str]], ref: str,
                     make: Callable[[str | None], tuple[str, T]], *, reflog: str, env: Mapping[str, str],
                     max_attempts: int, what: str, stuck: str | None = None) -> T:
    """Move ``ref`` to a commit built on its current tip, retrying while other processes move it first.

    Each attempt reads the tip (None when ``ref`` does not exist), calls ``make(tip)`` for ``(new commit,
    result)``, and runs ``git update-ref -m <reflog> <ref> <new> <tip or zeros>``: git moves the ref only if
    it still points at the tip read (all zeros: only if it does not exist yet), so two concurrent moves never
    lose one. A lost race sleeps 5-30 ms times the attempt number (at most 10) and rebuilds on the new tip.
    ``run`` is a runner with :func:`run_git`'s ``(command, *args, ok=, env=)`` (cwd and default env bound);
    ``env`` is used for update-ref (the committer identity). Returns ``make``'s result of the attempt that
    swapped. ``make`` may raise to stop (e.g. a precondition on the tip no longer holds).

    Raises:
        GwenlakeError: ``"<what> for <max_attempts> attempts; last error: ..."`` when every attempt lost;
            with ``stuck`` given, ``"<stuck>: <git's error>"`` at once when update-ref fails although the ref
            did not move and no other process held its lock (a permanent refusal, e.g. a branch ``models``
            blocking ``models/...``).
    """
    last_error = ""
    tips: set[str | None] = set()
    for attempt in range(1, max_attempts + 1):
        tip = _tip(run, ref)
        tips.add(tip)
        new, result = make(tip)
        old = tip or "0" * len(new)  # all zeros: the ref must not exist yet
        status, _, err = run("update_ref", "-m", reflog, ref, new, old, ok=(0, 1, 128), env=env)
        if status == 0:
            return result
        last_error = err.strip()
        # Retry only when the ref moved or another process held its lock; anything else is permanent.
        locked = ".lock': File exists" in last_error
        if stuck is not None and _tip(run, ref) == tip and not locked:
            raise GwenlakeError(f"{stuck}: {last_error}")
        time.sleep(random.uniform(0.005, 0.03) * min(attempt, 10))
    stale = re.search(r"Unable to create '([^']+\.lock)': File exists", last_error)
    if stale and len(tips) == 1:  # locked every time while it never moved: a git killed as it moved the ref
        raise GwenlakeError(
            f"{what}: {stale.group(1)} was there at each of {max_attempts} attempts and the branch never moved: a "
            "git process killed while it moved the branch (a SIGKILL of the job, a node crash) leaves that file. "
            f"If no git process runs on this repository (pgrep -a git), remove it (rm {shlex.quote(stale.group(1))})"
            " and run the same job again: it commits the version it trained")
    raise GwenlakeError(f"{what} for {max_attempts} attempts; last error: {last_error}")


def _tip(run: Callable[..., tuple[int, bytes, str]], ref: str) -> str | None:
    status, out, _ = run("rev_parse", "--verify", "--quiet", f"{ref}^{{commit}}", ok=(0, 1, 128))
    return (out.decode().strip() or None) if status == 0 else None
