"""MLflow's own API inside a training function, reporting into the job's run.

While the training function runs, the job sets ``MLFLOW_TRACKING_URI=gwenlake-job:<state folder>`` and
``MLFLOW_RUN_ID`` (:func:`reporting`). MLflow finds the two classes below through its plug-in entry points
(``mlflow.tracking_store`` and ``mlflow.artifact_repository`` in ``pyproject.toml``), so ``mlflow.log_metric``,
``log_param(s)``, ``set_tag(s)``, ``log_artifact(s)``, ``log_dict``, ``log_figure``, ``log_input`` and
``mlflow.active_run()`` work on the job's run with nothing to configure:

- writes go into the job's tracking spool, like the package's own points: the delivery process sends them, in
  order, once; a step at or below one already logged for a key is dropped (a resumed training replays the steps
  after its checkpoint), so a restart never stores a second point;
- a point logged without a step (MLflow records step 0) is recorded at the training's current step;
- artifacts are copied into the state folder and uploaded by the delivery process;
- dataset inputs (``log_input``, autolog's training data) go through the spool; MLflow's warning when autolog
  cannot describe the data itself becomes one line of ours with the reason (:class:`_DatasetFailureOnce`);
- the fluent API's status changes are ignored: the job alone marks the run (KILLED when evicted, FINISHED at
  the end), whatever ``mlflow.end_run`` or MLflow's exit hook say;
- with tracking off (``tracking=False``, ``job.tracking=false``, ``fit.local()``) the calls go nowhere, with one
  warning, and nothing is written to the working directory.

Reads that need the server (``get_metric_history``, ``search_runs``) and other runs are refused with a message:
use an :class:`mlflow.MlflowClient` with an explicit ``tracking_uri`` for them.

This module never imports MLflow: the store classes are in :mod:`.mlflow_plugin`, which MLflow loads itself
when the user's code calls it, so a training that does not use MLflow pays nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..uri import redact_uri
from .sink import ARTIFACT_SCHEME, ATTACH_WAIT_S, SCHEME, register, set_off_reason, unregister, warn_once

logger = logging.getLogger("gwenlake_hpc.tracking")

#: Loggers of MLflow's autolog integrations that warn, at every fit, when they cannot describe the training data.
_DATASET_LOGGERS = ("mlflow.sklearn", "mlflow.tensorflow", "mlflow.pyspark.ml")
_DATASET_FAILURE = "Failed to log training dataset information"


class _DatasetFailureOnce(logging.Filter):
    """Drops MLflow's "Failed to log training dataset information" warnings; the first becomes one line of ours
    with its reason and, for MLflow's known failure on numpy features with a pandas target, the fix."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_DATASET_FAILURE):
            return True
        reason = str(record.args[0]) if isinstance(record.args, tuple) and record.args else record.getMessage()
        # MLflow's from_numpy hashes the target with .flatten(), which a pandas Series lacks
        hint = ": MLflow describes numpy features only with a numpy target, so fit on y.to_numpy() (or on a " \
               "DataFrame of features)" if "attribute 'flatten'" in reason else ""
        warn_once("autolog-dataset", "MLflow's autolog could not record the training data as a dataset input of "
                                     "the run (%s)%s; the job records its own datasets (name@revision) as run tags "
                                     "and in the version's lineage. Said once per process", reason, hint)
        return False


_dataset_filter = _DatasetFailureOnce()


@contextlib.contextmanager
def reporting(tracker: Any, state_dir: Path | None, current_step: Callable[[], int],
              off_reason: str = "tracking is off for this job (tracking=False or job.tracking=false)") -> Iterator[None]:
    """Route MLflow's fluent API of this process (and of processes started meanwhile) into the job's run while
    the training function runs.

    Args:
        tracker: the job's :class:`~gwenlake_hpc.stores.tracking.Tracker`; None when tracking is off.
        state_dir: its state folder (``<run_dir>/tracking``); None when tracking is off.
        current_step: the training's current step (``run.step``), for points logged without one.
        off_reason: the warning given once when tracking is off and the function calls MLflow.

    Sets ``MLFLOW_TRACKING_URI`` (and, where the code called ``mlflow.set_tracking_uri``, MLflow's own URI) to
    the job's store, unsets ``MLFLOW_RUN_ID``, and restores all three afterwards: a URI the user set is set
    aside, with a line saying so, since it would send the calls to a second run. Where MLflow is imported
    already, the job's run is started in MLflow's fluent API so that ``mlflow.active_run()`` returns it from the
    first step; otherwise MLflow starts it at the first call. It is ended (without a status: see the module
    docstring) on the way out.
    """
    own = os.environ.get("MLFLOW_TRACKING_URI")
    if own and not own.startswith(f"{SCHEME}:"):
        # often exported in a shell profile: it would send the function's calls to a second run elsewhere
        logger.info("MLFLOW_TRACKING_URI (%s) is set aside while the training function runs: its MLflow calls "
                    "report into the job's run (tracking.uri); use MlflowClient(tracking_uri=...) for another store",
                    redact_uri(own))
    key = str(Path(state_dir).absolute()) if state_dir is not None and tracker is not None else ""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID")}
    set_off_reason(off_reason)
    if key:
        register(key, tracker, current_step)
    if key and "mlflow" in sys.modules and tracker.run_id is None:
        # the function's module uses MLflow: its active run should carry the real id from the first step (the
        # delivery process creates the run within seconds; at once False when the server is known down)
        tracker.wait_attached(ATTACH_WAIT_S)
    os.environ["MLFLOW_TRACKING_URI"] = f"{SCHEME}:{key}"
    # no MLFLOW_RUN_ID: every start_run (MLflow's own at the first call, the user's, a forked process's) creates
    # a run, which the store answers with the job's run (a nested one it refuses)
    os.environ.pop("MLFLOW_RUN_ID", None)
    _register_plugins()
    set_aside = _set_process_uri(f"{SCHEME}:{key}")
    restore = _start_fluent_run()
    for name in _DATASET_LOGGERS:
        logging.getLogger(name).addFilter(_dataset_filter)
    try:
        yield
    finally:
        for name in _DATASET_LOGGERS:
            logging.getLogger(name).removeFilter(_dataset_filter)
        # every fluent run ends while the URI is still ours: MLflow's exit hook would end one left active against
        # its default store (a new ./mlflow.db); the store ignores the status
        _end_fluent_runs()
        if restore is not None:
            restore()
        if set_aside is not None:
            _set_process_uri(set_aside)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if key:
            unregister(key)


def _set_process_uri(uri: str) -> str | None:
    """Where MLflow is imported and ``mlflow.set_tracking_uri`` was called (it wins over the environment), set
    ``uri`` the same way; returns the URI it replaced (None: nothing to undo)."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return None
    try:
        from mlflow.tracking._tracking_service import utils

        previous = utils._tracking_uri  # not public: None unless set_tracking_uri was called
        if previous is None or previous == uri:
            return None
        mlflow.set_tracking_uri(uri)
        return str(previous)
    except Exception:  # noqa: BLE001 - MLflow's internals moved: the environment variable still applies
        return None


def _plugins_installed() -> bool:
    """True when this environment's entry points name our MLflow store and its module exists.

    An install made before an upgrade moved the module (``pip install -e`` not run again) names a module that is
    gone: MLflow would then refuse the job's URI. The store is then registered by hand (MLflow imported for
    that), with one warning saying how to mend the install.
    """
    from importlib.metadata import entry_points
    from importlib.util import find_spec

    ours = [ep for ep in entry_points(group="mlflow.tracking_store") if ep.name == SCHEME]
    if not ours:
        return False
    try:
        stale = find_spec(ours[0].module) is None
    except ImportError:  # a parent package that no longer exists
        stale = True
    if stale:
        warn_once("stale", "this environment's gwenlake_hpc entry points name %s, a module that no longer exists "
                           "(installed before an upgrade): run `pip install -e <checkout>` (or bash scripts/setup.sh) "
                           "again; the MLflow store is registered by hand meanwhile", ours[0].value)
        import mlflow  # noqa: F401 - its registries exist once it is imported
    return not stale


def _register_plugins() -> None:
    """Make MLflow know our schemes when the package's entry points are missing (gwenlake_hpc imported from a
    source folder on ``PYTHONPATH``, not installed): possible only once MLflow is imported, through its
    registries (not public API: failures are a warning)."""
    if _plugins_installed():
        return
    if "mlflow" not in sys.modules:
        warn_once("plugins", "gwenlake_hpc is not installed as a package (its MLflow plug-in entry points are "
                             "missing): MLflow calls inside the training function will fail with an unknown URI "
                             "scheme. Install it (pip install -e <checkout>) in the job's environment",
                  level=logging.INFO)  # most trainings never call MLflow themselves
        return
    try:
        from mlflow.store.artifact.artifact_repository_registry import _artifact_repository_registry
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry

        from .mlflow_plugin import JobArtifactRepository, JobStore

        _tracking_store_registry.register(SCHEME, JobStore)
        _artifact_repository_registry.register(ARTIFACT_SCHEME, JobArtifactRepository)
    except Exception as exc:  # noqa: BLE001 - MLflow's internals moved: say what to do
        warn_once("plugins", "cannot register the gwenlake-job MLflow store (%s): install gwenlake_hpc as a package "
                             "(pip install -e <checkout>) in the job's environment", exc)


def _start_fluent_run() -> Callable[[], None] | None:
    """Start the job's run in MLflow's fluent API when MLflow is imported already, so that ``mlflow.active_run()``
    is the job's run from the first step. The user's own ``mlflow.start_run()`` (``with mlflow.start_run():``)
    would then find a run active and fail: ``mlflow.start_run`` is wrapped to end ours first (not for a nested
    run, which the store refuses). Returns what undoes the wrapper, or None when nothing was started."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or not hasattr(mlflow, "start_run"):
        return None
    try:
        if mlflow.active_run() is not None:
            return None
        ours = mlflow.start_run()
    except Exception as exc:  # noqa: BLE001 - the user's MLflow setup; the training goes on
        logger.warning("MLflow's fluent run could not be started on the job's run (%s); mlflow.log_* calls "
                       "start it at their first use", exc)
        return None
    real = mlflow.start_run

    @functools.wraps(real)
    def start_run(*args: Any, **kwargs: Any) -> Any:
        nested = kwargs.get("nested", args[3] if len(args) > 3 else False)
        if not nested and mlflow.active_run() is ours:
            mlflow.end_run()  # the run opened for active_run(): the user's own start_run takes its place
        return real(*args, **kwargs)

    mlflow.start_run = start_run

    def restore() -> None:
        if mlflow.start_run is start_run:
            mlflow.start_run = real

    return restore


def _end_fluent_runs() -> None:
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or not hasattr(mlflow, "active_run"):
        return
    with contextlib.suppress(Exception):
        for _ in range(100):  # runs nested in each other: one end_run each
            if mlflow.active_run() is None or not mlflow.get_tracking_uri().startswith(f"{SCHEME}:"):
                break
            mlflow.end_run()
