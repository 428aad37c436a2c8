"""Benchmark of a job's start-up (a script, not a test): a short fit through the job against the same fit in a plain
script.

Side by side in one run, in a temporary project (conf/, a git repository, a 2,000-row dataset of 8 features):

- job: ``python -m gwenlake_hpc +job=lr`` for a short fit (:mod:`gwenlake_hpc.transforms`) of a one-step
  scikit-learn LogisticRegression (``max_iter=1``): plan, lock, tracking (its delivery process), the DataFrame,
  the fit, the commit of the version, the MLflow run FINISHED with its params and metric;
- plain: ``python plain.py``, a script that reads the same HDF5 file with h5py into a pandas DataFrame, fits the
  same model, saves it with joblib and logs the same params and metric to an MLflow SQLite store of its own,
  as our default store is (``sqlite:///<runs_root>/mlflow.db``).

Each round gives both a new ``C`` (a new run: the job does not just reprint a finished version); the stores are
made by one warm-up round each, as on a second fit of a project. Medians of ``--repeat`` rounds, interleaved,
of the wall time and of the CPU time (user + system, the command's processes included: the delivery process,
git), which a machine loaded by others disturbs less. After each job the MLflow run is checked (FINISHED, its
metric and param) outside the timing.
``--baseline DIR`` adds a third series, the job run with another copy of the package first on ``PYTHONPATH``
(e.g. ``git archive <commit> | tar -x -C DIR``: the code before a change), in the same rounds.
``--breakdown`` adds where the job's time goes: ``-X importtime`` of one job (the packages the training process
imports, cumulative seconds, the biggest first), the job's phases under cProfile (cumulative wall seconds of
plan, user code import, datasets, lock, tracker start, git, the wait for the delivery process...), and the
delivery process's own start in a fresh process (MLflow's import, the store's check, a first call).

Prints one ``name value`` line per figure; the ratio adds ``target <= 1.5 met|MISSED`` (issue 21).
Usage: ``python benchmarks/bench_startup.py [--repeat 5] [--breakdown] [--baseline DIR]``.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TRAINER = '''
from dataclasses import dataclass

import joblib
from sklearn.linear_model import LogisticRegression

from gwenlake_hpc.transforms import Input, Output, train


@dataclass
class Params:
    C: float = 1.0


@train(data=Input("b.rows"), output=Output("b.model"))
def fit(data, output, config: Params):
    x, y = data[[f"x_{i}" for i in range(8)]].to_numpy(), data["y"].to_numpy()
    clf = LogisticRegression(C=config.C, max_iter=1).fit(x, y)
    joblib.dump(clf, output.file("model.joblib"))
    return {"accuracy": float(clf.score(x, y))}
'''

JOB = """target: lr_short.py:fit
seed: 0
params:
  C: 1.0
"""

PLAIN = '''
import sys
import warnings

import h5py
import joblib
import mlflow
import pandas as pd
from sklearn.linear_model import LogisticRegression

C = float(sys.argv[1])
with h5py.File("data/b/rows.h5", "r") as f:
    x, y = f["x"][:], f["y"][:]
data = pd.DataFrame({**{f"x_{i}": x[:, i] for i in range(8)}, "y": y})
x, y = data[[f"x_{i}" for i in range(8)]].to_numpy(), data["y"].to_numpy()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    clf = LogisticRegression(C=C, max_iter=1).fit(x, y)
joblib.dump(clf, "plain-model.joblib")
mlflow.set_tracking_uri("sqlite:///plain/mlflow.db")
mlflow.set_experiment("b.model")
with mlflow.start_run(run_name="fit"):
    mlflow.log_params({"params.C": C, "seed": 0})
    mlflow.log_metric("accuracy", float(clf.score(x, y)), step=1)
'''


def make_project(root: Path) -> Path:
    import numpy as np

    from gwenlake_hpc.data import Catalog

    shutil.copytree(REPO / "conf", root / "conf")
    (root / "conf" / "job" / "lr.yaml").write_text(JOB)
    (root / "lr_short.py").write_text(TRAINER)
    (root / "plain.py").write_text(PLAIN)
    (root / "plain").mkdir()
    (root / ".gitignore").write_text("runs/\ndata/\nplain/\nplain-model.joblib\n")
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "code"], cwd=root, check=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 8)).astype(np.float32)
    y = (x @ rng.normal(size=8) + 0.5 * rng.normal(size=2000) > 0).astype(np.int64)
    Catalog(root / "data").write("b.rows", {"x": x, "y": y})
    return root


#: CPU seconds (user + system) of each timed command, its processes included (the delivery process, git).
CPU: list[float] = []


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(project: Path, argv: list[str], pythonpath: str | None = None) -> tuple[float, subprocess.CompletedProcess]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("GWENLAKE_CONF", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], cwd=project, env=env, capture_output=True, text=True,
                          timeout=600)
    took = time.perf_counter() - t0
    CPU.append(_children_cpu() - cpu0)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return took, done


def job_s(project: Path, c: float, pythonpath: str | None = None) -> tuple[float, subprocess.CompletedProcess]:
    took, done = timed(project, ["-m", "gwenlake_hpc", "+job=lr", f"job.params.C={c}"], pythonpath)
    check_tracked(project, c)
    return took, done


def check_tracked(project: Path, c: float) -> None:
    """The job's MLflow run of ``C=c`` is FINISHED with its param and metric (read after the timing)."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{project / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("b.model")
    runs = client.search_runs([exp.experiment_id], f"params.`params.C` = '{c}'")
    if len(runs) != 1 or runs[0].info.status != "FINISHED" or "accuracy" not in runs[0].data.metrics:
        raise SystemExit(f"C={c}: the job's MLflow run is not FINISHED with its metric: {runs}")


#: Functions of the job whose cumulative wall time the breakdown prints (``file:function`` in cProfile's terms).
PHASES = [
    ("hydra_compose", "hydra/_internal/hydra.py", "compose_config"), ("plan", "gwenlake_hpc/job/plan.py", "plan"),
    ("plan_import_user_code", "gwenlake_hpc/job/plan.py", "load_target"),
    ("datasets_open", "gwenlake_hpc/job/plan.py", "open_inputs"), ("lock", "gwenlake_hpc/job/run_lock.py", "__init__"),  # RunLock
    ("tracker_start", "gwenlake_hpc/stores/tracking/tracker.py", "__init__"),
    ("git_code_state", "gwenlake_hpc/stores/versioning/code.py", "code_state"),
    ("datasets_to_frame", "gwenlake_hpc/authoring/short_fit.py", "to_frame"),
    ("user_fit", "lr_short.py", "fit"), ("wait_delivery_attached", "gwenlake_hpc/stores/tracking/tracker.py", "wait_attached"),
    ("git_commit", "gwenlake_hpc/stores/versioning/commit.py", "commit_model"),
    ("registry_after_commit", "gwenlake_hpc/stores/registry/training.py", "after_commit"),
    ("tracker_finish_wait", "gwenlake_hpc/stores/tracking/tracker.py", "finish"),
]

DELIVERY_PIECES = """
import time
t0 = time.perf_counter()
from mlflow import MlflowClient
t1 = time.perf_counter()
from gwenlake_hpc.stores.tracking.sqlite import ensure_sqlite_store, sqlite_uri
uri = sqlite_uri("runs/mlflow.db")
ensure_sqlite_store(uri)
t2 = time.perf_counter()
MlflowClient(tracking_uri=uri).get_experiment_by_name("b.model")
t3 = time.perf_counter()
print(f"delivery_import_mlflow_s {t1 - t0:.2f}")
print(f"delivery_store_check_s {t2 - t1:.2f}")
print(f"delivery_client_first_call_s {t3 - t2:.2f}")
"""


def breakdown(project: Path, tmp: Path) -> None:
    """Where one job's time goes: imports (``-X importtime``), the job's phases (cProfile, wall time), and the
    delivery process's own start (MLflow's import, the store's check, a first call) in a fresh process."""
    import pstats

    _, done = timed(project, ["-X", "importtime", "-m", "gwenlake_hpc", "+job=lr", "job.params.C=0.123"])
    cumulative: dict[str, float] = {}
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)", line)
        if m and len(m.group(2)) == 1:  # top-level imports only: nested ones are inside their cumulative time
            top = m.group(3).split(".")[0]
            cumulative[top] = cumulative.get(top, 0.0) + int(m.group(1)) / 1e6
    print(f"breakdown_imports_training_process_s {sum(cumulative.values()):.2f}")
    for name, s in sorted(cumulative.items(), key=lambda kv: -kv[1])[:6]:
        print(f"breakdown_import_{name}_s {s:.2f}")
    print(f"breakdown_training_process_imports_torch {'torch' in cumulative}")
    prof = tmp / "job.prof"
    took, _ = timed(project, ["-m", "cProfile", "-o", str(prof), "-m", "gwenlake_hpc", "+job=lr", "job.params.C=0.124"])
    stats = pstats.Stats(str(prof)).stats  # type: ignore[attr-defined]
    print(f"breakdown_job_under_cprofile_s {took:.2f}")
    for label, file, func in PHASES:
        cum = sum(v[3] for (f, _, fn), v in stats.items() if fn == func and f.endswith(file))
        print(f"breakdown_{label}_s {cum:.2f}")
    took, done = timed(project, ["-c", DELIVERY_PIECES])
    print(done.stdout.strip().replace("delivery_", "breakdown_delivery_"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline", help="a copy of the package (its parent folder) to time as well")
    parser.add_argument("--breakdown", action="store_true", help="also print where one job run's time goes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        project = make_project(Path(tmp) / "project")
        first_job, _ = job_s(project, 100.0)  # makes the store, as a project's first fit does
        first_plain, _ = timed(project, ["plain.py", "100.0"])
        if args.baseline:
            job_s(project, 200.0, args.baseline)  # its own warm-up (bytecode of the copy)
        jobs, plains, baselines = [], [], []
        job_cpu, plain_cpu, baseline_cpu = [], [], []
        for i in range(args.repeat):
            c = round(0.5 + 0.1 * i, 3)
            jobs.append(job_s(project, c)[0])
            job_cpu.append(CPU[-1])
            plains.append(timed(project, ["plain.py", str(c)])[0])
            plain_cpu.append(CPU[-1])
            if args.baseline:
                baselines.append(job_s(project, c + 1000, args.baseline)[0])
                baseline_cpu.append(CPU[-1])
        if args.breakdown:
            breakdown(project, Path(tmp))
    print(f"first_job_new_store_s {first_job:.2f}")
    print(f"first_plain_new_store_s {first_plain:.2f}")
    job, plain = statistics.median(jobs), statistics.median(plains)
    print(f"job_short_fit_s {job:.2f}")
    print(f"plain_script_s {plain:.2f}")
    print(f"job_short_fit_cpu_s {statistics.median(job_cpu):.2f}")
    print(f"plain_script_cpu_s {statistics.median(plain_cpu):.2f}")
    if baselines:
        base = statistics.median(baselines)
        print(f"baseline_job_short_fit_s {base:.2f}")
        print(f"baseline_job_short_fit_cpu_s {statistics.median(baseline_cpu):.2f}")
        print(f"ratio_baseline_over_plain {base / plain:.2f}")
    ratio = job / plain
    print(f"ratio_job_over_plain {ratio:.2f} target <= 1.5 {'met' if ratio <= 1.5 else 'MISSED'}")


if __name__ == "__main__":
    main()
