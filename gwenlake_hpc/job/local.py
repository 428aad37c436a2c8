"""Local runs: a decorated training called in this process, for a quick try (``fit.local(steps=50)``).

No Hydra, no tracking, no commit, no signal handlers: the function gets its bindings and a :class:`Run` over a
temporary run directory (removed afterwards unless ``run_dir=`` names one to keep), and whatever it returns is
returned. The loop, checkpoints and resume behave as in a job, so a bug in ``run.steps()``/``run.checkpoint()``
use shows up here first.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..base import rules
from .arguments import bind_arguments
from ..authoring.bindings import Input, Model, Output, resolve_params

if TYPE_CHECKING:
    from ..authoring.api import TrainFunction
from ..base.errors import ConfigError
from ..runtime.current import active
from ..runtime.rng import seed_everything
from ..runtime.run import Run
from ..runtime.signals import StopRequest
from ..stores.tracking import user_mlflow
from ..stores.tracking.null_tracker import NullTracker


def run_local(tf: TrainFunction, config: Any = None, *, steps: int | None = None, epochs: int | None = None,
              seed: int | None = None, eval_every: int | None = None, data_root: str | os.PathLike[str] = "data",
              run_dir: str | os.PathLike[str] | None = None, progress: str = "off", **bindings: Any) -> Any:
    """Run the training ``tf`` in this process; returns what its function returned.

    Args:
        config: the hyperparameters: an instance of the function's config dataclass, a dict (checked against
            it, defaults filled in), or None (the defaults).
        steps, epochs, seed, eval_every: override the decorator's settings (``steps=50``: a smoke run).
        data_root: the catalog ``Input`` names are opened from when not given as bindings.
        run_dir: keep the run directory (checkpoints, ``output/``) here; default: a temporary one, removed.
        progress: ``off``, ``bar`` or ``lines``.
        bindings: by parameter name: a :class:`gwenlake_hpc.data.Dataset` or an ``.h5`` path for an
            ``Input``; a folder or a loaded model (``load_model(...)``) for a ``Model``. An ``Output`` is always
            ``<run_dir>/output``.

    Raises:
        ConfigError: an unknown binding or a bad value; whatever the function raises, unchanged.
    """
    _check_arguments(tf, steps, epochs, eval_every, run_dir, bindings)
    d = tf.defaults
    if steps is None and epochs is None:
        steps, epochs = d.get("steps"), d.get("epochs")
    for key, value in (("steps", steps), ("epochs", epochs), ("eval_every", eval_every)):
        rules.whole_number(key, value)
    config_obj = _config_object(tf, config)
    seed = d.get("seed", 0) if seed is None else seed
    rules.seed("seed", seed)

    temporary = run_dir is None
    root = Path(tempfile.mkdtemp(prefix="gwenlake-local-")) if temporary else Path(run_dir)  # type: ignore[arg-type]
    opened: list[Any] = []  # the datasets this call opened (closed at the end; a given Dataset stays open)
    try:
        kwargs = bind_arguments(tf, root / "output", _open_inputs(tf, bindings, data_root, opened),
                                lambda name, b: _model_files(b, bindings.get(name)))
        seed_everything(seed)
        run = Run(run_dir=root, run_key=f"local-{tf.fn.__name__}", steps=steps, epochs=epochs,
                  eval_every=int(eval_every or d.get("eval_every") or 1000), seed=seed, tracker=NullTracker(),
                  stop=StopRequest(), progress=progress)
        kwargs["run"] = run
        if tf.wants_config:
            kwargs["config"] = config_obj
        with active(run), user_mlflow.reporting(None, None, lambda: run.step,
                                                "fit.local() does not track"):
            result = tf.fn(**kwargs)
        run.wait_for_checkpoint()
        return result
    finally:
        for ds in opened:
            ds.close()
        if temporary:
            shutil.rmtree(root, ignore_errors=True)


def _check_arguments(tf: TrainFunction, steps: int | None, epochs: int | None, eval_every: int | None,
                     run_dir: str | os.PathLike[str] | None, bindings: Mapping[str, Any]) -> None:
    """Refuse what ``fit.local()`` cannot run, before anything is opened.

    Raises:
        ConfigError: an unknown binding, a loop setting for a short fit, both steps and epochs, a given
            argument of the wrong kind for its binding, ``run_dir`` a file.
    """
    unknown = sorted(set(bindings) - set(tf.bindings))
    if unknown:
        raise ConfigError(f"{tf.target}.local(): {', '.join(unknown)} is not a binding of the function "
                          f"(its bindings: {', '.join(tf.bindings) or 'none'})")
    if getattr(tf, "is_short", False) and (steps, epochs, eval_every) != (None, None, None):
        raise ConfigError(f"{tf.target} is a short fit (one call, no loop): drop steps/epochs/eval_every")
    if steps is not None and epochs is not None:
        raise ConfigError("give steps= or epochs=, not both")
    for name, b in tf.bindings.items():
        given = bindings.get(name)
        if given is None:
            continue
        if isinstance(b, Output):
            raise ConfigError(f"{name}: the Output of a local run is <run_dir>/output; give run_dir= to keep it")
        if isinstance(b, Input) and not isinstance(given, (str, os.PathLike)) and not hasattr(given, "read"):
            raise ConfigError(f"{name}={given!r}: give a Dataset or the path of an .h5 dataset file")
        if isinstance(b, Model) and not isinstance(given, (str, os.PathLike)) and not hasattr(given, "version"):
            raise ConfigError(f"{name}={given!r}: give a folder of the model's files or a load_model(...) result")
    if run_dir is not None and Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise ConfigError(f"run_dir={str(run_dir)!r} is a file: give a folder (created if absent)")


def _config_object(tf: TrainFunction, config: Any) -> Any:
    """The function's config object: ``config`` itself, or built from a dict (None: the defaults).

    Raises:
        ConfigError: not the function's config dataclass nor a dict, or a dict it refuses.
    """
    if config is None or isinstance(config, Mapping):
        config_obj, _ = resolve_params(tf, dict(config or {}))
        return config_obj
    if tf.config_type is not None and not isinstance(config, tf.config_type):
        raise ConfigError(f"config: give a {tf.config_type.__name__} or a dict, not {type(config).__name__}")
    return config


def _open_inputs(tf: TrainFunction, bindings: Mapping[str, Any], data_root: str | os.PathLike[str],
                 opened: list[Any]) -> dict[str, Any]:
    """The dataset of every ``Input``: the Dataset given, the ``.h5`` file given, else the catalog's at
    ``data_root``. What is opened here is appended to ``opened`` for the caller to close."""
    from ..stores.data import Catalog, Dataset

    datasets: dict[str, Any] = {}
    catalog = None
    for name, b in tf.bindings.items():
        if not isinstance(b, Input):
            continue
        given = bindings.get(name)
        if isinstance(given, Dataset):
            datasets[name] = given
            continue
        if given is not None:
            datasets[name] = Dataset(given, name=b.name)
        else:
            catalog = catalog or Catalog(data_root)
            datasets[name] = catalog.open(b.name)
        opened.append(datasets[name])
    return datasets


def _model_files(b: Model, given: Any) -> tuple[Path, str]:
    """The folder and version of a ``Model``: a ``load_model(...)`` result, a folder (version ``local``), or the
    model repository's version the binding names."""
    if given is None:
        from ..stores.registry import load_model

        given = load_model(b.name, b.version, alias=b.alias)
    return (given.path, given.version) if hasattr(given, "version") else (Path(given), "local")
