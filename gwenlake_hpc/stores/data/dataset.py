"""Reading a dataset: :class:`Dataset`, a read-only view of one HDF5 file (metadata, slices, batches)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gwenlake_hpc.base.errors import ConfigError, DataError

from .batches import Batches
from .format import FORMAT_VERSION, IMPORT_HINT, RESERVED_ATTRS, STRING_DTYPE
from .revision import stored_revision

log = logging.getLogger("gwenlake_hpc.data.dataset")  # a name users filter on: kept when the module moved


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
                f"dataset {self.name}: {self.path} is not a readable HDF5 file ({err}); {IMPORT_HINT}"
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
                raise DataError(f"{where}: attribute 'columns' is not a JSON list ({err}); {IMPORT_HINT}") from None
            absent = [c for c in columns if not isinstance(f.get(c), h5py.Dataset)]
            if absent:
                raise DataError(f"{where}: columns {absent} are listed but missing from the file; {IMPORT_HINT}")
        else:
            columns = [k for k in f.keys() if isinstance(f.get(k), h5py.Dataset)]
        if not columns:
            raise DataError(f"{where}: {self.path} has no columns (no HDF5 dataset at its root); {IMPORT_HINT}")

        self.columns: list[str] = columns
        self._ds: dict[str, h5py.Dataset] = {}
        self._is_string: dict[str, bool] = {}
        self.schema: dict[str, tuple[str, tuple[int, ...]]] = {}
        rows: int | None = None
        for col in columns:
            ds = f[col]
            if ds.ndim == 0:
                raise DataError(f"{where}: column {col!r} is a scalar, not a column of rows; {IMPORT_HINT}")
            is_string = h5py.check_string_dtype(ds.dtype) is not None
            if not is_string and ds.dtype.kind not in "biufc":
                raise DataError(
                    f"{where}: column {col!r} has dtype {ds.dtype}, which cannot become a tensor;"
                    f" {IMPORT_HINT}"
                )
            n = int(ds.shape[0])
            if rows is None:
                rows = n
            elif n != rows:
                raise DataError(
                    f"{where}: column {col!r} has {n} rows but {columns[0]!r} has {rows}; {IMPORT_HINT}"
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
        return stored_revision({c: self.schema[c] for c in self.columns}, self.rows, self._read_slice)

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
        prefetch: bool | None = None,
    ) -> Batches:
        """A resumable plan of batches over this dataset; see :class:`Batches`.

        ``prefetch`` reads the next window in a background thread while the current one is
        consumed (same batches, same order); None (the default) means on unless the environment
        sets ``GWENLAKE_PREFETCH=0``.

        Raises :class:`DataError` for an unknown column (listing the available ones) and
        :class:`ConfigError` when ``batch_size``, ``block_rows`` or ``buffer_blocks`` is not an
        integer >= 1, or ``GWENLAKE_PREFETCH`` is not one of 1/0/true/false/yes/no/on/off.
        """
        return Batches(
            self, batch_size, shuffle=shuffle, drop_last=drop_last, columns=columns,
            block_rows=block_rows, buffer_blocks=buffer_blocks, prefetch=prefetch,
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
