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


def _mount(srv: SshServer, remote: Path, where: Path, enter: list[str] | None = None) -> None:
    """Mount ``remote`` (a folder of this machine, served by ``srv``) on ``where``; ``enter``: a command prefix
    that runs sshfs in another mount namespace (``nsenter -t PID -m --``)."""
    where.mkdir(parents=True, exist_ok=True)
    cmd = [*(enter or []), "sshfs", "-p", str(srv.port), "-o", f"IdentityFile={srv.client_key}",
           "-o", f"UserKnownHostsFile={srv.known_hosts}", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
           "-o", f"cache_timeout={CACHE_TIMEOUT_S}", "-o", "reconnect",
           f"{srv.user}@127.0.0.1:{remote}", str(where)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"sshfs mount of {remote} on {where} failed ({proc.returncode}): {proc.stderr}")
    if enter:
        return  # mounted in another namespace: this one's view of `where` is the folder itself
    deadline = time.monotonic() + 20
    while not os.path.ismount(where):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{where} is not a mount point after sshfs returned")
        time.sleep(0.1)


def _unmount(where: Path, enter: list[str] | None = None) -> None:
    if enter:
        for cmd in (["fusermount3", "-u", str(where)], ["umount", "-l", str(where)]):
            if subprocess.run([*enter, *cmd], capture_output=True, timeout=30).returncode == 0:
                return
        return
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


def slurmd_namespace(node: str) -> list[str] | None:
    """``nsenter`` into the mount namespace of the local cluster's slurmd of ``node`` (scripts/slurm-cluster.sh
    starts each in one of its own), or None when it has none of its own (an older cluster: restart it)."""
    try:
        pid = int(Path(f"/run/slurm/slurmd-{node}.pid").read_text().split()[0])
        if os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):
            return None
    except (OSError, ValueError, IndexError):
        return None
    return ["nsenter", "-t", str(pid), "-m", "--"]


@contextmanager
def node_mounts(folder: Path, nodes: tuple[str, ...] = ("n1", "n2")) -> Iterator[Path]:
    """Make ``folder`` (a folder of this machine) a network filesystem on each node of the local SLURM cluster:
    inside each slurmd's mount namespace ``folder`` is an sshfs mount of itself, served by a fresh sshd, with its
    own 30 s cache and its own ``flock``; here it stays the plain folder (the "server"). Skips (fails with
    ``GWENLAKE_REQUIRE_SLURM=1``) where sshfs cannot mount or the slurmds share this namespace."""
    require_sshfs()
    enters = {n: slurmd_namespace(n) for n in nodes}
    if any(e is None for e in enters.values()):
        reason = "the slurmds share this mount namespace: restart the cluster (scripts/slurm-cluster.sh down; up)"
        if os.environ.get("GWENLAKE_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    folder.mkdir(parents=True, exist_ok=True)
    srv = SshServer.start(folder.parent / f"{folder.name}-sshd")
    mounted = []
    try:
        for n, enter in enters.items():
            _mount(srv, folder, folder, enter)
            mounted.append(enter)
        yield folder
    finally:
        for enter in mounted:
            _unmount(folder, enter)
        srv.stop()
