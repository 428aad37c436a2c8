"""Background prefetch: compute the next item of a sequence in a thread while the consumer uses the current one."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from gwenlake_hpc.errors import ConfigError

T = TypeVar("T")

#: Environment variable that turns prefetching off by default (``0``/``false``/``no``/``off``).
PREFETCH_ENV = "GWENLAKE_PREFETCH"

_ITEM, _END, _ERROR = object(), object(), object()


def prefetch_default() -> bool:
    """Whether batches are prefetched by default: ``GWENLAKE_PREFETCH`` (on unless 0/false/no/off).

    Raises :class:`ConfigError` for another value.
    """
    raw = os.environ.get(PREFETCH_ENV, "1").strip().lower()
    if raw in ("1", "true", "yes", "on", ""):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{PREFETCH_ENV}={raw!r}: use 1 (prefetch batches in a background thread, the default) or 0")


def prefetched(load: Callable[[Any], T], keys: Iterable[Any], name: str = "gwenlake-prefetch") -> Iterator[T]:
    """Yield ``load(k)`` for each of ``keys`` in order, each computed in a background thread one item ahead.

    Bounded: at most two items exist at once, the one the consumer holds (the last yielded) and the next one
    (being computed, or ready). The thread starts at the first ``next()``; it is stopped and joined when the
    iteration ends, fails, or is abandoned (``close()``, or the generator garbage-collected): a ``load``
    already running finishes first, none starts after. An exception raised by ``load`` is re-raised in the
    consumer at the item where it happened, with its traceback. ``load`` must be safe to call from another
    thread (h5py serializes its calls with a global lock; numpy and the OS release the GIL during copies
    and reads, which is what overlaps with the consumer's step).
    """
    keys = list(keys)
    if not keys:
        return
    done: queue.SimpleQueue[tuple[object, Any]] = queue.SimpleQueue()
    # Two slots: the item the consumer holds and the one ahead. The consumer gives one back when it asks for
    # the next item, so the thread never runs more than one item ahead.
    slots = threading.Semaphore(2)
    stop = threading.Event()

    def work() -> None:
        try:
            for k in keys:
                slots.acquire()
                if stop.is_set():
                    return
                done.put((_ITEM, load(k)))
            done.put((_END, None))
        except BaseException as err:  # re-raised in the consumer
            done.put((_ERROR, err))

    # The thread references only the queue, the semaphore, the event and ``load``, never this generator, so an
    # abandoned generator is collected (and its ``finally`` stops the thread) as soon as it is unreferenced.
    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    try:
        while True:
            kind, value = done.get()
            if kind is _END:
                return
            if kind is _ERROR:
                raise value
            yield value
            value = None  # the consumer moved on: drop our reference before freeing its slot
            slots.release()
    finally:
        stop.set()
        slots.release()  # wake the thread if it waits for a slot
        thread.join()
