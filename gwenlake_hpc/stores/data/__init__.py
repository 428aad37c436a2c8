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
Importing this package does not import torch (batches import it on first use).

Modules (one concern each; each imports only modules listed before it):

* ``names``: dataset names and paths;
* ``format``: on-disk constants, validation and normalization of columns;
* ``revision``: the content hash;
* ``write``: atomic writes, whole (:func:`write_dataset`) or streamed in chunks (:class:`DatasetWriter`);
* ``tables``: CSV/Parquet import in chunks (:func:`import_table`);
* ``prefetch``: the background thread that reads the next window;
* ``batches``: the resumable batch plan (:class:`Batches`);
* ``dataset``: the reader (:class:`Dataset`);
* ``loader``: :class:`IterableBatches`, a torch ``IterableDataset`` for ``DataLoader`` workers;
* ``catalog``: :class:`Catalog`, names to files.
"""

from __future__ import annotations

from typing import Any

from .batches import Batches
from .catalog import Catalog
from .dataset import Dataset
from .format import FORMAT_VERSION, RESERVED_ATTRS, STRING_DTYPE
from .names import dataset_path
from .revision import content_revision
from .tables import import_table
from .write import DatasetWriter, write_dataset


def __getattr__(name: str) -> Any:
    # IterableBatches subclasses torch's IterableDataset: imported on first use, so that importing the catalog
    # (``data import``, ``data show``, a writer process) does not import torch.
    if name == "IterableBatches":
        from .loader import IterableBatches

        return IterableBatches
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "FORMAT_VERSION",
    "RESERVED_ATTRS",
    "STRING_DTYPE",
    "Batches",
    "Catalog",
    "Dataset",
    "DatasetWriter",
    "IterableBatches",
    "content_revision",
    "dataset_path",
    "import_table",
    "write_dataset",
]
