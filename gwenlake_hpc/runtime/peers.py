"""Which rank is gone when a collective fails: every rank's host and pid, learnt when the process group is
joined, and the one-line verdict a surviving rank gives instead of the backend's tracebacks.

A rank that dies (SIGKILL, a lost node, an out-of-memory kill) makes the others fail in their next collective
with the backend's words only ("Connection reset by peer", a timeout), often chained several times. The
survivors then say, in one line: which rank is gone, its pid and host, where the training was, and that the
newest sealed checkpoint is kept. A rank on this host is known gone when its pid is (a zombie counts as gone: its
parent may not have reaped it yet); a rank on another host cannot be looked at from here, so the verdict then
names the ranks of the other hosts as the ones that did not answer.
"""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ..base.processes import pid_gone, proc_state

#: Seconds a survivor waits for a peer of its host to be seen gone: the kernel closes a killed process's sockets
#: (the survivor's collective fails) a moment before the process has ended.
EXIT_WAIT_S = 3.0

#: Words of a collective whose peer went away (gloo's and NCCL's), or that waited past its timeout.
_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Socket closed|Read error|Write error|"
                   r"[Tt]imed out|timeout|NCCL (error|communicator was aborted)|ProcessGroup\w* .*abort", re.S)


@dataclass(frozen=True)
class Peer:
    """One rank of the job as it joined: its ``rank``, ``host`` (``socket.gethostname()``) and ``pid``."""

    rank: int
    host: str
    pid: int


def me() -> tuple[str, int]:
    """This process's ``(host, pid)``, as :func:`gather` exchanges it."""
    import os

    return socket.gethostname(), os.getpid()


def from_gathered(gathered: Sequence[Any]) -> list[Peer]:
    """The peers from what every rank sent (``[(host, pid)]`` by rank, from ``all_gather_object``)."""
    return [Peer(r, str(h), int(p)) for r, (h, p) in enumerate(gathered)]


def gone(pid: int) -> bool:
    """True when process ``pid`` of this host has ended: no such process, or a zombie (ended, not reaped)."""
    return pid_gone(pid) or proc_state(pid) in ("Z", "X")


def is_lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a collective's failure: torch.distributed's
    ``DistError`` family, or a RuntimeError in the backend's words (gloo raises plain RuntimeErrors)."""
    try:
        from torch.distributed import DistError  # torch >= 2.2
    except ImportError:  # pragma: no cover - a torch without distributed
        DistError = ()  # type: ignore[assignment,misc]
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if (DistError and isinstance(e, DistError)) or (isinstance(e, RuntimeError) and _LOST.search(str(e))):
            return True
        e = e.__cause__ or e.__context__
    return False


def verdict(peers: Sequence[Peer], my_rank: int, exc: BaseException | None, where: str,
            then: str | None = None) -> str | None:
    """The one line a surviving rank logs when a collective failed because a peer is gone, or None when
    ``exc`` is not such a failure (``exc`` None: a failure known to be one, e.g. a barrier at the end).

    Args:
        peers: every rank as it joined (:attr:`Dist.peers`); empty: ranks unknown (named as "another rank").
        my_rank: this process's rank (never named gone).
        exc: the exception the collective raised.
        where: where the training was, e.g. ``"at step 20"``.
        then: what happens now (default: every rank stops, the newest sealed checkpoint is kept).
    """
    if exc is not None and not is_lost_peer(exc):
        return None
    host = socket.gethostname()
    local = [p for p in peers if p.rank != my_rank and p.host == host]
    dead = [p for p in local if gone(p.pid)]
    deadline = time.monotonic() + EXIT_WAIT_S
    while local and not dead and time.monotonic() < deadline:  # its sockets close before its exit completes
        time.sleep(0.1)
        dead = [p for p in local if gone(p.pid)]
    said = _backend_words(exc)
    tail = ((then or "every rank stops; the newest sealed checkpoint is kept: run the same job again to resume")
            + (f" (the backend said: {said})" if said else ""))
    if dead:
        who = ", ".join(f"rank {p.rank} (pid {p.pid} on {p.host})" for p in dead)
        return f"{who} {'is' if len(dead) == 1 else 'are'} gone: a collective failed {where}; {tail}"
    remote = [p for p in peers if p.rank != my_rank and p.host != host]
    if remote:
        who = ", ".join(f"rank {p.rank} on {p.host}" for p in remote)
        return f"a collective failed {where}: a rank of another host did not answer ({who}); {tail}"
    return f"a collective failed {where}: another rank stopped answering; {tail}"


def _backend_words(exc: BaseException | None) -> str:
    """The backend's message, first line, without its source path and advice (at most 160 characters)."""
    if exc is None:
        return ""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's "[/path/pair.cc:537] "
    text = text.split(". This is typically")[0]
    return text[:160]
