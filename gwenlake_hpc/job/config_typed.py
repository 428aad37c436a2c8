"""A composed config as the typed settings of :mod:`gwenlake_hpc.job.config`, every check run.

:func:`typed` turns a composed config (Hydra's DictConfig, or the plain mapping a SLURM job receives) into a
:class:`~gwenlake_hpc.job.config.GwenlakeConfig`; :func:`typed_launcher` and :func:`typed_cluster` do it for one
node, :func:`launcher_node` gives a launcher node every key of its schema so code may set them. OmegaConf's errors
become a :class:`ConfigError` naming the key, and an unknown key (one Hydra let in with ``+KEY=``) is refused
(:func:`refuse_unknown_keys`) rather than dropped without a word.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import fields
from typing import Any

from ..base import rules
from ..base.errors import ConfigError
from .config import (LAUNCHERS, CheckpointConfig, ClusterConfig, GwenlakeConfig, JobConfig, LauncherConfig, PathsConfig,
                     SlurmLauncherConfig, StatsdConfig, TrackingConfig)


def typed(cfg: Any) -> GwenlakeConfig:
    """The composed config ``cfg`` (a DictConfig from Hydra, or a plain mapping such as the config a SLURM job
    receives) as a :class:`GwenlakeConfig` of dataclasses, every ``__post_init__`` check run.

    ``launcher`` becomes a :class:`LauncherConfig` or :class:`SlurmLauncherConfig` (by ``launcher.name``),
    ``cluster`` a :class:`ClusterConfig` when set; ``job.params`` stays a dict. Other top-level keys (Hydra's
    own ``hydra`` node) are left out. Each node is converted on its own: a node Hydra typed already is read as
    it is (about 1 ms for a whole config; a sweep plans hundreds), a plain one is merged onto its schema first.

    Raises:
        ConfigError: a missing mandatory value, a wrong type, an unknown key (also one Hydra let in with
            ``+KEY=``, at the top level or under a typed node) or a value a rule refuses; the message names the
            key.
    """
    from omegaconf import DictConfig, OmegaConf

    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    refuse_unknown_top_keys(node)  # each node's own keys are checked as it is converted
    parts: dict[str, Any] = {}
    with _as_config_error():
        for key, schema in (("job", JobConfig), ("paths", PathsConfig), ("tracking", TrackingConfig),
                            ("statsd", StatsdConfig), ("checkpoint", CheckpointConfig), ("launcher", LauncherConfig),
                            ("cluster", ClusterConfig)):
            if key not in node or OmegaConf.is_missing(node, key) or node[key] is None:
                if key == "cluster":
                    continue
                sub = OmegaConf.create({})  # the schema's defaults
            else:
                sub = node[key]
            if key == "launcher":
                name = str(sub.get("name", "local"))
                rules.choice("launcher.name", name, LAUNCHERS, "local: in this process; slurm: submitted")
                schema = SlurmLauncherConfig if name == "slurm" else LauncherConfig
            parts[key] = typed_cluster(sub) if key == "cluster" else _node_object(sub, schema, key)
    return GwenlakeConfig(**parts)


def _node_object(sub: Any, schema: type, key: str) -> Any:
    """One node of the config as an instance of ``schema`` (its checks run); its errors name ``key``."""
    from omegaconf import OmegaConf

    with _as_config_error(f"{key}."):
        refuse_unknown_keys(sub, schema, key)
        return OmegaConf.to_object(_schema_node(sub, schema))


#: The top-level keys of a composed config: the schema's, and Hydra's own node (a sweep's task configs hold it).
_TOP_KEYS = (*(f.name for f in fields(GwenlakeConfig)), "hydra")


def refuse_unknown_top_keys(cfg: Any) -> None:
    """Refuse a top-level key of ``cfg`` (a DictConfig or a mapping) that is neither a section of
    :class:`GwenlakeConfig` nor Hydra's own ``hydra`` node.

    Raises:
        ConfigError: ``KEY: no such setting at the top level``, naming the closest section.
    """
    for key in cfg.keys():
        if key not in _TOP_KEYS:
            raise ConfigError(f"{key}: no such setting at the top level{did_you_mean(str(key), _TOP_KEYS, '')} "
                              f"(it takes {', '.join(_TOP_KEYS[:-1])}): remove it or correct its name")


def did_you_mean(key: str, names: Any, prefix: str) -> str:
    """`` (did you mean PREFIX.NAME?)`` for the name of ``names`` closest to a mistyped ``key``, or ''."""
    import difflib

    close = difflib.get_close_matches(key, [n for n in names if n != "hydra"], n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


@functools.lru_cache(maxsize=None)
def schema_fields(schema: type) -> tuple[dict[str, Any], dict[str, type]]:
    """The fields of ``schema`` with their types, and those that are sections (dataclasses, ``Optional`` or not);
    cached: a sweep checks hundreds of task configs."""
    import typing

    hints = typing.get_type_hints(schema)
    sections = {}
    for name, kind in hints.items():
        kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)  # Optional[X] -> X
        if dataclasses.is_dataclass(kind):
            sections[name] = kind
    return hints, sections


def refuse_unknown_keys(data: Any, schema: type, prefix: str) -> None:
    """Refuse a key of ``data`` (a mapping or a DictConfig) that ``schema`` has no field for, and so on in its
    sections.

    Hydra lets ``+job.foo=1`` into a node it typed, and OmegaConf then drops the key without a word; mappings
    the schema types as dicts (``job.params``, ``launcher.env``, ``launcher.additional_parameters``) are free-form.

    Raises:
        ConfigError: ``PREFIX.KEY: no such setting`` with the closest setting's name, or, for a SLURM setting
            under the local launcher, the ``name: slurm`` it lacks.
    """
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(data, (dict, DictConfig)):
        return  # a value of the wrong shape: the schema's own type error names it
    hints, sections = schema_fields(schema)
    for key in data.keys():
        if key in hints:
            continue
        full = f"{prefix}.{key}"
        if schema is LauncherConfig and key in schema_fields(SlurmLauncherConfig)[0]:
            raise ConfigError(f"{full} is a setting of launcher=slurm: add `name: slurm` to this launcher's file "
                              "conf/launcher/NAME.yaml (without it the job runs here, locally), or give "
                              "launcher=slurm")
        listed = f"; {prefix} takes {', '.join(hints)}" if len(hints) <= 12 else \
            f"; {prefix} takes the keys of {schema.__name__} (gwenlake_hpc/job/config.py)"
        raise ConfigError(f"{full}: no such setting{did_you_mean(str(key), hints, prefix + '.')}: remove it or "
                          f"correct its name{listed}")
    for key, kind in sections.items():
        try:
            value = data.get(key)
        except OmegaConfBaseException:  # a missing or broken value: the schema's conversion names it
            continue
        refuse_unknown_keys(value, kind, f"{prefix}.{key}")


def _schema_node(sub: Any, schema: type) -> Any:
    """``sub`` (a DictConfig) as a DictConfig typed by ``schema``: itself when Hydra typed it already (its file
    named the schema), else merged onto the schema's defaults (OmegaConf's errors pass unchanged)."""
    from omegaconf import DictConfig, OmegaConf

    typed_as = OmegaConf.get_type(sub) if isinstance(sub, DictConfig) else None
    if isinstance(typed_as, type) and issubclass(typed_as, schema):
        return sub
    return OmegaConf.merge(OmegaConf.structured(schema), sub)


def typed_cluster(cc: Any) -> ClusterConfig:
    """The ``cluster`` node (``cluster=NAME``: a DictConfig, or a mapping) as a :class:`ClusterConfig`, with its
    ``launcher`` a :class:`SlurmLauncherConfig`, their checks run.

    Raises:
        ConfigError: as :func:`typed`; a rule of ``cluster.launcher`` names ``cluster.launcher.KEY``.
    """
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cc, ClusterConfig):
        return cc
    node = cc if isinstance(cc, DictConfig) else OmegaConf.create(dict(cc))
    try:
        return _node_object(node, ClusterConfig, "cluster")
    except ConfigError as exc:
        if str(exc).startswith("launcher."):
            raise ConfigError(f"cluster.{exc}") from None
        raise


def typed_launcher(lc: Any) -> SlurmLauncherConfig:
    """The SLURM launcher settings ``lc`` (``launcher`` or ``cluster.launcher``, a DictConfig or a mapping) as a
    :class:`SlurmLauncherConfig`, its checks run.

    Raises:
        ConfigError: as :func:`typed`.
    """
    from omegaconf import DictConfig, OmegaConf

    if isinstance(lc, SlurmLauncherConfig):
        return lc
    return _node_object(lc if isinstance(lc, DictConfig) else OmegaConf.create(dict(lc)), SlurmLauncherConfig,
                        "launcher")


def launcher_node(lc: Any) -> Any:
    """A copy of the SLURM launcher settings ``lc`` (a DictConfig, a mapping or a :class:`SlurmLauncherConfig`)
    as a DictConfig typed by :class:`SlurmLauncherConfig`, every key present, so keys may be set on it (a
    launcher file that does not name ``slurm_schema`` composes to an untyped node holding only its own keys,
    where setting another fails). ``lc`` is not changed.

    Raises:
        ConfigError: a wrong type or an unknown key, named ``launcher.KEY``.
    """
    import copy

    from omegaconf import DictConfig, OmegaConf

    if isinstance(lc, SlurmLauncherConfig):
        return OmegaConf.structured(lc)
    with _as_config_error("launcher."):
        lc = lc if isinstance(lc, DictConfig) else OmegaConf.create(dict(lc))
        refuse_unknown_keys(lc, SlurmLauncherConfig, "launcher")
        node = _schema_node(lc, SlurmLauncherConfig)
    return copy.deepcopy(node) if node is lc else node


_ROOT_KEYS = tuple(f"{f}." for f in ("job", "paths", "tracking", "statsd", "checkpoint", "launcher", "cluster"))


class _as_config_error:
    """OmegaConf's errors (a missing value, a wrong type, an unknown key) as a :class:`ConfigError` naming the
    key; a ConfigError from a ``__post_init__`` check passes unchanged."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix  # for a node merged on its own, whose keys do not name their parent

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

        if exc is None or isinstance(exc, ConfigError) or not isinstance(exc, OmegaConfBaseException):
            return False
        key = str(getattr(exc, "full_key", "") or "")
        if not key.startswith(_ROOT_KEYS):  # a node still in the whole config names its path already
            key = (self.prefix + key).rstrip(".")  # an error on the node itself has no key of its own
        if isinstance(exc, MissingMandatoryValue):
            raise ConfigError(f"{key} is not set: give it in the config file or on the command line ({key}=...)") \
                from None
        raise ConfigError(f"{key or 'config'}: {str(exc).splitlines()[0]}") from None
