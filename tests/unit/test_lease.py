"""The run's lease and fence (gwenlake_hpc.base.lease) in one process on a local folder: numbering, refusal,
breaking a record that stops changing, a torn record, the fence's check. The same across two sshfs mounts and
real processes: tests/integration/test_shared_fs.py."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from gwenlake_hpc.base import lease as leases
from gwenlake_hpc.base.lease import FENCE, LEASE, RECORD_BYTES, FencedError, Lease, RunHeldError, check_fence


def _foreign_record(run_dir, *, host="other-node", pid=12345, t=None, fence=7, token="f" * 32) -> bytes:
    rec = json.dumps({"token": token, "fence": fence, "host": host, "pid": pid, "slurm_job_id": "99", "beat": 0,
                      "time": time.time() if t is None else t}).encode()
    raw = rec + b" " * (RECORD_BYTES - len(rec) - 1) + b"\n"
    (run_dir / LEASE).write_bytes(raw)
    return raw


def test_each_start_gets_a_higher_number_and_a_second_is_refused(tmp_path):
    first = Lease(tmp_path, timeout_s=60).acquire()
    assert first.fence == 1 and (tmp_path / FENCE).read_text().strip() == "1"
    assert leases.current() is first
    assert len((tmp_path / LEASE).read_bytes()) == RECORD_BYTES
    with pytest.raises(RunHeldError, match=f"pid {os.getpid()} on {socket.gethostname()}"):
        Lease(tmp_path, timeout_s=60).acquire()
    check_fence("sealing")  # the holder passes
    first.release()
    assert not (tmp_path / LEASE).exists() and leases.current() is None
    check_fence("sealing")  # no lease held in this process: nothing to check
    second = Lease(tmp_path, timeout_s=60).acquire()
    assert second.fence == 2
    second.release()


def test_a_record_that_stops_changing_is_broken_after_the_timeout_not_before(tmp_path, caplog):
    _foreign_record(tmp_path)  # another node's live-looking holder that never renews
    t0 = time.monotonic()
    with pytest.raises(RunHeldError, match="start 7 \\(pid 12345 on other-node, SLURM job 99"):
        Lease(tmp_path, timeout_s=2, wait_s=0.5).acquire()
    assert time.monotonic() - t0 < 2  # refused within its wait, before the timeout
    caplog.set_level("WARNING", logger="gwenlake_hpc.lease")
    t0 = time.monotonic()
    lease = Lease(tmp_path, timeout_s=2, wait_s=30).acquire()
    assert 2 <= time.monotonic() - t0 < 30
    assert "no renewal for" in caplog.text and "other-node" in caplog.text
    assert lease.fence == 1  # .fence was never written by the foreign record: numbering goes on from it
    lease.release()


def test_a_record_old_by_its_own_clock_is_watched_then_broken_even_without_a_wait(tmp_path):
    # a lost node's lease, its last renewal long ago: a start with lease_wait_s=0 watches it for the timeout
    # (no other host's clock breaks a lease by itself), then takes the run over
    _foreign_record(tmp_path, t=time.time() - (2 * 2 + leases.MAX_CLOCK_SKEW_S + 5))
    t0 = time.monotonic()
    lease = Lease(tmp_path, timeout_s=2, wait_s=0).acquire()
    assert 2 <= time.monotonic() - t0 < 10
    lease.release()


def test_a_live_holder_whose_clock_is_behind_is_never_broken(tmp_path):
    """The adversarial pass's input: a holder whose clock was 300 s behind was broken while it renewed."""
    import threading

    stop = threading.Event()

    def renew():  # another node's holder, alive, its clock 300 s behind: its record changes at every renewal
        beat = 0
        while not stop.wait(0.2):
            beat += 1
            rec = json.loads(_foreign_record(tmp_path, t=time.time() - 300).decode())
            assert rec["beat"] == 0
            raw = (tmp_path / LEASE).read_bytes().replace(b'"beat": 0', f'"beat": {beat}'.encode())
            (tmp_path / LEASE).write_bytes(raw)

    _foreign_record(tmp_path, t=time.time() - 300)
    thread = threading.Thread(target=renew)
    thread.start()
    try:
        with pytest.raises(RunHeldError, match="is being trained by"):  # (its name if the read was not torn)
            Lease(tmp_path, timeout_s=2, wait_s=0).acquire()  # watched 3 s, never unchanged for 2 s
    finally:
        stop.set()
        thread.join()


def test_an_empty_or_damaged_record_is_broken_after_ten_seconds_at_most(tmp_path, monkeypatch):
    """The adversarial pass's input: a garbage .lease (or the empty one of a creator killed before its first
    write) refused every start with lease_wait_s=0, for ever. (The 10 s bound made 2 s: the fast tier.)"""
    assert leases.EMPTY_RECORD_S == 10.0
    monkeypatch.setattr(leases, "EMPTY_RECORD_S", 2.0)
    for content in (b"", b"garbage\x00\xff"):
        (tmp_path / LEASE).write_bytes(content)
        t0 = time.monotonic()
        lease = Lease(tmp_path, timeout_s=60, wait_s=0).acquire()
        assert leases.EMPTY_RECORD_S <= time.monotonic() - t0 < leases.EMPTY_RECORD_S + 10
        lease.release()


def test_a_renewing_holder_is_never_broken(tmp_path):
    holder = Lease(tmp_path, timeout_s=1).acquire()  # renews every 0.25 s
    try:
        with pytest.raises(RunHeldError):
            Lease(tmp_path, timeout_s=1, wait_s=3).acquire()  # watches it 3 timeouts long
        assert holder.lost is None
        holder.check("sealing")
    finally:
        holder.release()


def test_the_fence_refuses_a_start_whose_lease_was_taken(tmp_path):
    lost = []
    old = Lease(tmp_path, timeout_s=60, on_lost=lost.append).acquire()
    _foreign_record(tmp_path, fence=2, token="a" * 32)  # a newer start took it (after breaking it elsewhere)
    (tmp_path / FENCE).write_text("2\n")
    with pytest.raises(FencedError, match="sealing the checkpoint of step 5 refused: start 1 .* no longer holds"):
        check_fence("sealing the checkpoint of step 5")
    assert lost and lost[0].startswith("lease lost:") and old.lost
    old.release()
    assert (tmp_path / LEASE).exists()  # the newer start's lease is left alone


def test_a_torn_record_read_during_a_renewal_is_read_again(tmp_path, monkeypatch):
    lease = Lease(tmp_path, timeout_s=60).acquire()
    real, torn = leases.read_holder, [True]

    def read_once_torn(run_dir):
        if torn and torn.pop():
            return leases.Holder("", 0, "", 0, "", 0, 0.0, b'{"token": "ab')
        return real(run_dir)

    monkeypatch.setattr(leases, "read_holder", read_once_torn)
    lease.check("sealing")  # the torn read is not a loss
    assert lease.lost is None
    lease.release()


def test_an_exclusive_create_refused_as_eperm_by_sshfs_reads_the_holder(tmp_path, monkeypatch):
    """The CI run's input: two starts on two sshfs mounts raced to create .lease and the loser got EPERM (sshfs's
    answer for the server's failure), a traceback. With the file there it is the holder's lease: refused by name."""
    first = Lease(tmp_path, timeout_s=60).acquire()
    real_open = os.open

    def sshfs_open(path, flags, *args):
        if flags & os.O_EXCL and os.path.lexists(path):
            raise PermissionError(1, "Operation not permitted", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(leases.os, "open", sshfs_open)
    with pytest.raises(RunHeldError, match=f"pid {os.getpid()} on {socket.gethostname()}"):
        Lease(tmp_path, timeout_s=60).acquire()
    first.release()
    with pytest.raises(PermissionError):  # a real refusal (no file there) is not hidden
        monkeypatch.setattr(leases.os, "open", lambda *a: (_ for _ in ()).throw(PermissionError(1, "no")))
        Lease(tmp_path, timeout_s=60).acquire()
