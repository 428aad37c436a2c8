"""A catalog dataset as a torch ``IterableDataset``, for a ``DataLoader`` with worker processes."""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gwenlake_hpc.base.errors import ConfigError

from .dataset import Dataset


class IterableBatches(torch.utils.data.IterableDataset):
    """The batches of :meth:`Dataset.batches`, read in ``DataLoader`` worker processes.

    ``IterableBatches(data, 256)`` takes a :class:`Dataset` (or the path of its ``.h5`` file) and
    the arguments of :meth:`Dataset.batches`; use it with ``DataLoader(stream, batch_size=None,
    num_workers=N)`` (it yields whole batches ``{column: tensor [rows, ...]}``, string columns
    as numpy object arrays).

    Picklable: it holds the file's path and the parameters, never an h5py handle (those cannot be
    pickled and must not cross a fork). Each iteration opens the file itself, in the worker
    process, and closes it at the end. The dataset is opened once here to check the arguments
    (errors as :meth:`Dataset.batches`) and count the batches.

    Sharding: of the epoch's ``len(self)`` batches, in the order fixed by ``(seed, epoch)``,
    worker ``k`` of ``N`` yields the contiguous range ``[k * len // N, (k + 1) * len // N)``,
    starting it without reading the rows before it; so each worker reads about ``1/N`` of the
    file, and every batch of the epoch is yielded exactly once. The ``DataLoader`` interleaves
    the workers' batches (round robin), so the order differs from :meth:`Batches.epoch`'s but is
    still a pure function of ``(seed, epoch, N)``. Without workers it is :meth:`Batches.epoch`.
    :meth:`set_epoch` before each epoch gives it a new order; ``run.steps`` calls it (on the stream
    or on the ``DataLoader``'s dataset) before each epoch, the one a resume lands in included. With
    ``persistent_workers=True`` the workers keep the epoch they were started with (``run.steps``
    warns). A resume through ``run.steps`` reads the skipped batches (a ``DataLoader`` is a plain
    iterable there); ``Dataset.batches()`` does not.
    """

    def __init__(
        self,
        data: Dataset | str | os.PathLike[str],
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
        columns: list[str] | None = None,
        *,
        seed: int = 0,
        epoch: int = 0,
        block_rows: int = 1024,
        buffer_blocks: int = 64,
        prefetch: bool | None = None,
    ) -> None:
        super().__init__()
        if isinstance(data, Dataset):
            self.path, self.name = str(data.path), data.name
        else:
            path = Path(data).expanduser().resolve()
            self.path, self.name = str(path), f"{path.parent.name}.{path.stem}"
        self._kwargs: dict[str, Any] = dict(
            shuffle=shuffle, drop_last=drop_last, columns=columns, block_rows=block_rows,
            buffer_blocks=buffer_blocks, prefetch=prefetch,
        )
        self.batch_size = batch_size
        self.seed = seed
        with Dataset(self.path, name=self.name) as ds:  # check every argument now, in the main process
            batches = ds.batches(batch_size, **self._kwargs)
            self._len = len(batches)
            batches.epoch(epoch, seed=seed)  # checks epoch and seed (a generator not started: nothing is read)
        self.epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next iteration on (``run.steps`` calls it before each epoch).

        Raises :class:`ConfigError` if ``epoch`` is not an integer >= 0 (here, not later in a worker).
        """
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ConfigError(f"epoch must be an integer >= 0, got {epoch!r}")
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Batches per epoch, all workers together."""
        return self._len

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        start, stop = self._len * worker // workers, self._len * (worker + 1) // workers
        if start == stop:
            return
        with Dataset(self.path, name=self.name) as ds:
            it = ds.batches(self.batch_size, **self._kwargs).epoch(self.epoch, start=start, seed=self.seed)
            try:
                for _ in range(stop - start):
                    yield next(it)
            finally:
                it.close()  # the prefetch thread is joined before the file closes

    def __repr__(self) -> str:
        return (f"IterableBatches({self.name!r}, batch_size={self.batch_size}, seed={self.seed}, epoch={self.epoch}, "
                f"{', '.join(f'{k}={v!r}' for k, v in self._kwargs.items())})")
