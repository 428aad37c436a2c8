"""The catalog: dataset names (``group.name``) mapped to HDF5 files under ``data_root``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from gwenlake_hpc.base.errors import DataError

from .dataset import Dataset
from ...base.names import split_name
from .names import dataset_path
from .tables import IMPORT_CHUNK_ROWS, import_table
from .write import DatasetWriter, write_dataset


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
            if split_name(name) and p.is_file():
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

    def writer(self, name: str, attrs: Mapping[str, str] | None = None) -> DatasetWriter:
        """A streaming writer of dataset ``name``: append chunks of rows, published atomically when the
        ``with`` block ends. See :class:`~gwenlake_hpc.stores.data.write.DatasetWriter`."""
        return DatasetWriter(self.data_root, name, attrs)

    def import_table(
        self, source: str | os.PathLike[str], name: str, columns: list[str] | None = None,
        chunk_rows: int = IMPORT_CHUNK_ROWS,
    ) -> str:
        """Import a CSV/Parquet file as ``name``, in chunks; return its revision. See :func:`import_table`."""
        return import_table(source, self.data_root, name, columns, chunk_rows=chunk_rows)

    def __repr__(self) -> str:
        return f"Catalog({str(self.data_root)!r})"
