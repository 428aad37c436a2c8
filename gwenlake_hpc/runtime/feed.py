"""What the loop feeds: the batches of each step from the resume point on (the Run's :meth:`~.run.Run.steps`).

- :func:`resolve_total`: the training length from ``job.steps``/``job.epochs`` and the batches' length;
- :func:`batch_stream`: ``(epoch, batch)`` from the resume point on: gwenlake ``Batches`` computed without
  reading skipped data (each rank its shard, a :class:`PlanStream` that knows its data position), any other
  re-iterable read and dropped up to the resume point, with the RNG states of an uninterrupted run;
- :func:`set_epoch`: the epoch number handed to samplers and datasets before each pass.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Sequence

from ..base.errors import ConfigError
from .rng import rng_state, set_rng_state

log = logging.getLogger("gwenlake_hpc.run")


def length_of(batches: Any) -> int | None:
    """``len(batches)``, or None when unknown: no ``__len__``, or one that raises ``TypeError`` (a torch DataLoader
    over an ``IterableDataset`` without ``__len__``)."""
    if batches is None or not hasattr(batches, "__len__"):
        return None
    try:
        return len(batches)
    except TypeError:
        return None


def is_plan(batches: Any) -> bool:
    """Whether ``batches`` is a gwenlake ``Batches`` (an ``epoch(e, start=, seed=)`` method), not a plain iterable
    (``IterableBatches`` has an ``epoch`` number)."""
    return callable(getattr(batches, "epoch", None))


def set_epoch(batches: Any, epoch: int) -> int:
    """Call ``set_epoch(epoch)`` on each object that fixes the order of the plain iterable ``batches``.

    As Lightning's ``_set_sampler_epoch`` and Accelerate's ``DataLoaderShard.set_epoch``: the iterable itself,
    a ``DataLoader``'s ``dataset`` (an ``IterableBatches``), ``sampler`` (a ``DistributedSampler``),
    ``batch_sampler`` and ``batch_sampler.sampler``, each object once; those without a callable ``set_epoch``
    are skipped. Returns how many were called (0 for a list).
    """
    batch_sampler = getattr(batches, "batch_sampler", None)
    found: dict[int, Any] = {}  # by id: samplers may be unhashable, and one may be reached twice
    for obj in (batches, getattr(batches, "dataset", None), getattr(batches, "sampler", None), batch_sampler,
                getattr(batch_sampler, "sampler", None)):
        if obj is not None and callable(getattr(obj, "set_epoch", None)):
            found.setdefault(id(obj), obj)
    for obj in found.values():
        obj.set_epoch(epoch)
    return len(found)


def warn_persistent_workers(batches: Any) -> None:
    dataset = getattr(batches, "dataset", None)
    if getattr(batches, "persistent_workers", False) and getattr(batches, "num_workers", 0) > 0 \
            and callable(getattr(dataset, "set_epoch", None)):
        log.warning("DataLoader(persistent_workers=True) keeps the copy of %s its workers got at the first epoch: "
                    "set_epoch does not reach them and every epoch repeats that order; use "
                    "persistent_workers=False", type(dataset).__name__)


def sharded(batches: Any, world_size: int) -> bool:
    """Whether each of ``world_size`` ranks reads its own shard of every epoch of ``batches`` (gwenlake
    ``Batches`` of known length, several ranks)."""
    return world_size > 1 and is_plan(batches) and hasattr(batches, "__len__")

def resolve_total(batches: Any, steps: int | None, epochs: int | None, world_size: int) -> tuple[int, int | None]:
    """``(total steps, batches a rank reads per epoch or None)`` from ``job.steps``/``job.epochs`` and the
    batches' length.

    Raises:
        ConfigError: the batches are empty, too few for the ranks, or the length is unknown.
    """
    per_epoch = length_of(batches)
    if per_epoch == 0:
        raise ConfigError("run.steps(): the batches are empty (0 batches per epoch)")
    if per_epoch is not None and sharded(batches, world_size):
        per_epoch //= world_size
        if per_epoch == 0:
            raise ConfigError(f"run.steps(): {length_of(batches)} batches per epoch cannot be shared by "
                              f"{world_size} ranks; use a smaller batch_size or fewer tasks")
    if steps is not None:
        total = steps
    elif epochs is not None:
        if per_epoch is None:
            raise ConfigError("job.epochs is set but run.steps() got batches of unknown length; "
                              "set job.steps instead")
        total = epochs * per_epoch
    elif per_epoch is not None:
        total = per_epoch
    else:
        raise ConfigError("the training length is unknown: set job.steps or job.epochs")
    return total, per_epoch


def batch_stream(batches: Any, per_epoch: int | None, start: int, *, rank: int, world_size: int, seed: int,
                 on_pass: Callable[[dict[str, Any]], None], resume: dict[str, Any] | None = None,
                 position: dict[str, Any] | None = None) -> Iterator[tuple[int, Any]]:
    """Yield ``(epoch, batch)`` from step ``start`` on, forever.

    gwenlake ``Batches`` of known length: a :class:`PlanStream` (its :meth:`~PlanStream.position` is the data
    position the Run saves), which continues at ``position`` (the checkpoint's ``data``, None: from ``start``
    as the step of the same number of ranks). Other batches: see :func:`plain_stream`.

    ``on_pass`` gets the RNG states each pass over a plain iterable begins with (the Run saves them in its
    checkpoints, ``rng_epoch_start``).

    ``resume``: the checkpoint's Run state whose RNG states a plain iterable's stream restores itself
    (see below); None when :meth:`steps` restored them already.
    """
    if batches is not None and is_plan(batches) and per_epoch and hasattr(batches, "spans"):
        return PlanStream(batches, per_epoch, start, rank=rank, world_size=world_size, seed=seed, saved=position)
    return plain_stream(batches, per_epoch, start, rank=rank, world_size=world_size, seed=seed, on_pass=on_pass,
                        resume=resume)


def _length(spans: Sequence[Sequence[int]]) -> int:
    return sum(z - a for a, z in spans)


def _cut(spans: Sequence[Sequence[int]], lo: int, hi: int) -> list[list[int]]:
    """The part ``[lo, hi)`` of the concatenation of ``spans``, as position spans (adjacent ones merged)."""
    out: list[list[int]] = []
    offset = 0
    for a, z in spans:
        n = z - a
        x, y = max(lo, offset), min(hi, offset + n)
        if x < y:
            if out and out[-1][1] == a + x - offset:
                out[-1][1] = a + y - offset
            else:
                out.append([a + x - offset, a + y - offset])
        offset += n
    return out


class PlanStream:
    """The batches of one rank over gwenlake ``Batches``, and the run's data position as a global sample count.

    The epoch's order is a function of ``(seed, epoch)`` alone; a *position* is a row's place in it
    (:meth:`Batches.spans`). The stream is a sequence of *segments*: a segment lists the positions of an epoch
    still to read (``spans``), split into ``world_size`` contiguous chunks of ``steps * batch_size`` rows,
    chunk ``j`` read by rank ``j`` in ``steps`` batches. A plain epoch is one segment, ``spans = [[0, used)]``:
    rank ``j`` reads batches ``j * steps .. (j + 1) * steps - 1`` of :meth:`Batches.epoch` (each rank its own
    contiguous shard, ``steps = len(batches) // world_size``, the rest of the epoch unused), so the samples
    all ranks have read after ``k`` steps are not a prefix of the epoch's order: the position saved is the
    global count of samples read (``samples``) with the positions the epoch has left (``remaining``).

    Resume (``saved``: the checkpoint's position):

    - the same number of ranks and per-rank batch size: the same segment continues at the same step (what an
      uninterrupted run reads, bit for bit);
    - another one: the positions the interrupted epoch has left become one new segment for this run's ranks:
      ``steps = len(remaining) // (world_size * batch_size)`` global batches, rank ``j`` reads the ``j``-th
      chunk. With the same global batch size (``world_size * batch_size``) as the checkpoint's, that is the
      steps the epoch had left and no sample is skipped or read twice (except the short last batch of an epoch
      whose length divides by the ranks: its rows, fewer than one global batch, are skipped). With another one,
      the last ``len(remaining) % global_batch`` samples of that epoch are skipped (a warning names the counts)
      and the next epoch begins after those steps; the step counter goes on counting optimizer steps toward
      ``job.steps``.
    - None (a fresh run, or a checkpoint written before the position was a sample count): the plain epoch of
      step ``start`` on this number of ranks.

    Args:
        batches: a gwenlake ``Batches`` (``batch_size``, ``drop_last``, ``epoch``, ``spans``).
        per_epoch: steps of a plain epoch (``len(batches) // world_size`` on several ranks).
        start: the step the run resumes after (0: a fresh run).
        rank, world_size: this rank and the number of ranks.
        seed: the run's seed (the epoch order).
        saved: the checkpoint's :meth:`position`, or None.
    """

    def __init__(self, batches: Any, per_epoch: int, start: int, *, rank: int, world_size: int, seed: int,
                 saved: dict[str, Any] | None = None):
        self.batches, self.per_epoch, self.rank, self.world_size, self.seed = (batches, per_epoch, rank,
                                                                                 world_size, seed)
        self._it: Iterator[Any] | None = None  # the open epoch's (or segment's) batches
        self.batch_size = int(batches.batch_size)
        self.rows = int(batches.dataset.rows)
        end = len(batches) * self.batch_size if batches.drop_last else self.rows  # positions used per epoch
        self.used = min(world_size * per_epoch * self.batch_size, end)
        self.skipped = int((saved or {}).get("skipped", 0))
        if saved is not None and saved.get("rows") != self.rows:
            log.warning("the checkpoint's data position is over %s rows and these batches have %d: resuming at "
                        "step %d of this run's epochs", saved.get("rows"), self.rows, start)
            saved = None
        if saved is None:
            epoch, pos = divmod(start, per_epoch)
            # A checkpoint of a run that never changed its number of ranks: its epochs all had ``used`` rows.
            self.segment = self._plain_epoch(epoch, start - pos, epoch * self.used)
            self.k = pos
        elif saved["world_size"] == world_size and saved["batch_size"] == self.batch_size:
            self.segment, self.k = dict(saved["segment"]), int(saved["segment_step"])
        else:
            self.segment, self.k = self._resplit(saved, start), 0

    def _plain_epoch(self, epoch: int, first_step: int, samples_before: int) -> dict[str, Any]:
        return {"epoch": epoch, "spans": [[0, self.used]], "world_size": self.world_size,
                "batch_size": self.batch_size, "steps": self.per_epoch, "first_step": first_step,
                "samples_before": samples_before, "plain": True}

    def _resplit(self, saved: dict[str, Any], start: int) -> dict[str, Any]:
        """The segment of this run's ranks over the positions the checkpoint's epoch has left."""
        remaining, epoch, samples = saved["remaining"], int(saved["epoch"]), int(saved["samples"])
        was, now = int(saved["global_batch_size"]), self.world_size * self.batch_size
        steps, left = divmod(_length(remaining), now)
        log.info("data position: %d samples read by %d rank(s) of %d (global batch %d); the %d samples epoch %d "
                 "has left are read by %d rank(s) in %d steps of a global batch of %d", samples,
                 saved["world_size"], saved["batch_size"], was, _length(remaining), epoch, self.world_size,
                 steps, now)
        if left:
            log.warning("the global batch size changed from %d (%d rank(s) x %d) to %d (%d x %d): of the %d samples "
                        "epoch %d has left, %d are read in %d steps and the last %d are skipped; epoch %d begins "
                        "after step %d (global sample count %d then)", was, saved["world_size"],
                        saved["batch_size"], now, self.world_size, self.batch_size, _length(remaining), epoch,
                        steps * now, steps, left, epoch + 1, start + steps, samples + steps * now)
            self.skipped += left
        if steps == 0:
            return self._plain_epoch(epoch + 1, start, samples)
        return {"epoch": epoch, "spans": [list(s) for s in remaining], "world_size": self.world_size,
                "batch_size": self.batch_size, "steps": steps, "first_step": start, "samples_before": samples,
                "plain": False}

    @staticmethod
    def _chunk(segment: dict[str, Any], j: int) -> tuple[int, int]:
        """Rank ``j``'s chunk of ``segment``: ``[lo, hi)`` in the concatenation of its spans."""
        size = segment["steps"] * segment["batch_size"]
        total = _length(segment["spans"])
        return min(j * size, total), min((j + 1) * size, total)

    def _read(self, segment: dict[str, Any], k: int) -> dict[str, Any]:
        """What ``segment`` has read after ``k`` of its steps: the global sample count and the positions left."""
        b, read, remaining = segment["batch_size"], 0, []
        for j in range(segment["world_size"]):
            lo, hi = self._chunk(segment, j)
            mid = min(lo + k * b, hi)
            read += mid - lo
            remaining.extend(_cut(segment["spans"], mid, hi))
        merged: list[list[int]] = []
        for a, z in remaining:
            if merged and merged[-1][1] == a:
                merged[-1][1] = z
            else:
                merged.append([a, z])
        return {"samples": segment["samples_before"] + read, "remaining": merged}

    def position(self) -> dict[str, Any]:
        """The data position after the steps read so far (JSON-ready, saved as the Run state's ``data``).

        Keys: ``samples`` (samples read by all ranks together since step 0, the rows of skipped ones not
        counted), ``epoch``, ``remaining`` (the positions of that epoch not read yet, ``[[start, stop), ...]``),
        ``world_size``, ``batch_size`` (per rank), ``global_batch_size``, ``rows`` (the dataset's),
        ``skipped`` (samples skipped by changes of the global batch size), ``segment`` and ``segment_step``
        (where a resume on the same number of ranks continues).
        """
        seg, k = self.segment, self.k
        if k >= seg["steps"]:  # the epoch is done: the next one has not begun
            seg, k = self._plain_epoch(seg["epoch"] + 1, seg["first_step"] + seg["steps"],
                                       self._read(seg, k)["samples"]), 0
        return {**self._read(seg, k), "epoch": seg["epoch"], "world_size": self.world_size,
                "batch_size": self.batch_size, "global_batch_size": self.world_size * self.batch_size,
                "rows": self.rows, "skipped": self.skipped, "segment": seg, "segment_step": k}

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return self

    def __next__(self) -> tuple[int, Any]:
        if self.k >= self.segment["steps"]:
            seg = self.segment
            self.segment = self._plain_epoch(seg["epoch"] + 1, seg["first_step"] + seg["steps"],
                                             self._read(seg, seg["steps"])["samples"])
            self.k = 0
            self.close()  # the finished epoch's iterator (a rank's shard ends before the epoch does)
        if self._it is None:
            self._it = self._open(self.segment, self.k)
        batch = next(self._it)
        self.k += 1
        return self.segment["epoch"], batch

    def _open(self, seg: dict[str, Any], k: int) -> Iterator[Any]:
        if seg["plain"]:  # today's layout: this rank's contiguous shard of the epoch, computed, not read
            return self.batches.epoch(seg["epoch"], start=self.rank * seg["steps"] + k, seed=self.seed)
        lo, hi = self._chunk(seg, self.rank)
        return self.batches.spans(seg["epoch"], _cut(seg["spans"], lo + k * seg["batch_size"], hi), seed=self.seed)

    def close(self) -> None:
        """Close the open epoch's iterator (stops its prefetch thread)."""
        it, self._it = self._it, None
        if it is not None and hasattr(it, "close"):
            it.close()


def plain_stream(batches: Any, per_epoch: int | None, start: int, *, rank: int, world_size: int, seed: int,
                 on_pass: Callable[[dict[str, Any]], None], resume: dict[str, Any] | None = None
                 ) -> Iterator[tuple[int, Any]]:
    """Yield ``(epoch, batch)`` of batches that are not a :class:`PlanStream`'s from step ``start`` on, forever.

    None: ``(0, None)``. Any other re-iterable is read, the batches before the resume point dropped, with
    the RNG states of an uninterrupted run (below); ``rank``, ``world_size`` and ``seed`` are unused (each rank
    gets its own data from the iterable, a ``DistributedSampler``).
    """
    if batches is None:
        while True:
            yield 0, None
    # Any other re-iterable (a list, a DataLoader): skipping means reading.
    if start:
        log.warning("resuming at batch %d of a plain iterable: the skipped batches are read and dropped; "
                    "use Input(...).batches() to resume without reading them", start)
    # Beginning a pass may draw from the global RNGs (a DataLoader's iterator draws its workers' base seed,
    # a RandomSampler its order's seed), and without workers reading a batch may too. So a resume that lands
    # mid-pass begins it from the RNG states the pass began with (saved in the checkpoint), reads the
    # skipped batches, then restores the checkpoint's states: the batches, the workers' seeds and the
    # training's own stream are those of an uninterrupted run.
    epoch, pos = (divmod(start, per_epoch) if per_epoch else (0, start))
    while True:
        if resume is not None and pos == 0:  # the pass begins right after the checkpoint's step
            set_rng_state(resume["rng"])
            resume = None
        elif resume is not None and resume.get("rng_epoch_start"):
            set_rng_state(resume["rng_epoch_start"])
        on_pass(rng_state(torch_if_imported=True))
        set_epoch(batches, epoch)  # before iter(): a DataLoader hands its workers the dataset then
        it = iter(batches)
        produced = 0
        while True:
            if resume is not None and produced == pos:
                set_rng_state(resume["rng"])
                resume = None
            try:
                b = next(it)
            except StopIteration:
                break
            produced += 1
            if produced > pos:
                yield epoch, b
        if produced == 0:
            raise ConfigError("run.steps(): the batches yielded nothing")
        if per_epoch is None and pos >= produced:
            pos -= produced
        else:
            pos = 0
        epoch += 1
