"""The config files' checks that run before Hydra composes them, and the composed config's unknown keys.

Hydra reports some mistakes with a traceback or with no key named: a ``GROUP=null`` override, a config file that
is not valid YAML (or repeats a key), a misshapen ``defaults`` list, a file that is not a mapping, a value where
the schema has a section, an empty launcher file. :func:`check_group_choices` reads the files the command line
and ``config.yaml`` choose, before Hydra, and names the file, its line and the key. :func:`check_keys` then
refuses a key of the composed config that no schema has (Hydra lets ``+job.foo=1`` in and OmegaConf would drop
it without a word). The schemas, their rules and the conversion into them are :mod:`gwenlake_hpc.job.config`'s.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from ..base.errors import ConfigError
from .config import (CheckpointConfig, ClusterConfig, JobConfig, LauncherConfig, PathsConfig, SlurmLauncherConfig,
                     StatsdConfig, TrackingConfig)
from .config_typed import did_you_mean, refuse_unknown_keys, refuse_unknown_top_keys, schema_fields


def check_keys(cfg: Any) -> None:
    """Refuse a key of the composed config ``cfg`` (a DictConfig) that no schema has, at the top level or under
    a typed node (``job``, ``paths``, ``tracking``, ``statsd``, ``launcher`` by its ``name``, ``cluster`` and
    their sections), before any work: Hydra lets ``+job.foo=1`` in and OmegaConf would drop it without a word.
    Only keys are checked; values are :func:`typed`'s (a ``cluster=`` job is planned on the cluster).

    Raises:
        ConfigError: ``KEY: no such setting``, naming the closest setting.
    """
    from omegaconf import OmegaConf

    refuse_unknown_top_keys(cfg)
    for key, schema in (("job", JobConfig), ("paths", PathsConfig), ("tracking", TrackingConfig),
                        ("statsd", StatsdConfig), ("checkpoint", CheckpointConfig), ("launcher", None),
                        ("cluster", ClusterConfig)):
        if key not in cfg or OmegaConf.is_missing(cfg, key):
            continue
        data = cfg[key]
        if key == "launcher" and OmegaConf.is_dict(data):
            name = data.get("name", "local")
            schema = SlurmLauncherConfig if name == "slurm" else LauncherConfig if name == "local" else None
        if schema is not None:  # an unknown launcher.name: typed() names it
            refuse_unknown_keys(data, schema, key)


#: The config groups a command line chooses files of, and the schema each file's keys follow (a launcher file
#: is checked against the SLURM launcher's, the larger one: unknown keys are the schema's own error).
GROUP_SCHEMAS = {"job": JobConfig, "launcher": SlurmLauncherConfig, "cluster": ClusterConfig}


def check_group_choices(overrides: Any, root: Path) -> None:
    """Refuse a ``GROUP=null`` override and a config file under ``root`` (``config.yaml``, the ``conf/GROUP/NAME.yaml``
    files the command line or config.yaml's defaults choose, and the files of their group their own defaults
    name) where Hydra's own error would be a traceback or name no key: a file that is not valid YAML (or repeats a
    key), a ``defaults`` that is not a list of names or ``GROUP: NAME`` pairs, a file that is not a mapping of
    keys, a value that is not a mapping where the schema has a section (``cluster.launcher``,
    ``launcher.container``), an empty launcher file (it would run the job locally without a word). Missing or
    unreadable files, and every other mistake, are left to Hydra and the schemas.

    Raises:
        ConfigError: naming the override, or the file (and line) and the key, and the fix.
    """
    chosen: dict[str, str] = {}
    given: dict[str, str] = {}  # chosen on the command line (config.yaml's own choices are Hydra's to report)
    for ov in overrides:
        key, eq, name = str(ov).lstrip("+").partition("=")
        if not eq or key not in GROUP_SCHEMAS:
            continue
        if name.strip() in ("null", ""):
            raise ConfigError(f"{ov}: {key} takes the name of a file conf/{key}/NAME.yaml"
                              + ("; leave cluster= out to run without a cluster" if key == "cluster" else ""))
        chosen[key] = given[key] = name
    primary = _read_config_file(root / "config.yaml", "config")
    for entry in (primary.get("defaults") or []) if isinstance(primary, dict) else []:
        if isinstance(entry, dict) and len(entry) == 1:  # `- launcher: local`: the choice when none is given
            (group, name), = entry.items()
            if group in GROUP_SCHEMAS and isinstance(name, str):
                chosen.setdefault(group, name)
    for key, names in given.items():
        for name in names.split(","):
            _check_group_exists(root, key, name.strip())
    seen: set[Path] = set()
    for key, names in chosen.items():
        for name in names.split(","):  # a sweep over files: launcher=a,b
            _check_group_file(root, key, name.strip(), seen)


#: The schemas Hydra's ConfigStore holds in each group (:func:`gwenlake_hpc.job.config.register`).
_STORED = {"launcher": ("local_schema", "slurm_schema"), "cluster": ("cluster_schema",), "job": ()}


def _check_group_exists(root: Path, key: str, name: str) -> None:
    """Refuse ``key=name`` when there is no ``root/key/name.yaml`` (nor a stored schema of that name): Hydra's
    message lists its search path, not the files there are."""
    if not name or (root / key / f"{name}.yaml").is_file() or name in _STORED.get(key, ()):
        return
    import difflib

    there = sorted(p.stem for p in (root / key).glob("*.yaml")) if (root / key).is_dir() else []
    close = difflib.get_close_matches(name, there, n=1)
    hint = f" (did you mean {key}={close[0]}?)" if close else ""
    raise ConfigError(f"{key}={name}: there is no {root / key / (name + '.yaml')}{hint}; the {key} files there: "
                      f"{', '.join(there) or 'none'} (write conf/{key}/{name}.yaml to add one)")


def _check_group_file(root: Path, key: str, name: str, seen: set) -> None:
    """Check ``root/key/name.yaml`` (see :func:`check_group_choices`) and the files of its group it names."""
    path = root / key / f"{name}.yaml"
    if path in seen or not path.is_file():
        return
    seen.add(path)
    data = _read_config_file(path, key)
    if data is None and key == "launcher":
        raise ConfigError(f"launcher ({path}) is empty: write `name: slurm` and the sbatch settings in it to submit "
                          "to SLURM (see conf/launcher/slurm.yaml), or choose launcher=local to run here")
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{key} ({path}): the file holds a {type(data).__name__}, not a mapping: write one "
                          f"KEY: VALUE line per setting")
    for entry in (data or {}).get("defaults") or []:
        if isinstance(entry, str) and entry != "_self_":  # another file of the group, e.g. a shared base
            _check_group_file(root, key, entry, seen)
    _check_sections(data or {}, GROUP_SCHEMAS[key], key)


@functools.lru_cache(maxsize=None)
def _strict_loader() -> type:
    """A safe YAML loader (libyaml's when installed: a few times faster) that, as OmegaConf's, which Hydra reads
    config files with, refuses a key given twice in one mapping."""
    import yaml

    class StrictLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            keys = set()
            for key_node, _ in node.value:
                if key_node.tag == yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG:
                    if key_node.value in keys:
                        raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                                f"found duplicate key {key_node.value}",
                                                                key_node.start_mark)
                    keys.add(key_node.value)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _read_config_file(path: Path, key: str) -> Any:
    """The data of the config file ``path`` (None when empty, missing or unreadable: Hydra's to report), its
    ``defaults`` list checked.

    Raises:
        ConfigError: not valid YAML (file, line, the parser's words), a key given twice, a misshapen ``defaults``.
    """
    import yaml

    try:
        text = path.read_text()
    except (OSError, ValueError):
        return None
    try:
        data = yaml.load(text, Loader=_strict_loader())
    except yaml.YAMLError as exc:
        mark, at = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context = getattr(exc, "context", None)
        said = f" ({context} at line {at.line + 1}, column {at.column + 1})" if context and at else ""
        raise ConfigError(f"{path}{f', line {mark.line + 1}' if mark else ''}: not valid YAML: {problem}{said}; "
                          "fix the file") from None
    if isinstance(data, dict) and "defaults" in data:
        defaults = data["defaults"]
        how = ("write one `- NAME` line per entry under `defaults:` (e.g. `- slurm_schema` then `- _self_`), "
               "or remove it")
        if not isinstance(defaults, list):
            raise ConfigError(f"{key} ({path}): defaults: {defaults!r} is not a list: {how}")
        for entry in defaults:
            ok = isinstance(entry, str) or (
                isinstance(entry, dict) and len(entry) == 1 and all(
                    v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(i, str) for i in v))
                    for v in entry.values()))
            if not ok:
                raise ConfigError(f"{key} ({path}): defaults entry {entry!r}: give a name (`- slurm_schema`) or one "
                                  "GROUP: NAME pair (`- launcher: slurm`)")
    return data


def _check_sections(data: dict, schema: type, prefix: str) -> None:
    """Refuse a value of ``data`` that is not a mapping where ``schema`` has a section (a dataclass field)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(schema)
    for name, value in data.items():
        kind = hints.get(name)
        kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)  # Optional[X] -> X
        if not dataclasses.is_dataclass(kind) or value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{prefix}.{name}={value!r}: give a section, its keys indented on the lines under "
                              f"`{name}:` (the keys of {kind.__name__})")
        _check_sections(value, kind, f"{prefix}.{name}")


#: The typed sections a plain ``KEY=VALUE`` override is checked against before Hydra (the launcher against the
#: SLURM launcher's schema, the larger one: a SLURM key under the local launcher is :func:`check_keys`'s).
_OVERRIDE_SCHEMAS = {"job": JobConfig, "paths": PathsConfig, "tracking": TrackingConfig, "statsd": StatsdConfig,
                     "checkpoint": CheckpointConfig,
                     "launcher": SlurmLauncherConfig, "cluster": ClusterConfig}
_KINDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}


def check_overrides(argv: Any) -> None:
    """Refuse a plain ``SECTION.KEY=VALUE`` override of the command line whose key no schema has, or whose value
    cannot be converted to the key's type, before Hydra: Hydra's own message suggests ``+KEY`` for a mistyped
    key (``job.stesp=10``) and prints OmegaConf's internals for a bad value (``job.steps=abc``).

    Free-form mappings (``job.params``, ``launcher.env``...) are not checked here (``job.params`` is the training
    function's config dataclass's), nor are sweeps (``a,b``), interpolations, ``+``/``~`` overrides and group
    choices; an override Hydra cannot parse is left to Hydra.

    Raises:
        ConfigError: ``KEY: no such setting (did you mean ...?)`` or ``KEY=VALUE: give <kind>``.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    plain = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(plain)
    except HydraException:
        return
    for o in overrides:
        section, _, rest = o.key_or_group.partition(".")
        if o.type is not OverrideType.CHANGE or not rest or section not in _OVERRIDE_SCHEMAS or o.package:
            continue
        value = None if o.is_sweep_override() else o.value()
        _check_override(o.key_or_group, rest.split("."), _OVERRIDE_SCHEMAS[section], section, value,
                        checkable=not o.is_sweep_override() and not (isinstance(value, str) and "${" in value))


def _check_override(key: str, parts: list[str], schema: type, prefix: str, value: Any, checkable: bool) -> None:
    import types
    import typing

    for i, name in enumerate(parts):
        hints, sections = schema_fields(schema)
        if name not in hints:
            raise ConfigError(f"{key}: no such setting{did_you_mean(name, hints, prefix + '.')}: correct its name "
                              f"({prefix} takes {', '.join(hints)})")
        prefix = f"{prefix}.{name}"
        if name in sections:
            schema = sections[name]
            continue
        if i < len(parts) - 1 or not checkable:
            return  # inside a free-form mapping (job.params.lr, launcher.env.X) or a sweep: not ours to check
        kind = hints[name]
        optional = typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in typing.get_args(kind)
        if optional:  # Optional[X] -> X; a List[str] stays a list (not checked here)
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        _check_value(key, value, kind, optional)


def _check_value(key: str, value: Any, kind: Any, optional: bool) -> None:
    """Refuse ``value`` that OmegaConf would not convert to ``kind`` (as Hydra would, with its internals)."""
    import enum

    choices = isinstance(kind, type) and issubclass(kind, enum.Enum)
    if (kind not in _KINDS and not choices) or (value is None and optional):
        return
    from omegaconf import OmegaConf, ValidationError

    try:
        OmegaConf.structured(_holder(kind, optional)).v = value
    except ValidationError:
        null = " or null" if optional else ""
        wanted = f"one of {', '.join(m.name for m in kind)}" if choices else _KINDS[kind]
        raise ConfigError(f"{key}={value!r}: give {wanted}{null}") from None


@functools.lru_cache(maxsize=None)
def _holder(kind: type, optional: bool) -> type:
    """A one-field dataclass of type ``kind`` (``Optional`` when ``optional``): OmegaConf's own conversion."""
    import dataclasses
    import typing

    from omegaconf import MISSING

    return dataclasses.make_dataclass("_Holder", [("v", typing.Optional[kind] if optional else kind,
                                                   dataclasses.field(default=None if optional else MISSING))])


def settable_launcher_overrides(argv: Any, root: Path) -> list[str]:
    """``argv`` with each plain ``launcher.KEY=VALUE`` override of a setting the chosen launcher file leaves out
    made ``++launcher.KEY=VALUE``, when that file names no schema in its ``defaults`` (a file of only
    ``name: slurm`` and a few settings, as the SLURM guide allows), and each plain override of a SLURM setting
    when the file is a local launcher's (``local_schema``): :func:`check_keys` then says it is a setting of
    ``launcher=slurm``, where Hydra said ``Key 'folder' not in 'LauncherConfig'``.

    Hydra composes such a file as an untyped node that refuses new keys (``use +launcher.dry_run=true``); its
    keys are the schema's all the same (:func:`check_keys` and the typed conversion check them and their values).
    Sweeps (``a,b``) and ``+``/``~`` overrides are left as they are.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    argv = list(argv)
    name = next((a.partition("=")[2] for a in argv if a.startswith("launcher=")), None)
    if name is None:
        primary = _read_config_file(root / "config.yaml", "config")
        name = next((e["launcher"] for e in (primary.get("defaults") or []) if isinstance(primary, dict)
                     and isinstance(e, dict) and isinstance(e.get("launcher"), str)), None)
    path = root / "launcher" / f"{name}.yaml"
    if not name or "," in name or not path.is_file():
        return argv
    data = _read_config_file(path, "launcher")
    defaults = (data.get("defaults") or []) if isinstance(data, dict) else []
    if not isinstance(data, dict) or "slurm_schema" in defaults:
        return argv
    fields = schema_fields(SlurmLauncherConfig)[0]
    if "local_schema" in defaults:  # a typed local launcher: Hydra's "Key 'folder' not in 'LauncherConfig'"
        local = schema_fields(LauncherConfig)[0]  # ++ lets the key in; check_keys names it a SLURM setting
        fields, data = {k: v for k, v in fields.items() if k not in local}, {}
    parser = OverridesParser.create()
    for i, arg in enumerate(argv):
        if not arg.startswith("launcher.") or "=" not in arg:
            continue
        try:
            (o,) = parser.parse_overrides([arg])
        except HydraException:
            continue
        top = o.key_or_group.split(".")[1]
        if o.type is OverrideType.CHANGE and not o.is_sweep_override() and top in fields and top not in data:
            argv[i] = "++" + arg
    return argv
