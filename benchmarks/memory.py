"""What the benchmarks share: this process's memory figures from ``/proc/self/status`` and a raw write.

Imported by the benchmark scripts as a sibling module (``python benchmarks/bench_X.py`` puts this folder on
``sys.path``; so do the rank processes ``bench_sharded`` starts from its own file).
"""

from __future__ import annotations

import os
from pathlib import Path

_CHUNK = bytearray(64 << 20)


def vm_bytes(field: str = "VmRSS") -> int:
    """``field`` of ``/proc/self/status`` (``VmRSS``: resident now; ``VmHWM``: its peak), in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current resident size (Linux ``clear_refs`` 5); False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def write_fsync(path: Path, nbytes: int) -> None:
    """The raw baseline: ``nbytes`` written to ``path`` unbuffered in 64 MiB chunks, then fsynced."""
    with open(path, "wb", buffering=0) as fh:
        left = nbytes
        while left > 0:
            left -= fh.write(memoryview(_CHUNK)[:min(left, len(_CHUNK))])
        os.fsync(fh.fileno())


def drop_cached(folder: Path) -> bool:
    """Evict the files under ``folder`` from the page cache (``posix_fadvise(DONTNEED)`` after an fsync: no root
    needed), so that the next read of them comes from the disk, as a resume on another node does. False when
    the platform has no ``posix_fadvise``."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in Path(folder).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True
