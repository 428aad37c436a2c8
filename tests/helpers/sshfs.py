"""A real network filesystem for the tests: one folder served by the tests' own sshd on loopback, mounted twice
with ``sshfs`` (Debian's package; FUSE), each mount with its own caches, standing for two nodes of a cluster.

``sshfs`` caches attributes and directory listings for ``cache_timeout`` seconds (we use 30) and ``flock`` on a
FUSE mount is local to that mount: the two failures of real shared filesystems (issue 27) that these tests
reproduce. ``require_sshfs()`` skips where sshfs, /dev/fuse or sshd are missing, and fails instead where CI
promised the services (``GWENLAKE_REQUIRE_SLURM=1``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from .sshd_server import SshServer, require_sshd

CACHE_TIMEOUT_S = 30


def require_sshfs() -> None:
    """Skip (or, with ``GWENLAKE_REQUIRE_SLURM=1``, fail) when sshfs cannot mount here."""
    require_sshd()
    reason = None
    if shutil.which("sshfs") is None:
        reason = "no sshfs: apt-get install sshfs"
    elif not os.path.exists("/dev/fuse"):
        reason = "no /dev/fuse: FUSE is not available in this container"
    if reason:
        if os.environ.get("GWENLAKE_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


@dataclass
class TwoMounts:
    """``server``: the folder on the "server" (seen directly); ``a``, ``b``: the same folder through two sshfs
    mounts (two "nodes")."""

    server: Path
    a: Path
    b: Path


def _mount(srv: SshServer, remote: Path, where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    cmd = ["sshfs", "-p", str(srv.port), "-o", f"IdentityFile={srv.client_key}",
           "-o", f"UserKnownHostsFile={srv.known_hosts}", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
           "-o", f"cache_timeout={CACHE_TIMEOUT_S}", "-o", "reconnect",
           f"{srv.user}@127.0.0.1:{remote}", str(where)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"sshfs mount of {remote} on {where} failed ({proc.returncode}): {proc.stderr}")
    deadline = time.monotonic() + 20
    while not os.path.ismount(where):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{where} is not a mount point after sshfs returned")
        time.sleep(0.1)


def _unmount(where: Path) -> None:
    for cmd in (["fusermount3", "-u", str(where)], ["fusermount3", "-uz", str(where)], ["umount", "-l", str(where)]):
        if not os.path.ismount(where):
            return
        subprocess.run(cmd, capture_output=True, timeout=30)


@contextmanager
def two_mounts(folder: Path) -> Iterator[TwoMounts]:
    """Serve ``folder/server`` over a fresh sshd and mount it on ``folder/a`` and ``folder/b``; unmounted and
    stopped at the end."""
    require_sshfs()
    srv = SshServer.start(folder / "sshd")
    server = folder / "server"
    server.mkdir(parents=True, exist_ok=True)
    mounts = TwoMounts(server, folder / "a", folder / "b")
    try:
        _mount(srv, server, mounts.a)
        _mount(srv, server, mounts.b)
        yield mounts
    finally:
        _unmount(mounts.a)
        _unmount(mounts.b)
        srv.stop()
