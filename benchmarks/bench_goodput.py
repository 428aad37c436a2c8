"""Benchmark of the goodput ledger and ``job.eval_every=auto`` (issue 25; a script, not a test).

A real job (``python -m gwenlake_hpc +job=g``'s own entry point, in a temporary project) whose steps take a fixed
``--step-s`` seconds and whose checkpoints stall the loop a fixed ``--cost-s`` (a synchronous block), with
tracking and the hang watchdog off. Each start is SIGKILLed at an exponentially distributed moment of mean
``--mtbf-s`` after it began and the next one starts at once (as a requeue would, without SLURM's delay), until
a wall budget of ``--budget-s`` seconds is spent (the last start is killed at the budget). The starts are
forked from one warm process (the job's imports paid once, so a restart costs what the job itself does, not
the interpreter's and torch's imports); the kill moments are the same for every interval (one seeded
sequence), so the intervals are compared on the same failures.

For ``auto`` and for fixed ``eval_every`` of 0.25x, 1x and 4x the Young/Daly optimum sqrt(2 C M) (in steps) it
prints, one figure a line:

- ``goodput_<name>``: what the run's own ledger reports (kept step time / allocated time, its starts' elapsed
  times added);
- ``kept_steps_ledger_<name>`` and ``kept_steps_bench_<name>``: the steps the ledger counts as kept, and the
  benchmark's own count (the newest sealed checkpoint's step at the end); ``ratio_kept_ledger_over_bench_<name>``;
- ``goodput_bench_<name>``: the benchmark's own figure, kept steps x step time / budget;

then ``goodput_analytic`` (1 - sqrt(2C/M)), the start-up per start the ledger measured and
``goodput_analytic_with_startup`` (minus R/M: the first-order formula leaves restarts out),
``ratio_goodput_auto_over_best_fixed`` and ``goodput_auto_minus_analytic``.

Usage: ``python benchmarks/bench_goodput.py [--step-s 0.02] [--cost-s 0.5] [--mtbf-s 20] [--budget-s 120]``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import project  # noqa: E402  (benchmarks/project.py)

TRAINER = '''
import os
import time

import torch

from gwenlake_hpc import Output, save_state, train

STEP_S, COST_S = float(os.environ["BENCH_STEP_S"]), float(os.environ["BENCH_COST_S"])


@train(output=Output("g.model"), steps=10_000_000, eval_every=100)
def fit(output, run):
    w = torch.zeros(4)
    if run.resumed:
        w = torch.load(run.resume_path / "w.pt")
    for step, _ in run.steps():
        time.sleep(STEP_S)
        w += 1
        if run.at_eval:
            with run.checkpoint(keep=2, sync=True) as ck:
                time.sleep(COST_S)  # the checkpoint's fixed cost, a stall of the loop
                torch.save(w, ck.path("w.pt"))
    save_state(output.file("w.safetensors"), extra={"w": w})
    return {"w0": float(w[0])}
'''


def make_project(root: Path) -> Path:
    return project.make_project(root, "g", "goodput_train", TRAINER)


def start(root: Path, args: list[str]) -> int:
    """Fork one start of the job; returns its pid."""
    pid = os.fork()
    if pid == 0:  # the child: the job's own entry point, as `python -m gwenlake_hpc ARGS` runs it
        code = 1
        try:
            os.chdir(root)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            from gwenlake_hpc.cli import main

            code = main(args)
        finally:
            os._exit(code if isinstance(code, int) else 1)
    return pid


def run_interval(root: Path, name: str, every: str, kills: list[float], budget_s: float, mtbf_h: float) -> dict:
    """Run the job under the kill moments ``kills`` (seconds after each start) for ``budget_s``; returns the
    ledger's summary and the benchmark's own count."""
    from gwenlake_hpc.runtime import ledger as ledgers

    runs = root / "runs" / name
    args = ["+job=g", f"paths.runs_root={runs}", f"job.eval_every={every}", f"job.mtbf_h={mtbf_h!r}",
            "job.tracking=false", "job.hang_timeout_s=0", "launcher.progress=off"]
    began, i = time.monotonic(), 0
    while time.monotonic() - began < budget_s:
        pid = start(root, args)
        left = budget_s - (time.monotonic() - began)
        deadline = time.monotonic() + min(kills[i % len(kills)], left)
        i += 1
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                raise SystemExit(f"start {i} of {name} ended by itself (status {status}); see {runs}")
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    run_dir = next((runs / "g.model").iterdir())
    recs = ledgers.read_ledger(run_dir)
    summary = ledgers.summarize(recs)
    kept_ledger = sum(k - int(r["first_step"]) + 1 for r in recs
                      if (k := ledgers.kept_step(r)) is not None)
    return {"summary": summary, "kept_ledger": kept_ledger, "kept_bench": _newest_step(run_dir), "starts": i}


def _newest_step(run_dir: Path) -> int:
    """The newest sealed checkpoint's step (a ``step-N`` folder with its manifest), 0 when none."""
    steps = [int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*")
             if p.name.split("-")[1].isdigit() and (p / "MANIFEST.json").is_file()]
    return max(steps, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--cost-s", type=float, default=0.5)
    parser.add_argument("--mtbf-s", type=float, default=20.0)
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    os.environ.update({"BENCH_STEP_S": repr(a.step_s), "BENCH_COST_S": repr(a.cost_s), "OMP_NUM_THREADS": "1"})
    import gwenlake_hpc.cli  # noqa: F401 (the warm parent: the job's imports, once)
    import torch  # noqa: F401

    rng = random.Random(a.seed)
    kills = [rng.expovariate(1.0 / a.mtbf_s) for _ in range(10_000)]
    optimum_steps = math.sqrt(2 * a.cost_s * a.mtbf_s) / a.step_s
    intervals = {"auto": "auto", **{f"fixed_{f:g}x": str(max(1, round(f * optimum_steps))) for f in (0.25, 1, 4)}}
    with tempfile.TemporaryDirectory(prefix="gwenlake-bench-goodput-") as tmp:
        root = make_project(Path(tmp) / "project")
        sys.path.insert(0, str(root))
        print(f"young_daly_interval_steps {optimum_steps:.1f}")
        results = {}
        for name, every in intervals.items():
            r = results[name] = run_interval(root, name, every, kills, a.budget_s, a.mtbf_s / 3600.0)
            s = r["summary"]
            print(f"eval_every_{name} {every}", flush=True)
            print(f"starts_{name} {r['starts']}")
            print(f"goodput_{name} {s['goodput']:.4f}")
            print(f"kept_steps_ledger_{name} {r['kept_ledger']}")
            print(f"kept_steps_bench_{name} {r['kept_bench']}")
            print(f"ratio_kept_ledger_over_bench_{name} {r['kept_ledger'] / max(r['kept_bench'], 1):.4f}")
            print(f"goodput_bench_{name} {r['kept_bench'] * a.step_s / a.budget_s:.4f}")
            print(f"largest_loss_{name} {s['largest_loss']}")
        analytic = 1 - math.sqrt(2 * a.cost_s / a.mtbf_s)
        best = max(results[n]["summary"]["goodput"] for n in intervals if n != "auto")
        auto = results["auto"]["summary"]["goodput"]
        print(f"goodput_analytic {analytic:.4f}")
        # the first-order optimum leaves out each restart's own start-up R (the ledger measures it): - R / M
        startup = results["auto"]["summary"]["startup_s"] / max(results["auto"]["summary"]["starts"], 1)
        print(f"startup_s_per_start_auto {startup:.3f}")
        print(f"goodput_analytic_with_startup {analytic - startup / a.mtbf_s:.4f}")
        print(f"ratio_goodput_auto_over_best_fixed {auto / best:.4f}")
        print(f"goodput_auto_minus_analytic {auto - analytic:+.4f}")


if __name__ == "__main__":
    main()
