"""Resumable shuffled batches over a :class:`~gwenlake_hpc.data.Dataset`: the order is a pure function of
``(seed, epoch)`` and an epoch restarts at any batch without reading the skipped rows."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from gwenlake_hpc.base.errors import ConfigError

from .prefetch import prefetch_default, prefetched

if TYPE_CHECKING:
    import torch


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

    Prefetch (``prefetch=True``, the default unless the environment sets ``GWENLAKE_PREFETCH=0``):
    the same code makes the batches in a background thread, up to one window of rows
    (``ceil(window_rows / batch_size)`` batches) ahead of the training, so reading, permuting and
    gathering overlap with the step. The batches, their order and the resume position are the
    same with and without it. The thread starts at the first batch and is stopped and joined when
    the epoch's iterator ends, raises, is closed or is garbage-collected; an error in the thread
    is raised in the training thread.

    Memory: at most one window (``block_rows * buffer_blocks`` rows of the selected columns) plus
    one batch is held; with prefetch, one more window's worth of ready batches. Yielded batches
    are fresh arrays that do not pin the window.
    """

    def __init__(
        self,
        dataset: Any,  # a Dataset (.dataset imports this module: no import back, even for the type)
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
        columns: list[str] | None = None,
        *,
        block_rows: int = 1024,
        buffer_blocks: int = 64,
        prefetch: bool | None = None,
    ) -> None:
        self.dataset = dataset
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.block_rows = _positive_int(block_rows, "block_rows")
        self.buffer_blocks = _positive_int(buffer_blocks, "buffer_blocks")
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.columns = dataset._check_columns(columns)
        # None: the environment decides (GWENLAKE_PREFETCH), read now so a bad value fails before the loop.
        self.prefetch = prefetch_default() if prefetch is None else bool(prefetch)

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

    def spans(self, epoch: int, spans: list[tuple[int, int]], seed: int = 0) -> Iterator[dict[str, Any]]:
        """Yield batches of ``batch_size`` rows over the row positions ``[a, z)`` of each span of ``spans``,
        in that order, in the epoch order fixed by ``(seed, epoch)``; the last batch may be shorter.

        A position ``p`` is the ``p``-th row of the epoch's order (batch ``k`` of :meth:`epoch` covers positions
        ``[k * batch_size, (k + 1) * batch_size)``), so ``spans(e, [(k * batch_size, rows)])`` yields what
        ``epoch(e, start=k)`` yields. A batch may join the end of one span to the start of the next. Used by
        the Run to resume on another number of ranks (each rank reads its share of the rows an interrupted
        epoch has left). Rows before a span are not read; prefetch as :meth:`epoch`.

        Raises :class:`ConfigError` if ``epoch`` or ``seed`` is not an integer >= 0, or a span is not
        ``0 <= a <= z <= rows``.
        """
        epoch = _non_negative_int(epoch, "epoch")
        seed = _non_negative_int(seed, "seed")
        checked = []
        for a, z in spans:
            a, z = _non_negative_int(a, "span start"), _non_negative_int(z, "span stop")
            if a > z or z > self.dataset.rows:
                raise ConfigError(f"span [{a}, {z}) is not within the {self.dataset.rows} rows of dataset "
                                  f"{self.dataset.name}")
            if a < z:
                checked.append((a, z))
        return self._stream(functools.partial(self._produce_spans, epoch, seed, checked), bool(checked))

    def _iterate(self, epoch: int, start: int, seed: int, n_batches: int) -> Iterator[dict[str, Any]]:
        end = n_batches * self.batch_size if self.drop_last else self.dataset.rows  # positions used this epoch
        produce = functools.partial(self._produce_spans, epoch, seed, [(start * self.batch_size, end)])
        return self._stream(produce, start < n_batches)

    def _stream(self, produce: Any, anything: bool) -> Iterator[dict[str, Any]]:
        if not anything:
            return
        if not self.prefetch:
            yield from produce()
            return
        # One window of rows ahead, in batches: reading, permuting and gathering overlap with the step.
        ahead = max(1, math.ceil(self.window_rows / self.batch_size))
        stream = prefetched(produce, ahead, name=f"gwenlake-prefetch-{self.dataset.name}")
        try:
            yield from stream
        finally:
            stream.close()  # type: ignore[attr-defined]  # stops and joins the thread, also when abandoned

    def _produce_spans(self, epoch: int, seed: int, spans: list[tuple[int, int]]) -> Iterator[dict[str, Any]]:
        """Batches of ``batch_size`` rows over the positions of ``spans`` (non-empty, within the rows); the
        last one is what is left. One window is held at a time (a span inside the current window reuses it)."""
        bs = self.batch_size
        plan = self._plan(epoch, seed)
        need = bs
        pieces: list[dict[str, np.ndarray]] = []
        current, window, perm = -1, None, None
        for a, z in spans:
            pos = a
            while pos < z:
                w = int(np.searchsorted(plan.offsets, pos, side="right")) - 1
                if w != current:
                    # Drop this window before reading the next so at most one is held.
                    window = perm = None
                    window = self._load_window(plan, w)
                    perm = (
                        np.random.default_rng([seed, epoch, w]).permutation(int(plan.window_sizes[w]))
                        if self.shuffle
                        else None
                    )
                    current = w
                local = pos - int(plan.offsets[w])
                take = min(need, int(plan.window_sizes[w]) - local, z - pos)
                if perm is None:
                    pieces.append({c: a_[local : local + take].copy() for c, a_ in window.items()})  # type: ignore[union-attr]
                else:
                    idx = perm[local : local + take]
                    pieces.append({c: a_[idx] for c, a_ in window.items()})  # type: ignore[union-attr]
                pos += take
                need -= take
                if need == 0:
                    yield self._assemble(pieces)
                    pieces, need = [], bs
        if pieces:
            yield self._assemble(pieces)

    def _assemble(self, pieces: list[dict[str, np.ndarray]]) -> dict[str, Any]:
        import torch  # on use: reading, writing and listing datasets do not need torch (2+ s to import)

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
