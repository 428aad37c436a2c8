"""Benchmark of the goodput ledger's size and of ``status``'s read of it over a run's length (issue 40, item 12; a
script, not a test).

One start's ledger is driven through the ledger API on a fake clock (no waiting): ``--step-s`` steps (default
1 s: a record at every step, the most the ledger writes), a checkpoint every ``--eval-every`` steps sealed at
once, for a simulated 1 hour, 1 day and 2 weeks. For each length it prints, one figure a line:

- ``ledger_bytes_<length>``: the start's file at the end of its loop (events and the two slots);
- ``status_ms_<length>``: the median time of what ``status`` does with it (``read_ledger`` + ``summarize`` +
  ``describe``) over 50 reads;
- ``records_written_<length>``: records the ledger wrote (one a simulated second at most).

and, side by side, the format before (one cumulative line appended a second, the file replaced by its last line
past 1 MiB): ``old_format_bytes_written_per_day`` (its records' bytes in a day), ``old_format_max_bytes`` and
``old_format_status_ms`` (its reader read the whole file: a 1 MiB file of its records), and
``old_format_status_ms_tail_reader`` (the same file read by today's reader: a run's old ledgers still read).

Usage: ``python benchmarks/bench_ledger.py [--step-s 1.0] [--eval-every 600]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from gwenlake_hpc.runtime import ledger as ledgers

LENGTHS = {"1h": 3600.0, "1d": 86400.0, "2w": 14 * 86400.0}


def _status_ms(run_dir: Path, reads: int = 50) -> float:
    times = []
    for _ in range(reads):
        began = time.perf_counter()
        ledgers.describe(ledgers.summarize(ledgers.read_ledger(run_dir, live=True)))
        times.append(time.perf_counter() - began)
    return 1000.0 * statistics.median(times)


def simulate(run_dir: Path, length_s: float, step_s: float, eval_every: int) -> tuple[int, int]:
    """One start of ``length_s`` simulated seconds; returns (file bytes, records written)."""
    path = ledgers.start_path(run_dir, 0)
    led = ledgers.StartLedger(path, 0, {"host": "n1", "job_id": "12345", "restarts": 0}, every_s=1.0,
                              suspended_of=lambda: 0.0)
    written = 0
    flush = led._flush

    def counted(now, event):
        nonlocal written
        written += 1
        flush(now, event)

    led._flush = counted
    t = led._origin + 30.0  # 30 s of start-up
    led.first_step(1, t)
    for step in range(1, int(length_s / step_s) + 1):
        checkpointed = step % eval_every == 0
        led.step_done(step, step_s, 0.0, checkpointed, t + step * step_s)
        if checkpointed:
            led.sealed_of = lambda s=step: s
    size = path.stat().st_size
    led.close()
    return size, written


def old_format(run_dir: Path) -> tuple[int, int, float, float]:
    """The format before: (bytes of one record, the file's largest size, status ms on a 1 MiB file with the
    reader before, and with today's, which reads its tail)."""
    rec = {"v": 1, "start": 0, "host": "n1", "job_id": "12345", "restarts": 0, "elapsed_s": 86400.123456,
           "startup_s": 30.0, "first_step": 1, "last_step": 86370, "step_s": 86370.0, "checkpoint_s": 0.0,
           "sealed_step": 86400, "kept_step_s": 86370.0, "step_end_s": 86400.0, "loop_end_s": None, "stop_s": None,
           "stop_signal": None, "drain_s": None, "end": None, "marks": {"86400": 86370.0}}
    line = json.dumps(rec, separators=(",", ":")) + "\n"
    max_bytes = 1 << 20
    path = ledgers.start_path(run_dir, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(line * (max_bytes // len(line)))
    times = []
    for _ in range(50):
        began = time.perf_counter()
        recs = []
        for p in sorted(path.parent.glob("start-*.jsonl")):  # the reader before: every byte of every file
            for raw in reversed(p.read_bytes().splitlines()):
                recs.append({**json.loads(raw), "end": ledgers.RUNNING})
                break
        ledgers.describe(ledgers.summarize(recs))
        times.append(time.perf_counter() - began)
    return len(line), max_bytes, 1000.0 * statistics.median(times), _status_ms(run_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=600)
    args = ap.parse_args()
    print(f"step_s {args.step_s}")
    print(f"eval_every {args.eval_every}")
    for name, length in LENGTHS.items():
        with tempfile.TemporaryDirectory() as tmp:
            size, written = simulate(Path(tmp), length, args.step_s, args.eval_every)
            print(f"ledger_bytes_{name} {size}")
            print(f"records_written_{name} {written}")
            print(f"status_ms_{name} {_status_ms(Path(tmp)):.3f}")
    with tempfile.TemporaryDirectory() as tmp:
        line, max_bytes, ms, ms_now = old_format(Path(tmp))
        print(f"old_format_bytes_written_per_day {line * 86400}")
        print(f"old_format_max_bytes {max_bytes}")
        print(f"old_format_status_ms {ms:.3f}")
        print(f"old_format_status_ms_tail_reader {ms_now:.3f}")


if __name__ == "__main__":
    main()
