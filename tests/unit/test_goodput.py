"""job.eval_every=auto's choice (Young/Daly) and the goodput ledger's arithmetic, on given measurements."""

from __future__ import annotations

import json
import math

import pytest

from gwenlake_hpc.runtime import ledger as ledgers
from gwenlake_hpc.runtime.interval import AutoInterval, expected_goodput, young_daly_s


def test_young_daly_interval_and_goodput():
    assert young_daly_s(2.0, 100.0) == pytest.approx(20.0)
    assert expected_goodput(2.0, 100.0) == pytest.approx(1 - math.sqrt(0.04))
    assert expected_goodput(200.0, 100.0) == 0.0


def _fed(auto: AutoInterval, start: int, plain_s: float, eval_s: float) -> int:
    """Feed steps from start+1 until the first evaluation; returns that step."""
    step = start
    while True:
        step += 1
        at_eval = step >= auto.next_step
        auto.observe(step, eval_s if at_eval else plain_s, at_eval)
        if at_eval:
            return step


def test_auto_interval_is_sqrt_2cm_in_steps_bounded_by_the_write_and_the_maximum():
    logged = []
    auto = AutoInterval(40, lambda: 200.0, 1800.0, lambda: None, log=lambda v, s: logged.append((s, v)))
    assert auto.next_step == 43  # a warm-up step, a measured plain step, then the first evaluation
    first = _fed(auto, 40, 0.1, 1.1)
    assert first == 43
    # C = 1.1 - 0.1 = 1.0 s, M = 200 s: T = 20 s = 200 steps of 0.1 s
    assert auto.cost_s == pytest.approx(1.0) and auto.interval_s == pytest.approx(20.0)
    assert auto.interval_steps == 200 and auto.next_step == 243
    assert logged[-1][0] == 43 and logged[-1][1]["checkpoint/interval_steps"] == 200.0

    slow_write = AutoInterval(0, lambda: 200.0, 1800.0, lambda: 30.0)
    _fed(slow_write, 0, 0.1, 1.1)
    assert slow_write.interval_steps == 300  # never shorter than the previous background write (30 s)

    capped = AutoInterval(0, lambda: 200.0, 10.0, lambda: None)
    _fed(capped, 0, 0.1, 1.1)
    assert capped.interval_steps == 100  # job.max_eval_interval_s=10

    # recomputed at each evaluation: a cheaper checkpoint later gives a shorter interval
    step = _fed(auto, 43, 0.1, 0.1 + 0.25)
    assert step == 243 and auto.interval_steps == 100  # sqrt(2 * 0.25 * 200) = 10 s


def test_auto_interval_takes_rank_0s_choice():
    seen = []
    auto = AutoInterval(0, lambda: 200.0, 1800.0, lambda: None, broadcast=lambda v: seen.append(v) or 7)
    _fed(auto, 0, 0.1, 1.1)
    assert seen == [200] and auto.interval_steps == 7 and auto.next_step == 3 + 7


def _write(path, *records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"torn')


def test_ledger_kept_and_lost_from_the_next_starts_resume_point(tmp_path):
    run = tmp_path / "run"
    killed = {"start": 0, "elapsed_s": 100.0, "startup_s": 10.0, "first_step": 1, "last_step": 50,
              "step_s": 80.0, "checkpoint_s": 5.0, "sealed_step": 30, "kept_step_s": 48.0,
              "marks": {"30": 48.0, "40": 64.0}, "step_end_s": 97.0, "loop_end_s": None, "end": None}
    # its newest record said 30 sealed; step 40's seal landed after it: the next start resumed from 40
    _write(ledgers.start_path(run, 0), {**killed, "last_step": 45}, killed)
    finished = {"start": 1, "elapsed_s": 50.0, "startup_s": 5.0, "first_step": 41, "last_step": 60,
                "step_s": 30.0, "checkpoint_s": 2.0, "sealed_step": 60, "kept_step_s": 30.0, "marks": {},
                "loop_end_s": 45.0, "end": "finished"}
    _write(ledgers.start_path(run, 1), finished)
    recs = ledgers.read_ledger(run)
    assert [r["end"] for r in recs] == ["killed", "finished"]
    assert recs[0]["next_resumed_at"] == 40
    p0 = ledgers.parts(recs[0])
    # lost: the 16 s of steps 41..50 and the 3 s of step 51, in progress at the kill (its last whole step ended
    # at 97 s, its last record at 100 s)
    assert p0 == {"startup_s": 10.0, "kept_s": 64.0, "lost_s": 19.0, "checkpoint_s": 5.0, "after_loop_s": 0.0,
                  "suspended_s": 0.0, "other_s": 2.0}
    old = {k: v for k, v in recs[0].items() if k != "step_end_s"}  # a record from before step_end_s existed
    assert ledgers.parts(old)["lost_s"] == 16.0 and ledgers.parts(old)["other_s"] == 5.0
    assert ledgers.lost_steps(recs[0]) == 10
    p1 = ledgers.parts(recs[1])
    assert p1["kept_s"] == 30.0 and p1["after_loop_s"] == 5.0 and sum(p1.values()) == pytest.approx(50.0)
    total = ledgers.summarize(recs)
    assert total["goodput"] == pytest.approx((64.0 + 30.0) / 150.0)
    assert total["largest_loss"] == "lost_s" and total["unannounced"] == 1 and total["lost_steps"] == 10
    assert ledgers.describe(total) == "goodput 0.63 of 150 s (largest loss: lost 19 s)"


def test_ledger_start_without_a_loop_is_all_startup_and_the_live_one_is_running(tmp_path):
    run = tmp_path / "run"
    _write(ledgers.start_path(run, 0), {"start": 0, "elapsed_s": 7.0, "startup_s": None, "first_step": None,
                                        "last_step": None, "step_s": 0.0, "end": "failure"})
    _write(ledgers.start_path(run, 1), {"start": 1, "elapsed_s": 9.0, "startup_s": 2.0, "first_step": 1,
                                        "last_step": 5, "step_s": 6.0, "sealed_step": None, "end": None})
    recs = ledgers.read_ledger(run, live=True)
    assert [r["end"] for r in recs] == ["failure", "running"]
    assert ledgers.parts(recs[0])["startup_s"] == 7.0 and ledgers.lost_steps(recs[0]) == 0
    assert ledgers.parts(recs[1])["kept_s"] == 0.0 and ledgers.lost_steps(recs[1]) == 5
    assert ledgers.read_ledger(run, lost_nodes=[1])[1]["end"] == "lost node"


def test_start_ledger_records_as_it_goes_and_a_hang_is_appended(tmp_path):
    path = ledgers.start_path(tmp_path, 3)
    led = ledgers.StartLedger(path, 3, {"host": "n1"}, every_s=0.0)
    t = led.now() + led._origin  # perf_counter seconds
    led.first_step(11, t)
    led.step_done(11, 0.5, 0.0, False, t + 0.5)
    led.step_done(12, 0.7, 0.2, True, t + 1.2)  # a checkpoint block of 0.2 s in it
    led.sealed_of = lambda: 12
    led.step_done(13, 0.5, 0.2, False, t + 1.7)
    last = ledgers.last_record(path)
    assert (last["start"], last["host"], last["first_step"], last["last_step"]) == (3, "n1", 11, 13)
    assert last["sealed_step"] == 12 and last["kept_step_s"] == pytest.approx(1.0)  # 0.5 + 0.7 - 0.2
    assert last["step_s"] == pytest.approx(1.5) and last["checkpoint_s"] == pytest.approx(0.2)
    led.close()  # the process is gone: the watchdog killed it
    assert ledgers.append_end(path, "hang", elapsed_s=last["elapsed_s"] + 300.0) is True
    hung = ledgers.read_ledger(tmp_path)[0]
    assert hung["end"] == "hang" and hung["elapsed_s"] == pytest.approx(last["elapsed_s"] + 300.0)
    # the 300 s from the last whole step to the kill are the hung step's: lost, not "other"
    assert ledgers.parts(hung)["lost_s"] == pytest.approx(0.5 + hung["elapsed_s"] - last["step_end_s"])
    assert ledgers.append_end(path, "hang") is False  # once


def test_start_ledger_records_the_time_while_no_step_ends(tmp_path):
    """Start-up, a long step or a hang write no step's record: the ledger's thread records the time anyway, so a
    SIGKILL there loses at most ``every_s`` of it."""
    import time

    path = ledgers.start_path(tmp_path, 0)
    led = ledgers.StartLedger(path, 0, every_s=0.2)
    try:
        first = ledgers.last_record(path)["elapsed_s"]
        time.sleep(1.5)
        last = ledgers.last_record(path)
        assert last["elapsed_s"] - first >= 1.0 and last["first_step"] is None and last["end"] is None
    finally:
        led.close()
    written = path.read_bytes()
    time.sleep(0.5)
    assert path.read_bytes() == written  # closed: the thread writes no more


def test_a_checkpoint_sealed_during_a_long_step_is_in_the_threads_records(tmp_path):
    """The adversarial pass's case (GWL_TEST_SLOW_STEPS=21:10, SIGKILL at 9 s): step 20's checkpoint was sealed
    by the background writer while step 21 ran; the records of that step still said 10, so `report` counted
    steps 11..20 lost until the run resumed."""
    import time

    path = ledgers.start_path(tmp_path, 0)
    led = ledgers.StartLedger(path, 0, every_s=0.2)
    try:
        t = led.now() + led._origin
        led.first_step(1, t)
        led.step_done(10, 0.1, 0.0, True, t + 0.1)
        led.sealed_of = lambda: 10
        led.step_done(20, 0.1, 0.0, True, t + 0.2)  # its checkpoint is written in the background
        led.sealed_of = lambda: 20  # sealed while step 21 runs: no step ends to record it
        time.sleep(1.0)
        last = ledgers.last_record(path)
    finally:
        led.close()
    assert last["sealed_step"] == 20 and last["last_step"] == 20
    (rec,) = ledgers.read_ledger(tmp_path)
    assert ledgers.lost_steps(rec) == 0


def test_auto_interval_is_never_nan_with_a_free_checkpoint_and_an_infinite_mean_time():
    """The adversarial pass's input: job.mtbf_h=1e308 (M = inf once in seconds) and a checkpoint that measured
    0 s: 0 * inf was NaN, and int(NaN) raised at step 3."""
    for cost in (0.0, 0.5):
        auto = AutoInterval(0, lambda: 1e308 * 3600.0, 1800.0, lambda: None)
        _fed(auto, 0, 0.1, 0.1 + cost)
        assert auto.interval_s == (0.0 if cost == 0.0 else 1800.0) and auto.interval_steps == (2 if cost == 0.0
                                                                                                else 18000)


def test_one_slow_plain_step_does_not_pin_auto_to_an_evaluation_at_every_step():
    """The adversarial pass's input (GWL_TEST_SLOW_STEPS=2:0.5): the one plain step measured before the first
    evaluation took 0.55 s, so the evaluation (0.055 s) seemed to cost nothing; the interval of 1 step then
    measured no plain step again, and every later step was an evaluation."""
    auto = AutoInterval(0, lambda: 86400.0, 1800.0, lambda: None)
    auto.observe(1, 0.05, False)  # warm-up, not measured
    auto.observe(2, 0.55, False)
    auto.observe(3, 0.055, True)
    assert auto.interval_steps == 2 and auto.next_step == 5  # one plain step to measure again
    auto.observe(4, 0.05, False)
    auto.observe(5, 0.055, True)
    # C = 5 ms now, M = 1 day: sqrt(2 * 0.005 * 86400) = 29.4 s of 0.05 s steps
    assert auto.cost_s == pytest.approx(0.005) and auto.interval_steps == 588


def test_a_run_json_that_lost_starts_never_makes_a_start_reuse_a_ledger_file(tmp_path):
    """The adversarial pass's input: run.json's last start removed by hand after two killed starts (files 0 and
    1): the next start, place 1 in run.json, writes file 2, and the killed start 1 keeps its own record."""
    assert ledgers.free_index(tmp_path, 0) == 0  # no ledger yet
    for i in (0, 1):
        ledgers.start_path(tmp_path, i).parent.mkdir(parents=True, exist_ok=True)
        ledgers.start_path(tmp_path, i).write_text("{}\n")
    assert ledgers.free_index(tmp_path, 1) == 2 and ledgers.free_index(tmp_path, 2) == 2
    assert ledgers.free_index(tmp_path, 5) == 5


def test_a_start_killed_after_its_commit_finished(tmp_path):
    """The adversarial pass's case: killed after the version's commit, before its end record: the run's
    run.json is completed, so its newest start finished (not killed, not an unannounced interruption)."""
    _write(ledgers.start_path(tmp_path, 0), {"start": 0, "elapsed_s": 9.0, "startup_s": 2.0, "first_step": 1,
                                             "last_step": 5, "step_s": 6.0, "sealed_step": 5, "end": None})
    assert ledgers.read_ledger(tmp_path)[0]["end"] == "killed"
    (rec,) = ledgers.read_ledger(tmp_path, completed=True)
    assert rec["end"] == "finished" and ledgers.summarize([rec])["unannounced"] == 0


def test_a_run_of_the_job_that_sacct_says_ended_node_fail_is_a_lost_node(tmp_path):
    """``sacct -D``'s k-th run of the job is the start that recorded restart count k (a faked sacct; the real
    one in tests/cluster/test_slurm.py's lost-node test)."""
    from gwenlake_hpc.launch.status import lost_node_starts

    for i, restart in enumerate((None, "1", "2")):
        _write(ledgers.start_path(tmp_path, i), {"start": i, "slurm_job_id": "41", "slurm_restart_count": restart,
                                                 "elapsed_s": 5.0, "startup_s": 1.0, "first_step": 1,
                                                 "last_step": 3, "step_s": 3.0, "end": None if i < 2 else "finished"})
    asked = []
    lost = lost_node_starts("41", tmp_path, run=lambda cmd: asked.append(cmd) or "COMPLETED\nNODE_FAIL\nCOMPLETED\n")
    assert asked == [["sacct", "-n", "-P", "-X", "-D", "-j", "41", "-o", "State"]] and lost == {1}
    assert [r["end"] for r in ledgers.read_ledger(tmp_path, lost_nodes=lost)] == ["killed", "lost node", "finished"]
    assert lost_node_starts("41", tmp_path, run=lambda cmd: "") == set()


# -- issue 40, item 12: the ledger's size is bounded by its events, not by the run's length ----------------------

def test_a_million_step_start_keeps_its_ledger_small(tmp_path):
    """The churn job's input (9 ms steps, a record a second) driven for a million steps on a fake clock (2.5 h):
    the file stays under a bound that does not depend on the step count (it held 1 record a second, up to 1 MiB,
    before); the last record still has the whole state."""
    path = ledgers.start_path(tmp_path, 0)
    led = ledgers.StartLedger(path, 0, {"host": "n1", "job_id": "77"}, every_s=1.0)
    t = led._origin + 5.0  # perf_counter seconds: start-up took 5 s
    led.first_step(1, t)
    step_s, sizes = 0.009, []
    for step in range(1, 1_000_001):
        checkpointed = step % 10_000 == 0
        led.step_done(step, step_s, 0.0, checkpointed, t + step * step_s)
        if checkpointed:
            led.sealed_of = lambda s=step: s  # sealed before the next step
        if step % 100_000 == 0:
            sizes.append(path.stat().st_size)
    live = ledgers.last_record(path)  # the slot's totals: within a second of the fake clock's now
    assert live["last_step"] >= 1_000_000 - 112 and live["elapsed_s"] == pytest.approx(9005.0, abs=1.0)
    led.loop_ended()
    led.end(ledgers.FINISHED)
    assert max(sizes) < 4096, sizes  # a few records' bytes, whatever the step count
    assert path.stat().st_size < 4096
    (rec,) = ledgers.read_ledger(tmp_path)
    assert (rec["last_step"], rec["end"], rec["sealed_step"], rec["host"]) == (1_000_000, "finished", 1_000_000, "n1")
    assert rec["step_s"] == pytest.approx(9000.0, rel=1e-6) and rec["startup_s"] == pytest.approx(5.0, abs=1e-3)


def test_status_reads_a_ledger_from_its_tail_and_old_ledgers_still_read(tmp_path, monkeypatch):
    """A start's file written before the slots (one cumulative record appended a second, 1 MiB of them, a torn
    last line from a kill): its last whole record is read, and only the file's tail is read for it."""
    path = ledgers.start_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    rec = {"v": 1, "start": 0, "elapsed_s": 0.0, "startup_s": 4.0, "first_step": 1, "last_step": 0, "step_s": 0.0,
           "checkpoint_s": 0.0, "sealed_step": None, "kept_step_s": 0.0, "step_end_s": None, "loop_end_s": None,
           "stop_s": None, "stop_signal": None, "drain_s": None, "end": None, "marks": {}}
    with open(path, "w") as fh:
        while fh.tell() < (1 << 20):
            rec["elapsed_s"] += 1.0
            rec["last_step"] += 100
            rec["step_s"] = rec["elapsed_s"] - 4.0
            fh.write(json.dumps(rec) + "\n")
        fh.write('{"v": 1, "start": 0, "elapsed_s": 99999')  # torn by the kill
    read = []

    def spy_open(*args, **kwargs):
        fh = open(*args, **kwargs)
        real = fh.read
        fh.read = lambda *a: read.append(len(data := real(*a))) or data
        return fh

    monkeypatch.setattr(ledgers, "open", spy_open, raising=False)
    (last,) = ledgers.read_ledger(tmp_path)
    assert (last["elapsed_s"], last["last_step"], last["end"]) == (rec["elapsed_s"], rec["last_step"], "killed")
    assert 0 < sum(read) <= 64 * 1024  # the tail, not the 1 MiB


_KILLED_CHILD = r"""
import sys, time
from gwenlake_hpc.runtime import ledger as ledgers
led = ledgers.StartLedger(ledgers.start_path(sys.argv[1], 0), 0)
led.first_step(1, time.perf_counter())
step = 0
while True:
    step += 1
    t = time.perf_counter()
    time.sleep(0.005)
    led.step_done(step, time.perf_counter() - t, 0.0, False, time.perf_counter())
    print(step, led.now(), flush=True)
"""


def test_a_sigkilled_start_loses_at_most_about_a_second_of_its_totals(tmp_path):
    """A real process writing its ledger (5 ms steps) SIGKILLed: its last record has its steps and its time up
    to about FLUSH_EVERY_S before the kill (what it lost before the slots too), and reads as killed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, env=env)
    seen = []  # (step, its age) as the child printed them
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            step, age = proc.stdout.readline().split()
            seen.append((int(step), float(age)))
            if float(age) - seen[0][1] >= 4.0:
                break
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    killed_step, killed_age = seen[-1]
    (rec,) = ledgers.read_ledger(tmp_path)
    assert rec["end"] == "killed" and rec["first_step"] == 1
    # a record at least every FLUSH_EVERY_S: generous bounds (2 s of the child's own clock)
    assert rec["elapsed_s"] >= killed_age - 2.0 * ledgers.FLUSH_EVERY_S
    assert rec["last_step"] >= max(s for s, a in seen if a <= killed_age - 2.0 * ledgers.FLUSH_EVERY_S)
    assert rec["last_step"] <= killed_step + 1
    assert rec["step_s"] <= rec["elapsed_s"] and ledgers.lost_steps(rec) == rec["last_step"]
    assert (tmp_path / "ledger" / "start-0000.jsonl").stat().st_size < 4096


# -- issue 40, item 11: a suspended start is not training ------------------------------------------------------

_SUSPENDED_CHILD = r"""
import sys, time
from gwenlake_hpc.runtime import ledger as ledgers
from gwenlake_hpc.runtime.progress import Progress
led = ledgers.StartLedger(ledgers.start_path(sys.argv[1], 0), 0)
progress = Progress(1000, 0, "lines")
t0 = time.perf_counter()
led.first_step(1, t0)
for step in range(1, 1001):
    t = time.perf_counter()
    time.sleep(0.004)
    led.step_done(step, time.perf_counter() - t, 0.0, False, time.perf_counter())
    if step in (100, 101, 1000):
        print(step, progress.line(step), flush=True)
    if step == 100:
        print("stop me", flush=True)
        sys.stdin.readline()  # the test stops this process, continues it, then writes a line
led.loop_ended()
led.end(ledgers.FINISHED)
print("done", flush=True)
"""


def test_a_start_stopped_for_3_s_records_them_as_suspended_not_as_step_time(tmp_path):
    """The issue's input, at unit level: a real process stopped (SIGSTOP, what scontrol suspend sends) and
    continued (SIGCONT) in the middle of its loop. Before, the stopped seconds were step time (``step_s`` 131.7 s
    for 72 s of steps) and the ETA after the resume was computed from them."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _SUSPENDED_CHILD, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line_100 = proc.stdout.readline()
        assert proc.stdout.readline().strip() == "stop me"
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(proc.pid, signal.SIGCONT)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = proc.stdout.read()
        assert proc.wait(timeout=120) == 0, out
    finally:
        proc.kill()
    (rec,) = ledgers.read_ledger(tmp_path)
    assert rec["end"] == "finished" and rec["last_step"] == 1000
    assert rec["suspended_s"] >= 2.5  # 3 s stopped, less the watch's sampling period and a margin
    assert rec["suspended_s"] <= rec["elapsed_s"]
    # the steps' time is the time they ran: the elapsed time less the stop, at most
    assert rec["step_s"] <= rec["elapsed_s"] - rec["suspended_s"]
    p = ledgers.parts(rec)
    assert p["suspended_s"] == rec["suspended_s"] and sum(p.values()) == pytest.approx(rec["elapsed_s"])
    total = ledgers.summarize([rec])
    assert total["allocated_s"] == pytest.approx(rec["elapsed_s"] - rec["suspended_s"])
    assert total["largest_loss"] != "suspended_s" and "suspended" in ledgers.describe(total)
    # the progress line after the resume: its speed leaves the stop out (1000 steps of >= 4 ms: ETA under 10 s;
    # with the stop counted, 101 steps in > 3.4 s gave ~30 steps/s)
    after = next(line for line in out.splitlines() if line.startswith("101 "))
    rate = float(after.split(" steps/s")[0].split()[-1])
    assert rate > 2 * 101 / (3.0 + 101 * 0.004), (line_100, after)


def test_a_suspension_the_ledgers_thread_recorded_first_is_still_left_out_of_the_step(tmp_path):
    """The cluster run's finding: after the resume, the ledger's thread wrote a record (counting the suspension)
    before the step that spanned it ended; that step's time then kept the 20 s stopped."""
    stopped = [0.0]
    path = ledgers.start_path(tmp_path, 0)
    led = ledgers.StartLedger(path, 0, every_s=60.0, suspended_of=lambda: stopped[0])
    try:
        t = led._origin + 2.0
        led.first_step(1, t)
        led.step_done(1, 0.5, 0.0, False, t + 0.5)
        stopped[0] = 20.0  # step 2 stopped for 20 s; the thread's record comes first
        led.flush(t + 21.0)
        led.step_done(2, 20.5, 0.0, False, t + 21.0)
        led.flush(t + 21.0)
        rec = ledgers.last_record(path)
    finally:
        led.close()
    assert rec["suspended_s"] == 20.0 and rec["step_s"] == pytest.approx(1.0)
    assert rec["step_end_s"] == pytest.approx(3.0)  # active: 2 s of start-up and 1 s of steps
