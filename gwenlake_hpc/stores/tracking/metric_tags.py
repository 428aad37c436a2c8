"""Tagged metrics: how ``run.log(metrics, tags={...})`` names its series in MLflow.

MLflow has no tags on metric points, so each combination of tags is a series of its own, named
``<metric>/<tag>:<value>/...`` with the tags sorted by name (MLflow's UI then groups them under ``<metric>/``
and compares them in one chart): ``run.log({"auc": 0.91}, tags={"split": "test", "class": "churn"})`` logs
``auc/class:churn/split:test``. The tags of every such series are also recorded on the run, as the run tag
``gwenlake.metric_tags.<series>`` = ``{"class": "churn", "split": "test"}`` (JSON), so a query can find them.

``step`` and ``epoch`` are not part of the name: they give the x-axis. ``step=N`` puts the point at step N;
``epoch=E`` (without ``step``) at step E, the series then counting epochs. The common vocabulary is
:data:`VOCABULARY`; other tag names are accepted with one warning each (a typo such as ``spilt`` would
otherwise make a new series silently). Characters MLflow refuses in names become ``_``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("gwenlake_hpc.tracking")

#: Tag names with a meaning every tool shares.
VOCABULARY = ("split", "class", "threshold", "optimizer", "model_version", "epoch", "step")
#: Tags that give the x-axis instead of naming a series.
X_AXIS = ("step", "epoch")
#: MLflow's longest metric name.
MAX_SERIES_LENGTH = 250
#: Run tag prefix recording each tagged series' tags.
RUN_TAG_PREFIX = "gwenlake.metric_tags."

_TAG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
_UNSAFE = re.compile(r"[^\w.\- ]")  # MLflow's names allow [/\w.\- :]; '/' and ':' are our separators
_warned: set[str] = set()


def tagged_series(name: str, tags: Mapping[str, Any] | None) -> tuple[str, int | None, dict[str, str]]:
    """The series name, the step the tags give (or None) and the naming tags of one tagged metric.

    Args:
        name: the metric's name (``"auc"``).
        tags: ``{tag name: value}``; values are turned into text (``0.5`` -> ``"0.5"``).

    Returns:
        (``"auc/class:churn/split:test"``, step from ``step``/``epoch`` or None, the naming tags as given
        (values as text, before characters MLflow refuses become ``_``)).

    Raises:
        ValueError: tags that are not a dict, a tag name that is not a word (letters, digits, ``_ . -``), a value
            that is not a string or number, a ``step``/``epoch`` that is not a whole number >= 0, a series name
            over MLflow's 250 characters.
    """
    if not tags:
        return name, None, {}
    if not isinstance(tags, Mapping):
        raise ValueError(f"metric tags={tags!r}: give a dict, e.g. tags={{'split': 'val'}}")
    naming: dict[str, str] = {}
    safe: dict[str, str] = {}
    step: int | None = None
    for key in sorted(tags, key=str):
        value = tags[key]
        if value is None or not isinstance(value, (str, int, float)):
            raise ValueError(f"metric tag {key}={value!r}: give a string or a number")
        if not isinstance(key, str) or not _TAG_NAME.match(key):
            raise ValueError(f"metric tag name {key!r}: use letters, digits, _ . - (e.g. split, class)")
        if key not in VOCABULARY and key not in _warned:
            _warned.add(key)
            log.warning("metric tag %r is not one of %s: accepted, as a series of its own (a typo?)", key,
                        ", ".join(VOCABULARY))
        if key in X_AXIS:
            number = _whole(key, value)
            if key == "step" or "step" not in tags:  # step wins over epoch
                step = number
            continue
        naming[key] = str(value)
        safe[key] = _UNSAFE.sub("_", str(value)) or "_"
    series = name + "".join(f"/{k}:{v}" for k, v in safe.items())
    if len(series) > MAX_SERIES_LENGTH:
        raise ValueError(f"metric {name!r} with tags {naming}: the series name would have {len(series)} characters, "
                         f"MLflow takes {MAX_SERIES_LENGTH} at most; shorten the tag values")
    return series, step, naming


def _whole(key: str, value: Any) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit():
        if not (isinstance(value, float) and value.is_integer() and value >= 0):
            raise ValueError(f"metric tag {key}={value!r}: give a whole number >= 0 (it is the x-axis)")
        return int(value)
    return int(text)


def run_tag(series: str, naming: Mapping[str, str]) -> tuple[str, str]:
    """The run tag recording a tagged series' tags: (``gwenlake.metric_tags.<series>``, JSON of the tags)."""
    return RUN_TAG_PREFIX + series, json.dumps(dict(naming), sort_keys=True)
