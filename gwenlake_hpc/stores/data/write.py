"""Writing datasets: validated, hashed, written to a temporary file and renamed into place atomically.

:func:`write_dataset` takes every column in memory; :class:`DatasetWriter` (``Catalog.writer``) takes
them in chunks of rows, so a dataset larger than memory can be written."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any
from pathlib import Path

import h5py
import numpy as np

from gwenlake_hpc.base.errors import DataError
from gwenlake_hpc.base.fsutil import mkstemp, publish

from .format import FORMAT_VERSION, RESERVED_ATTRS, STRING_DTYPE, normalize_columns
from .names import dataset_path
from .revision import content_revision, stored_revision

log = logging.getLogger("gwenlake_hpc.data.write")  # a name users filter on: kept when the module moved

#: Some shared file systems refuse to open a directory; the file itself is fsynced before the rename anyway.
_BEST_EFFORT_DIR = True


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
    norm, _ = normalize_columns(columns)
    for col, arr in norm.items():
        _warn_nonfinite(name, col, _count_nonfinite(arr), len(arr))
    user_attrs = _check_attrs(name, attrs)
    revision = content_revision(norm)

    tmp = _temp_file(path)
    try:
        # locking=False: file locks fail on many NFS mounts, and nobody else opens the temp file.
        with h5py.File(tmp, "w", locking=False) as f:
            for col, arr in norm.items():
                if arr.dtype.kind == "O":
                    f.create_dataset(col, data=arr, dtype=h5py.string_dtype("utf-8"))
                else:
                    f.create_dataset(col, data=arr)
            _write_root_attrs(f, revision, list(norm), user_attrs)
        publish(tmp, path, best_effort_dir=_BEST_EFFORT_DIR)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return revision


class DatasetWriter:
    """Streaming writer of dataset ``name``: append chunks of rows, publish atomically at the end.

    Use as a context manager (``with catalog.writer("crm.big") as w: w.append({...})``): leaving
    the block normally publishes the dataset (:meth:`close`), leaving it with an exception
    discards it (:meth:`abort`). Each :meth:`append` takes ``{column: array}`` like
    :func:`write_dataset`, all arrays with the same number of rows; the first chunk fixes the
    columns, their order, dtypes and shapes after rows, and every later chunk must match them.
    Rows are written to a temporary file in the target directory as they come (HDF5 chunks of
    about 1 MiB), so memory is one chunk of input, whatever the dataset's size.

    The revision is the one :func:`write_dataset` gives for the concatenated chunks. It hashes
    each column whole, its shape (the final row count) first, so it cannot be computed while
    chunks of all columns interleave: :meth:`close` reads the temporary file back column by
    column, 65536 rows at a time (from the page cache when the file fits there), before the
    rename. Publication is the same as :func:`write_dataset`: fsync, rename over
    ``<data_root>/<group>/<name>.h5``, fsync of the directory. A process killed before that
    leaves the previous version (if any) in place and at most a hidden ``.<name>.*.h5.tmp`` file,
    which the catalog does not list.

    Attributes: ``path`` (the final path), ``rows`` (rows appended so far), ``revision`` (hex
    sha256, set by :meth:`close`).

    Raises :class:`DataError` for a bad name or attributes (at once), a bad chunk (as
    :func:`write_dataset`, or columns/dtypes/shapes differing from the first chunk, naming the
    column), and at :meth:`close` when nothing was appended.
    """

    #: Target size of one HDF5 chunk (the unit of storage and of h5py's chunk cache).
    CHUNK_BYTES = 1 << 20

    def __init__(
        self, data_root: str | os.PathLike[str], name: str, attrs: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.path = dataset_path(data_root, name)
        self._attrs = _check_attrs(name, attrs)
        self.rows = 0
        self.revision: str | None = None
        self._schema: dict[str, tuple[str, tuple[int, ...]]] | None = None
        self._nonfinite: dict[str, int] = {}
        self._tmp = _temp_file(self.path)
        try:
            self._file: h5py.File | None = h5py.File(self._tmp, "w", locking=False)
        except BaseException:
            self._tmp.unlink(missing_ok=True)
            raise

    def append(self, columns: Mapping[str, Any]) -> None:
        """Append the rows of ``columns`` (``{column: array [n, ...]}``, ``n`` may be 0)."""
        if self._file is None:
            raise DataError(f"dataset {self.name}: the writer is closed; open a new one with Catalog.writer")
        norm, n = normalize_columns(columns)
        schema = {c: (STRING_DTYPE if a.dtype.kind == "O" else a.dtype.str, tuple(a.shape[1:])) for c, a in norm.items()}
        if self._schema is None:
            self._create(norm, schema)
        elif schema != self._schema:
            raise DataError(f"dataset {self.name}: chunk at row {self.rows} differs from the first chunk: "
                            f"{_schema_difference(self._schema, schema)}; give every chunk the same columns, "
                            "in the same order, with the same dtypes and shapes")
        try:
            for col, arr in norm.items():
                ds = self._file[col]
                ds.resize(self.rows + n, axis=0)
                ds[self.rows:] = arr
                self._nonfinite[col] = self._nonfinite.get(col, 0) + _count_nonfinite(arr)
        except BaseException:
            self.abort()  # a column is now longer than the others: the file cannot be finished
            raise
        self.rows += n

    def _create(self, norm: Mapping[str, np.ndarray], schema: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        assert self._file is not None
        for col, arr in norm.items():
            string = arr.dtype.kind == "O"
            inner = arr.shape[1:]
            row_bytes = max(1, (16 if string else arr.dtype.itemsize) * int(np.prod(inner, dtype=np.int64)))
            chunk_rows = max(1, self.CHUNK_BYTES // row_bytes)
            self._file.create_dataset(
                col, shape=(0, *inner), maxshape=(None, *inner), chunks=(chunk_rows, *inner),
                dtype=h5py.string_dtype("utf-8") if string else arr.dtype,
            )
        self._schema = schema

    def _read(self, col: str, start: int, stop: int) -> np.ndarray:
        assert self._file is not None and self._schema is not None
        ds = self._file[col]
        return ds.asstr()[start:stop] if self._schema[col][0] == STRING_DTYPE else ds[start:stop]

    def close(self) -> str:
        """Hash, publish atomically and return the revision; idempotent after success.

        Raises :class:`DataError` when nothing was appended (the temporary file is removed).
        """
        if self.revision is not None:
            return self.revision
        if self._file is None:
            raise DataError(f"dataset {self.name}: the writer was aborted; nothing was published")
        if self._schema is None:
            self.abort()
            raise DataError(f"dataset {self.name}: a dataset needs at least one column: append a chunk "
                            "{column: array} before closing the writer")
        try:
            for col in self._schema:
                _warn_nonfinite(self.name, col, self._nonfinite.get(col, 0), self.rows)
            revision = stored_revision(self._schema, self.rows, self._read)
            _write_root_attrs(self._file, revision, list(self._schema), self._attrs)
            self._file.close()
            self._file = None
            publish(self._tmp, self.path, best_effort_dir=_BEST_EFFORT_DIR)
        except BaseException:
            self.abort()
            raise
        self.revision = revision
        return revision

    def abort(self) -> None:
        """Discard what was written: the temporary file is closed and removed; the old version stays."""
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._file = None
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __repr__(self) -> str:
        return f"DatasetWriter({self.name!r}, rows={self.rows}, path={str(self.path)!r})"


# --------------------------------------------------------------------------- helpers


def _count_nonfinite(arr: np.ndarray) -> int:
    if arr.dtype.kind not in "fc":
        return 0
    return int(arr.size - np.count_nonzero(np.isfinite(arr)))


def _warn_nonfinite(name: str, col: str, bad: int, rows: int) -> None:
    # A NaN label or feature makes every loss over it NaN: say so at write time.
    if bad:
        log.warning("dataset %s: column %r holds %d NaN or infinite value(s) in %d row(s); a loss over "
                    "them is NaN (the run stops there): drop or impute them before training", name, col, bad, rows)


def _check_attrs(name: str, attrs: Mapping[str, str] | None) -> dict[str, str]:
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
    return user_attrs


def _schema_difference(want: Mapping[str, Any], got: Mapping[str, Any]) -> str:
    if list(want) != list(got):
        return f"columns {list(got)} instead of {list(want)}"
    return "; ".join(f"column {c!r} is {got[c][0]} {list(got[c][1])} instead of {want[c][0]} {list(want[c][1])}"
                     for c in want if want[c] != got[c])


def _temp_file(path: Path) -> Path:
    """A new empty temporary file next to ``path``, hidden from the catalog (``.<name>.*.h5.tmp``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = mkstemp(path.parent, prefix=f".{path.stem}.", suffix=".h5.tmp")
    os.close(fd)
    return Path(tmp_name)


def _write_root_attrs(f: h5py.File, revision: str, columns: list[str], user_attrs: Mapping[str, str]) -> None:
    f.attrs["revision"] = revision
    f.attrs["gwenlake_format"] = FORMAT_VERSION
    f.attrs["columns"] = json.dumps(columns)
    for key, value in user_attrs.items():
        f.attrs[key] = value
    f.flush()

