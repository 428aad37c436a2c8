"""Which of our threads a thread waits for, for the hang watchdog's verdict.

A faulthandler dump shows a thread waiting in ``threading.py`` (``join``, a lock, a condition) but not whom it
waits for. Our code that blocks on one of our own threads (the checkpoint writer's ``join``, a copier's
condition) says so with :func:`waiting_for`; the job's watchdog publishes :func:`snapshot` beside the rank's
heartbeat, so that a hang's verdict names the thread that blocks and where (:mod:`gwenlake_hpc.job.hang_report`).
A dict store and a pop per wait: nothing a checkpoint block would notice. Standard library only.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

# waiter's ident -> the thread it waits for; one entry per waiting thread (a wait does not nest another)
_WAITS: dict[int, threading.Thread] = {}


@contextlib.contextmanager
def waiting_for(thread: threading.Thread | None) -> Iterator[None]:
    """Record, for the block's duration, that the calling thread waits for ``thread`` (None: nothing recorded)."""
    if thread is None:
        yield
        return
    me = threading.get_ident()
    _WAITS[me] = thread
    try:
        yield
    finally:
        _WAITS.pop(me, None)


def snapshot() -> dict[str, Any]:
    """The process's threads and waits now: ``{"names": {ident: name}, "waits": {waiter ident: waited ident}}``
    (idents as decimal strings, the JSON form; ``threading.get_ident()``, which faulthandler prints in hex)."""
    names = {str(t.ident): t.name for t in threading.enumerate() if t.ident is not None}
    waits = {str(w): str(t.ident) for w, t in list(_WAITS.items()) if t.ident is not None}
    return {"names": names, "waits": waits}
