"""Importing CSV and Parquet tables into the catalog, in chunks of rows (pandas/pyarrow are imported on use).

A table is read twice, a chunk at a time: the first pass finds each column's dtype over the whole file
(a chunk alone can mislead: integers in one chunk, a missing value or text in a later one), the second
converts each chunk to it and appends it to a :class:`~gwenlake_hpc.stores.data.write.DatasetWriter`. Memory is
one chunk, whatever the file's size."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import numpy as np

from gwenlake_hpc.base.errors import DataError

from .format import normalize_strings
from .names import dataset_name_parts
from .write import DatasetWriter

log = logging.getLogger("gwenlake_hpc.data.tables")  # a name users filter on: kept when the module moved


#: Rows per chunk read from a CSV/Parquet file by :func:`import_table`.
IMPORT_CHUNK_ROWS = 65536


def _chunk_dtype(source: Path, col: str, series: Any) -> tuple[np.dtype | None, int, bool]:
    """How one chunk of a pandas column would be stored: ``(dtype or None for strings, missing, widened)``.

    Numbers keep their dtype, bool becomes uint8, integers with missing values become float64
    (``widened``), anything else is text. Raises :class:`DataError` for missing bools and datetimes.
    """
    import pandas as pd

    dtype = series.dtype
    n_missing = int(series.isna().sum())
    if pd.api.types.is_bool_dtype(dtype):
        if n_missing:
            raise DataError(
                f"{source}: bool column {col!r} has {n_missing} missing values; fill them before import"
            )
        return np.dtype(np.uint8), 0, False
    if pd.api.types.is_numeric_dtype(dtype) and not isinstance(dtype, pd.CategoricalDtype):
        np_dtype = np.dtype(getattr(dtype, "numpy_dtype", dtype))
        if n_missing and np_dtype.kind in "iu":
            # Nullable integers (e.g. Parquet Int64 with nulls) cannot hold NaN: widen to float64.
            return np.dtype(np.float64), n_missing, True
        return np_dtype, n_missing, False
    if pd.api.types.is_datetime64_any_dtype(dtype) or pd.api.types.is_timedelta64_dtype(dtype):
        raise DataError(
            f"{source}: column {col!r} has dtype {dtype}, which datasets do not store; convert it"
            " to int64 (e.g. epoch seconds) or to str before import"
        )
    return None, n_missing, False


def _series_to_array(col: str, series: Any, target: np.dtype | None) -> np.ndarray:
    """Convert one chunk of a pandas column to ``target`` (None: UTF-8 strings, missing text as '')."""
    import pandas as pd

    if target is None:
        values = series.to_numpy(dtype=object)
        # Empty CSV cells in text columns are common; an empty string is the usual reading.
        values[pd.isna(values)] = ""
        return normalize_strings(col, values)
    if series.isna().any():
        return series.to_numpy(dtype=target, na_value=np.nan)
    return series.to_numpy(dtype=target)


def _chunks(src: Path, ext: str, wanted: list[str], chunk_rows: int, text: list[str]) -> Iterator[Any]:
    """DataFrames of at most ``chunk_rows`` rows of ``wanted``, at least one (empty for an empty table).

    CSV columns named in ``text`` are read as text, keeping each cell as written (``007``, ``1.50``).
    """
    import pandas as pd

    seen = False
    if ext == ".csv":
        reader = pd.read_csv(src, usecols=wanted, chunksize=chunk_rows, dtype={c: str for c in text})
        with reader:
            for frame in reader:
                frame.columns = [str(c) for c in frame.columns]
                seen = True
                yield frame
        if not seen:
            yield pd.read_csv(src, usecols=wanted, nrows=0)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        with pq.ParquetFile(src) as pf:
            for batch in pf.iter_batches(batch_size=chunk_rows, columns=wanted):
                seen = True
                yield pa.Table.from_batches([batch]).to_pandas()
            if not seen:
                yield pf.read(columns=wanted).to_pandas()


def import_table(
    source: str | os.PathLike[str],
    data_root: str | os.PathLike[str],
    name: str,
    columns: list[str] | None = None,
    chunk_rows: int = IMPORT_CHUNK_ROWS,
) -> str:
    """Import a CSV (``.csv``) or Parquet (``.parquet``/``.pq``) table as dataset ``name``.

    Reads with pandas (``read_csv(chunksize=)``) or pyarrow (``iter_batches``) ``chunk_rows``
    rows at a time, twice (see the module), and writes through a streaming
    :class:`~gwenlake_hpc.stores.data.write.DatasetWriter`: a file larger than memory imports, and the
    dataset appears atomically at the end. Numeric columns keep their dtype (int64, float64, ...),
    widened to one dtype for the whole file when chunks differ (int64 and float64 -> float64);
    bool columns become uint8; integer columns with missing values become float64 with NaN; text
    columns become UTF-8 strings, missing text becoming ``''`` (with a warning); a CSV column with
    text in any chunk is text in all, each cell as written. ``columns`` selects and orders the
    columns to import (default: all, in file order). The source path is recorded in the
    ``source`` attribute. Returns the revision, equal to :func:`write_dataset`'s of the same
    columns written at once.

    Raises :class:`DataError` if ``source`` is missing or unreadable, its extension is not one of
    the above, a requested column is absent (listing the available ones), or a column has an
    unsupported dtype (datetimes: convert first), or ``chunk_rows`` is not an integer >= 1.
    """
    import pandas as pd

    src = Path(source).expanduser()
    dataset_name_parts(name)  # Fail on a bad name before reading a large file.
    ext = _checked_source(src, chunk_rows)
    wanted = _wanted_columns(src, ext, columns)
    try:
        # Pass 1: the dtype of each column over the whole file.
        target, missing_total, widened = _column_dtypes(src, ext, wanted, chunk_rows)
        text = [c for c in wanted if target[c] is None]
        # Pass 2: each chunk converted to those dtypes, appended as it comes.
        with DatasetWriter(data_root, name, attrs={"source": str(src.resolve())}) as writer:
            for frame in _chunks(src, ext, wanted, chunk_rows, text=text):
                writer.append({c: _series_to_array(c, frame[c], target[c]) for c in wanted})
    except DataError:
        raise
    except (ValueError, OSError, pd.errors.ParserError) as err:  # pandas/pyarrow errors on a bad file
        raise DataError(f"cannot import {src}: failed to read it ({err})") from err
    for c in wanted:
        if widened[c]:
            log.warning("%s: integer column %r has %d missing values; storing it as float64 with NaN",
                        src, c, widened[c])
        elif target[c] is None and missing_total[c]:
            log.warning("%s: string column %r has %d missing values; storing them as ''", src, c, missing_total[c])
    assert writer.revision is not None
    return writer.revision


def _checked_source(src: Path, chunk_rows: Any) -> str:
    """The table's extension (``.csv``, ``.parquet``, ``.pq``), lower case.

    Raises:
        DataError: ``chunk_rows`` not an integer >= 1, no such file, an unknown extension.
    """
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, (int, np.integer)) or chunk_rows < 1:
        raise DataError(f"cannot import {src}: chunk_rows must be an integer >= 1, got {chunk_rows!r}")
    if not src.is_file():
        raise DataError(f"cannot import {src}: file not found; check the path")
    ext = src.suffix.lower()
    if ext not in (".csv", ".parquet", ".pq"):
        raise DataError(
            f"cannot import {src}: unknown extension {src.suffix!r}; expected .csv, .parquet or .pq"
        )
    return ext


def _wanted_columns(src: Path, ext: str, columns: list[str] | str | None) -> list[str]:
    """The columns to import, in order: ``columns`` (one name or a list), else all of the file's.

    Raises:
        DataError: the file's header cannot be read, a column is not in it, or none is selected.
    """
    import pandas as pd

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
    return wanted


def _column_dtypes(src: Path, ext: str, wanted: list[str], chunk_rows: int
                   ) -> tuple[dict[str, np.dtype | None], dict[str, int], dict[str, int]]:
    """The first pass over the table: each column's dtype over all chunks (None: text), its count of missing
    values, and of those that widen an integer column to float64.

    Raises:
        DataError: a column of an unsupported dtype; pandas' and pyarrow's errors on a bad file pass.
    """
    target: dict[str, np.dtype | None] = {}
    missing_total = dict.fromkeys(wanted, 0)
    widened = dict.fromkeys(wanted, 0)
    for i, frame in enumerate(_chunks(src, ext, wanted, chunk_rows, text=[])):
        for c in wanted:
            dtype, n_missing, wide = _chunk_dtype(src, c, frame[c])
            missing_total[c] += n_missing
            widened[c] += n_missing if wide else 0
            if i == 0:
                target[c] = dtype
            elif target[c] is None or dtype is None:
                target[c] = None
            else:
                target[c] = np.result_type(target[c], dtype)
    return target, missing_total, widened
