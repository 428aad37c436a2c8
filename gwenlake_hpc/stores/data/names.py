"""Dataset names and paths: ``group.name`` <-> ``<data_root>/<group>/<name>.h5``."""

from __future__ import annotations

import os
from pathlib import Path

from gwenlake_hpc.base.errors import DataError
from gwenlake_hpc.base.names import split_name


def dataset_name_parts(name: str) -> tuple[str, str]:
    """Return ``(group, name)`` of a dataset name; raise :class:`DataError` if malformed."""
    parts = split_name(name)
    if parts is None:
        raise DataError(
            f"bad dataset name {name!r}: expected 'group.name' where each part is letters, digits,"
            " '_' or '-' and starts with a letter or digit (e.g. 'crm.churn-train')"
        )
    return parts


def dataset_path(data_root: str | os.PathLike[str], name: str) -> Path:
    """Path of dataset ``name`` (``group.name``) under ``data_root``: ``<data_root>/<group>/<name>.h5``.

    The file need not exist. Raises :class:`DataError` if ``name`` is not of the form
    ``group.name`` (no slashes, no ``..``, no empty part, exactly one dot).
    """
    group, short = dataset_name_parts(name)
    return Path(data_root).expanduser() / group / f"{short}.h5"
