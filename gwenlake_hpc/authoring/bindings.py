"""Bindings: what a training function reads (``Input``), writes (``Output``) and starts from (``Model``), and its
hyperparameters checked against its config dataclass (:func:`resolve_params`). Declarations only; the job
(:mod:`gwenlake_hpc.job.execute`) resolves them when it runs. The decorator's data is :mod:`gwenlake_hpc.authoring.api`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import typing
from pathlib import Path
from typing import Any, Mapping

from ..base.errors import ConfigError
from ..base.names import check_name, is_alias


def resolve_params(tf: Any, params: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Check ``job.params`` against the function's config dataclass, if it has one.

    ``tf`` is a :class:`~gwenlake_hpc.authoring.api.TrainFunction` (only its ``config_type`` is read: the bindings
    do not import the decorator's module, which imports them).

    Returns:
        ``(config, plain)``: what the function receives (dataclass instance or dict) and a plain dict of every
        hyperparameter with defaults filled in (it enters the run key and MLflow params).

    Raises:
        ConfigError: an unknown key or a value of the wrong type, naming ``job.params.<key>``.
    """
    if tf.config_type is None:
        plain = dict(params)
        return plain, plain
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged = OmegaConf.merge(_schema(tf.config_type), dict(params))  # merge copies the schema
        plain = OmegaConf.to_container(merged, resolve=True, enum_to_str=True)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"job.params{('.' + str(key)) if key else ''}: {msg} "
                          f"(fields of {tf.config_type.__name__}: "
                          f"{', '.join(f.name for f in dataclasses.fields(tf.config_type))})") from exc
    return obj, plain  # type: ignore[return-value]


@functools.lru_cache(maxsize=64)
def _schema(config_type: type) -> Any:
    """``OmegaConf.structured(config_type)``, made once per dataclass (a sweep checks every task's params)."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(config_type)


class Input:
    """A dataset the training reads: ``Input("crm.churn-train")``.

    Resolved through the catalog to ``<paths.data_root>/crm/churn-train.h5`` and passed to the function as a
    :class:`gwenlake_hpc.data.Dataset` (``.rows``, ``.columns``, ``.revision``, ``.batches(...)``).
    """

    def __init__(self, name: str):
        self.name = check_name(name, "Input dataset")

    def __repr__(self) -> str:
        return f"Input({self.name!r})"


class Output:
    """The model a training produces: ``Output("crm.churn")``.

    The name is the model's name: it names the MLflow experiment, the run directory's parent
    (``<paths.runs_root>/crm.churn/``) and the path ``crm/churn/`` in the model repository. In the function
    the binding is bound to a directory: write the final model files with ``output.file("model.safetensors")``.

    ``predict="package.module:function"`` declares how to use the model: ``function(model_dir, batch)`` takes
    the directory of a version's files (a Path) and a batch ``{column: numpy array [n, ...]}`` of input columns,
    and returns scores as a numpy array ``[n]``. ``inputs`` names those columns (default: every column of the
    first Input). Both are recorded with each version (``lineage.json``, key ``serving``, with the columns'
    dtypes and shapes taken from the training dataset), so ``gwenlake_hpc.load_model`` and the release gate
    can run any version.
    """

    def __init__(self, name: str, *, path: str | os.PathLike | None = None, predict: str | None = None,
                 inputs: typing.Sequence[str] | None = None):
        self.name = check_name(name, "Output model")
        self._path = Path(path) if path is not None else None
        if predict is not None and (not isinstance(predict, str)
                                    or not re.match(r"^[\w.]+:[\w.]+$", predict)):
            raise ConfigError(f"Output({name!r}, predict={predict!r}): use 'package.module:function'")
        if inputs is not None and (isinstance(inputs, str) or not all(isinstance(c, str) for c in inputs)):
            raise ConfigError(f"Output({name!r}, inputs={inputs!r}): give a list of column names")
        self.predict = predict
        self.inputs = list(inputs) if inputs is not None else None

    def bind(self, path: str | os.PathLike) -> "Output":
        """A copy bound to the directory ``path`` (created)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        return Output(self.name, path=path, predict=self.predict, inputs=self.inputs)

    @property
    def path(self) -> Path:
        """The model's directory (``<run_dir>/output``); everything in it is committed at the end.

        Raises:
            RuntimeError: the binding is not bound (outside a job).
        """
        if self._path is None:
            raise RuntimeError(f"Output({self.name!r}) is not bound to a directory outside a job")
        return self._path

    def file(self, name: str) -> Path:
        """Path of a file inside the model's directory; parent folders are created.

        Raises:
            ConfigError: ``name`` is absolute or escapes the directory (``../x``, symlinks pointing out).
        """
        root = self.path.resolve()
        candidate = (root / name).resolve()
        if Path(name).is_absolute() or not candidate.is_relative_to(root) or candidate == root:
            raise ConfigError(f"output.file({name!r}): the path escapes the model directory {root}; "
                              "use a relative name such as 'model.safetensors'")
        candidate.parent.mkdir(parents=True, exist_ok=True)
        return candidate

    def __repr__(self) -> str:
        return f"Output({self.name!r})" if self._path is None else f"Output({self.name!r}, path={str(self._path)!r})"


class Model:
    """An existing model version to start from (fine-tuning): ``Model("crm.churn", version=SHA)``.

    ``version`` is a commit SHA of the model repository, or None for the newest version of the model's
    branch; ``alias="champion"`` takes the version an alias points to now (see :mod:`gwenlake_hpc.stores.registry`;
    the version it resolved to is logged). In the function the binding is a directory with that version's files
    (``.path``, ``.file(name)``), exported without touching any working tree; the resolved version enters the
    run key and the lineage.

    Raises:
        ConfigError: both ``version`` and ``alias`` given, or a malformed alias.
    """

    def __init__(self, name: str, version: str | None = None, *, alias: str | None = None):
        self.name = check_name(name, "Model")
        if version is not None and alias is not None:
            raise ConfigError(f"Model({name!r}): give version= or alias=, not both")
        if alias is not None and not is_alias(alias):
            raise ConfigError(f"Model({name!r}, alias={alias!r}): an alias is a name such as 'champion' "
                              "(letters, digits, '_' and '-', starting with a letter)")
        self.version = version
        self.alias = alias
        self._path: Path | None = None

    def bind(self, path: str | os.PathLike, version: str) -> "Model":
        """A copy bound to the exported directory ``path`` of ``version``."""
        m = Model(self.name, version)
        m.alias = self.alias
        m._path = Path(path)
        return m

    @property
    def path(self) -> Path:
        """Directory holding the files of the version (bound in a job)."""
        if self._path is None:
            raise RuntimeError(f"Model({self.name!r}) is not bound outside a job")
        return self._path

    def file(self, name: str) -> Path:
        """Path of one of the version's files."""
        return self.path / name

    def __repr__(self) -> str:
        if self.alias is not None and self._path is None:
            return f"Model({self.name!r}, alias={self.alias!r})"
        return f"Model({self.name!r}, version={self.version!r})"


Binding = typing.Union[Input, Output, Model]

#: Decorator arguments that are settings rather than bindings, with their defaults.
