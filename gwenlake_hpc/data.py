"""``gwenlake_hpc.data``: the dataset catalog, as training code imports it (``from gwenlake_hpc.data import
Catalog, IterableBatches``). The code lives in :mod:`gwenlake_hpc.stores.data`; this module re-exports its public
names (``IterableBatches``, which imports torch, on first use)."""

from __future__ import annotations

from typing import Any

from .stores.data import (FORMAT_VERSION, RESERVED_ATTRS, STRING_DTYPE, Batches, Catalog, Dataset, DatasetWriter,
                          content_revision, dataset_path, import_table, write_dataset)
from .stores.data import __all__


def __getattr__(name: str) -> Any:
    if name == "IterableBatches":  # a torch IterableDataset: torch is imported on first use only
        from .stores.data.loader import IterableBatches

        return IterableBatches
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
