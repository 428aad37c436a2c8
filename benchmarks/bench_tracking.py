"""Benchmark of tracking (a script, not a test): reattach cost against history length, loop overhead.

Side by side in one process, on SQLite stores in a temporary directory:

- reattach: a Tracker started on the state folder of an existing run with ``--short`` steps, then of one with
  ``--long`` steps (the same ``--metrics`` metrics each step), timed from construction until attached (median of
  ``--repeat``; MLflow is imported and a first store opened before timing);
- loop overhead: ``--loop-steps`` steps of about 1 ms of work (a busy wait that holds the interpreter) with
  ``run.log()`` every step, with tracking off (NullTracker), on a SQLite store, and on a real ``mlflow server``
  (started here, SQLite-backed), as steps per second; ``--loop-repeat`` rounds interleaved, medians. The
  delivery process's start (MLflow's import, 3-4 s of CPU) falls inside each timed loop.

Prints one ``name value`` line per figure; the ratios of issue 10's targets add ``target OP X met|MISSED``.
Usage: ``python benchmarks/bench_tracking.py [--long 200000] [--short 20000]``. Filling the long run's store
takes a minute or two on 2 cores; it is not timed.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gwenlake_hpc.runtime.run import Run
from gwenlake_hpc.runtime.signals import StopRequest
from gwenlake_hpc.stores.tracking import NullTracker, Tracker, default_uri

logging.getLogger("gwenlake_hpc").setLevel(logging.WARNING)


def filled_run(uri: str, root: Path, name: str, steps: int, metrics: int) -> Path:
    """A run with ``steps`` points of each of ``metrics`` metrics, written straight to the store."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    state = root / name
    tracker = Tracker(uri, "bench", name, state)
    assert tracker.wait_attached(120)
    tracker.close()
    client = MlflowClient(uri)
    now = int(time.time() * 1000)
    batch = []
    for step in range(1, steps + 1):
        batch.extend(Metric(f"m{k}", float(step), now, step) for k in range(metrics))
        if len(batch) >= 1000:
            client.log_batch(tracker.run_id, metrics=batch, synchronous=True)
            batch = []
    if batch:
        client.log_batch(tracker.run_id, metrics=batch, synchronous=True)
    return state


def reattach_s(uri: str, state: Path, name: str) -> float:
    t0 = time.perf_counter()
    tracker = Tracker(uri, "bench", name, state)
    assert tracker.wait_attached(600)
    took = time.perf_counter() - t0
    tracker.close()
    return took


def loop_rate(tmp: Path, tracker, steps: int, name: str) -> float:
    run = Run(run_dir=tmp / name, run_key=name, steps=steps, epochs=None, eval_every=10**9, seed=0,
              tracker=tracker, stop=StopRequest(), progress="off")
    t0 = time.perf_counter()
    for step, _ in run.steps():
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:  # 1 ms of "training" that holds the interpreter, as Python code does
            pass
        run.log({"loss": 1.0 / step, "lr": 0.001})
    took = time.perf_counter() - t0
    if hasattr(tracker, "finish"):
        tracker.finish("FINISHED", timeout_s=120)
    return steps / took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", type=int, default=200_000)
    parser.add_argument("--short", type=int, default=20_000)
    parser.add_argument("--metrics", type=int, default=2)
    parser.add_argument("--loop-steps", type=int, default=5000)
    parser.add_argument("--loop-repeat", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    def ratio(name: str, value: float, op: str, target: float) -> None:
        met = value <= target if op == "<=" else value >= target
        print(f"{name} {value:.3f} target {op} {target} {'met' if met else 'MISSED'}")

    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp_s:
        tmp = Path(tmp_s)
        uri = default_uri(tmp)
        warm = filled_run(uri, tmp, "warm", 10, args.metrics)
        reattach_s(uri, warm, "warm")
        short = filled_run(uri, tmp, "short", args.short, args.metrics)
        long = filled_run(uri, tmp, "long", args.long, args.metrics)
        short_s = statistics.median(reattach_s(uri, short, "short") for _ in range(args.repeat))
        long_s = statistics.median(reattach_s(uri, long, "long") for _ in range(args.repeat))
        print(f"reattach_{args.short}_steps_s {short_s:.3f}")
        print(f"reattach_{args.long}_steps_s {long_s:.3f}")
        ratio("ratio_reattach_long_over_short", long_s / short_s, "<=", 1.2)

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from helpers.mlflow_server import MlflowServer, sqlite_backend

        with MlflowServer(sqlite_backend(tmp / "server"), workdir=tmp / "server") as server:
            rates: dict[str, list[float]] = {"off": [], "sqlite": [], "server": []}
            for i in range(args.loop_repeat):
                rates["off"].append(loop_rate(tmp, NullTracker(), args.loop_steps, f"off{i}"))
                rates["sqlite"].append(loop_rate(tmp, Tracker(uri, "bench", f"l{i}", tmp / f"sq{i}"),
                                                 args.loop_steps, f"sqlite{i}"))
                rates["server"].append(loop_rate(tmp, Tracker(server.uri, "bench", f"l{i}", tmp / f"sv{i}"),
                                                 args.loop_steps, f"server{i}"))
        off, on, srv = (statistics.median(rates[k]) for k in ("off", "sqlite", "server"))
        print(f"loop_steps_per_s_tracking_off {off:.1f}")
        print(f"loop_steps_per_s_tracking_sqlite {on:.1f}")
        print(f"loop_steps_per_s_tracking_server {srv:.1f}")
        ratio("ratio_loop_tracking_sqlite_over_off", on / off, ">=", 0.98)
        ratio("ratio_loop_tracking_server_over_off", srv / off, ">=", 0.98)


if __name__ == "__main__":
    main()
