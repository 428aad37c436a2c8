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
              "marks": {"30": 48.0, "40": 64.0}, "loop_end_s": None, "end": None}
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
    assert p0 == {"startup_s": 10.0, "kept_s": 64.0, "lost_s": 16.0, "checkpoint_s": 5.0, "after_loop_s": 0.0,
                  "other_s": 5.0}
    assert ledgers.lost_steps(recs[0]) == 10
    p1 = ledgers.parts(recs[1])
    assert p1["kept_s"] == 30.0 and p1["after_loop_s"] == 5.0 and sum(p1.values()) == pytest.approx(50.0)
    total = ledgers.summarize(recs)
    assert total["goodput"] == pytest.approx((64.0 + 30.0) / 150.0)
    assert total["largest_loss"] == "lost_s" and total["unannounced"] == 1 and total["lost_steps"] == 10
    assert ledgers.describe(total) == "goodput 0.63 of 150 s (largest loss: lost 16 s)"


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
    last = json.loads(path.read_text().splitlines()[-1])
    assert (last["start"], last["host"], last["first_step"], last["last_step"]) == (3, "n1", 11, 13)
    assert last["sealed_step"] == 12 and last["kept_step_s"] == pytest.approx(1.0)  # 0.5 + 0.7 - 0.2
    assert last["step_s"] == pytest.approx(1.5) and last["checkpoint_s"] == pytest.approx(0.2)
    assert ledgers.append_end(path, "hang") is True
    assert ledgers.read_ledger(tmp_path)[0]["end"] == "hang"
    assert ledgers.append_end(path, "hang") is False  # once
