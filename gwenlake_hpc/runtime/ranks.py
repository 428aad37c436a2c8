"""Slow ranks: every rank's time per step, compared at each evaluation.

Responsibilities:

- at each evaluation step of a multi-rank run (:meth:`RankSpeeds.compare`, every rank: one gather over the
  control group), every rank's seconds per step since the previous evaluation, as its own time breakdown
  measured them (waiting for input plus the steps, less the checkpoint blocks, where rank 0 alone writes a
  whole-model checkpoint; the loop's own stop vote, where a fast rank waits for a slow one at the step
  boundary, is not counted);
- on rank 0: the metrics ``time/step_max_rank`` (the slowest rank's seconds per step), ``time/step_median_rank``
  and ``time/slowest_rank`` (its rank), the tag ``gwenlake.slowest_rank`` (rank, host, ratio to the median of
  the other ranks), the file ``<run_dir>/ranks.json`` that ``status`` reads, and one warning per rank slower
  than the median of the other ranks by ``job.slow_rank_factor`` for :data:`SLOW_EVALS` evaluations in a
  row, naming its host. (Against the others, not all: with two ranks the median of all is their mean.)

What it cannot see: waits inside the training's own collectives (DDP's gradient all-reduce, FSDP's
all-gathers) count as the waiting rank's own time, so a rank slowed before its first collective of the step
(input, forward) slows every rank alike; it is then seen in ``time/input`` and in the stop vote only when its
extra time falls after the step's last collective. A rank slowed by its data loading is seen by its input time.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Mapping

from ..base.fsutil import write_json_atomic

log = logging.getLogger("gwenlake_hpc.run")

#: Evaluations in a row a rank must be slower than the median by the factor before its warning.
SLOW_EVALS = 3
#: ``job.slow_rank_factor`` by default.
DEFAULT_FACTOR = 1.5
#: What ``status`` reads (rank 0 writes it at each evaluation of a multi-rank run).
RANKS_FILE = "ranks.json"


def node_name() -> str:
    """This process's node: SLURM's name for it where SLURM runs it, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class RankSpeeds:
    """The comparison of the ranks' step times (see the module's docstring).

    Args:
        dist: the run's :class:`~gwenlake_hpc.runtime.distributed.Dist` (a single process compares nothing).
        tracker: where rank 0 logs (a Tracker or a NullTracker).
        run_dir: where rank 0 writes :data:`RANKS_FILE`.
        factor: ``job.slow_rank_factor`` (> 1; 0 turns the warning off, the metrics stay).
    """

    def __init__(self, dist: Any, tracker: Any, run_dir: Path, factor: float = DEFAULT_FACTOR):
        self.dist, self.tracker, self.path, self.factor = dist, tracker, Path(run_dir) / RANKS_FILE, float(factor)
        self.host = node_name()
        self._in_a_row: dict[int, int] = {}
        self._warned: set[int] = set()

    def compare(self, step: int, times: Mapping[str, float]) -> dict[str, Any] | None:
        """Gather every rank's ``times`` (its last ``time/*`` breakdown, seconds per step) at evaluation step
        ``step``; on rank 0 log and return the comparison ``{"step", "time", "median_s" (all ranks), "ratio" (the
        slowest to the median of the others), "slowest": {"rank", "host", "step_s", "input_s"}, "ranks": [...]}``,
        None elsewhere. A collective: every rank calls it."""
        mine = {"rank": self.dist.rank, "host": self.host, "input_s": float(times.get("time/input", 0.0)),
                "step_s": float(sum(v for k, v in times.items() if k.startswith("time/") and k != "time/checkpoint"))}
        ranks = self.dist.gather(mine)
        if not ranks:
            return None
        median = statistics.median(r["step_s"] for r in ranks)
        slowest = max(ranks, key=lambda r: (r["step_s"], -r["rank"]))
        ratio = slowest["step_s"] / max(_others_median(ranks, slowest["rank"]), 1e-12)
        self.tracker.log_metrics({"time/step_max_rank": slowest["step_s"], "time/step_median_rank": median,
                                  "time/slowest_rank": float(slowest["rank"])}, step)
        self.tracker.set_tags({"gwenlake.slowest_rank": f"rank {slowest['rank']} on {slowest['host']}: "
                                                        f"{slowest['step_s']:.4g} s/step, {ratio:.2f}x the median of "
                                                        f"the others (step {step})"})
        out = {"step": step, "time": time.time(), "median_s": median, "ratio": ratio, "slowest": slowest,
               "ranks": ranks}
        self._warn(step, ranks)
        try:
            write_json_atomic(self.path, out)  # a status hint: a failure is not the training's
        except OSError as exc:
            log.debug("could not write %s: %s", self.path, exc)
        return out

    def _warn(self, step: int, ranks: list[dict[str, Any]]) -> None:
        if self.factor <= 0:
            return
        for r in ranks:
            median = _others_median(ranks, r["rank"])
            slow = median > 0 and r["step_s"] > self.factor * median
            self._in_a_row[r["rank"]] = self._in_a_row.get(r["rank"], 0) + 1 if slow else 0
            if self._in_a_row[r["rank"]] >= SLOW_EVALS and r["rank"] not in self._warned:
                self._warned.add(r["rank"])
                log.warning("rank %d on %s has been slower than the median of the other ranks by more than %.2gx for %d "
                            "evaluations in a row (%.4g s/step against %.4g at step %d; input %.4g s/step): a slow "
                            "node (another job's load, a throttled device, a slow disk)? Warned once; "
                            "job.slow_rank_factor sets the factor", r["rank"], r["host"], self.factor, SLOW_EVALS,
                            r["step_s"], median, step, r["input_s"])


def _others_median(ranks: list[dict[str, Any]], rank: int) -> float:
    """The median seconds per step of every rank but ``rank`` (with two ranks: the other one)."""
    others = [r["step_s"] for r in ranks if r["rank"] != rank]
    return statistics.median(others) if others else 0.0


def read_ranks(run_dir: Path) -> dict[str, Any] | None:
    """The last comparison rank 0 wrote in ``run_dir`` (:data:`RANKS_FILE`), or None."""
    try:
        data = json.loads((Path(run_dir) / RANKS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("slowest"), dict) else None
