"""A throwaway OpenSSH server on loopback for the SSH submission tests (Debian's ``openssh-server``).

``SshServer.start(folder)`` writes its own ``sshd_config`` (never the system's), a fresh ed25519 host key and
a fresh client key into ``folder``, and runs ``sshd -D -e -f <config>`` on ``127.0.0.1:<free port>``. Only
the current user may log in, with the client key (``AuthorizedKeysFile <folder>/authorized_keys.%u``), and
never with a password. ``known_hosts`` holds the host key as ``ssh-keyscan -p PORT`` would write it.

``require_sshd()`` skips a test where sshd is not installed or cannot run (not root), and fails it instead
where CI promised the services (``GWENLAKE_REQUIRE_SLURM=1``).
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
SKIP_REASON = "no OpenSSH server: apt-get install openssh-server (tests run sshd as root on loopback)"


def require_sshd() -> None:
    """Skip (or, with ``GWENLAKE_REQUIRE_SLURM=1``, fail) when sshd cannot be run here."""
    reason = None
    if SSHD is None or shutil.which("ssh-keygen") is None:
        reason = SKIP_REASON
    elif os.geteuid() != 0:
        reason = "sshd needs root to switch to the logged-in user's session"
    if reason:
        if os.environ.get("GWENLAKE_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SshServer:
    """A running sshd: ``port``, ``user``, ``client_key`` (private key path), ``known_hosts`` (trusting it)."""

    folder: Path
    port: int
    user: str
    client_key: Path
    known_hosts: Path
    host_key: Path
    proc: subprocess.Popen | None = None

    @classmethod
    def start(cls, folder: Path, port: int | None = None) -> "SshServer":
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        host_key, client_key = folder / "host_ed25519", folder / "client_ed25519"
        for key in (host_key, client_key):
            if not key.exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gwenlake-test", "-f", str(key)],
                               check=True, capture_output=True)
        user = getpass.getuser()
        (folder / f"authorized_keys.{user}").write_text((folder / "client_ed25519.pub").read_text())
        server = cls(folder, port or free_port(), user, client_key, folder / "known_hosts", host_key)
        host_pub = (folder / "host_ed25519.pub").read_text().split()
        server.known_hosts.write_text(f"[127.0.0.1]:{server.port} {host_pub[0]} {host_pub[1]}\n")
        server.launch()
        return server

    def config_text(self) -> str:
        return "\n".join([
            f"ListenAddress 127.0.0.1:{self.port}",
            f"HostKey {self.host_key}",
            f"PidFile {self.folder / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.folder}/authorized_keys.%u",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes",
            "UsePAM no",
            "StrictModes no",
            "AllowTcpForwarding yes",
            "X11Forwarding no",
            "PrintMotd no",
            "LogLevel VERBOSE",
            "MaxStartups 50",
            # A login shell's `pyenv init` (this machine's ~/.bashrc) waits up to 60 s for pyenv's rehash lock;
            # one left by a killed shell must not stall every later session of the run.
            "SetEnv PYENV_REHASH_TIMEOUT=2",
            "Subsystem sftp internal-sftp",
            "",
        ])

    def launch(self) -> None:
        """Start sshd (again) on ``self.port``; waits until it accepts connections."""
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation directory
        cfg = self.folder / "sshd_config"
        cfg.write_text(self.config_text())
        log = open(self.folder / "sshd.log", "a")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited {self.proc.returncode}: {(self.folder / 'sshd.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"sshd did not listen on port {self.port}")

    def session_pids(self) -> list[int]:
        """Pids of the processes serving connections: every descendant of the listener (the per-connection
        monitor and its ``sshd: user@notty`` child, which holds the socket, and the commands it runs)."""
        if self.proc is None:
            return []
        found, todo = [], [self.proc.pid]
        while todo:
            out = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout
            kids = [int(p) for p in out.split()]
            found += kids
            todo += kids
        return found

    def kill_sessions(self) -> int:
        """Drop every connection as a network failure does: the commands the sessions run get SIGHUP (their
        shells end as on a hang-up, running their exit traps: a SIGKILLed shell would leave its locks, e.g.
        pyenv's rehash lock, behind for the next sessions), then the sshd processes serving the connections
        are SIGKILLed (the client sees the connection drop; the listener stays, so a reconnect succeeds).
        Returns how many sshd processes were killed."""
        pids = self.session_pids()

        def is_sshd(pid: int) -> bool:
            try:
                return Path(f"/proc/{pid}/comm").read_text().startswith("sshd")
            except OSError:
                return False

        served = [p for p in pids if is_sshd(p)]
        for pid, sig in [(p, signal.SIGHUP) for p in pids if p not in served] + [(p, signal.SIGKILL) for p in served]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return len(served)

    def stop(self) -> None:
        """Stop the listener and every session it serves."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill_sessions()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
