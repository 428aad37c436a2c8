"""``scontrol suspend`` of a running training on the real local cluster (issue 40, item 11): the stopped seconds are
the ledger's ``suspended_s``, not step time, and the tracking delivery process (a session of its own, which SLURM's
suspend does not reach) stops while its training is stopped. Skipped with a reason when no cluster answers."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from helpers.slurm_cluster import finish, require_cluster, submit, wait_until

pytestmark = pytest.mark.slurm

SUSPEND_S = 20.0


@pytest.fixture(autouse=True)
def _cluster():
    require_cluster()


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of ``pid`` from /proc, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def _training_pid(run_dir: Path) -> int | None:
    """The job step's training process of ``run_dir`` (submitit's runner under our boot module)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        # python -m gwenlake_hpc.launch.boot ... <run dir>/slurm/%j (not srun, whose arguments name it too)
        if args[1:3] == [b"-m", b"gwenlake_hpc.launch.boot"] and any(a.startswith(str(run_dir).encode())
                                                                     for a in args):
            return int(cmdline.parent.name)
    return None


def _delivery_pids(parent: int) -> list[int]:
    """The tracking delivery processes that ``parent`` started."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"gwenlake_hpc.stores.tracking.delivery" not in cmdline.read_bytes():
                continue
        except OSError:
            continue
        if (_proc_stat(int(cmdline.parent.name)) or ("", 0))[1] == parent:
            pids.append(int(cmdline.parent.name))
    return pids


def test_a_suspended_job_records_its_suspension_and_stops_its_delivery(project):
    from gwenlake_hpc.runtime.ledger import parts, read_ledger, summarize

    # 2,000 steps of >= 20 ms: ~50 s of training on node n1, with MLflow tracking (the delivery process)
    job = submit(project, "job.steps=2000", "launcher=slurm", "launcher.timeout_min=10", "launcher.cpus_per_task=2",
                 "+launcher.additional_parameters.nodelist=n1", "launcher.progress_every_s=2",
                 env_vars={"GWL_TEST_SLEEP": "0.02"})
    run_dirs = lambda: list((project.root / "runs" / "t.model").glob("*/ledger"))  # noqa: E731

    def training():
        dirs = run_dirs()
        recs = read_ledger(dirs[0].parent, live=True) if dirs else []
        return recs if recs and (recs[-1].get("last_step") or 0) >= 100 else None

    wait_until(training, what="the job training 100 steps")
    run_dir = run_dirs()[0].parent
    trainer = wait_until(lambda: _training_pid(run_dir), what="the job step's training process")
    deliveries = wait_until(lambda: _delivery_pids(trainer), what="the tracking delivery process")
    assert subprocess.run(["scontrol", "suspend", job], capture_output=True, text=True, timeout=60).returncode == 0
    suspended_at = time.monotonic()
    try:
        wait_until(lambda: (_proc_stat(trainer) or ("?",))[0] == "T", timeout=30, poll=0.2,
                   what="the training stopped by the suspend")
        # the delivery process follows it (it looks every 0.5 s): stopped, not delivering, during the suspension
        wait_until(lambda: all((_proc_stat(p) or ("T",))[0] == "T" for p in deliveries), timeout=15, poll=0.2,
                   what="the delivery process stopped with its training")
        time.sleep(max(0.0, SUSPEND_S - (time.monotonic() - suspended_at)))
        assert all((_proc_stat(p) or ("T",))[0] == "T" for p in deliveries)
    finally:
        assert subprocess.run(["scontrol", "resume", job], capture_output=True, text=True,
                              timeout=60).returncode == 0
    # continued by its training once that runs again
    wait_until(lambda: all((_proc_stat(p) or ("S",))[0] != "T" for p in deliveries), timeout=30, poll=0.2,
               what="the delivery process continued")
    assert finish(job) == "COMPLETED"

    (rec,) = read_ledger(run_dir)
    assert rec["end"] == "finished" and rec["last_step"] == 2000
    assert rec["suspended_s"] >= SUSPEND_S - 5.0, rec
    # the steps' time is what they ran: never the suspension (before, step_s held it: 131.7 s for 72 s of steps)
    assert rec["step_s"] <= rec["elapsed_s"] - rec["suspended_s"], rec
    assert sum(parts(rec).values()) == pytest.approx(rec["elapsed_s"])
    total = summarize([rec])
    assert total["allocated_s"] == pytest.approx(rec["elapsed_s"] - rec["suspended_s"])
    status = project.run("status", check=0).stdout
    assert re.search(r"goodput 0\.\d\d of \d+ s.*suspended \d+ s", status), status
