"""A temporary project with a tiny scorer model that declares ``predict``, for the registry and release tests.

``make_scorer_project(root)`` writes conf/ (the repository's, plus conf/release/scorer.yaml), ``scorer.py``
(training functions ``fit`` and ``fit_wide``, a fine-tune ``tune`` bound to ``Model(alias="champion")``),
the datasets ``t.cls-train`` / ``t.cls-test`` and a git repository. ``params.noise`` spoils the weights, so a
worse model is one override away. Training takes a few steps: the tests are about what happens after.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from helpers.project import REPO, Project, git

TRUE_W = np.array([1.0, -2.0, 0.5, 0.0], dtype=np.float32)

SCORER = '''
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sklearn.metrics import roc_auc_score

from gwenlake_hpc import Input, Model, Output, train

TRUE_W = np.array([1.0, -2.0, 0.5, 0.0], dtype=np.float32)


@dataclass
class P:
    noise: float = 0.0  # noise added to the true weights: larger is worse
    noise_seed: int = 0


def _walk(run, data):
    for step, batch in run.steps(data.batches(50, columns=["x"])):
        run.log({"loss": 1.0 / step})
        if run.at_eval:
            with run.checkpoint(keep=1) as ck:
                ck.path("state.txt").write_text(str(step))


@train(data=Input("t.cls-train"), output=Output("t.scorer", predict="scorer:predict", inputs=["x"]),
       steps=4, eval_every=2)
def fit(data, output, run, config: P):
    _walk(run, data)
    w = TRUE_W + config.noise * np.random.default_rng(config.noise_seed).normal(size=4).astype(np.float32)
    np.save(output.file("w.npy"), w.astype(np.float32))
    full = data.read(["x", "label"])
    return {"train_auc": roc_auc_score(full["label"], full["x"] @ w)}


@train(data=Input("t.cls-train"), output=Output("t.scorer", predict="scorer:predict", inputs=["x"]),
       steps=6, eval_every=2)
def fit_ckpt(data, output, run):
    """Checkpoints a promotion can pick: each holds w.npy, closer to TRUE_W at each one, and its train_auc."""
    full = data.read(["x", "label"])
    direction = np.random.default_rng(1).normal(size=4)
    for step, batch in run.steps(data.batches(50, columns=["x"])):
        w = (TRUE_W + (2.0 / step) * direction).astype(np.float32)
        if run.at_eval:
            with run.checkpoint(keep=3) as ck:
                np.save(ck.path("w.npy"), w)
                ck.metrics = {"train_auc": float(roc_auc_score(full["label"], full["x"] @ w))}
    np.save(output.file("w.npy"), w)
    return {"train_auc": float(roc_auc_score(full["label"], full["x"] @ w))}


def predict(model_dir, batch):
    """scores float64 [n] = x float32 [n, 4] @ w"""
    return batch["x"].astype(np.float64) @ np.load(Path(model_dir) / "w.npy")


@train(data=Input("t.cls-train"), output=Output("t.scorer", predict="scorer:predict_wide", inputs=["xw"]),
       steps=4, eval_every=2)
def fit_wide(data, output, run, config: P):
    _walk(run, data)
    np.save(output.file("w.npy"), np.append(TRUE_W, 0.0).astype(np.float32))
    return {"train_auc": 1.0}


def predict_wide(model_dir, batch):
    return batch["xw"].astype(np.float64) @ np.load(Path(model_dir) / "w.npy")


@train(data=Input("t.cls-train"), init=Model("t.scorer", alias="champion"), output=Output("t.tuned"),
       steps=2, eval_every=2)
def tune(data, init, output, run):
    _walk(run, data)
    (output.file("from.txt")).write_text(init.version)
    np.save(output.file("w.npy"), np.load(init.file("w.npy")))
    return {"ok": 1.0}
'''

RELEASE = """model: t.scorer
metric: roc_auc
margin: 0.01
test_dataset: t.cls-test
label: label
slices: seg
slice_tolerance: 0.02
min_slice_rows: 20
latency_budget_ms: 500
batch_size: 64
required_files: [w.npy, metrics.json, lineage.json]
"""


def write_datasets(data_root: Path, seed: int = 0) -> None:
    """t.cls-train (400 rows) and t.cls-test (300 rows): x float32 [n, 4], xw float32 [n, 5], label float32
    [n] drawn from a logistic model of x @ TRUE_W, seg str [n] in {"a", "b", "c"}."""
    from gwenlake_hpc.data import Catalog

    rng = np.random.default_rng(seed)
    catalog = Catalog(data_root)
    for name, n in (("t.cls-train", 400), ("t.cls-test", 300)):
        x = rng.normal(size=(n, 4)).astype(np.float32)
        p = 1 / (1 + np.exp(-2.0 * (x @ TRUE_W)))
        label = (rng.random(n) < p).astype(np.float32)
        xw = np.concatenate([x, rng.normal(size=(n, 1)).astype(np.float32)], axis=1)
        seg = np.array(["a", "b", "c"])[rng.integers(0, 3, n)]
        catalog.write(name, {"x": x, "xw": xw, "label": label, "seg": seg})


def make_scorer_project(root: Path) -> Project:
    """The project described in the module docstring, at ``root`` (created)."""
    root.mkdir(parents=True)
    shutil.copytree(REPO / "conf", root / "conf")
    (root / "conf" / "release").mkdir(exist_ok=True)
    (root / "conf" / "release" / "scorer.yaml").write_text(RELEASE)
    (root / "scorer.py").write_text(SCORER)
    (root / ".gitignore").write_text("runs/\ndata/\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "code")
    write_datasets(root / "data")
    return Project(root)


def train(project: Project, target: str = "scorer:fit", *overrides: str, env=None) -> tuple[str, str]:
    """Train in a subprocess; returns (version SHA, its output: stdout, where the job logs, then stderr)."""
    proc = project.run(f"job.target={target}", *overrides, check=0, env=env)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("model ") and " version " in last, proc.stdout + proc.stderr
    return last.split()[-1], proc.stdout + proc.stderr
