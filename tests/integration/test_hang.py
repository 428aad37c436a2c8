"""The hang watchdog (issue 24) on real processes: a training blocked in a C call that holds the GIL is caught,
its stacks point at the user's line, it is ended (SIGKILL) and its rerun resumes from its newest checkpoint and
finishes; a long checkpoint block and a SIGSTOP are not called hangs.

Job ``t`` (``trainer.py:fit``: a checkpoint every 10 steps) with ``job.hang_timeout_s=8``: a step may last 8 s,
start-up, the first step, checkpoint and evaluation steps 24 s (generous: a loaded machine imports torch and
opens the data slowly, and that is no hang). The trainer's hooks: ``GWL_TEST_HANG=k:gil`` blocks step ``k`` (the checkpoints before it sealed)
in libc's ``sleep`` through ``ctypes.PyDLL`` (the GIL held), ``GWL_TEST_HANG_ONCE`` only on the first launch,
``GWL_TEST_SLEEP_IN_CKPT`` sleeps inside each checkpoint block.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
import signal
import subprocess
import time

import pytest

from helpers.project import expect_hangs

pytestmark = pytest.mark.slow


def _trainer_line(project, text: str) -> int:
    """The line of ``text`` in the test project's trainer.py."""
    lines = (project.root / "trainer.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if text in line)


def test_a_step_blocked_in_c_with_the_gil_is_caught_its_stacks_name_the_line_and_the_rerun_finishes(project):
    expect_hangs(project)
    marker = project.root / "hung-once"
    env = {"GWL_TEST_HANG": "25:gil", "GWL_TEST_HANG_ONCE": str(marker)}
    hung = project.run("+job=t", "job.hang_timeout_s=8", env=env, timeout=300)
    out = hung.stdout + hung.stderr
    assert hung.returncode == -signal.SIGKILL, out[-4000:]
    assert "test hook: hanging at step 25 (gil)" in out
    line = _trainer_line(project, "ctypes.PyDLL(None).sleep(100000)")  # inside its loop
    verdict_line = next(ln for ln in out.splitlines() if ln.startswith("gwenlake_hpc: hang: "))
    assert re.search(r"rank 0 on \S+ made no progress for \d+ s in step 25 \(step; the limit is 8 s", verdict_line), \
        verdict_line
    assert f"trainer.py:{line} in _hang" in verdict_line, verdict_line

    run_dir = next((project.root / "runs" / "t.model").iterdir())
    [folder] = [p for p in (run_dir / "hangs").iterdir() if p.is_dir()]
    stacks = (folder / "rank0.txt").read_text()
    assert stacks.startswith("host ") and "\nrank 0\n" in stacks and "\nstep 25\n" in stacks, stacks[:400]
    assert f'trainer.py", line {line} in _hang' in stacks, stacks
    assert "Thread 0x" in stacks or "Current thread 0x" in stacks  # every thread of the process
    verdict = json.loads((folder / "verdict-rank0.json").read_text())
    assert verdict["step"] == 25 and verdict["limit_s"] == 8.0 and verdict["silent_s"] > 8.0, verdict
    assert verdict["user_code_at"].endswith(f"trainer.py:{line} in _hang"), verdict
    # The goodput ledger: the hung step's time up to the kill is in the start's record, lost (the GIL held, the
    # ledger's own thread could not write: the watchdog timed it by the process's age)
    from gwenlake_hpc.runtime import ledger as ledgers

    (rec,) = ledgers.read_ledger(run_dir)
    assert rec["end"] == "hang" and rec["first_step"] == 1, json.dumps(rec)
    # its last record may be up to a second (FLUSH_EVERY_S) before the hang: steps 1..24 take less than that
    assert rec["elapsed_s"] - rec["startup_s"] >= verdict["silent_s"], (rec, verdict)
    assert ledgers.parts(rec)["lost_s"] >= verdict["silent_s"] - 1.0, json.dumps(rec)
    # What the killed rank could not remove, its watchdog did: the heartbeat file, the stacks' scratch file.
    assert not list((run_dir / "hangs").glob(".stacks-*")), sorted(p.name for p in (run_dir / "hangs").iterdir())
    assert not list(Path("/dev/shm").glob(f"gwenlake-*-{verdict['pid']}-rank0.heartbeat"))

    rerun = project.run("+job=t", "job.hang_timeout_s=8", env=env, timeout=300)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    assert "resuming from step 20" in rerun.stdout + rerun.stderr, (rerun.stdout + rerun.stderr)[:3000]
    assert "gwenlake_hpc: hang:" not in rerun.stdout + rerun.stderr


def test_a_long_checkpoint_block_a_long_evaluation_a_slow_first_step_and_a_sigstop_are_not_hangs(project):
    """A step may last 8 s; the first step of a start, checkpoint blocks and evaluation steps 24 s. The first
    step takes 11 s (compiling, warming up), each checkpoint block 9 s, the evaluation step 20 takes 11 s more
    outside its block; the process is stopped for 12 s early in the run (SIGSTOP, then SIGCONT): the run
    finishes, nothing is called a hang."""
    proc = project.popen("+job=t", "job.steps=20", "job.hang_timeout_s=8",
                         env={"GWL_TEST_SLEEP_IN_CKPT": "9", "GWL_TEST_SLEEP": "0.2",
                              "GWL_TEST_SLOW_STEPS": "1:11,20:11"})
    time.sleep(6)
    proc.send_signal(signal.SIGSTOP)
    time.sleep(12)
    proc.send_signal(signal.SIGCONT)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, (out + err)[-4000:]
    assert "gwenlake_hpc: hang:" not in out + err
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    assert not [p for p in (run_dir / "hangs").iterdir() if p.is_dir()] if (run_dir / "hangs").exists() else True


def test_a_failure_before_the_loop_is_exit_1_not_a_hang_even_while_tracking_finishes(project):
    """The adversarial pass's case: the function raised before its loop; while the job ended tracking (FAILED)
    the watchdog still counted start-up and killed the rank (exit -9). The function's end ends the watching.
    Start-up's bound is 6 s here; tracking's end waits 12 s for an MLflow server that does not answer."""
    from helpers.mlflow_server import free_port

    failed = project.run("+job=t", "job.hang_timeout_s=2", f"tracking.uri=http://127.0.0.1:{free_port()}",
                         "tracking.finish_timeout_s=12", env={"GWL_TEST_RAISE_BEFORE_LOOP": "0"}, timeout=300)
    out = failed.stdout + failed.stderr
    assert failed.returncode == 1, out[-4000:]
    assert "test hook: failed before the loop" in out and "gwenlake_hpc: hang:" not in out, out[-4000:]


def test_two_ranks_rank_1_stops_the_verdict_names_it_both_stacks_are_written_and_mlflow_has_the_tag(project):
    """Rank 1 blocks in step 25 (GIL held) after its backward; rank 0 finishes the step and waits in the next
    collective (the loop's stop vote). Both ranks' stacks are taken, the verdict names rank 1 as the rank that
    stopped first and rank 0 as waiting in a collective; MLflow gets the tag and the stack files; the rerun on
    two ranks resumes from step 20 and finishes, with rank 1 slow and named so."""
    expect_hangs(project)
    from helpers.jobs import mlflow_runs
    from helpers.ranks import launch

    marker = project.root / "hung-once"
    env = {"GWL_TEST_HANG": "25:gil", "GWL_TEST_HANG_RANK": "1", "GWL_TEST_HANG_ONCE": str(marker)}
    hung = launch(project, "+job=t", "job.hang_timeout_s=8", env=env, timeout=300)
    logs = "\n=====\n".join(r[2][-3000:] for r in hung)
    assert [r[0] for r in hung] == [-signal.SIGKILL, -signal.SIGKILL], logs
    lines = [ln for r in hung for ln in r[2].splitlines() if ln.startswith("gwenlake_hpc: hang: ")]
    assert len(lines) == 1, logs  # one verdict for the job, by one watchdog
    hang_line = _trainer_line(project, "ctypes.PyDLL(None).sleep(100000)")
    assert re.search(r"^gwenlake_hpc: hang: rank 1 on \S+ made no progress for \d+ s in step 25 \(step; the limit "
                     r"is 8 s, job.hang_timeout_s\) \(it stopped first\): its main thread is at \S+trainer.py:"
                     rf"{hang_line} in _hang; the others wait: rank 0 on \S+ in step 25, collective at \S+"
                     r"distributed_c10d.py:\d+ in all_reduce", lines[0]), lines[0]

    run_dir = next((project.root / "runs" / "t.model").iterdir())
    [folder] = [p for p in (run_dir / "hangs").iterdir() if p.is_dir()]
    verdict = json.loads((folder / "verdict.json").read_text())
    assert (verdict["first"], verdict["waiting"], verdict["step"]) == ([1], [0], 25), verdict
    by_rank = {r["rank"]: r for r in verdict["records"]}
    assert by_rank[0]["activity"] == "collective" and by_rank[1]["activity"] == "your code", by_rank
    assert by_rank[1]["detected"] is True and by_rank[0]["step"] == 25
    assert f'trainer.py", line {hang_line} in _hang' in (folder / "rank1.txt").read_text()
    assert "in all_reduce" in (folder / "rank0.txt").read_text()  # rank 0's own stacks, taken on request
    assert "\nrank 0\n" in (folder / "rank0.txt").read_text()

    # The rerun: rank 1 is the slow one now (0.1 s more a step, after the step's collectives): at each
    # evaluation (30, 40, 50, 60) it is the slowest rank, and after three in a row rank 0 warns about it once.
    slow = {**env, "GWL_TEST_SLEEP": "0.1", "GWL_TEST_SLEEP_RANK": "1"}
    rerun = launch(project, "+job=t", "job.hang_timeout_s=8", env=slow, timeout=300)
    assert [r[0] for r in rerun] == [0, 0], "\n=====\n".join(r[2][-3000:] for r in rerun)
    assert "resuming from step 20" in rerun[0][1] + rerun[0][2]
    warned = [ln for ln in (rerun[0][1] + rerun[0][2]).splitlines() if "slower than the median of the other" in ln]
    assert len(warned) == 1 and "rank 1 on " in warned[0] and "for 3 evaluations in a row" in warned[0], \
        rerun[0][1][-3000:] + rerun[0][2][-3000:]
    assert json.loads((run_dir / "ranks.json").read_text())["slowest"]["rank"] == 1
    client, runs = mlflow_runs(project)
    slowest = client.get_metric_history(runs[0].info.run_id, "time/slowest_rank")
    points = sorted((m.step, m.value) for m in slowest)
    assert [st for st, _ in points] == [10, 20, 30, 40, 50, 60], points  # the hung start's two evaluations too
    assert points[2:] == [(30, 1.0), (40, 1.0), (50, 1.0), (60, 1.0)], points
    assert runs[0].data.tags["gwenlake.slowest_rank"].startswith("rank 1 on "), runs[0].data.tags
    assert len(runs) == 1, runs  # the hung start and the rerun: one MLflow run
    tags = runs[0].data.tags
    assert tags["gwenlake.hang"] == verdict["line"] and tags["gwenlake.hang.first_ranks"] == "1", tags
    assert tags["gwenlake.hang.step"] == "25"
    listed = {a.path for a in client.list_artifacts(runs[0].info.run_id, f"hangs/{folder.name}")}
    assert listed == {f"hangs/{folder.name}/{n}" for n in ("rank0.txt", "rank1.txt", "verdict.json")}, listed


def test_a_deadlocked_dataloader_worker_is_caught_and_killed_with_its_rank(project):
    """A DataLoader worker blocks for good on row 170 (batch 10, the batch of step 11): the main thread waits for
    it after step 10 (an evaluation step: 24 s). The verdict says data loading, the worker dies with the rank
    (the reruns after a hang are checked by the other tests)."""
    expect_hangs(project)
    marker = project.root / "worker-hung"
    args = ("+job=t", "job.target=trainer.py:fit_loader", "job.hang_timeout_s=8")
    env = {"GWL_TEST_LOADER_HANG": f"170:{marker}"}
    hung = project.run(*args, env=env, timeout=300)
    out = hung.stdout + hung.stderr
    assert hung.returncode == -signal.SIGKILL, out[-4000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("gwenlake_hpc: hang: "))
    assert "in step 10 (step (evaluation step); the limit is 24 s" in line, line
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    [folder] = [p for p in (run_dir / "hangs").iterdir() if p.is_dir()]
    [record] = json.loads((folder / "verdict.json").read_text())["records"]
    assert record["activity"] == "data loading", record
    assert "torch/utils/data/dataloader.py" in (folder / "rank0.txt").read_text()
    worker = int(marker.read_text())
    deadline = time.monotonic() + 30
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{worker}").exists(), "the hung DataLoader worker outlived its rank"


def test_one_rank_of_two_stopped_is_no_hang_of_the_other_that_waits_for_it(project):
    """The adversarial pass's case: rank 1 SIGSTOPped for 9 s (the step limit is 5 s); rank 0 waits for it in
    the stop vote. Rank 1's watchdog marks it stopped, rank 0's does not count the wait: both finish."""
    from helpers.ranks import start_ranks

    procs = start_ranks(project, "+job=t", "job.steps=30", "job.hang_timeout_s=5", env={"GWL_TEST_SLEEP": "0.5"})
    try:
        time.sleep(12)  # past start-up, in the loop
        procs[1].send_signal(signal.SIGSTOP)
        time.sleep(9)
        procs[1].send_signal(signal.SIGCONT)
        out = [(p.wait(timeout=300), *p.communicate(timeout=60)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n=====\n".join(r[2][-3000:] for r in out)
    assert [r[0] for r in out] == [0, 0], logs
    assert "gwenlake_hpc: hang" not in logs
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    assert not list((run_dir / "hangs").glob(".stopped-*")), sorted(p.name for p in (run_dir / "hangs").iterdir())


def test_a_killed_watchdog_is_started_again_and_still_catches_a_time_sleep_past_the_limit(project):
    """The adversarial pass's case: the watchdog process SIGKILLed by hand went unnoticed and the hang after it
    was never caught. Now the training starts it again with a warning, and the hang at step 30 (a time.sleep in
    user code) is caught."""
    expect_hangs(project)
    proc = project.popen("+job=t", "job.hang_timeout_s=5", env={"GWL_TEST_SLEEP": "0.3", "GWL_TEST_HANG": "30:sleep"})
    try:
        deadline = time.monotonic() + 120
        watchdog = None
        while watchdog is None and time.monotonic() < deadline:
            time.sleep(0.5)
            found = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "gwenlake_hpc.job.watchdog"],
                                   capture_output=True, text=True).stdout.split()
            watchdog = int(found[0]) if found else None
        assert watchdog is not None, "no watchdog process found"
        os.kill(watchdog, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "the hang watchdog of rank 0 ended (status -9) while the training runs: started again (1 of 3)" in \
        out + err, (out + err)[-4000:]
    assert proc.returncode == -signal.SIGKILL, (out + err)[-4000:]
    # a time.sleep in user code past the limit, caught by the watchdog started again: the verdict names the line
    sleep_line = _trainer_line(project, "time.sleep(100000)  # GWL_TEST_HANG sleep")
    assert re.search(rf"gwenlake_hpc: hang: rank 0 on \S+ made no progress for \d+ s in step 30 \(step \(evaluation "
                     rf"step\); the limit is 15 s.*: its main thread is at \S+trainer.py:{sleep_line} in _hang;",
                     out + err), out + err


def test_a_checkpoint_writer_blocked_in_fsync_is_named_by_the_verdict(project):
    """Issue 40 item 5, the reported input: the checkpoint writer thread blocked in os.fsync (the seal of step
    20's checkpoint, GWL_TEST_FSYNC_BLOCK), the main thread waits for it at step 30's checkpoint (at most one in
    flight). The verdict said the main thread was in ``threading.py ... _wait_for_tstate_lock``; it names the
    writer thread and where it blocks, the hook's ``fsync``."""
    expect_hangs(project)
    hung = project.run("+job=t", "job.hang_timeout_s=4", env={"GWL_TEST_FSYNC_BLOCK": "20"}, timeout=300)
    out = hung.stdout + hung.stderr
    assert hung.returncode == -signal.SIGKILL, out[-4000:]
    assert "test hook: the checkpoint writer blocks in fsync" in out
    line = _trainer_line(project, "ctypes.CDLL(None).sleep(100000)")
    verdict_line = next(ln for ln in out.splitlines() if ln.startswith("gwenlake_hpc: hang: "))
    assert re.search(r"in step (20|30) \(checkpoint \(evaluation step\); the limit is 12 s, job.hang_timeout_s\): its main "
                     r"thread waits for thread gwenlake-checkpoint-writer, blocked at \S+trainer.py:"
                     rf"{line} in fsync \(the main thread is at \S+threading.py:\d+ in _wait_for_tstate_lock\)",
                     verdict_line), verdict_line
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    [folder] = [p for p in (run_dir / "hangs").iterdir() if p.is_dir()]
    record = json.loads((folder / "verdict-rank0.json").read_text())
    assert record["waits_for"]["name"] == "gwenlake-checkpoint-writer", record
    assert record["waits_for"]["at"].endswith(f"trainer.py:{line} in fsync"), record
    assert not list(Path("/dev/shm").glob(f"gwenlake-*-{record['pid']}-rank0.threads"))  # removed with the rank
