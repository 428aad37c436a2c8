"""Content revision of a dataset: a sha256 over each column's name, dtype, shape and bytes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from gwenlake_hpc.base.errors import DataError

from .format import STRING_DTYPE, normalize_columns

# Rows per h5py read when hashing a file (a file that lacks its revision attribute, or a streamed write).
_HASH_CHUNK_ROWS = 65536


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
    norm, _ = normalize_columns(columns)
    h = _new_hash()
    for col, arr in norm.items():
        is_string = arr.dtype.kind == "O"
        _hash_header(h, col, STRING_DTYPE if is_string else arr.dtype.str, arr.shape)
        _hash_chunk(h, col, arr, is_string)
    return h.hexdigest()


def stored_revision(
    schema: Mapping[str, tuple[str, tuple[int, ...]]], rows: int, read: Callable[[str, int, int], np.ndarray]
) -> str:
    """:func:`content_revision` of columns already stored, read back in chunks of 65536 rows.

    ``schema`` maps each column, in order, to ``(dtype token, shape after rows)`` as in
    :attr:`Dataset.schema`; ``read(col, start, stop)`` returns rows ``[start, stop)`` of ``col``
    (strings as an object array of ``str``). Memory: one chunk of one column.
    """
    h = _new_hash()
    for col, (dtype_token, inner) in schema.items():
        _hash_header(h, col, dtype_token, (rows, *inner))
        for a in range(0, rows, _HASH_CHUNK_ROWS):
            _hash_chunk(h, col, read(col, a, min(a + _HASH_CHUNK_ROWS, rows)), dtype_token == STRING_DTYPE)
    return h.hexdigest()
