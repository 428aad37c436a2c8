"""Importing CSV and Parquet tables into the catalog (pandas/pyarrow are imported on use)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from gwenlake_hpc.errors import DataError

from .format import _normalize_strings
from .names import _split_name
from .write import write_dataset

log = logging.getLogger(__name__)


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
