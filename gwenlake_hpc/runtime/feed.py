"""What the loop feeds: the batches of each step from the resume point on (the Run's :meth:`~.run.Run.steps`).

- :func:`resolve_total`: the training length from ``job.steps``/``job.epochs`` and the batches' length;
- :func:`batch_stream`: ``(epoch, batch)`` from a global batch index on: gwenlake ``Batches`` computed without
  reading skipped data (each rank its shard), any other re-iterable read and dropped up to the resume point,
  with the RNG states of an uninterrupted run;
- :func:`set_epoch`: the epoch number handed to samplers and datasets before each pass.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

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
                 on_pass: Callable[[dict[str, Any]], None], resume: dict[str, Any] | None = None
                 ) -> Iterator[tuple[int, Any]]:
    """Yield ``(epoch, batch)`` from global batch index ``start`` on, forever.

    ``on_pass`` gets the RNG states each pass over a plain iterable begins with (the Run saves them in its
    checkpoints, ``rng_epoch_start``).

    ``resume``: the checkpoint's Run state whose RNG states a plain iterable's stream restores itself
    (see below); None when :meth:`steps` restored them already.
    """
    if batches is None:
        while True:
            yield 0, None
    if is_plan(batches) and per_epoch:
        # gwenlake Batches: the data position is computed, skipped batches are never read. A rank of a
        # multi-task run reads its own contiguous shard of each epoch's order.
        epoch, pos = divmod(start, per_epoch)
        shard = rank * per_epoch if sharded(batches, world_size) else 0
        while True:
            it = batches.epoch(epoch, start=shard + pos, seed=seed)
            for _ in range(per_epoch - pos):
                yield epoch, next(it)
            epoch, pos = epoch + 1, 0
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
