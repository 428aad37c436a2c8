"""``tracking sync``: deliver what a training left in its state folder, after the training ended."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from ....base.errors import ConfigError
from .deliverer import DeliverLock, Deliverer, read_config
from .session import http_settings
from ..sqlite import BrokenStoreError
from .state import (PENDING_STATUS_FILE, PENDING_TAGS_FILE, TERMINAL_STATUSES, read_json_dict,
                    read_pending_status, write_pending_status)
from ..uri import redact_uri, scrub, validate_uri

logger = logging.getLogger("gwenlake_hpc.tracking")


def sync(state_dir: str | os.PathLike[str], uri: str | None = None, timeout_s: float = 60.0,
         status: str | None = None) -> dict[str, Any]:
    """Deliver what a training left in ``state_dir``: the spool, pending tags, the pending status.

    Used by ``python -m gwenlake_hpc tracking sync RUN_DIR`` when the server was down at the end of a training.
    Safe while a training runs: it waits (up to ``timeout_s``) for the delivery lock, which the training's
    delivery process holds while it lives.

    Args:
        state_dir: the tracking state folder (normally ``<run_dir>/tracking``).
        uri: tracking URI; default the one in ``tracking.json`` (stored without its password).
        timeout_s: seconds to keep retrying an unreachable server (and to wait for the lock).
        status: a terminal status to apply when none is pending (``FAILED``: the SLURM teardown of a job whose
            training was killed and is not started again), with the end time now.

    Returns:
        ``{"run_id": str | None, "delivered": int (points stored), "remaining": int (points still in the
        spool), "status": the status applied, or None}``. If the run was never created (server unreachable
        from the start), it is created from ``tracking.json``. Points the server already holds (same key, step
        at or below its highest) are dropped. The status is applied only once the spool is empty; on timeout
        a WARNING is logged and ``remaining`` tells what is left.

    Raises:
        ConfigError: ``state_dir`` has no readable ``tracking.json``, the URI is invalid, or a training's
            delivery process holds the lock for all of ``timeout_s``.
        BrokenStoreError (a ConfigError): the SQLite store exists but cannot be opened.
    """
    state_dir = Path(state_dir).expanduser().absolute()
    cfg = read_config(state_dir)
    uri = validate_uri(uri if uri is not None else cfg["uri"])
    deadline = time.monotonic() + max(float(timeout_s), 0.0)
    lock = DeliverLock(state_dir)
    while not lock.try_acquire():
        if time.monotonic() >= deadline:
            raise ConfigError(f"the delivery process {lock.holder()} of a training still delivers {state_dir}; "
                              "run tracking sync again after that training ends")
        time.sleep(0.5)
    try:
        if status is not None and read_pending_status(state_dir) is None:
            write_pending_status(state_dir, status.upper(), int(time.time() * 1000))
        with http_settings():
            return _sync(state_dir, uri, deadline)
    finally:
        lock.release()


def _sync(state_dir: Path, uri: str, deadline: float) -> dict[str, Any]:
    d = Deliverer(state_dir, uri)
    tags_path = state_dir / PENDING_TAGS_FILE
    pending = read_pending_status(state_dir)
    applied: str | None = None
    backoff = 0.5
    while True:
        try:
            session = d.session or d.connect(resume=False, update=False)
            d.deliver()
            tags = read_json_dict(tags_path)
            if tags:
                session.log_tags({str(k): str(v) for k, v in tags.items()})
                tags_path.unlink(missing_ok=True)
            if pending is not None and d.remaining() == 0:
                status, end_time = pending
                session.terminate(status, end_time)
                (state_dir / PENDING_STATUS_FILE).unlink(missing_ok=True)
                applied = status
            break
        except BrokenStoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - unreachable: retry until the deadline
            d.drop_session()
            if time.monotonic() + backoff >= deadline:
                logger.warning("tracking: sync of %s to %s failed (%s: %s); run it again later", state_dir,
                               redact_uri(uri), type(exc).__name__, scrub(exc, uri))
                break
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
    return {"run_id": d.run_id, "delivered": d.total_delivered(), "remaining": d.remaining(), "status": applied}


def main(argv: list[str] | None = None) -> int:
    """``python -m gwenlake_hpc.stores.tracking.delivery.sync RUN_DIR [--status FAILED] [--timeout S]``: what the
    SLURM teardown runs when a killed training ends for good (its run would stay RUNNING). Exit 0 when
    everything was delivered, 1 otherwise, 2 for a folder without tracking."""
    import argparse
    import sys

    logging.basicConfig(level=logging.INFO, format="[gwenlake tracking] %(message)s", stream=sys.stderr)
    p = argparse.ArgumentParser(prog="python -m gwenlake_hpc.stores.tracking.delivery.sync")
    p.add_argument("run_dir")
    p.add_argument("--status", choices=TERMINAL_STATUSES)
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args(argv)
    state = Path(a.run_dir) / "tracking"
    try:
        res = sync(state, timeout_s=a.timeout, status=a.status)
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    logger.info("run %s: delivered %d points, %d remaining, status %s", res["run_id"], res["delivered"],
                res["remaining"], res["status"] or "unchanged")
    return 0 if res["remaining"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
