"""Helpers for tests against the real SLURM test cluster of ``scripts/slurm-cluster.sh``.

The cluster runs on localhost: nodes ``n1`` and ``n2`` (2 CPUs and 2 fake GPUs each), partitions ``low``
(default, PriorityTier=1) and ``high`` (PriorityTier=10, preempts ``low`` jobs, which are requeued).

``require_cluster()`` skips a test where the cluster does not answer. Job states come from ``sacct``
(``-X``: the allocation, not its steps) and ``squeue``; a requeued job keeps its id, gets ``Restarts=N`` in
``scontrol show job`` and ``SLURM_RESTART_COUNT=N`` in its environment, and waits about two minutes
(its BeginTime) before it may start again: ``release(job_id)`` lets it start at once (needs root).
"""

from __future__ import annotations

import re
import shutil
import os
import subprocess
import time
from pathlib import Path
from collections.abc import Iterable, Sequence

import pytest

NODES = ("n1", "n2")
PARTITIONS = ("low", "high")
SKIP_REASON = "no SLURM cluster: run `bash scripts/slurm-cluster.sh up`"
# sinfo's compact node states of a node that takes jobs (a suffix such as "*" = not responding, "~" = powered
# off, "#"/"%"/"!" = powering up/down, "-" = planned by backfill... only the plain ones count as up).
_UP_STATES = {"idle", "mix", "alloc", "comp", "plnd"}


def _run(args: Sequence[str], timeout: float = 15) -> subprocess.CompletedProcess | None:
    """Run a SLURM command; None when it is missing or does not answer in time."""
    if shutil.which(args[0]) is None:
        return None
    try:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (subprocess.TimeoutExpired, OSError):
        return None


def node_states() -> dict[str, str]:
    """{node: compact state} from ``sinfo -N`` (a node in two partitions is listed once)."""
    proc = _run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=5)
    if proc is None or proc.returncode != 0:
        return {}
    states = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


_unavailable = False  # once found absent, stays absent for this process (each sinfo try costs seconds)


def cluster_available(wait_s: float = 90) -> bool:
    """sinfo answers within a few seconds and both nodes are up (idle, mixed, allocated or completing).

    A node still coming back (a test revived it, the controller has not heard from it yet: ``idle*``) is
    waited for up to ``wait_s`` seconds. Only a cluster that is not there at all (sinfo does not answer) is
    remembered as absent, so one slow node does not fail every later test.
    """
    global _unavailable
    if _unavailable:
        return False
    deadline = time.monotonic() + wait_s
    while True:
        states = node_states()
        if not states:
            _unavailable = True
            return False
        if all(states.get(node) in _UP_STATES for node in NODES):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(1)


def require_cluster() -> None:
    """Skip the calling test when the SLURM test cluster is not running."""
    if not cluster_available():
        if os.environ.get("GWENLAKE_REQUIRE_SLURM") == "1":  # CI brought a cluster up: its absence is a failure
            pytest.fail(SKIP_REASON)
        pytest.skip(SKIP_REASON)


def sbatch(*args: str, script: str | None = None, timeout: float = 30) -> int:
    """Submit a batch job (``sbatch --parsable ARGS``, the script text on stdin if given); returns its id."""
    proc = subprocess.run(["sbatch", "--parsable", *args], input=script, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return int(proc.stdout.strip().split(";")[0])


def scancel(*job_ids: int, signal: str | None = None) -> None:
    """``scancel [--signal=SIG] IDS``; errors (e.g. job already gone) are ignored."""
    if job_ids:
        _run(["scancel", *([f"--signal={signal}"] if signal else []), *map(str, job_ids)])


def sacct_state(job_id: int) -> str | None:
    """The job's state in accounting (latest run of a requeued job), e.g. "COMPLETED", "CANCELLED by 0";
    None when sacct does not know it (yet)."""
    proc = _run(["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "State"])
    if proc is None or proc.returncode != 0:
        return None
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else None


def sacct_history(job_id: int) -> list[str]:
    """The states of every run of the job, oldest first (``sacct -D``): e.g. ["PREEMPTED", "COMPLETED"]."""
    proc = _run(["sacct", "-n", "-P", "-X", "-D", "-j", str(job_id), "-o", "State"])
    if proc is None or proc.returncode != 0:
        return []
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()]


def squeue_state(job_id: int) -> str | None:
    """The job's state in the controller (PENDING, RUNNING, COMPLETING, COMPLETED...); None once it is gone
    (MinJobAge after its end) or unknown."""
    proc = _run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T"])
    if proc is None or proc.returncode != 0:
        return None
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    return lines[0] if lines else None


def _matches(state: str | None, states: Iterable[str]) -> bool:
    return state is not None and any(state.startswith(s) for s in states)


def wait_state(job_id: int, states: str | Iterable[str], timeout_s: float = 60, poll_s: float = 0.5) -> str:
    """Poll squeue and sacct until the job's state starts with one of ``states`` (e.g. "COMPLETED",
    "CANCELLED" matches "CANCELLED by 0"); returns that state. Raises TimeoutError after ``timeout_s``."""
    wanted = (states,) if isinstance(states, str) else tuple(states)
    deadline = time.monotonic() + timeout_s
    seen: tuple[str | None, str | None] = (None, None)
    while True:
        seen = (squeue_state(job_id), sacct_state(job_id))
        for state in seen:
            if _matches(state, wanted):
                return state  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"job {job_id} not in {wanted} after {timeout_s:.0f} s: "
                               f"squeue {seen[0]!r}, sacct {seen[1]!r}")
        time.sleep(poll_s)


def show_job(job_id: int) -> dict[str, str]:
    """``scontrol show job -o ID`` as {key: value}; {} when the controller no longer knows the job."""
    proc = _run(["scontrol", "show", "job", "-o", str(job_id)])
    if proc is None or proc.returncode != 0:
        return {}
    return dict(re.findall(r"(\w[\w:/]*)=(\S*)", proc.stdout))


def job_restarts(job_id: int) -> int:
    """How many times the job was requeued: ``Restarts=N`` of ``scontrol show job``; once the controller
    has forgotten the job, the number of earlier runs in accounting (``sacct -D``)."""
    info = show_job(job_id)
    if "Restarts" in info:
        return int(info["Restarts"])
    return max(len(sacct_history(job_id)) - 1, 0)


def release(job_id: int) -> None:
    """Let a requeued job start now instead of ~2 minutes later (``scontrol update jobid=N StartTime=now``;
    root or SlurmUser only).

    Waits 2 s first: slurmd revokes the old credential of a requeued job with one-second resolution, and a
    start within the same second is killed ("Job credential revoked") -- SLURM's own delay avoids that."""
    time.sleep(2)
    proc = _run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])
    if proc is None or proc.returncode != 0:
        raise RuntimeError(f"scontrol update jobid={job_id} StartTime=now failed: "
                           f"{proc.stderr.strip() if proc else 'no answer'}")


def _descendants(pids: Iterable[int]) -> list[int]:
    """The pids and every process below them (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def lose_node(node: str, job_id: int) -> None:
    """Simulate a node dying under a job: SIGKILL its slurmd, the job's slurmstepds and everything they
    started, then tell the controller the node is down (``scontrol update nodename=N state=down``), as the
    controller would decide by itself after ``SlurmdTimeout``. :func:`revive_node` brings it back."""
    daemon = _run(["pgrep", "-f", f"^/usr/sbin/slurmd -N {node}$"])
    steps = _run(["pgrep", "-f", rf"^slurmstepd: \[{job_id}\."])
    pids = [int(p) for proc in (daemon, steps) if proc for p in proc.stdout.split()]
    for pid in _descendants(pids):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    proc = _run(["scontrol", "update", f"nodename={node}", "state=down", "reason=lost-node-test"])
    if proc is None or proc.returncode != 0:
        raise RuntimeError(f"scontrol update nodename={node} state=down failed: {proc.stderr if proc else ''}")


def revive_node(node: str, timeout_s: float = 120) -> None:
    """Start the node's slurmd again and wait until the controller has it back in service."""
    for sock in Path(f"/var/spool/slurmd-{node}").glob("*.socket"):  # the killed stepds' sockets
        sock.unlink(missing_ok=True)
    if not _run(["pgrep", "-f", f"^/usr/sbin/slurmd -N {node}$"]).stdout.strip():
        # in a mount namespace of its own, as scripts/slurm-cluster.sh starts it (tests/helpers/sshfs.py node_mounts)
        own = ["unshare", "-m", "--propagation", "slave"] if subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode == 0 else []
        subprocess.run([*own, "/usr/sbin/slurmd", "-N", node], check=True, timeout=30)
    _run(["scontrol", "update", f"nodename={node}", "state=resume"])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node_states().get(node, "") in ("idle", "mix", "alloc"):  # not "idle*": the controller hears it
            return
        _run(["scontrol", "update", f"nodename={node}", "state=resume"])
        time.sleep(1)
    raise RuntimeError(f"node {node} did not come back: {node_states()}")


def sh(*cmd) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()


def job_fields(job_id) -> dict:
    return show_job(int(job_id))


def wait_until(pred, timeout=240, what="condition", poll=0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


# Jobs of the tests' project (``+job=t``) submitted with ``launcher=slurm``.


def submit(project, *overrides, env_vars=None, env=None) -> str:
    args = ["+job=t", *overrides]
    for k, v in (env_vars or {}).items():
        args.append(f"+launcher.env.{k}={v}")
    proc = project.run(*args, env=env, check=0)
    m = re.search(r"submitted job (\d+)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    return m.group(1)


def state_of(job_id) -> str:
    f = job_fields(job_id)
    if f.get("JobState"):
        return f["JobState"]
    out = sh("sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State").splitlines()
    return out[-1].split()[0] if out else "UNKNOWN"


def finish(job_id, timeout=400) -> str:
    """Wait for a final state, releasing requeued jobs from SLURM's start delay as we go."""
    def done():
        st = state_of(job_id)
        if st == "PENDING" and job_fields(job_id).get("Reason") == "BeginTime":  # a requeued job's delay
            release(int(job_id))
        return st if st in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") else None
    return wait_until(done, timeout, f"job {job_id} to end")


def log_text_any(project, job_id) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(project.root.glob(f"runs*/t.model/*/slurm/{job_id}/*_log.*")))
