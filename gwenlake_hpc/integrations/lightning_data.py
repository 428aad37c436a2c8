"""A plain map-style ``DataLoader`` of a Lightning training resumed in the same order.

Lightning saves the position of a loader only where the loader has ``state_dict`` (torchdata's
``StatefulDataLoader``); a plain ``DataLoader(shuffle=True)`` (what most Lightning code uses) starts its epoch again
at a resume, in another order. :class:`ResumableBatches` takes the place of such a loader's batch sampler once
Lightning has made it (its ``DistributedSampler`` added on several ranks):

- at the start of each pass it records the RNG states the sampler draws its order from (the global torch, Python
  and NumPy RNGs: ``RandomSampler()`` draws its seed there; a ``generator=`` of the sampler's own: its state);
- a resumed pass sets those states back for the sampler's first draw (then the live ones), so the epoch has the
  order of the interrupted one, and skips the batches already trained as index lists, without loading them
  (the workers never see them), as :mod:`gwenlake_hpc.runtime.feed` does for the Run's own loop.

The state (epoch, batches done in it, the RNG states) travels in the Lightning checkpoint as part of the
``GwenlakeCallback`` state (``Callback.state_dict``).

Refused (:func:`refuse_unresumable`): a plain ``DataLoader`` over an ``IterableDataset`` (no index to skip by, no
state to restore). Not restored: random draws a dataset makes inside the loader's worker processes (their seeds
come from a new iterator); a ``StatefulDataLoader`` restores those.
"""

from __future__ import annotations

import itertools
import logging
import random
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from ..base.errors import ConfigError

log = logging.getLogger("gwenlake_hpc.integrations")

_END = object()


def _rng_get() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}


def _rng_set(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


def is_stateful(loader: Any) -> bool:
    """A loader whose position Lightning saves and restores itself (``state_dict``/``load_state_dict``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def refuse_unresumable(loader: Any, where: str) -> None:
    """Refuse a loader whose position a resume cannot restore exactly.

    Raises:
        ConfigError: a plain ``DataLoader`` over an ``IterableDataset`` (naming ``where`` and the fix).
    """
    if isinstance(loader, DataLoader) and not is_stateful(loader) and isinstance(loader.dataset, IterableDataset):
        raise ConfigError(f"{where}: a DataLoader over an IterableDataset ({type(loader.dataset).__name__}) cannot "
                          "resume where it stopped (no index to skip to, no state): a resumed run would train on "
                          "other data than an uninterrupted one. Use a map-style Dataset (__getitem__, __len__), "
                          "or torchdata's StatefulDataLoader over a dataset with state_dict()/load_state_dict()")


def refuse_unresumable_in(loaders: Any, where: str) -> None:
    """:func:`refuse_unresumable` over a loader or a list/tuple/dict of them (``train_dataloaders=``)."""
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
        refuse_unresumable(loader, where)


class ResumableBatches:
    """The batch sampler (or, without automatic batching, the sampler) of a plain DataLoader, resumable.

    Args:
        inner: the loader's own ``batch_sampler`` (index lists) or ``sampler``.
    """

    def __init__(self, inner: Any):
        self.inner = inner
        self.sampler = getattr(inner, "sampler", inner)  # Lightning's _set_sampler_epoch looks here
        self._owner = next((o for o in (inner, self.sampler) if isinstance(getattr(o, "generator", None),
                                                                            torch.Generator)), None)
        self._pass: dict[str, Any] | None = None  # the RNG states the current pass drew its order from
        self._resume: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.inner)  # the whole epoch: Lightning counts the resumed batches from its restored index

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.inner, "set_epoch", None)):
            self.inner.set_epoch(epoch)

    def resume_with(self, state: dict[str, Any]) -> None:
        """Make the next pass the one ``state`` (:meth:`state`) describes, from its batch ``state["skip"]``."""
        self._resume = state

    def state(self, epoch: int, done: int) -> dict[str, Any] | None:
        """The current pass as a resume needs it: epoch, ``done`` batches trained in it, its RNG states; None
        before the first pass."""
        if self._pass is None:
            return None
        gen = self._owner.generator if self._owner is not None else None
        return {**self._pass, "epoch": int(epoch), "skip": int(done),
                "gen_now": gen.get_state() if gen is not None else None}

    def restore_generator(self, state: dict[str, Any]) -> None:
        """A resume at an epoch's end: the sampler's own generator as it was at the checkpoint, for the next
        epoch's order (the global RNG is the Run's to restore)."""
        gen = self._owner.generator if self._owner is not None else None
        if gen is not None and state.get("gen_now") is not None:
            gen.set_state(state["gen_now"])

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        gen = self._owner.generator if self._owner is not None else None
        if resume is None:
            self._pass = {"rng": _rng_get(), "gen": gen.get_state() if gen is not None else None}
            it = iter(self.inner)
            first = next(it, _END)  # the sampler draws its order here
        else:
            self._pass = {"rng": resume["rng"], "gen": resume["gen"]}
            live = _rng_get()
            _rng_set(resume["rng"])
            try:
                if gen is not None and resume["gen"] is not None:
                    gen.set_state(resume["gen"])
                it = iter(self.inner)
                # the index lists of the batches already trained: drawn, never loaded
                it = itertools.islice(it, int(resume["skip"]), None)
                first = next(it, _END)
            finally:
                _rng_set(live)  # the training's own RNG: the Run restores the checkpoint's
        if first is _END:
            return
        yield first
        yield from it


def install(loaders: list[Any]) -> list[ResumableBatches | None]:
    """Put a :class:`ResumableBatches` in each plain map-style DataLoader of ``loaders`` (Lightning's processed
    train loaders, in order); None for the others (stateful loaders: Lightning resumes them).

    Raises:
        ConfigError: see :func:`refuse_unresumable`.
    """
    out: list[ResumableBatches | None] = []
    for loader in loaders:
        refuse_unresumable(loader, "the Trainer's train dataloader")
        if not isinstance(loader, DataLoader) or is_stateful(loader):
            out.append(None)
            continue
        current = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
        wrapper = current if isinstance(current, ResumableBatches) else ResumableBatches(current)
        # DataLoader refuses these attributes after __init__; its iterators read them at each pass
        object.__setattr__(loader, "batch_sampler" if loader.batch_sampler is not None else "sampler", wrapper)
        out.append(wrapper)
    return out
