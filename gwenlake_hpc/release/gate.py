"""The release gate: checks a version against the incumbent before an alias moves to it.

``python -m gwenlake_hpc models promote crm.churn --version SHA --alias champion`` loads the release config
(``conf/release/*.yaml`` whose ``model`` is the name, or ``--config``), runs every check, prints each result,
and moves the alias only when all pass. The incumbent is the version the alias points to now. Checks:

1. ``files``: the required files are in the version, its predict entry point imports, and it scores a batch
   of the test set.
2. ``schema``: its input columns, dtypes and per-row shapes equal the incumbent's (the dataset the incumbent
   serves), and the test dataset provides them.
3. ``metric``: on the same test set, running both versions' predict, the candidate's metric beats the
   incumbent's by ``margin``.
4. ``slices``: for each value of the ``slices`` column with at least ``min_slice_rows`` rows, the candidate's
   metric is not worse than the incumbent's by more than ``slice_tolerance``.
5. ``latency``: the median time of predict on ``batch_size`` rows is within ``latency_budget_ms``.

Without an incumbent the comparative checks pass as "no incumbent". A failing check keeps the incumbent and
exits 1.
"""

from __future__ import annotations

import fcntl
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional

import numpy as np
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..base.errors import ConfigError, GwenlakeError
from ..base.names import check_alias
from ..stores.registry import LoadedModel, check_batch, current_aliases, load_model, mlflow_set_alias, move_alias

log = logging.getLogger("gwenlake_hpc.release")

__all__ = ["ReleaseConfig", "Check", "METRICS", "load_release_config", "run_gate", "promote", "register_release"]


@dataclass
class ReleaseConfig:
    """The release gate of one model (``conf/release/<name>.yaml``).

    Attributes:
        model: the model name ``group.name`` this config gates.
        metric: one of :data:`METRICS` (``roc_auc``, ``average_precision``, ``accuracy``, ``log_loss``,
            ``brier``), computed from predict's scores and the ``label`` column.
        margin: how much the candidate must beat the incumbent by (in the metric's units; ``0`` = at least
            equal). For lower-is-better metrics, "beat" means lower.
        test_dataset: catalog dataset both versions are scored on, e.g. ``crm.churn-test``.
        label: its column of 0/1 labels.
        slices: a column of the test dataset whose values are slices (e.g. ``contract``), or None.
        slice_tolerance: how much worse than the incumbent a slice may be.
        min_slice_rows: slices with fewer rows are reported, not judged.
        latency_budget_ms: the most a predict of ``batch_size`` rows may take (median of 5, after a warm-up).
        batch_size: rows per predict call (scoring and latency).
        threshold: score threshold of ``accuracy``.
        required_files: files every version must hold (relative to the model directory).
    """

    model: str = MISSING
    metric: str = "roc_auc"
    margin: float = 0.0
    test_dataset: str = MISSING
    label: str = MISSING
    slices: Optional[str] = None
    slice_tolerance: float = 0.02
    min_slice_rows: int = 30
    latency_budget_ms: float = 250.0
    batch_size: int = 256
    threshold: float = 0.5
    required_files: List[str] = field(default_factory=lambda: ["metrics.json", "lineage.json"])


def register_release() -> None:
    """Register ReleaseConfig in Hydra's ConfigStore as ``release/release_schema`` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="release", name="release_schema", node=ReleaseConfig)


def _metric_fns() -> dict[str, tuple[Callable[[np.ndarray, np.ndarray, float], float], bool]]:
    from sklearn import metrics as m

    return {
        "roc_auc": (lambda y, s, t: float(m.roc_auc_score(y, s)), True),
        "average_precision": (lambda y, s, t: float(m.average_precision_score(y, s)), True),
        "accuracy": (lambda y, s, t: float(np.mean((s >= t) == (y >= 0.5))), True),
        "log_loss": (lambda y, s, t: float(m.log_loss(y, np.clip(s, 1e-7, 1 - 1e-7), labels=[0, 1])), False),
        "brier": (lambda y, s, t: float(np.mean((s - y) ** 2)), False),
    }


#: Metric names the gate knows; the bool says whether higher is better.
METRICS = ("roc_auc", "average_precision", "accuracy", "log_loss", "brier")


def load_release_config(model_name: str, config: str | None = None, conf_root: Path | None = None) -> ReleaseConfig:
    """The release config of ``model_name``.

    ``config`` is a YAML path or a name under ``<conf>/release/``; default: the ``<conf>/release/*.yaml``
    whose ``model`` is ``model_name``. ``<conf>`` is :func:`gwenlake_hpc.job.config.conf_dir` unless given.

    Raises:
        ConfigError: no such file, no config for the model, a wrong key or type (named), an unknown metric.
    """
    from ..job.config import conf_dir

    root = (conf_root or conf_dir()) / "release"
    if config:
        path = Path(config)
        if not path.is_file():
            path = root / (config if config.endswith(".yaml") else f"{config}.yaml")
        if not path.is_file():
            raise ConfigError(f"--config {config}: no such file (nor {path}); give a YAML path or a name in {root}")
        candidates = [path]
    else:
        candidates = [p for p in sorted(root.glob("*.yaml"))
                      if (OmegaConf.load(p) or {}).get("model") == model_name] if root.is_dir() else []
        if not candidates:
            raise ConfigError(f"no release config for {model_name}: write {root}/<name>.yaml with `model: "
                              f"{model_name}`, metric, test_dataset, label (see ReleaseConfig), or pass --config")
    path = candidates[0]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ReleaseConfig), OmegaConf.load(path))
        cfg: ReleaseConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        raise ConfigError(f"release config {path}: {('key ' + str(key) + ': ') if key else ''}"
                          f"{str(exc).splitlines()[0]} (fields: model, metric, margin, test_dataset, label, slices, "
                          "slice_tolerance, min_slice_rows, latency_budget_ms, batch_size, threshold, "
                          "required_files)") from exc
    if cfg.model != model_name:
        raise ConfigError(f"release config {path} is for model {cfg.model}, not {model_name}")
    if cfg.metric not in METRICS:
        raise ConfigError(f"release config {path}: metric={cfg.metric!r}; use one of {', '.join(METRICS)}")
    if cfg.batch_size < 1:
        raise ConfigError(f"release config {path}: batch_size={cfg.batch_size} must be >= 1")
    return cfg


@dataclass
class Check:
    """One check's result: ``name``, ``passed``, and ``detail`` (the numbers it was decided on)."""

    name: str
    passed: bool
    detail: str

    def __str__(self) -> str:
        return f"  {'PASS' if self.passed else 'FAIL'}  {self.name:<8} {self.detail}"


def _scores(model: LoadedModel, columns: dict[str, np.ndarray], batch_size: int) -> np.ndarray:
    n = len(next(iter(columns.values())))
    parts = [model.predict({c: a[i:i + batch_size] for c, a in columns.items()}) for i in range(0, n, batch_size)]
    return np.concatenate(parts) if parts else np.zeros(0)


def run_gate(cfg: ReleaseConfig, candidate: LoadedModel, incumbent: LoadedModel | None,
             data_root: Path) -> list[Check]:
    """Run every check of the gate (see the module docstring); returns their results, in order.

    Raises:
        ConfigError: the test dataset or its label/slices column is missing.
    """
    from ..stores.data import Catalog

    checks: list[Check] = []
    ds = Catalog(data_root).open(cfg.test_dataset)
    for col in [cfg.label] + ([cfg.slices] if cfg.slices else []):
        if col not in ds.columns:
            raise ConfigError(f"release config: column {col!r} is not in {cfg.test_dataset} (columns: "
                              f"{', '.join(ds.columns)})")
    fn, higher = _metric_fns()[cfg.metric]
    schema = candidate.input_schema
    try:  # 1. files present, predict importable, a batch scored
        data, cand_scores = _load_and_score(cfg, candidate, ds)
        checks.append(Check("files", True, f"{', '.join(cfg.required_files)} present; "
                                           f"{candidate.serving.get('predict')} scored {len(cand_scores)} rows"))
    except Exception as exc:  # noqa: BLE001 - any failure to load or run is this check's verdict
        checks.append(Check("files", False, f"not loadable: {exc}"))
        for name in ("schema", "metric", "slices", "latency"):
            checks.append(Check(name, False, "not run: the candidate is not loadable"))
        return checks
    checks.append(_schema_check(cfg, schema, incumbent))  # 2.
    schema_ok = checks[-1].passed
    # 3. metric on the same test set; 4. slices
    y = data[cfg.label].astype(np.float64)
    inc_scores = None
    if incumbent is not None and schema_ok:
        try:
            inc_scores = _scores(incumbent, {c: data[c] for c in schema}, cfg.batch_size)
        except Exception as exc:  # noqa: BLE001
            checks.append(Check("metric", False, f"the incumbent {incumbent.version[:12]} could not be scored: {exc}"))
    metric = _metric_check(cfg, fn, higher, y, cand_scores, inc_scores, incumbent is None, schema_ok)
    if metric is not None:
        checks.append(metric)
    if cfg.slices:
        checks.append(_slices(cfg, fn, higher, y, data[cfg.slices], cand_scores,
                              inc_scores if incumbent is not None and schema_ok else None, incumbent is None))
    else:
        checks.append(Check("slices", True, "no slices configured"))
    checks.append(_latency_check(cfg, candidate, {c: data[c][:cfg.batch_size] for c in schema}))  # 5.
    return checks


def _load_and_score(cfg: ReleaseConfig, candidate: LoadedModel, ds: Any) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The test columns the gate reads, and the candidate's scores on them (the ``files`` check).

    Raises:
        GwenlakeError: a required file missing, no input schema, an input column missing from the test set;
            whatever loading or running ``predict`` raises.
    """
    missing = [f for f in cfg.required_files if not (candidate.path / f).is_file()]
    schema = candidate.input_schema
    if missing:
        raise GwenlakeError(f"missing files {missing}")
    if not schema:
        raise GwenlakeError("the version records no input schema (lineage.json 'serving')")
    absent = [c for c in schema if c not in ds.columns]
    if absent:
        raise GwenlakeError(f"test dataset {cfg.test_dataset} lacks input columns {absent}")
    data = ds.read(list(schema) + [cfg.label] + ([cfg.slices] if cfg.slices else []))
    inputs = {c: data[c] for c in schema}
    check_batch(schema, {c: a[:1] for c, a in inputs.items()}, f"{candidate.name} version "
                f"{candidate.version[:12]} on {cfg.test_dataset}")
    return data, _scores(candidate, inputs, cfg.batch_size)


def _schema_check(cfg: ReleaseConfig, schema: Any, incumbent: LoadedModel | None) -> Check:
    """The ``schema`` check: the candidate's inputs equal the incumbent's (any, without an incumbent)."""
    if incumbent is None:
        return Check("schema", True, f"no incumbent; inputs {_schema_str(schema)} found in {cfg.test_dataset}")
    if incumbent.input_schema != schema:
        return Check("schema", False, f"inputs {_schema_str(schema)} differ from the incumbent's "
                                      f"{_schema_str(incumbent.input_schema)} (dataset "
                                      f"{incumbent.serving.get('dataset')})")
    return Check("schema", True, f"inputs {_schema_str(schema)} equal the incumbent's (dataset "
                                 f"{incumbent.serving.get('dataset')})")


def _metric_check(cfg: ReleaseConfig, fn: Callable, higher: bool, y: np.ndarray, cand: np.ndarray,
                  inc: np.ndarray | None, no_incumbent: bool, schema_ok: bool) -> Check | None:
    """The ``metric`` check: the candidate's metric at least ``margin`` better than the incumbent's on the same
    rows; None when the incumbent could not be scored (that failure is the check, already recorded)."""
    cand_value = fn(y, cand, cfg.threshold)
    if no_incumbent:
        return Check("metric", True, f"no incumbent; {cfg.metric} {cand_value:.4f} on {cfg.test_dataset} "
                                     f"({len(y)} rows)")
    if not schema_ok:
        return Check("metric", False, "not compared: input schemas differ")
    if inc is None:
        return None
    inc_value = fn(y, inc, cfg.threshold)
    delta = cand_value - inc_value if higher else inc_value - cand_value
    return Check("metric", delta >= cfg.margin - 1e-12,
                 f"{cfg.metric} {cand_value:.4f} vs incumbent {inc_value:.4f} on {cfg.test_dataset} "
                 f"({len(y)} rows): {'+' if delta >= 0 else ''}{delta:.4f}, needs >= +{cfg.margin:.4f}")


def _latency_check(cfg: ReleaseConfig, candidate: LoadedModel, batch: Mapping[str, np.ndarray]) -> Check:
    """The ``latency`` check: the median of 5 timed ``predict`` calls on one batch (after a warm-up call)."""
    candidate.predict(batch)  # warm-up: imports, weights loaded once
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        candidate.predict(batch)
        times.append((time.perf_counter() - t0) * 1000)
    median = float(np.median(times))
    return Check("latency", median <= cfg.latency_budget_ms,
                 f"median {median:.2f} ms for {len(next(iter(batch.values())))} rows, budget "
                 f"{cfg.latency_budget_ms:g} ms")


def _slices(cfg: ReleaseConfig, fn: Callable, higher: bool, y: np.ndarray, values: np.ndarray,
            cand: np.ndarray, inc: np.ndarray | None, no_incumbent: bool) -> Check:
    parts, ok = [], True
    for value in sorted(set(values.tolist()), key=str):
        mask = values == value
        n = int(mask.sum())
        if n < cfg.min_slice_rows or len(set(y[mask].tolist())) < 2:
            parts.append(f"{value}: {n} rows, not judged")
            continue
        c = fn(y[mask], cand[mask], cfg.threshold)
        if inc is None:
            parts.append(f"{value}: {c:.4f}")
            continue
        i = fn(y[mask], inc[mask], cfg.threshold)
        worse = (i - c) if higher else (c - i)
        bad = worse > cfg.slice_tolerance + 1e-12
        ok = ok and not bad
        parts.append(f"{value}: {c:.4f} vs {i:.4f}{' REGRESSED' if bad else ''}")
    if no_incumbent:
        return Check("slices", True, f"no incumbent; {cfg.slices} {'; '.join(parts)}")
    if inc is None:
        return Check("slices", False, "not compared: the incumbent could not be scored on the same inputs")
    return Check("slices", ok, f"{cfg.metric} by {cfg.slices} (tolerance {cfg.slice_tolerance:g}): {'; '.join(parts)}")


def _schema_str(schema: dict) -> str:
    return "{" + ", ".join(f"{c}: {s['dtype']} {s['shape']}" for c, s in schema.items()) + "}"


def promote(model_name: str, version: str, alias: str, *, repo: Any = None, reason: str = "",
            config: str | None = None, data_root: Path = Path("data"), tracking_uri: str | None = None,
            force: bool = False, out: Callable[[str], Any] = print) -> int:
    """Run the gate for ``version`` of ``model_name`` against the version ``alias`` points to, print each
    check, and move the alias when all pass (git alias log, mirrored onto the MLflow alias when
    ``tracking_uri`` is given). Returns 0 when promoted (or already there), 1 when refused.

    Raises:
        ConfigError: bad name, version, alias or release config; missing test dataset.
    """
    check_alias(alias)  # before the gate runs: a bad name would only fail at the end
    cfg = load_release_config(model_name, config)
    candidate = load_model(model_name, version, repo=repo)
    incumbent_sha = current_aliases(model_name, repo).get(alias)
    if incumbent_sha == candidate.version:
        out(f"{model_name} version {candidate.version} already holds alias {alias}; nothing to do")
        return 0
    incumbent = load_model(model_name, incumbent_sha, repo=repo) if incumbent_sha else None
    if incumbent is not None:
        log.info("alias %s of %s resolved to version %s (the incumbent)", alias, model_name, incumbent.version)
    out(f"release gate for {model_name} version {candidate.version} -> alias {alias} (incumbent: "
        f"{incumbent.version if incumbent else 'none'})")
    checks = run_gate(cfg, candidate, incumbent, Path(data_root))
    for c in checks:
        out(str(c))
    failed = [c.name for c in checks if not c.passed]
    if failed and not force:
        out(f"refused: {', '.join(failed)} failed; alias {alias} stays at "
            f"{incumbent.version if incumbent else 'nothing (unset)'}")
        return 1
    summary = "; ".join(f"{c.name}: {c.detail}" for c in checks if c.name == "metric")
    move_alias(model_name, alias, candidate.version, repo=repo, action="promote", expected=incumbent_sha,
               reason=(reason + " | " if reason else "") + summary)
    if tracking_uri:
        try:
            mlflow_set_alias(tracking_uri, model_name, alias, candidate.version)
        except Exception as exc:  # noqa: BLE001 - git holds the truth; say that MLflow lags
            log.warning("alias %s moved in git but not in MLflow: %s", alias, exc)
    out(f"promoted: alias {alias} of {model_name} -> {candidate.version} (was "
        f"{incumbent.version if incumbent else 'unset'})")
    return 0


# --- promotion from a run ---------------------------------------------------------------------------------------

#: Files of a checkpoint that are gwenlake_hpc's own bookkeeping, not part of a version.
_CHECKPOINT_BOOKKEEPING = ("MANIFEST.json", "gwenlake-run-state.json", ".ranks")


def find_run_dir(runs_root: Path, model_name: str, run: str) -> Path:
    """The run directory of ``run``: a run key (``<runs_root>/<model>/<run>``) or an MLflow run id (the one in
    a run directory's ``tracking*/run_id``).

    Raises:
        ConfigError: no such run of ``model_name`` under ``runs_root`` (what was looked at is named).
    """
    from ..base.names import check_name

    check_name(model_name, "model")
    model_root = Path(runs_root) / model_name
    if run and "/" not in run and run not in (".", "..") and (model_root / run / "run.json").is_file():
        return model_root / run
    for run_id_file in sorted(model_root.glob("*/tracking*/run_id")):
        try:
            if run_id_file.read_text().strip() == run:
                return run_id_file.parent.parent
        except OSError:
            continue
    raise ConfigError(f"--from-run {run!r}: no run of {model_name} under {model_root} has this run key or MLflow "
                      "run id (run keys are the folder names there; `python -m gwenlake_hpc status` lists them)")


def parse_criterion(text: str) -> tuple[str, str]:
    """``"max:test_auc"`` -> ("max", "test_auc").

    Raises:
        ConfigError: not ``max:METRIC`` or ``min:METRIC``.
    """
    how, _, metric = str(text).partition(":")
    if how not in ("max", "min") or not metric.strip():
        raise ConfigError(f"--criterion {text!r}: use max:METRIC or min:METRIC (a metric the run's checkpoints "
                          "recorded with ck.metrics, e.g. max:test_auc)")
    return how, metric.strip()


def version_from_run(model_name: str, run_dir: Path, criterion: str | None = None, *, repo: Any = None,
                     out: Callable[[str], Any] = print) -> str:
    """The version to promote from a run: without ``criterion`` the run's own (its last committed one); with
    ``max:METRIC``/``min:METRIC`` the best of its intact checkpoints by the metric in their manifests,
    committed as a version first if it is not one yet (lineage names the run, the step and the checkpoint's
    metrics; the run's serving entry point and code are carried over from its own version when it has one).

    Raises:
        ConfigError: the run has no committed version (and no criterion), no checkpoint records the metric, or
            the chosen checkpoint is damaged.
    """
    from ..stores.checkpoints import CheckpointStore
    from ..base.fsutil import read_json
    from ..stores.versioning import default_model_repo, open_model_repo

    info = read_json(run_dir / "run.json", default=None) or {}
    key = run_dir.name
    if criterion is None:
        done = info.get("completions") or ([info["completed"]] if info.get("completed") else [])
        versions = [c.get("version") for c in done if c and c.get("version")]
        if not versions:
            raise ConfigError(f"run {key} of {model_name} has no committed version yet: let it finish, or pick one "
                              "of its checkpoints with --criterion max:METRIC")
        out(f"run {key}: its own version {versions[-1]}")
        return str(versions[-1])
    how, metric = parse_criterion(criterion)
    store = CheckpointStore(run_dir / "checkpoints", key)
    scored = [ck for ck in store.complete() if metric in ck.metrics]
    if not scored:
        seen = sorted({m for ck in store.complete() for m in ck.metrics})
        raise ConfigError(f"no checkpoint of run {key} recorded {metric!r} (recorded: {', '.join(seen) or 'none'}); "
                          "give --criterion with one of those")
    # The best value; among equals the latest step (the most trained).
    best = max(scored, key=lambda ck: ((ck.metrics[metric] if how == "max" else -ck.metrics[metric]), ck.step))
    problem = store.verify(best, full=True)
    if problem is not None:
        raise ConfigError(f"checkpoint {best.path} is damaged ({problem}): it cannot become a version")
    out(f"run {key}: checkpoint step {best.step} has the {how} {metric} = {best.metrics[metric]:.6g} "
        f"(of {len(scored)} checkpoints)")
    g_repo = repo if repo is not None and not isinstance(repo, (str, Path)) else \
        open_model_repo(Path(repo) if repo is not None else default_model_repo(Path.cwd()), create=True)
    ref = f"{key}/{info.get('uid', '')}@{best.step}"
    lock_path = Path(g_repo.git_dir) / "gwenlake" / f"promote-{model_name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # two promotes of one checkpoint at once: one commit
        return _commit_checkpoint(g_repo, model_name, key, info, ref, best, how, metric, out)


def _commit_checkpoint(g_repo: Any, model_name: str, key: str, info: dict[str, Any], ref: str, best: Any, how: str,
                       metric: str, out: Callable[[str], Any]) -> str:
    import json
    import shutil
    import tempfile

    from ..stores.versioning import commit_model, find_run_version, read_file

    existing = find_run_version(g_repo, model_name, ref)
    if existing is not None:
        out(f"checkpoint step {best.step} of run {key} is version {existing} already")
        return existing
    lineage: dict[str, Any] = {}
    own = [c.get("version") for c in (info.get("completions") or []) if c.get("version")]
    if own:
        try:
            lineage = json.loads(read_file(g_repo, model_name, own[-1], "lineage.json"))
        except (ConfigError, ValueError):
            lineage = {}
    lineage.update({"model": model_name, "run_key": key, "final_step": best.step,
                    "from_checkpoint": {"step": best.step, "path": str(best.path), "metrics": best.metrics,
                                        "chosen_by": f"{how}:{metric}"}})
    with tempfile.TemporaryDirectory(prefix="gwenlake-promote-") as tmp:
        files = Path(tmp) / "files"
        shutil.copytree(best.path, files, ignore=lambda d, names: [n for n in names if n in _CHECKPOINT_BOOKKEEPING])
        version = commit_model(
            g_repo, model_name, files, run=ref,
            message=f"{model_name}: checkpoint step {best.step} of run {key} ({how} {metric} = "
                    f"{best.metrics[metric]:.6g})\n\n" + "".join(f"{k}: {v:.6g}\n" for k, v in sorted(best.metrics.items())),
            extra_files={"metrics.json": (json.dumps(best.metrics, indent=2, sort_keys=True) + "\n").encode(),
                         "lineage.json": (json.dumps(lineage, indent=2, sort_keys=True, default=str) + "\n").encode()})
    out(f"committed checkpoint step {best.step} of run {key} as {model_name} version {version}")
    return version
