"""Background prefetch: run an iterator in a thread, a bounded number of items ahead of its consumer."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from gwenlake_hpc.base.errors import ConfigError
from gwenlake_hpc.base.waits import waiting_for

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


def prefetched(produce: Callable[[], Iterator[T]], ahead: int, name: str = "gwenlake-prefetch") -> Iterator[T]:
    """Yield the items of ``produce()``, an iterator run in a background thread up to ``ahead`` items ahead.

    Bounded: besides the item the consumer holds (the last yielded), at most ``ahead`` items are ready
    or being made. The thread starts at the first ``next()``; it is stopped and joined when the iteration
    ends, fails, or is abandoned (``close()``, or the generator garbage-collected): an item being made is
    finished first, the producer is then closed (its ``finally`` blocks run in the thread) and none is made
    after. An exception raised by the producer is re-raised in the consumer where its item would have come,
    with its traceback. The producer must be safe to run beside the consumer (h5py serializes its calls
    with a global lock; numpy and the OS release the GIL during copies and reads, and so does a training
    step waiting for the GPU: that is what overlaps).
    """
    if ahead < 1:
        raise ValueError(f"ahead must be >= 1, got {ahead}")
    done: queue.SimpleQueue[tuple[object, Any]] = queue.SimpleQueue()
    # ahead + 1 slots: the item the consumer holds and those ahead. The consumer gives one back when it asks
    # for the next item, so the thread never gets more than ``ahead`` items ahead.
    slots = threading.Semaphore(ahead + 1)
    stop = threading.Event()

    def work() -> None:
        try:
            items = produce()
            try:
                while True:
                    slots.acquire()
                    if stop.is_set():
                        return
                    try:
                        item = next(items)
                    except StopIteration:
                        break
                    done.put((_ITEM, item))
                    del item
            finally:
                close = getattr(items, "close", None)
                if close is not None:
                    close()
            done.put((_END, None))
        except BaseException as err:  # re-raised in the consumer
            done.put((_ERROR, err))

    # The thread references only the queue, the semaphore, the event and ``produce``, never this generator, so
    # an abandoned generator is collected (and its ``finally`` stops the thread) as soon as it is unreferenced.
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
        with waiting_for(thread):  # a hang's verdict names this thread, not the join
            thread.join()
