"""SSH to a remote cluster's login node with paramiko: connection, remote commands, SFTP.

Security rules kept here, so that callers cannot forget them:

- Host keys are checked against an OpenSSH ``known_hosts`` file; an unknown key is rejected (a RejectPolicy
  that names the key's SHA256 fingerprint and the ``ssh-keyscan`` line that trusts it), a changed key is
  refused outright. Nothing is ever added to ``known_hosts`` by this module.
- Authentication is by key file or SSH agent, never by password.
- A remote command is always an argv list joined with :func:`shlex.quote` (:func:`command_line`); shell
  scripts run as ``bash -c <quoted script>`` whose own values are quoted by the caller.
- Secret values travel only inside SFTP file contents (:meth:`SshConnection.write_private`), written after the
  file was made 0600, never on a command line.

One concern, kept in one module of about 500 lines: the SSH session and its security rules (the target and its
host-key policy, the connection and its reconnects, commands, SFTP writes), so that every way to the cluster
goes through the same checks and none can be imported without them.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import logging
import posixpath
import re
import shlex
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence, TypeVar

import paramiko

from ..base.errors import ConfigError, GwenlakeError
from ..base.rules import has_control

log = logging.getLogger("gwenlake_hpc.launch.ssh")
logging.getLogger("paramiko").setLevel(logging.WARNING)  # "Connected", "Authentication successful" at INFO

T = TypeVar("T")
#: Exceptions that mean the connection is gone (worth a reconnect), as opposed to a refused login.
DROPPED = (paramiko.SSHException, EOFError, OSError, socket.timeout)


class RemoteCommandError(GwenlakeError):
    """A remote command exited with a non-zero status (its stderr is in the message)."""

    def __init__(self, message: str, rc: int, stdout: str = "", stderr: str = ""):
        super().__init__(message)
        self.rc, self.stdout, self.stderr = rc, stdout, stderr


class ConnectionLost(GwenlakeError):
    """The connection dropped and could not be re-established within the reconnect time."""


def command_line(argv: Sequence[str]) -> str:
    """One remote command line from an argv list, every element shell-quoted."""
    return " ".join(shlex.quote(str(a)) for a in argv)


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's ``SHA256:...`` fingerprint of a public key (as ``ssh-keygen -lf`` prints it)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


@dataclass(frozen=True)
class SshTarget:
    """Where and how to log in; built from a ``cluster`` config by :meth:`from_config`.

    Attributes:
        name: the cluster's name (``conf/cluster/<name>.yaml``), used in messages and job records.
        host, port, user: the login node and account.
        key_file: absolute path of the private key, None for the SSH agent.
        known_hosts: absolute path of the known_hosts file.
        proxy_jump: ``[user@]host[:port]`` of a jump host, or None.
        connect_timeout_s: seconds for TCP connect, banner and authentication each.
    """

    name: str
    host: str
    port: int
    user: str
    key_file: str | None
    known_hosts: str
    proxy_jump: str | None = None
    connect_timeout_s: float = 20.0

    @classmethod
    def from_config(cls, cc: Any, name: str) -> "SshTarget":
        """Validate a ``cluster`` config node (see :class:`gwenlake_hpc.job.config.ClusterConfig`).

        Raises:
            ConfigError: a missing or malformed field, naming ``cluster.<field>`` and the fix.
        """
        def get(key: str) -> Any:  # a ClusterConfig, or a mapping of its keys
            return cc.get(key) if hasattr(cc, "get") else getattr(cc, key, None)

        host = str(get("host") or "")
        if not host or has_control(host) or " " in host or host.startswith("-"):
            raise ConfigError(f"cluster.host={host!r} ({name}): give the login node's host name or address")
        port = int(get("port") or 22)
        if not 0 < port < 65536:
            raise ConfigError(f"cluster.port={port} ({name}): must be between 1 and 65535")
        user = str(get("user") or getpass.getuser())
        if has_control(user) or " " in user or user.startswith("-"):
            raise ConfigError(f"cluster.user={user!r} ({name}): not a user name")
        key_file = get("key_file")
        if key_file:
            kp = Path(str(key_file)).expanduser()
            if not kp.is_file():
                raise ConfigError(f"cluster.key_file={key_file} ({name}): no such file; give the private key the "
                                  "cluster accepts, or remove cluster.key_file to use the SSH agent")
            key_file = str(kp.resolve())
        known = Path(str(get("known_hosts") or "~/.ssh/known_hosts")).expanduser()
        jump = get("proxy_jump") or None
        if jump is not None:
            _parse_jump(str(jump), user, name)
        return cls(name=name, host=host, port=port, user=user, key_file=key_file, known_hosts=str(known.absolute()),
                   proxy_jump=str(jump) if jump else None,
                   connect_timeout_s=float(get("connect_timeout_s") or 20.0))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a job record (no secrets: a key file's path, never its content)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SshTarget":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


def _parse_jump(spec: str, default_user: str, name: str) -> tuple[str, str, int]:
    m = re.fullmatch(r"(?:([^@\s:]+)@)?([^@\s:]+)(?::(\d+))?", spec)
    if not m or spec.startswith("-"):
        raise ConfigError(f"cluster.proxy_jump={spec!r} ({name}): use [user@]host[:port], as for ssh -J")
    return m.group(1) or default_user, m.group(2), int(m.group(3) or 22)


class UnknownHostKey(ConfigError):
    """The server's host key is not in known_hosts (rejected, never trusted on first use)."""


class _Reject(paramiko.RejectPolicy):
    """paramiko's RejectPolicy, with an error that names the key and how to trust it."""

    def __init__(self, target: SshTarget, host: str, port: int):
        self.target, self.host, self.port = target, host, port

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        port_opt = f"-p {self.port} " if self.port != 22 else ""
        raise UnknownHostKey(
            f"cluster {self.target.name}: the host key of {hostname} is not in {self.target.known_hosts} "
            f"(cluster.known_hosts), so the connection was refused. The server offered {key.get_name()} key "
            f"{fingerprint(key)}. Check that fingerprint with the cluster's administrators (on the host: "
            f"ssh-keygen -lf /etc/ssh/ssh_host_{_key_file_kind(key)}_key.pub), then trust it with:\n"
            f"  ssh-keyscan {port_opt}-t {key.get_name()} {shlex.quote(self.host)} >> "
            f"{shlex.quote(self.target.known_hosts)}")


def _key_file_kind(key: paramiko.PKey) -> str:
    name = key.get_name()
    return "ed25519" if "ed25519" in name else "ecdsa" if "ecdsa" in name else "rsa"


class SshConnection:
    """One SSH connection to a :class:`SshTarget`, opened on first use, reopened after a drop.

    Use as a context manager, or call :meth:`close`. Methods that only read (:meth:`run` with
    ``retry=True``, :meth:`read_from`, :meth:`stat_size`) reconnect when the connection drops, for up to
    ``reconnect_s`` seconds; commands with effects (sbatch, scancel) are never repeated behind your back.
    """

    def __init__(self, target: SshTarget, reconnect_s: float = 60.0):
        self.target = target
        self.reconnect_s = reconnect_s
        self._client: paramiko.SSHClient | None = None
        self._jump: paramiko.SSHClient | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self.reconnects = 0

    # --- connection ---------------------------------------------------------------------------------------

    def __enter__(self) -> "SshConnection":
        self.connect()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def connect(self) -> None:
        """Open the connection (through the jump host if any).

        Raises:
            UnknownHostKey: the host key is not in known_hosts (message: fingerprint, ssh-keyscan line).
            ConfigError: changed host key, authentication failure, unreachable host, a port that does not
                speak SSH, an encrypted key file, no key at all; each names the field to fix.
        """
        if self._client is not None:
            transport = self._client.get_transport()
            if transport is not None and transport.is_active():
                return
            log.warning("connection to %s was lost; reconnecting", self.target.where)
            self.reconnects += 1
        self.close()
        t = self.target
        sock = None
        if t.proxy_jump:
            juser, jhost, jport = _parse_jump(t.proxy_jump, t.user, t.name)
            self._jump = self._open(jhost, jport, juser, None, what="cluster.proxy_jump")
            try:
                sock = self._jump.get_transport().open_channel(  # type: ignore[union-attr]
                    "direct-tcpip", (t.host, t.port), ("127.0.0.1", 0), timeout=t.connect_timeout_s)
            except paramiko.ChannelException as exc:
                raise ConfigError(f"cluster {t.name}: the jump host {t.proxy_jump} (cluster.proxy_jump) could not "
                                  f"reach {t.host}:{t.port}: {exc}; check cluster.host and cluster.port as "
                                  "seen from the jump host") from exc
        self._client = self._open(t.host, t.port, t.user, sock, what="cluster.host")

    def _open(self, host: str, port: int, user: str, sock: Any, what: str) -> paramiko.SSHClient:
        t = self.target
        client = paramiko.SSHClient()
        known = Path(t.known_hosts)
        if known.is_file():
            try:
                client.load_system_host_keys(str(known))  # read only: never written back
            except (OSError, paramiko.SSHException) as exc:
                raise ConfigError(f"cluster.known_hosts={known}: unreadable ({exc})") from exc
        client.set_missing_host_key_policy(_Reject(t, host, port))
        where = f"{user}@{host}:{port}"
        try:
            client.connect(host, port=port, username=user, key_filename=t.key_file, allow_agent=t.key_file is None,
                           look_for_keys=False, sock=sock, timeout=t.connect_timeout_s,
                           banner_timeout=t.connect_timeout_s, auth_timeout=t.connect_timeout_s,
                           passphrase=None, password=None)
        except UnknownHostKey:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise ConfigError(
                f"cluster {t.name}: the host key of {host}:{port} CHANGED: {t.known_hosts} has "
                f"{fingerprint(exc.expected_key)}, the server offered {fingerprint(exc.key)}. This can be an attack "
                f"(someone between you and the cluster); if the administrators confirm the new key, remove the old "
                f"line with: ssh-keygen -f {shlex.quote(t.known_hosts)} -R "
                f"{shlex.quote(host if port == 22 else f'[{host}]:{port}')}") from exc
        except paramiko.PasswordRequiredException as exc:
            client.close()
            raise ConfigError(f"cluster.key_file={t.key_file} ({t.name}) is encrypted: load it into the SSH agent "
                              "(ssh-add) and remove cluster.key_file; passphrases are not read from config") from exc
        except paramiko.AuthenticationException as exc:
            client.close()
            how = f"key {t.key_file} (cluster.key_file)" if t.key_file else "the SSH agent's keys (no cluster.key_file)"
            raise ConfigError(
                f"cluster {t.name}: authentication failed as {where} with {how}. Check cluster.user "
                f"(the account name on the cluster, here {user!r}) and cluster.key_file (its public key must be in "
                f"~{user}/.ssh/authorized_keys on the cluster); passwords are not supported.") from exc
        except socket.gaierror as exc:
            client.close()
            raise ConfigError(f"cluster {t.name}: unknown host name {host!r} ({what}): {exc}") from exc
        except (ConnectionRefusedError, socket.timeout, TimeoutError, OSError) as exc:
            client.close()
            raise ConfigError(f"cluster {t.name}: cannot reach {host}:{port} ({exc}); check {what} and "
                              "cluster.port, and that the login node is up") from exc
        except paramiko.SSHException as exc:
            client.close()
            if "No authentication methods available" in str(exc):
                raise ConfigError(f"cluster {t.name}: no key to log in as {where}: set cluster.key_file or add "
                                  "a key to the SSH agent (ssh-add)") from exc
            raise ConfigError(f"cluster {t.name}: SSH to {host}:{port} failed ({exc}); is {what}/cluster.port an "
                              "SSH server?") from exc
        transport = client.get_transport()
        if transport is not None:
            transport.set_keepalive(15)
        return client

    def close(self) -> None:
        """Close the connection (and the jump host's); safe to call twice."""
        for obj in (self._sftp, self._client, self._jump):
            try:
                if obj is not None:
                    obj.close()
            except Exception:  # a dead connection may fail to close: nothing left to free
                pass
        self._sftp = self._client = self._jump = None

    def _retrying(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn``; on a dropped connection, reconnect (every second, up to ``reconnect_s``) and rerun."""
        deadline = time.monotonic() + self.reconnect_s
        while True:
            try:
                self.connect()
                return fn()
            except ConfigError:
                raise
            except DROPPED as exc:
                self.close()
                if time.monotonic() > deadline:
                    raise ConnectionLost(f"cluster {self.target.name}: connection to {self.target.where} lost "
                                         f"during {what} and not back after {self.reconnect_s:.0f} s: {exc}") from exc
                log.warning("connection to %s lost during %s (%s); reconnecting", self.target.where, what,
                            exc.__class__.__name__)
                self.reconnects += 1
                time.sleep(1.0)

    # --- commands -----------------------------------------------------------------------------------------

    def run(self, argv: Sequence[str], *, check: bool = True, timeout_s: float = 120.0, retry: bool = False,
            stdin: bytes | None = None) -> tuple[int, str, str]:
        """Run one remote command (argv, each element quoted); returns ``(exit status, stdout, stderr)``.

        Args:
            retry: reconnect and rerun after a dropped connection (only for commands without effects).
            stdin: bytes sent to the command's standard input (never used for secrets by this package).

        Raises:
            RemoteCommandError: ``check`` and a non-zero exit status.
            ConnectionLost / ConfigError: as :meth:`connect`, or the connection dropped (without ``retry``:
                at once).
        """
        line = command_line(argv)

        def once() -> tuple[int, str, str]:
            return self._exec(line, timeout_s, stdin)

        if retry:
            rc, out, err = self._retrying(once, f"`{line[:60]}`")
        else:
            self.connect()
            try:
                rc, out, err = once()
            except DROPPED as exc:
                self.close()
                raise ConnectionLost(f"cluster {self.target.name}: connection to {self.target.where} lost while "
                                     f"running `{line[:80]}`: {exc}") from exc
        if check and rc != 0:
            raise RemoteCommandError(f"on {self.target.name} ({self.target.host}): `{line[:200]}` exited {rc}: "
                                     f"{err.strip()[-2000:]}", rc, out, err)
        return rc, out, err

    def script(self, text: str, **kwargs: Any) -> tuple[int, str, str]:
        """Run a bash script (``bash -c <quoted text>``); the caller quotes every value inside ``text``."""
        return self.run(["bash", "-c", text], **kwargs)

    def _exec(self, line: str, timeout_s: float, stdin: bytes | None) -> tuple[int, str, str]:
        transport = self._client.get_transport()  # type: ignore[union-attr]
        if transport is None or not transport.is_active():
            raise paramiko.SSHException("transport closed")
        chan = transport.open_session(timeout=self.target.connect_timeout_s)
        try:
            chan.settimeout(timeout_s)
            chan.exec_command(line)
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + timeout_s
            while True:
                busy = False
                if chan.recv_ready():
                    out += chan.recv(65536)
                    busy = True
                if chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                    busy = True
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if chan.closed and not busy:
                    if not chan.exit_status_ready():
                        raise EOFError("channel closed before the command's exit status arrived")
                    break
                if not transport.is_active():
                    raise EOFError("connection closed")
                if time.monotonic() > deadline:
                    so_far = (out.decode(errors="replace")[-300:] + err.decode(errors="replace")[-300:]).strip()
                    raise RemoteCommandError(f"on {self.target.name}: `{line[:200]}` did not finish within "
                                             f"{timeout_s:.0f} s (its output so far: {so_far or 'none'!r})", 124,
                                             out.decode(errors="replace"), err.decode(errors="replace"))
                if not busy:
                    time.sleep(0.01)
            rc = chan.recv_exit_status()
            return rc, out.decode(errors="replace"), err.decode(errors="replace")
        finally:
            chan.close()

    # --- files --------------------------------------------------------------------------------------------

    @property
    def sftp(self) -> paramiko.SFTPClient:
        """The SFTP session of this connection (opened on first use)."""
        self.connect()
        if self._sftp is None or self._sftp.get_channel() is None or self._sftp.get_channel().closed:  # type: ignore[union-attr]
            self._sftp = self._client.open_sftp()  # type: ignore[union-attr]
        return self._sftp

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        """``mkdir -p`` over SFTP (absolute POSIX path); existing directories are kept as they are."""
        parts = [p for p in path.split("/") if p]
        cur = ""
        for part in parts:
            cur += "/" + part
            try:
                self.sftp.stat(cur)
            except FileNotFoundError:
                try:
                    self.sftp.mkdir(cur, mode)
                except OSError:
                    self.sftp.stat(cur)  # created meanwhile by someone else: fine; else raise

    def write_atomic(self, path: str, data: bytes | IO[bytes], mode: int = 0o644) -> None:
        """Upload to ``<path>.tmp-<random>`` then rename over ``path`` (POSIX rename): a failed or interrupted
        upload leaves the temporary name only (removed when possible), never a partial ``path``.

        Raises:
            OSError / paramiko.SSHException: the upload failed (the temporary file was removed if the
                connection still allowed it).
        """
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        sftp = self.sftp
        try:
            with sftp.open(tmp, "wb") as fh:
                sftp.chmod(tmp, mode)
                if isinstance(data, (bytes, bytearray)):
                    fh.write(bytes(data))
                else:
                    while True:
                        chunk = data.read(1 << 20)
                        if not chunk:
                            break
                        fh.write(chunk)
                fh.flush()
            # fsutil's routines work on local paths; this file is on the remote host, reached by SFTP only.
            # posix-rename@openssh.com is rename(2) there, so readers see the old file or the new one and an
            # interrupted upload leaves only the temporary name. There is no fsync (paramiko has no
            # fsync@openssh.com call), so a crash of the remote host may lose the upload: these files
            # (batch scripts, code bundles, patches) are made again from the local checkout at the next submission.
            sftp.posix_rename(tmp, path)
        except BaseException:
            try:
                sftp.remove(tmp)
            except Exception:  # the connection may be gone; the temporary name is never read by anyone
                pass
            raise

    def write_private(self, path: str, text: str) -> None:
        """Create ``path`` with mode 0600 (chmod before any content is written), then write ``text``.

        For secrets: the value travels inside the SFTP stream only. The parent directory is made 0700.
        """
        parent = posixpath.dirname(path)
        self.makedirs(parent, 0o700)
        self.sftp.chmod(parent, 0o700)
        with self.sftp.open(path, "wb") as fh:
            self.sftp.chmod(path, 0o600)
            fh.write(text.encode())

    def stat_size(self, path: str) -> int | None:
        """Size of a remote file in bytes, None if it does not exist (reconnects after a drop)."""
        def once() -> int | None:
            try:
                return int(self.sftp.stat(path).st_size or 0)
            except FileNotFoundError:
                return None
        return self._retrying(once, f"stat {path}")

    def read_from(self, path: str, offset: int, limit: int = 1 << 20) -> bytes:
        """Up to ``limit`` bytes of a remote file from byte ``offset`` (b"" if it does not exist);
        reconnects after a drop, so a follower resumes at the same offset."""
        def once() -> bytes:
            try:
                with self.sftp.open(path, "rb") as fh:
                    fh.seek(offset)
                    return fh.read(limit)
            except FileNotFoundError:
                return b""
        return self._retrying(once, f"reading {path}")

    def read_text(self, path: str) -> str | None:
        """A whole (small) remote text file, None if it does not exist."""
        def once() -> str | None:
            try:
                with self.sftp.open(path, "rb") as fh:
                    return fh.read().decode(errors="replace")
            except FileNotFoundError:
                return None
        return self._retrying(once, f"reading {path}")

    def listdir(self, path: str) -> list[str]:
        """Names in a remote directory ([] if it does not exist)."""
        def once() -> list[str]:
            try:
                return self.sftp.listdir(path)
            except FileNotFoundError:
                return []
        return self._retrying(once, f"listing {path}")


_POOL: dict[SshTarget, SshConnection] = {}


def connection(target: SshTarget) -> SshConnection:
    """A shared connection per target for the commands of one process (``status`` over many jobs)."""
    conn = _POOL.get(target)
    if conn is None:
        conn = _POOL[target] = SshConnection(target)
    return conn
