"""Benchmark of the hang watchdog (issue 24; a script, not a test): what it costs a step, and how long a hang
takes from the moment a rank stops to the next start's first new step.

Side by side in one run:

- per-step cost: ``run.steps()`` of an empty loop (``--steps`` steps, no tracking) without a heartbeat and with
  one (what the job gives the Run when the watchdog is on, the default); microseconds a step, medians of
  ``--repeat`` interleaved rounds, and their ratio;
- detection latency, for each ``--timeouts`` value T: a job (``python -m gwenlake_hpc +job=h``, in a temporary
  project: 10 ms steps, a checkpoint every 10) whose step 25 blocks for good in libc's ``sleep`` with the GIL
  held. From the moment the step blocks (the training writes ``time.time()`` just before) to the kill of the
  process (the watchdog's SIGKILL: ``limit + polling + the stack dump``), then to the first new step of a start
  run at once after it (as a requeue would be, without SLURM's own requeue delay), which resumes from step 20.
  Printed as seconds and as ratios to T; the issue's goal is "timeout + one requeue".

Prints one ``name value`` line per figure.
Usage: ``python benchmarks/bench_hang.py [--steps 200000] [--repeat 5] [--timeouts 5 20]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import project  # noqa: E402  (benchmarks/project.py)

TRAINER = '''
import ctypes
import os
import time
from pathlib import Path

from gwenlake_hpc import Output, save_state, train
import torch


@train(output=Output("h.model"), steps=60, eval_every=10)
def fit(output, run):
    w = torch.zeros(4)
    if run.resumed:
        w = torch.load(run.resume_path / "w.pt")
    for step, _ in run.steps():
        time.sleep(0.01)
        w += 1
        if step == 25 and not Path("hung").exists():
            Path("hung").write_text(repr(time.time()))  # the moment the rank stops
            while True:
                ctypes.PyDLL(None).sleep(100000)  # the GIL held; a signal ends it early: sleep again
        if run.at_eval:
            with run.checkpoint() as ck:
                torch.save(w, ck.path("w.pt"))
    save_state(output.file("w.safetensors"), extra={"w": w})
    return {"w0": float(w[0])}
'''


def make_project(root: Path) -> Path:
    return project.make_project(root, "h", "hang_train", TRAINER, ("hung",))


def loop_us(tmp: Path, steps: int, heartbeat: bool, name: str) -> float:
    """Microseconds a step of an empty ``run.steps()`` loop, with or without a heartbeat."""
    from gwenlake_hpc.runtime.heartbeat import Heartbeat
    from gwenlake_hpc.runtime.run import Run
    from gwenlake_hpc.runtime.signals import StopRequest
    from gwenlake_hpc.stores.tracking import NullTracker

    beat = Heartbeat(tmp / f"{name}.heartbeat") if heartbeat else None
    run = Run(run_dir=tmp / name, run_key=name, steps=steps, epochs=None, eval_every=10**9, seed=0,
              tracker=NullTracker(), stop=StopRequest(), progress="off", heartbeat=beat)
    t0 = time.perf_counter()
    for _ in run.steps():
        pass
    took = time.perf_counter() - t0
    if beat is not None:
        beat.close()
    return took / steps * 1e6


def latency(root: Path, timeout_s: float) -> tuple[float, float, float]:
    """(stop -> kill, stop -> the next start's first new step, the next start's own start-up), in seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "gwenlake_hpc", "+job=h", f"job.hang_timeout_s={timeout_s:g}",
            "launcher.progress=lines", "launcher.progress_every_s=0.001"]
    for leftover in ("hung", "runs"):
        shutil.rmtree(root / leftover, ignore_errors=True) if leftover == "runs" else (root / leftover).unlink(
            missing_ok=True)
    first = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    killed = time.time()
    if first.returncode != -9 or "gwenlake_hpc: hang:" not in first.stderr:
        raise SystemExit(f"the hung start ended {first.returncode}, not killed by the watchdog:\n{first.stderr[-3000:]}")
    stopped = float((root / "hung").read_text())
    t_rerun = time.time()
    proc = subprocess.Popen(args, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    new_step = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if new_step is None and line.startswith("step 21/60"):  # the end of the first new step
            new_step = time.time()
    proc.wait(timeout=600)
    if proc.returncode != 0 or new_step is None:
        raise SystemExit(f"the next start ended {proc.returncode} (first new step seen: {new_step is not None})")
    return killed - stopped, new_step - stopped, new_step - t_rerun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--timeouts", type=float, nargs="+", default=[5.0, 20.0])
    a = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gwenlake-bench-hang-") as tmp:
        tmp_path = Path(tmp)
        off, on = [], []
        loop_us(tmp_path, 2000, True, "warm")
        for i in range(a.repeat):
            off.append(loop_us(tmp_path, a.steps, False, f"off{i}"))
            on.append(loop_us(tmp_path, a.steps, True, f"on{i}"))
        m_off, m_on = statistics.median(off), statistics.median(on)
        print(f"loop_us_per_step_without_heartbeat {m_off:.3f}")
        print(f"loop_us_per_step_with_heartbeat {m_on:.3f}")
        print(f"heartbeat_us_per_step {m_on - m_off:.3f}")
        print(f"ratio_loop_with_over_without_heartbeat {m_on / m_off:.3f}")
        root = make_project(tmp_path / "project")
        for t in a.timeouts:
            kill_s, next_s, startup_s = latency(root, t)
            print(f"hang_timeout_s {t:g}")
            print(f"stop_to_kill_s {kill_s:.2f}")
            print(f"ratio_stop_to_kill_over_timeout {kill_s / t:.3f}")
            print(f"stop_to_next_start_first_new_step_s {next_s:.2f}")
            print(f"ratio_stop_to_next_first_step_over_timeout {next_s / t:.3f}")
            print(f"next_start_startup_s {startup_s:.2f}")


if __name__ == "__main__":
    main()
