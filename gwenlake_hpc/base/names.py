"""Names users give things: datasets and models (``group.name``), aliases, version ids.

One place for the rules, so a dataset, a model and its branch accept the same names. Each check raises the
error of the layer that calls it (ConfigError for a training's declarations and the model repository; the
data catalog turns a ``None`` from :func:`split_name` into its own DataError). Imports nothing of the package
but its errors, so every layer may import it.
"""

from __future__ import annotations

import re

from .errors import ConfigError

__all__ = ["NAME_PART", "split_name", "check_name", "split_model_name", "is_alias", "check_alias", "is_hex_id"]

#: One part of a ``group.name``: a letter or digit, then letters, digits, ``_`` or ``-``.
NAME_PART = r"[A-Za-z0-9][A-Za-z0-9_-]*"
_NAME_RE = re.compile(rf"({NAME_PART})\.({NAME_PART})")
_ALIAS_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,62}")
_HEX_RE = re.compile(r"[0-9a-fA-F]{4,64}")


def split_name(name: object) -> tuple[str, str] | None:
    """``(group, name)`` of a ``group.name`` (each part :data:`NAME_PART`), or None when ``name`` is not one.

    The whole string must match (a trailing newline is refused: names become paths and branch names).
    """
    match = _NAME_RE.fullmatch(name) if isinstance(name, str) else None
    return (match.group(1), match.group(2)) if match else None


def check_name(name: str, what: str) -> str:
    """Validate a ``group.name`` (dataset or model name) and return it.

    Raises:
        ConfigError: not of the form ``group.name`` with letters, digits, ``_`` and ``-``.
    """
    if split_name(name) is None:
        raise ConfigError(f"{what} {name!r} is not a valid name: use 'group.name' "
                          "(letters, digits, '_' and '-', e.g. 'crm.churn-train')")
    return name


def split_model_name(model_name: str) -> tuple[str, str]:
    """``(group, name)`` of a model name, which also names its git branch ``models/<group>.<name>``.

    Raises:
        ConfigError: not a string ``group.name`` (see :func:`split_name`), or the name part is ``lock``
            (git refuses ref names ending in ``.lock``).
    """
    if not isinstance(model_name, str):
        raise ConfigError(f"model name must be a string 'group.name', got {model_name!r}")
    parts = split_name(model_name)
    if parts is None:
        raise ConfigError(
            f"model name {model_name!r} must be 'group.name' where each part starts with a letter"
            " or digit followed by letters, digits, '_' or '-' (e.g. 'crm.churn')")
    if parts[1].lower() == "lock":
        # git refuses ref names ending in '.lock' (models/<group>.lock)
        raise ConfigError(f"model name {model_name!r}: the name part cannot be 'lock'")
    return parts


def is_alias(value: object) -> bool:
    """True when ``value`` is a valid alias name: a letter, then up to 62 letters, digits, ``_`` or ``-``."""
    return isinstance(value, str) and _ALIAS_RE.fullmatch(value) is not None


def check_alias(alias: str) -> str:
    """``alias`` when it is a valid alias name; ConfigError naming the accepted form otherwise."""
    if not is_alias(alias):
        raise ConfigError(f"alias {alias!r}: use a name such as 'champion' (letters, digits, '_' and '-', "
                          "starting with a letter)")
    return alias


def is_hex_id(value: object) -> bool:
    """True when ``value`` is a (possibly abbreviated) commit id: 4 to 64 hexadecimal digits, nothing else.

    Only such ids are passed to git as versions: a version string must never be taken as an option or a
    revision range.
    """
    return isinstance(value, str) and _HEX_RE.fullmatch(value) is not None
