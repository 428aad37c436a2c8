"""Benchmark of sweep submission (a script, not a test): a 256-point sweep against one job, on a real cluster.

Side by side in one run, in a temporary copy of the tests' project (tests/project): the wall time of the
command that submits one job (``python -m gwenlake_hpc +job=t launcher=slurm``) and of the one that submits a
``--points``-point sweep as one job array (``-m ... job.params.lr=v1,v2,...``), medians of ``--repeat`` rounds,
interleaved. Every job is cancelled as soon as it is submitted (nothing trains). Needs ``sbatch`` (the local
cluster: ``bash scripts/slurm-cluster.sh up``).

Prints one ``name value`` line per figure; the ratio adds ``target <= 2 met|MISSED`` (issue 11).
Usage: ``python benchmarks/bench_sweep.py [--points 256] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_project(root: Path) -> Path:
    import numpy as np

    from gwenlake_hpc.data import Catalog

    shutil.copytree(REPO / "conf", root / "conf")
    shutil.copy(REPO / "tests" / "project" / "conf" / "job" / "t.yaml", root / "conf" / "job" / "t.yaml")
    shutil.copy(REPO / "tests" / "project" / "trainer.py", root / "trainer.py")
    (root / ".gitignore").write_text("runs/\ndata/\n")
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "code"], cwd=root, check=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    Catalog(root / "data").write("t.rows", {"x": x, "y": x.sum(axis=1).astype(np.float32)})
    return root


def submit_s(project: Path, args: list[str]) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gwenlake_hpc", *args], cwd=project, env=env, capture_output=True,
                          text=True, timeout=1800)
    took = time.perf_counter() - t0
    ids = re.findall(r"submitted job (?:array )?(\d+)", done.stdout)
    if done.returncode != 0 or not ids:
        raise SystemExit(f"submission failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    subprocess.run(["scancel", *ids], capture_output=True)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    common = ["+job=t", "launcher=slurm", "launcher.partition=low", "launcher.timeout_min=5"]
    values = ",".join(f"{0.001 * (i + 1):.3f}" for i in range(args.points))
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        project = make_project(Path(tmp) / "project")
        singles, sweeps = [], []
        for i in range(args.repeat):
            singles.append(submit_s(project, [*common, f"job.seed={i}"]))
            sweeps.append(submit_s(project, ["-m", *common, f"job.seed={i}", f"job.params.lr={values}"]))
    single, sweep = statistics.median(singles), statistics.median(sweeps)
    print(f"single_submission_s {single:.2f}")
    print(f"sweep_{args.points}_points_submission_s {sweep:.2f}")
    ratio = sweep / single
    print(f"ratio_sweep_over_single {ratio:.2f} target <= 2 {'met' if ratio <= 2 else 'MISSED'}")


if __name__ == "__main__":
    main()
