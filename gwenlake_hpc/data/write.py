"""Writing datasets: validated, hashed, written to a temporary file and renamed into place atomically."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np

from gwenlake_hpc.errors import DataError
from gwenlake_hpc.fsutil import fsync_dir, mkstemp

from .format import FORMAT_VERSION, RESERVED_ATTRS, _normalize_columns
from .names import dataset_path
from .revision import content_revision

log = logging.getLogger(__name__)


def write_dataset(
    data_root: str | os.PathLike[str],
    name: str,
    columns: Mapping[str, np.ndarray],
    attrs: Mapping[str, str] | None = None,
) -> str:
    """Write dataset ``name`` atomically under ``data_root``; return its revision (hex sha256).

    ``columns`` maps column name -> array; all arrays share their first dimension (rows) and are
    written in mapping order. Numeric and bool arrays keep their dtype (stored little-endian);
    str/bytes/object arrays are stored as UTF-8 strings (``h5py.string_dtype('utf-8')``).
    ``attrs`` are extra string root attributes (keys other than ``revision``, ``gwenlake_format``,
    ``columns``).

    The file is written to a temporary file in the target directory, flushed and fsynced, then
    renamed over ``<data_root>/<group>/<name>.h5`` and the directory fsynced: readers see either
    the old file or the new one, never a partial one.

    Raises :class:`DataError` for a bad name, no columns, ragged columns (naming each column and
    its row count), unsupported dtypes, non-string objects or bad attributes.
    """
    path = dataset_path(data_root, name)
    norm, _ = _normalize_columns(columns)
    for col, arr in norm.items():  # a NaN label or feature makes every loss over it NaN: say so now
        if arr.dtype.kind in "fc":
            bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
            if bad:
                log.warning("dataset %s: column %r holds %d NaN or infinite value(s) in %d row(s); a loss over "
                               "them is NaN (the run stops there): drop or impute them before training", name, col,
                               bad, len(arr))
    user_attrs: dict[str, str] = {}
    for key, value in (attrs or {}).items():
        if not isinstance(key, str) or key in RESERVED_ATTRS:
            raise DataError(
                f"dataset {name}: attribute {key!r} is reserved or not a string; reserved keys are"
                f" {', '.join(RESERVED_ATTRS)}"
            )
        if not isinstance(value, str):
            raise DataError(
                f"dataset {name}: attribute {key!r} must be a str, got {type(value).__name__};"
                " convert it (e.g. json.dumps) before writing"
            )
        user_attrs[key] = value
    revision = content_revision(norm)

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = mkstemp(path.parent, prefix=f".{path.stem}.", suffix=".h5.tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        # locking=False: file locks fail on many NFS mounts, and nobody else opens the temp file.
        with h5py.File(tmp, "w", locking=False) as f:
            for col, arr in norm.items():
                if arr.dtype.kind == "O":
                    f.create_dataset(col, data=arr, dtype=h5py.string_dtype("utf-8"))
                else:
                    f.create_dataset(col, data=arr)
            f.attrs["revision"] = revision
            f.attrs["gwenlake_format"] = FORMAT_VERSION
            f.attrs["columns"] = json.dumps(list(norm))
            for key, value in user_attrs.items():
                f.attrs[key] = value
            f.flush()
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir_quietly(path.parent)
    return revision


def _fsync_dir_quietly(directory: Path) -> None:
    # Some platforms/filesystems do not allow opening or fsyncing directories; the rename stands anyway.
    try:
        fsync_dir(directory)
    except OSError:
        pass
