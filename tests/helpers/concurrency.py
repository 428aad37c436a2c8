"""Threads released together, and polling with a deadline."""

from __future__ import annotations


def run_concurrently(n: int, work) -> dict:
    """Call ``work(i)`` for i in 0..n-1 in n threads released together; returns {i: result}.

    Raises the first exception a thread raised (after all threads ended)."""
    import threading

    barrier = threading.Barrier(n)
    results, errors = {}, []

    def run(i):
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def wait_until(pred, timeout_s: float = 60.0, what: str = "") -> None:
    """Poll ``pred()`` every 50 ms until it is true; AssertionError after ``timeout_s`` (generous: loaded machines)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what or pred}")
