"""On-disk format constants and the validation/normalization of columns before they are written or hashed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from gwenlake_hpc.base.errors import DataError

#: Version of the on-disk layout, stored in the ``gwenlake_format`` root attribute.
FORMAT_VERSION = 1
#: Root attributes written by this package; user attributes may not use these keys.
RESERVED_ATTRS = ("revision", "gwenlake_format", "columns")
#: Dtype token of string columns in :attr:`Dataset.schema` and in the revision hash.
STRING_DTYPE = "str"

#: What a message about a malformed dataset file suggests.
IMPORT_HINT = "rewrite it with `python -m gwenlake_hpc data import`"


def _check_column_name(col: Any) -> str:
    if not isinstance(col, str) or not col or "/" in col or "\0" in col or col in (".", ".."):
        raise DataError(
            f"bad column name {col!r}: column names must be non-empty strings without '/' or NUL"
            " and not '.' or '..'; rename the column"
        )
    return col


def normalize_strings(col: str, arr: np.ndarray) -> np.ndarray:
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
        return normalize_strings(col, arr)
    raise DataError(
        f"column {col!r} has dtype {arr.dtype}, which datasets do not store; convert it to a"
        " number (e.g. int64 epoch seconds for datetimes) or to str"
    )


def normalize_columns(columns: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
    """Validate and normalize columns (name -> array-like, one row per element of the first axis) for a
    write: numeric columns as numpy arrays, strings as object arrays of ``str``; returns ``(columns, rows)``.

    Raises:
        DataError: no column, a bad column name or dtype, or columns of different lengths.
    """
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
