"""The rules a setting's value must follow, each written once.

The config dataclasses (:mod:`gwenlake_hpc.job.config`, in ``__post_init__``), the Run, ``fit.local()`` and the
tracker call these with the setting's full key (``job.steps``, ``launcher.timeout_min``), so a value refused
in one place is refused with the same message everywhere. Each raises :class:`ConfigError` (exit 2) naming the
key, the value and what to give instead. Basics layer: imports only :mod:`gwenlake_hpc.base.errors`.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from .errors import ConfigError

#: Largest whole-number setting accepted (steps, epochs): far beyond any training, still exact in a float64.
MAX_COUNT = 2**62
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def whole_number(key: str, value: Any, minimum: int = 1, why: str = "", maximum: int = MAX_COUNT) -> None:
    """Refuse ``value`` unless it is None or an int (not a bool) from ``minimum`` to ``maximum - 1``
    (default: below :data:`MAX_COUNT`).

    Raises:
        ConfigError: ``<key>=<value>: must be a whole number >= <minimum>`` (or ``from <minimum> to <maximum - 1>``
            for a value above the range or a bounded setting) and ``why`` when given.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < maximum:
        too_large = isinstance(value, int) and value >= maximum
        bound = f"from {minimum} to {maximum - 1}" if too_large or maximum != MAX_COUNT else f">= {minimum}"
        said = f" {why}" if why and not (too_large and maximum == MAX_COUNT) else ""
        raise ConfigError(f"{key}={value!r}: must be a whole number {bound}{said}")


def positive_seconds(key: str, value: Any, allow_zero: bool = False) -> None:
    """Refuse ``value`` unless it is None or a number of seconds > 0 (>= 0 with ``allow_zero``).

    Raises:
        ConfigError: naming the key and the accepted range.
    """
    if value is None:
        return
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and value == value and value != float("inf")
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value!r}: must be a number of seconds {'>= 0' if allow_zero else '> 0'}")


def positive_number(key: str, value: Any, meaning: str = "") -> None:
    """Refuse ``value`` unless it is a finite number > 0 (not a bool, not a string).

    Raises:
        ConfigError: ``<key>=<value>: must be a number > 0`` and ``meaning`` (its unit and default).
    """
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and value == value and value != float("inf")
    if not ok or value <= 0:
        raise ConfigError(f"{key}={value!r}: must be a number > 0" + (f" ({meaning})" if meaning else ""))


def factor_above_one(key: str, value: Any, meaning: str = "") -> None:
    """Refuse ``value`` unless it is 0 (off) or a finite number > 1.

    Raises:
        ConfigError: naming the key, the accepted values and ``meaning``.
    """
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and value == value and value != float("inf")
    if not ok or not (value == 0 or value > 1):
        raise ConfigError(f"{key}={value!r}: must be a number > 1 (a factor), or 0 to turn it off" +
                          (f"; {meaning}" if meaning else ""))


def choice(key: str, value: Any, choices: Iterable[str], meaning: str = "") -> None:
    """Refuse ``value`` (a str or a str Enum member) unless it is one of ``choices``.

    Raises:
        ConfigError: ``<key>=<value>: use a, b or c`` and ``meaning`` when given.
    """
    options = list(choices)
    if str(getattr(value, "value", value)) not in options:
        listed = ", ".join(options[:-1]) + f" or {options[-1]}" if len(options) > 1 else options[0]
        raise ConfigError(f"{key}={value!r}: use {listed}{' (' + meaning + ')' if meaning else ''}")


def seed(key: str, value: Any) -> None:
    """Refuse a seed outside torch's range (an int from 0 to 2**63-1).

    Raises:
        ConfigError: naming the key.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ConfigError(f"{key}={value!r}: must be an integer from 0 to 2**63-1 (torch's seed range)")


def has_control(text: str) -> bool:
    """Whether ``text`` holds a control character (a newline, a NUL, ESC...)."""
    return bool(_CONTROL_RE.search(text))


def single_line(key: str, value: Any, where: str = "") -> None:
    """Refuse a str holding control characters (a newline would start a new line in a script or header).

    Raises:
        ConfigError: naming the key and ``where`` the value goes.
    """
    if isinstance(value, str) and _CONTROL_RE.search(value):
        raise ConfigError(f"{key}={value!r}: control characters (newlines) are not allowed"
                          f"{' in ' + where if where else ''}: give it on one line")


#: One item of sbatch's ``--gres``: ``name[:type][:count]`` (``gpu``, ``gpu:2``, ``gpu:a100:2``), count >= 1.
_GRES_ITEM_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*(?::[A-Za-z0-9_.-]*[A-Za-z_.-][A-Za-z0-9_.-]*)?(?::[1-9][0-9]*)?")


def gres(key: str, value: Any) -> None:
    """Refuse a ``--gres`` value sbatch would refuse after the job was planned (exit 1 instead of 2).

    Accepts None and comma-separated items ``name[:type][:count]``: ``gpu``, ``gpu:2``, ``gpu:a100:2``,
    ``gpu:a100:2,shard:1`` (the type is not all digits, the count a positive whole number).

    Raises:
        ConfigError: naming the key and the accepted forms.
    """
    if value is None:
        return
    items = str(value).split(",")
    if not all(_GRES_ITEM_RE.fullmatch(item) for item in items):
        raise ConfigError(f"{key}={value!r}: give generic resources as NAME[:TYPE][:COUNT], comma-separated "
                          "(gpu:2, gpu:a100:2, gpu:a100:2,shard:1), or null")


def env_name(key: str, name: Any) -> None:
    """Refuse an environment variable name a shell cannot ``export`` (letters, digits, ``_``; no leading digit).

    Raises:
        ConfigError: naming the key (``launcher.env.NAME``, ``launcher.secrets``).
    """
    if not _ENV_NAME_RE.fullmatch(str(name)):
        raise ConfigError(f"{key}: {str(name)!r} is not a valid environment variable name (letters, digits, _; "
                          "not starting with a digit)")
