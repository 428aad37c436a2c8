"""Benchmark of the two checkpoint levels (issue 27; a script, not a test): the shared level alone vs a node-local
first level copied to the shared level in the background, side by side in one run.

The shared level is a real network filesystem: a folder served by a local sshd, mounted with ``sshfs``
(tests/helpers/sshfs.py, as the integration tests mount it). The local level is ``--local-dir`` (default
``/dev/shm``, a RAM disk; ``--local-dir /var/tmp`` for a local disk). The state is one extra tensor of ``--size-mib``
MiB in a ``save_state`` file.

- ``block_*``: the loop's blocking time of a synchronous checkpoint (``run.checkpoint(sync=True)``: written,
  hashed, fsynced, sealed before the block returns), medians of ``--repeat`` checkpoints ``--gap-s`` apart (the
  copy of the two-level run goes on in those gaps, as during training);
- ``evict_*``: eviction-to-exit, from SIGTERM to the process's exit, of a job process that checkpoints
  asynchronously every 20 steps of 50 ms: its loop ends after the next step, writes the final checkpoint and exits
  (medians of ``--repeat`` processes). Two levels are timed twice: with ``checkpoint.shared_wait_s`` long enough for
  the copy (``waited``: the newest checkpoint is on both levels at exit) and with ``--grace-s`` (``bounded``: the
  grace window a cluster gives is shorter than the copy; the newest is on the local level at exit, the shared one
  has the previous). The level the final checkpoint was on at exit is printed too.

Prints one ``name value`` line per figure; ratios are two levels / shared only (below 1: two levels are faster).
Usage: ``python benchmarks/bench_levels.py [--size-mib 256] [--repeat 3] [--local-dir /dev/shm] [--grace-s 0]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def _run(run_dir: Path, local: Path | None, steps: int = 10**6):
    from gwenlake_hpc.runtime.run import Run
    from gwenlake_hpc.runtime.signals import StopRequest
    from gwenlake_hpc.stores.checkpoints.levels import local_root
    from gwenlake_hpc.stores.tracking import NullTracker

    return Run(run_dir=run_dir, run_key=run_dir.name, steps=steps, epochs=None, eval_every=10**9, seed=0,
               tracker=NullTracker(), stop=StopRequest(), progress="off",
               local_dir=local_root(local, run_dir, run_dir.name) if local else None)


def blocking(shared: Path, local: Path | None, size_mib: int, repeat: int, gap_s: float) -> list[float]:
    """Seconds of each synchronous checkpoint block (after a first, untimed one)."""
    import torch

    from gwenlake_hpc import save_state

    blob = torch.ones(size_mib * 2**20 // 4)
    run = _run(shared / ("levels" if local else "shared"), local)
    times = []
    for step, _ in run.steps(None):
        blob.fill_(float(step))
        t0 = time.perf_counter()
        with run.checkpoint(keep=2, sync=True) as ck:
            save_state(ck.path("state.safetensors"), extra={"blob": blob})
        times.append(time.perf_counter() - t0)
        if len(times) > repeat:
            break
        time.sleep(gap_s)
    run.wait_for_checkpoint()
    return times[1:]


_JOB = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    import torch
    from gwenlake_hpc import save_state
    from gwenlake_hpc.runtime.run import Run
    from gwenlake_hpc.runtime.signals import StopRequest
    from gwenlake_hpc.stores.checkpoints.levels import local_root
    from gwenlake_hpc.stores.tracking import NullTracker

    run_dir, local, wait_s, size = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    stop = StopRequest()
    stop.install()
    run = Run(run_dir=run_dir, run_key=run_dir.name, steps=10**6, epochs=None, eval_every=20, seed=0,
              tracker=NullTracker(), stop=stop, progress="off", shared_wait_s=wait_s,
              local_dir=local_root(local, run_dir, run_dir.name) if local != "-" else None)
    blob = torch.ones(size * 2**20 // 4)
    for step, _ in run.steps(None):
        time.sleep(0.05)
        if run.at_eval:
            blob.fill_(float(step))
            with run.checkpoint(keep=2) as ck:
                save_state(ck.path("state.safetensors"), extra={{"blob": blob}})
        if step == 21:
            run.wait_for_checkpoint()
            print("ready", flush=True)
    print("level:", run.checkpoint_level, flush=True)
""")


def evict(shared: Path, local: Path | None, wait_s: float, size_mib: int, name: str) -> tuple[float, str]:
    """Seconds from SIGTERM to the job process's exit, and what it said of the newest checkpoint's level."""
    script = shared.parent / "job.py"
    script.write_text(_JOB.format(repo=str(REPO)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(script), str(shared / name), str(local) if local else "-",
                             str(wait_s), str(size_mib)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        raise RuntimeError(f"the job did not start: {line}{proc.stderr.read()}")
    time.sleep(0.4)  # into the next interval: a checkpoint of this interval may be in flight
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    took = time.perf_counter() - t0
    level = next((ln[len("level: "):] for ln in out.splitlines() if ln.startswith("level: ")), "?")
    if proc.returncode != 0:
        raise RuntimeError(f"job exit {proc.returncode}: {err[-2000:]}")
    return took, level


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gap-s", type=float, default=3.0)
    ap.add_argument("--local-dir", default="/dev/shm")
    ap.add_argument("--grace-s", type=float, default=0.0, help="checkpoint.shared_wait_s of the bounded case")
    a = ap.parse_args()
    from helpers.sshfs import two_mounts

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=a.local_dir) as local_tmp:
        local = Path(local_tmp)
        with two_mounts(Path(tmp) / "fs") as mounts:
            shared = mounts.a
            print(f"size_mib {a.size_mib}")
            print(f"shared sshfs({mounts.a})")
            print(f"local {a.local_dir}")
            plain = blocking(shared, None, a.size_mib, a.repeat, a.gap_s)
            two = blocking(shared, local, a.size_mib, a.repeat, a.gap_s)
            print(f"block_shared_only_s {statistics.median(plain):.3f}")
            print(f"block_two_levels_s {statistics.median(two):.3f}")
            print(f"block_ratio {statistics.median(two) / statistics.median(plain):.3f}")
            cases = {"shared_only": (None, 0.0), "two_levels_waited": (local, 600.0),
                     "two_levels_bounded": (local, a.grace_s)}
            results: dict[str, list[float]] = {k: [] for k in cases}
            levels: dict[str, str] = {}
            for r in range(a.repeat):  # interleaved rounds: a slower moment of the machine hits every case
                for k, (lv, wait_s) in cases.items():
                    took, levels[k] = evict(shared, lv, wait_s, a.size_mib, f"{k}-{r}")
                    results[k].append(took)
            base = statistics.median(results["shared_only"])
            for k in cases:
                print(f"evict_{k}_s {statistics.median(results[k]):.3f}")
            for k in ("two_levels_waited", "two_levels_bounded"):
                print(f"evict_ratio_{k[len('two_levels_'):]} {statistics.median(results[k]) / base:.3f}")
            for k in cases:
                print(f"evict_level_{k} {levels[k]}")


if __name__ == "__main__":
    main()
