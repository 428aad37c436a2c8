"""DataLoader worker processes under a termination signal sent to the whole process group, as SLURM does
(preemption, scancel, time limit): the workers do not die from it, the training checkpoints at the step
boundary, and no worker outlives the job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_survive_the_group_signal_and_do_not_outlive_the_job(project, tmp_path):
    reached, go = tmp_path / "reached", tmp_path / "go"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GWL_TEST_PAUSE": f"23:{reached}:{go}"}
    proc = subprocess.Popen([sys.executable, "-m", "gwenlake_hpc", "+job=t", "job.target=trainer.py:fit_loader"],
                            cwd=project.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group, like a SLURM job step
    deadline = time.time() + 120
    while not reached.exists() or not reached.read_text():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.1)
    workers = [int(p) for p in reached.read_text().split()]
    assert workers and proc.pid not in workers and all(alive(p) for p in workers)
    os.killpg(proc.pid, signal.SIGTERM)  # every process of the group, the workers included
    time.sleep(0.5)
    assert all(alive(p) for p in workers)  # still serving batches
    go.touch()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-3000:]
    assert "loop ended after step 24" in out and "killed by signal" not in out
    deadline = time.time() + 10
    while any(alive(p) for p in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in workers)
    assert (next((project.root / "runs" / "t.model").iterdir()) / "checkpoints" / "step-000000024").is_dir()

    again = project.run("+job=t", "job.target=trainer.py:fit_loader", check=0)
    assert "resuming from step 24" in again.stdout + again.stderr


def test_children_started_while_shielded_survive_the_stop_signals():
    """The final commit's git processes: SLURM's SIGUSR2/SIGTERM to the whole step must not kill them."""
    from gwenlake_hpc.base.processes import shield_children
    from gwenlake_hpc.runtime.signals import StopRequest

    stop = StopRequest()
    with stop:
        with shield_children():
            child = subprocess.Popen(["sleep", "1"])
            time.sleep(0.2)
            for sig in (signal.SIGUSR2, signal.SIGTERM):
                os.kill(child.pid, sig)
            os.kill(os.getpid(), signal.SIGUSR2)
            assert child.wait(timeout=10) == 0  # would be -12 (killed by SIGUSR2) unshielded
        time.sleep(0.1)
        assert stop.requested and stop.reason == "SIGUSR2"  # this process still recorded it
    unshielded = subprocess.Popen(["sleep", "1"])
    time.sleep(0.2)
    os.kill(unshielded.pid, signal.SIGUSR2)
    assert unshielded.wait(timeout=10) == -signal.SIGUSR2


def test_children_started_from_a_thread_while_shielded_survive_the_stop_signals():
    """The tracker starts its delivery process from a thread: the block applies to the calling thread's children."""
    import threading

    from gwenlake_hpc.base.processes import shield_children

    codes = []

    def start():
        with shield_children():
            child = subprocess.Popen(["sleep", "1"])
        time.sleep(0.2)
        os.kill(child.pid, signal.SIGUSR2)
        codes.append(child.wait(timeout=10))

    t = threading.Thread(target=start)
    t.start()
    t.join(30)
    assert codes == [0]
