"""Slow ranks (issue 24): the comparison of the ranks' step times at each evaluation, and what `status` shows."""

import json
import logging

from gwenlake_hpc.launch.status import live_facts
from gwenlake_hpc.runtime.ranks import SLOW_EVALS, RankSpeeds, read_ranks


class _Dist:
    """Rank 0 of a job whose other ranks' times are given: gather returns them with rank 0's own."""

    rank, is_main, enabled = 0, True, True

    def __init__(self, others):
        self.others = others

    def gather(self, mine):
        return [mine, *self.others]


class _Tracker:
    def __init__(self):
        self.metrics, self.tags = [], {}

    def log_metrics(self, values, step):
        self.metrics.append((step, dict(values)))

    def set_tags(self, tags):
        self.tags.update(tags)


def _times(step_s, input_s=0.0, checkpoint_s=0.0):
    return {"time/input": input_s, "time/compute": step_s - input_s, "time/checkpoint": checkpoint_s,
            "time/tracking": 0.0}


def test_the_slowest_rank_is_logged_and_warned_about_once_after_three_slow_evaluations(tmp_path, caplog):
    others = [{"rank": 1, "host": "n2", "input_s": 0.3, "step_s": 0.5},
              {"rank": 2, "host": "n1", "input_s": 0.0, "step_s": 0.21}]
    tracker = _Tracker()
    speeds = RankSpeeds(_Dist(others), tracker, tmp_path, factor=1.5)
    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.run"):
        for k in range(1, SLOW_EVALS + 2):
            # rank 0's checkpoint block (it writes the whole model) is not counted against it
            out = speeds.compare(10 * k, _times(0.2, checkpoint_s=5.0))
    assert out["slowest"]["rank"] == 1 and abs(out["median_s"] - 0.21) < 1e-9
    step, values = tracker.metrics[-1]
    assert step == 40 and values == {"time/step_max_rank": 0.5, "time/step_median_rank": 0.21,
                                     "time/slowest_rank": 1.0}
    # against the median of the others (0.2 and 0.21): 2.44x
    assert tracker.tags["gwenlake.slowest_rank"] == "rank 1 on n2: 0.5 s/step, 2.44x the median of the others (step 40)"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # once, after the third evaluation in a row
    assert warnings[0].startswith("rank 1 on n2 has been slower than the median of the other ranks by more than "
                                  "1.5x for 3 evaluations in a row (0.5 s/step against 0.205 at step 30; input 0.3 "
                                  "s/step)")
    assert read_ranks(tmp_path)["slowest"] == {"rank": 1, "host": "n2", "input_s": 0.3, "step_s": 0.5}


def test_a_rank_slow_now_and_then_is_not_warned_about(tmp_path, caplog):
    slow = {"rank": 1, "host": "n2", "input_s": 0.0, "step_s": 0.5}
    dist = _Dist([slow])
    speeds = RankSpeeds(dist, _Tracker(), tmp_path)
    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.run"):
        for other in [slow, slow, {**slow, "step_s": 0.2}, slow, slow]:
            dist.others = [other]
            speeds.compare(10, _times(0.2))
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    dist.others = [slow]
    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.run"):
        speeds.compare(70, _times(0.2))  # the third in a row
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_status_says_how_long_ago_the_last_step_ended_and_which_rank_is_slowest(tmp_path):
    assert live_facts(tmp_path) == ""
    (tmp_path / "progress.json").write_text(json.dumps({"step": 340, "time": 1000.0, "pid": 1}))
    assert live_facts(tmp_path, now=1012.4) == "last step 340 12 s ago"
    (tmp_path / "ranks.json").write_text(json.dumps({"step": 300, "median_s": 0.26, "ratio": 1.62, "slowest": {
        "rank": 1, "host": "n2", "step_s": 0.324, "input_s": 0.0}, "ranks": []}))
    assert live_facts(tmp_path, now=1012.4) == ("last step 340 12 s ago; slowest rank 1 on n2 (1.62x the others' "
                                                "median, step 300)")
