"""Dataset catalog: named HDF5 column files under ``data_root``, with resumable shuffled batches.

A dataset is named ``group.name`` and lives at ``<data_root>/<group>/<name>.h5``. The file holds
one HDF5 dataset per column at its root, all with the same first dimension (rows); a column may
have more dimensions (``features`` of shape ``[rows, d]``). Root attributes:

* ``revision``: hex sha256 of the content (see :func:`content_revision`), computed at write time;
* ``gwenlake_format``: ``1``;
* ``columns``: the column order, as a JSON list;
* any user attributes, as strings.

Reading never loads the whole file: :meth:`Dataset.batches` streams windows of contiguous blocks
(see :class:`Batches`), and an epoch can restart at any batch without reading the skipped ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from gwenlake_hpc.errors import ConfigError, DataError
from gwenlake_hpc.fsutil import fsync_dir, mkstemp
from gwenlake_hpc.names import split_name

log = logging.getLogger(__name__)

#: Version of the on-disk layout, stored in the ``gwenlake_format`` root attribute.
FORMAT_VERSION = 1
#: Root attributes written by this module; user attributes may not use these keys.
RESERVED_ATTRS = ("revision", "gwenlake_format", "columns")
#: Dtype token of string columns in :attr:`Dataset.schema` and in the revision hash.
STRING_DTYPE = "str"

_IMPORT_HINT = "rewrite it with `python -m gwenlake_hpc data import`"
# Rows per h5py read when hashing a file that lacks its revision attribute.
_HASH_CHUNK_ROWS = 65536


# --------------------------------------------------------------------------- names and paths


def _split_name(name: str) -> tuple[str, str]:
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
    group, short = _split_name(name)
    return Path(data_root).expanduser() / group / f"{short}.h5"


# --------------------------------------------------------------------------- content hashing


def _check_column_name(col: Any) -> str:
    if not isinstance(col, str) or not col or "/" in col or "\0" in col or col in (".", ".."):
        raise DataError(
            f"bad column name {col!r}: column names must be non-empty strings without '/' or NUL"
            " and not '.' or '..'; rename the column"
        )
    return col


def _normalize_strings(col: str, arr: np.ndarray) -> np.ndarray:
    """Object array of ``str`` with the shape of ``arr``; bytes are decoded as UTF-8."""
    out = np.empty(arr.shape, dtype=object)
    flat_in, flat_out = arr.reshape(-1), out.reshape(-1)
    for i, value in enumerate(flat_in):
        if isinstance(value, str):
            flat_out[i] = str(value)
        elif isinstance(value, (bytes, np.bytes_)):
            try:
                flat_out[i] = bytes(value).decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"column {col!r}: element {i} is bytes that are not valid UTF-8 ({err});"
                    " decode it to str before writing"
                ) from None
        else:
            raise DataError(
                f"column {col!r}: element {i} is {type(value).__name__} ({value!r}) in a string"
                " column; object columns must hold only str (fill missing values, e.g. with '')"
            )
    return out


def _normalize_column(col: str, value: Any) -> np.ndarray:
    """Little-endian contiguous numeric array, or object array of ``str`` for string columns."""
    arr = np.asarray(value)
    if arr.ndim == 0:
        raise DataError(
            f"column {col!r} is a scalar; every column needs a first dimension of rows"
            " (wrap it as a 1-element array)"
        )
    kind = arr.dtype.kind
    if kind in "biufc":
        # Little-endian on disk so the revision does not depend on the writer's byte order.
        return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    if kind in "USO":
        return _normalize_strings(col, arr)
    raise DataError(
        f"column {col!r} has dtype {arr.dtype}, which datasets do not store; convert it to a"
        " number (e.g. int64 epoch seconds for datetimes) or to str"
    )


def _normalize_columns(columns: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
    """Validate and normalize columns; return ``(columns, rows)``."""
    if not isinstance(columns, Mapping) or not columns:
        raise DataError("a dataset needs at least one column: pass a mapping column name -> array")
    out = {_check_column_name(c): _normalize_column(c, v) for c, v in columns.items()}
    counts = {c: int(a.shape[0]) for c, a in out.items()}
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"{c!r}: {n}" for c, n in counts.items())
        raise DataError(
            f"ragged columns: all columns need the same number of rows, got {listing};"
            " trim or pad them to the same length"
        )
    return out, next(iter(counts.values()))


def _string_bytes(col: str, arr: np.ndarray) -> bytes:
    """Unambiguous encoding of a string array: per element, 8-byte little-endian length + UTF-8."""
    parts = []
    for i, s in enumerate(arr.reshape(-1)):
        try:
            b = s.encode("utf-8")
        except UnicodeEncodeError as err:
            raise DataError(f"column {col!r}: element {i} cannot be encoded as UTF-8 ({err})") from None
        parts.append(len(b).to_bytes(8, "little"))
        parts.append(b)
    return b"".join(parts)


def _hash_header(h: Any, col: str, dtype_token: str, shape: Sequence[int]) -> None:
    # JSON framing keeps (name, dtype, shape) unambiguous; the data length follows from them.
    h.update(json.dumps([col, dtype_token, [int(n) for n in shape]]).encode("utf-8") + b"\n")


def _hash_chunk(h: Any, col: str, arr: np.ndarray, is_string: bool) -> None:
    if is_string:
        h.update(_string_bytes(col, arr))
    else:
        h.update(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).data)


def _new_hash() -> Any:
    h = hashlib.sha256()
    h.update(b"gwenlake-revision-v1\n")
    return h


def content_revision(columns: Mapping[str, np.ndarray]) -> str:
    """Hex sha256 of dataset content, as stored in the ``revision`` attribute.

    Hashes, for each column in mapping order: its name, its dtype (``dtype.str`` of the
    little-endian dtype, or ``"str"`` for string columns), its full shape, then its raw bytes
    (strings as UTF-8, each prefixed with its 8-byte length). Deterministic: the same columns in
    the same order give the same revision on any machine; changing one value changes it.

    Raises :class:`DataError` for ragged columns, unsupported dtypes or non-string objects.
    """
    norm, _ = _normalize_columns(columns)
    h = _new_hash()
    for col, arr in norm.items():
        is_string = arr.dtype.kind == "O"
        _hash_header(h, col, STRING_DTYPE if is_string else arr.dtype.str, arr.shape)
        _hash_chunk(h, col, arr, is_string)
    return h.hexdigest()


# --------------------------------------------------------------------------- writing


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
    fsync_dir(path.parent, best_effort=True)
    return revision


# --------------------------------------------------------------------------- importing


def _series_to_array(source: Path, col: str, series: Any) -> np.ndarray:
    """Convert one pandas column: numbers keep their dtype, bool -> uint8, text -> str objects."""
    import pandas as pd

    dtype = series.dtype
    n_missing = int(series.isna().sum())
    if pd.api.types.is_bool_dtype(dtype):
        if n_missing:
            raise DataError(
                f"{source}: bool column {col!r} has {n_missing} missing values; fill them before import"
            )
        return series.to_numpy(dtype=np.uint8)
    if pd.api.types.is_numeric_dtype(dtype) and not isinstance(dtype, pd.CategoricalDtype):
        np_dtype = np.dtype(getattr(dtype, "numpy_dtype", dtype))
        if n_missing and np_dtype.kind in "iu":
            # Nullable integers (e.g. Parquet Int64 with nulls) cannot hold NaN: widen to float64.
            log.warning(
                "%s: integer column %r has %d missing values; storing it as float64 with NaN",
                source, col, n_missing,
            )
            return series.to_numpy(dtype=np.float64, na_value=np.nan)
        if n_missing:
            return series.to_numpy(dtype=np_dtype, na_value=np.nan)
        return series.to_numpy(dtype=np_dtype)
    if pd.api.types.is_datetime64_any_dtype(dtype) or pd.api.types.is_timedelta64_dtype(dtype):
        raise DataError(
            f"{source}: column {col!r} has dtype {dtype}, which datasets do not store; convert it"
            " to int64 (e.g. epoch seconds) or to str before import"
        )
    values = series.to_numpy(dtype=object)
    if n_missing:
        # Empty CSV cells in text columns are common; an empty string is the usual reading.
        log.warning("%s: string column %r has %d missing values; storing them as ''", source, col, n_missing)
        values[pd.isna(values)] = ""
    return _normalize_strings(col, values)


def import_table(
    source: str | os.PathLike[str],
    data_root: str | os.PathLike[str],
    name: str,
    columns: list[str] | None = None,
) -> str:
    """Import a CSV (``.csv``) or Parquet (``.parquet``/``.pq``) table as dataset ``name``.

    Reads with pandas. Numeric columns keep their dtype (int64, float64, ...); bool columns become
    uint8; nullable integer columns with missing values become float64 with NaN; text columns
    become UTF-8 strings, missing text becoming ``''`` (with a warning). ``columns`` selects and
    orders the columns to import (default: all, in file order). The source path is recorded in
    the ``source`` attribute. Returns the revision, as :func:`write_dataset`.

    Raises :class:`DataError` if ``source`` is missing or unreadable, its extension is not one of
    the above, a requested column is absent (listing the available ones), or a column has an
    unsupported dtype (datetimes: convert first).
    """
    import pandas as pd

    src = Path(source).expanduser()
    _split_name(name)  # Fail on a bad name before reading a large file.
    if not src.is_file():
        raise DataError(f"cannot import {src}: file not found; check the path")
    ext = src.suffix.lower()
    if ext not in (".csv", ".parquet", ".pq"):
        raise DataError(
            f"cannot import {src}: unknown extension {src.suffix!r}; expected .csv, .parquet or .pq"
        )
    try:
        if ext == ".csv":
            available = [str(c) for c in pd.read_csv(src, nrows=0).columns]
        else:
            import pyarrow.parquet as pq

            available = list(pq.read_schema(src).names)
    except Exception as err:  # pandas/pyarrow raise many types for unreadable files
        raise DataError(f"cannot import {src}: not a readable {ext[1:]} file ({err})") from err
    if isinstance(columns, str):
        columns = [columns]
    wanted = list(available) if columns is None else list(columns)
    missing = [c for c in wanted if c not in available]
    if missing:
        raise DataError(
            f"cannot import {src}: unknown column(s) {missing}; available columns: {available}"
        )
    if not wanted:
        raise DataError(f"cannot import {src}: no columns selected; available columns: {available}")
    try:
        if ext == ".csv":
            frame = pd.read_csv(src, usecols=wanted)
            frame.columns = [str(c) for c in frame.columns]
        else:
            frame = pd.read_parquet(src, columns=wanted)
    except Exception as err:
        raise DataError(f"cannot import {src}: failed to read it ({err})") from err
    arrays = {c: _series_to_array(src, c, frame[c]) for c in wanted}
    return write_dataset(data_root, name, arrays, attrs={"source": str(src.resolve())})


# --------------------------------------------------------------------------- reading


def _attr_str(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    return str(value)


class Dataset:
    """Read-only view of one catalog dataset.

    Opens the file with ``h5py.File(path, 'r', locking=False)`` so it works on NFS without file
    locks. Attributes:

    * ``name`` (str): ``group.name``, derived from the path when not given;
    * ``path`` (Path); ``rows`` (int): first dimension shared by all columns;
    * ``columns`` (list[str]): column order (the ``columns`` attribute, else the file's order);
    * ``revision`` (str): hex sha256 content hash; when the file lacks it, it is computed as
      :func:`write_dataset` would (reading the whole file once, in chunks) and a warning logged;
    * ``attrs`` (dict[str, str]): user attributes (without ``revision``, ``gwenlake_format``,
      ``columns``);
    * ``schema``: ``{column: (dtype, shape_after_rows)}``, dtype as ``numpy.dtype.str``
      (e.g. ``'<f4'``) or ``'str'`` for string columns.

    Raises :class:`DataError` when the file is missing, not HDF5, has no columns, has a column
    that is a scalar or of unsupported dtype, or has ragged columns (naming both columns and
    their row counts). Use as a context manager or call :meth:`close`. Not picklable.
    """

    def __init__(self, path: str | os.PathLike[str], name: str | None = None) -> None:
        self.path = Path(path).expanduser()
        self.name = name if name is not None else f"{self.path.parent.name}.{self.path.stem}"
        if not self.path.is_file():
            raise DataError(f"dataset {self.name}: file {self.path} not found")
        try:
            self._file = h5py.File(self.path, "r", locking=False)
        except OSError as err:
            raise DataError(
                f"dataset {self.name}: {self.path} is not a readable HDF5 file ({err}); {_IMPORT_HINT}"
            ) from None
        try:
            self._load_metadata()
        except BaseException:
            self._file.close()
            raise

    def _load_metadata(self) -> None:
        f = self._file
        where = f"dataset {self.name}"
        fmt = f.attrs.get("gwenlake_format")
        if fmt is not None and int(fmt) > FORMAT_VERSION:
            raise DataError(
                f"{where}: gwenlake_format {int(fmt)} is newer than this gwenlake_hpc supports"
                f" ({FORMAT_VERSION}); upgrade gwenlake_hpc"
            )
        if "columns" in f.attrs:
            try:
                columns = [str(c) for c in json.loads(_attr_str(f.attrs["columns"]))]
            except (ValueError, TypeError) as err:
                raise DataError(f"{where}: attribute 'columns' is not a JSON list ({err}); {_IMPORT_HINT}") from None
            absent = [c for c in columns if not isinstance(f.get(c), h5py.Dataset)]
            if absent:
                raise DataError(f"{where}: columns {absent} are listed but missing from the file; {_IMPORT_HINT}")
        else:
            columns = [k for k in f.keys() if isinstance(f.get(k), h5py.Dataset)]
        if not columns:
            raise DataError(f"{where}: {self.path} has no columns (no HDF5 dataset at its root); {_IMPORT_HINT}")

        self.columns: list[str] = columns
        self._ds: dict[str, h5py.Dataset] = {}
        self._is_string: dict[str, bool] = {}
        self.schema: dict[str, tuple[str, tuple[int, ...]]] = {}
        rows: int | None = None
        for col in columns:
            ds = f[col]
            if ds.ndim == 0:
                raise DataError(f"{where}: column {col!r} is a scalar, not a column of rows; {_IMPORT_HINT}")
            is_string = h5py.check_string_dtype(ds.dtype) is not None
            if not is_string and ds.dtype.kind not in "biufc":
                raise DataError(
                    f"{where}: column {col!r} has dtype {ds.dtype}, which cannot become a tensor;"
                    f" {_IMPORT_HINT}"
                )
            n = int(ds.shape[0])
            if rows is None:
                rows = n
            elif n != rows:
                raise DataError(
                    f"{where}: column {col!r} has {n} rows but {columns[0]!r} has {rows}; {_IMPORT_HINT}"
                )
            self._ds[col] = ds
            self._is_string[col] = is_string
            self.schema[col] = (STRING_DTYPE if is_string else ds.dtype.str, tuple(int(d) for d in ds.shape[1:]))
        self.rows: int = int(rows or 0)
        self.attrs: dict[str, str] = {
            k: _attr_str(v) for k, v in f.attrs.items() if k not in RESERVED_ATTRS
        }
        if "revision" in f.attrs:
            self.revision: str = _attr_str(f.attrs["revision"])
        else:
            self.revision = self._compute_revision()
            log.warning(
                "dataset %s: %s has no 'revision' attribute; computed %s from its content."
                " Rewrite it with `python -m gwenlake_hpc data import` to store it",
                self.name, self.path, self.revision,
            )

    def _compute_revision(self) -> str:
        h = _new_hash()
        for col in self.columns:
            dtype_token, inner = self.schema[col]
            _hash_header(h, col, dtype_token, (self.rows, *inner))
            for a in range(0, self.rows, _HASH_CHUNK_ROWS):
                chunk = self._read_slice(col, a, min(a + _HASH_CHUNK_ROWS, self.rows))
                _hash_chunk(h, col, chunk, self._is_string[col])
        return h.hexdigest()

    def _check_columns(self, columns: Sequence[str] | str | None) -> list[str]:
        if columns is None:
            return list(self.columns)
        if isinstance(columns, str):
            columns = [columns]
        unknown = [c for c in columns if c not in self._ds]
        if unknown:
            raise DataError(
                f"dataset {self.name}: unknown column(s) {unknown}; available columns: {self.columns}"
            )
        if not columns:
            raise ConfigError(f"dataset {self.name}: columns is empty; pick some of {self.columns}")
        return list(columns)

    def _empty(self, col: str, n: int) -> np.ndarray:
        """Uninitialized buffer for ``n`` rows of ``col`` (native byte order, object for strings)."""
        ds = self._ds[col]
        dtype = np.dtype(object) if self._is_string[col] else ds.dtype.newbyteorder("=")
        return np.empty((n, *ds.shape[1:]), dtype=dtype)

    def _read_slice(self, col: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Read rows ``[start, stop)`` of ``col`` with one contiguous h5py read.

        Every read of the file goes through here (tests count rows by wrapping it). ``out``, when
        given, must be a C-contiguous buffer of ``stop - start`` rows from :meth:`_empty`; it is
        filled and returned. Strings come back as an object array of ``str``.
        """
        if out is None:
            out = self._empty(col, stop - start)
        if stop <= start:
            return out
        ds = self._ds[col]
        if self._is_string[col]:
            out[...] = ds.asstr()[start:stop]
        else:
            ds.read_direct(out, np.s_[start:stop])
        return out

    def read(
        self, columns: Sequence[str] | None = None, start: int = 0, stop: int | None = None
    ) -> dict[str, np.ndarray]:
        """Read rows ``[start, stop)`` (Python slice rules, step 1) of ``columns`` (default all).

        Returns ``{column: array}`` with shape ``[n, *shape_after_rows]``, the stored dtype in
        native byte order, strings as object arrays of ``str``. Raises :class:`DataError` for an
        unknown column.
        """
        cols = self._check_columns(columns)
        a, b, _ = slice(start, stop).indices(self.rows)
        b = max(a, b)
        return {c: self._read_slice(c, a, b) for c in cols}

    def batches(
        self,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
        columns: list[str] | None = None,
        *,
        block_rows: int = 1024,
        buffer_blocks: int = 64,
    ) -> Batches:
        """A resumable plan of batches over this dataset; see :class:`Batches`.

        Raises :class:`DataError` for an unknown column (listing the available ones) and
        :class:`ConfigError` when ``batch_size``, ``block_rows`` or ``buffer_blocks`` is not an
        integer >= 1.
        """
        return Batches(
            self, batch_size, shuffle=shuffle, drop_last=drop_last, columns=columns,
            block_rows=block_rows, buffer_blocks=buffer_blocks,
        )

    def close(self) -> None:
        """Close the HDF5 file; further reads fail."""
        self._file.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return self.rows

    def __repr__(self) -> str:
        return f"Dataset({self.name!r}, rows={self.rows}, columns={self.columns}, revision={self.revision[:12]})"

    def __getstate__(self) -> None:
        raise TypeError("Dataset holds an open HDF5 file and is not picklable; pass its path and reopen it")


# --------------------------------------------------------------------------- batches


def _positive_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{field} must be an integer >= 1, got {value!r}")
    return int(value)


def _non_negative_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"{field} must be an integer >= 0, got {value!r}")
    return int(value)


class _Plan:
    """Block order and window layout of one epoch (no data)."""

    def __init__(self, order: np.ndarray, window_sizes: np.ndarray, buffer_blocks: int) -> None:
        self.order = order  # permuted block ids
        self.window_sizes = window_sizes  # rows per window
        self.offsets = np.concatenate([[0], np.cumsum(window_sizes)]).astype(np.int64)
        self.buffer_blocks = buffer_blocks

    def window_blocks(self, w: int) -> np.ndarray:
        return self.order[w * self.buffer_blocks : (w + 1) * self.buffer_blocks]


class Batches:
    """A resumable, streamed plan of batches over a :class:`Dataset`.

    Attributes: ``dataset``, ``batch_size``, ``shuffle``, ``drop_last``, ``columns`` (list),
    ``block_rows``, ``buffer_blocks``. ``len(batches)`` is the number of batches per epoch:
    ``ceil(rows / batch_size)``, or ``floor`` with ``drop_last``.

    Shuffle (random access to scattered rows is very slow in HDF5, so it is done by blocks):

    1. rows are split into contiguous blocks of ``block_rows`` rows (the last may be shorter);
    2. blocks are permuted with ``np.random.default_rng([seed, epoch])``;
    3. the permuted blocks are grouped into consecutive windows of ``buffer_blocks`` blocks;
    4. each window is read block by block with contiguous reads, and its rows are permuted with
       ``np.random.default_rng([seed, epoch, window_index])``;
    5. the epoch's row order is the concatenation of the windows; batch ``p`` covers positions
       ``[p * batch_size, min((p + 1) * batch_size, rows))`` and may straddle two windows.

    So the order is a pure function of ``(seed, epoch)``, but it is not a uniform permutation:
    rows of the same block always land in the same window, hence within ``window`` positions of
    each other. When ``rows <= block_rows * buffer_blocks`` there is one window and the shuffle is
    a full uniform permutation. With ``shuffle=False`` rows come in file order, read in windows
    of contiguous rows.

    Memory: at most one window (``block_rows * buffer_blocks`` rows of the selected columns) plus
    one batch is held. Yielded batches are fresh arrays that do not pin the window.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
        columns: list[str] | None = None,
        *,
        block_rows: int = 1024,
        buffer_blocks: int = 64,
    ) -> None:
        self.dataset = dataset
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.block_rows = _positive_int(block_rows, "block_rows")
        self.buffer_blocks = _positive_int(buffer_blocks, "buffer_blocks")
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.columns = dataset._check_columns(columns)

    def __len__(self) -> int:
        rows = self.dataset.rows
        return rows // self.batch_size if self.drop_last else math.ceil(rows / self.batch_size)

    @property
    def window_rows(self) -> int:
        """Rows in a full window: ``block_rows * buffer_blocks``."""
        return self.block_rows * self.buffer_blocks

    def _plan(self, epoch: int, seed: int) -> _Plan:
        rows, br, wb = self.dataset.rows, self.block_rows, self.buffer_blocks
        n_blocks = math.ceil(rows / br)
        if self.shuffle:
            order = np.random.default_rng([seed, epoch]).permutation(n_blocks)
        else:
            order = np.arange(n_blocks)
        sizes = np.full(n_blocks, br, dtype=np.int64)
        if n_blocks:
            sizes[-1] = rows - (n_blocks - 1) * br
            window_sizes = np.add.reduceat(sizes[order], np.arange(0, n_blocks, wb))
        else:
            window_sizes = np.zeros(0, dtype=np.int64)
        return _Plan(order, window_sizes, wb)

    def _load_window(self, plan: _Plan, w: int) -> dict[str, np.ndarray]:
        """Read window ``w`` in plan order; adjacent blocks are merged into one read."""
        ds, br, rows = self.dataset, self.block_rows, self.dataset.rows
        blocks = plan.window_blocks(w)
        runs: list[tuple[int, int]] = []  # [start_row, stop_row) in file
        for b in blocks.tolist():
            a, z = b * br, min((b + 1) * br, rows)
            if runs and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], z)
            else:
                runs.append((a, z))
        size = int(plan.window_sizes[w])
        out = {}
        for col in self.columns:
            buf = ds._empty(col, size)
            o = 0
            for a, z in runs:
                ds._read_slice(col, a, z, out=buf[o : o + z - a])
                o += z - a
            out[col] = buf
        return out

    def epoch(self, epoch: int, start: int = 0, seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Yield batches ``start .. len(self) - 1`` of ``epoch`` in the order fixed by ``(seed, epoch)``.

        Each batch is ``{column: tensor}`` with first dimension the batch rows (``batch_size``,
        less for a last partial batch); numeric columns are ``torch.from_numpy`` of the stored
        dtype, string columns stay numpy object arrays of ``str``. Starting at ``start`` does not
        read the rows of the skipped batches: the window holding position ``start * batch_size``
        is found from the window sizes and earlier windows are never read, so the cost of the
        first batch does not depend on ``start``.

        Raises :class:`ConfigError` if ``epoch`` or ``seed`` is not an integer >= 0, or ``start``
        is not in ``[0, len(self)]`` (``start == len(self)`` yields nothing).
        """
        epoch = _non_negative_int(epoch, "epoch")
        seed = _non_negative_int(seed, "seed")
        start = _non_negative_int(start, "start")
        n_batches = len(self)
        if start > n_batches:
            raise ConfigError(
                f"start={start} is past the end of the epoch: dataset {self.dataset.name} has"
                f" {n_batches} batches of {self.batch_size}"
            )
        return self._iterate(epoch, start, seed, n_batches)

    def _iterate(self, epoch: int, start: int, seed: int, n_batches: int) -> Iterator[dict[str, Any]]:
        if start >= n_batches:
            return
        bs = self.batch_size
        end = n_batches * bs if self.drop_last else self.dataset.rows  # positions used this epoch
        plan = self._plan(epoch, seed)
        pos = start * bs
        w = int(np.searchsorted(plan.offsets, pos, side="right")) - 1
        batch = start
        need = min(bs, end - pos)
        pieces: list[dict[str, np.ndarray]] = []
        while batch < n_batches:
            window: dict[str, np.ndarray] | None = self._load_window(plan, w)
            perm = (
                np.random.default_rng([seed, epoch, w]).permutation(int(plan.window_sizes[w]))
                if self.shuffle
                else None
            )
            local = pos - int(plan.offsets[w])
            size = int(plan.window_sizes[w])
            while local < size and batch < n_batches:
                take = min(need, size - local)
                if perm is None:
                    pieces.append({c: a[local : local + take].copy() for c, a in window.items()})  # type: ignore[union-attr]
                else:
                    idx = perm[local : local + take]
                    pieces.append({c: a[idx] for c, a in window.items()})  # type: ignore[union-attr]
                local += take
                pos += take
                need -= take
                if need == 0:
                    yield self._assemble(pieces)
                    pieces = []
                    batch += 1
                    need = min(bs, end - pos)
            # Drop this window before reading the next so at most one is held.
            window = perm = None
            w += 1

    def _assemble(self, pieces: list[dict[str, np.ndarray]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for col in self.columns:
            arr = pieces[0][col] if len(pieces) == 1 else np.concatenate([p[col] for p in pieces])
            out[col] = arr if self.dataset._is_string[col] else torch.from_numpy(arr)
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.epoch(0)

    def __repr__(self) -> str:
        return (
            f"Batches({self.dataset.name!r}, batch_size={self.batch_size}, shuffle={self.shuffle},"
            f" drop_last={self.drop_last}, columns={self.columns}, block_rows={self.block_rows},"
            f" buffer_blocks={self.buffer_blocks})"
        )


# --------------------------------------------------------------------------- catalog


class Catalog:
    """Maps dataset names (``group.name``) to HDF5 files ``<data_root>/<group>/<name>.h5``."""

    def __init__(self, data_root: str | os.PathLike[str]) -> None:
        self.data_root = Path(data_root).expanduser()

    def path(self, name: str) -> Path:
        """File path of ``name`` (may not exist). Raises :class:`DataError` for a bad name."""
        return dataset_path(self.data_root, name)

    def exists(self, name: str) -> bool:
        """Whether the file of ``name`` exists. Raises :class:`DataError` for a bad name."""
        return self.path(name).is_file()

    def names(self) -> list[str]:
        """Sorted names of the datasets present under ``data_root`` (files matching the layout)."""
        if not self.data_root.is_dir():
            return []
        found = []
        for p in self.data_root.glob("*/*.h5"):
            name = f"{p.parent.name}.{p.stem}"
            if split_name(name) is not None and p.is_file():
                found.append(name)
        return sorted(found)

    def open(self, name: str) -> Dataset:
        """Open dataset ``name`` read-only.

        Raises :class:`DataError` if the name is malformed, the file is missing (giving the
        expected path and the import command), or the file is malformed (see :class:`Dataset`).
        """
        path = self.path(name)
        if not path.is_file():
            raise DataError(
                f"dataset {name!r} not found: expected {path}. Create it with"
                f" `python -m gwenlake_hpc data import FILE {name}` (paths.data_root={self.data_root})"
            )
        return Dataset(path, name=name)

    def write(self, name: str, columns: Mapping[str, np.ndarray], attrs: Mapping[str, str] | None = None) -> str:
        """Write dataset ``name`` atomically; return its revision. See :func:`write_dataset`."""
        return write_dataset(self.data_root, name, columns, attrs)

    def import_table(self, source: str | os.PathLike[str], name: str, columns: list[str] | None = None) -> str:
        """Import a CSV/Parquet file as ``name``; return its revision. See :func:`import_table`."""
        return import_table(source, self.data_root, name, columns)

    def __repr__(self) -> str:
        return f"Catalog({str(self.data_root)!r})"
