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
