"""Benchmark of gwenlake_hpc.data batch reading (a script, not a test).

Writes a dataset of ``--rows`` rows (int64 ``idx`` + float32 ``features[rows, --dim]``) to a
temporary directory, then times:

1. a full shuffled epoch with the block shuffle of :class:`gwenlake_hpc.data.Batches`, against
   reading the first ``--fancy-rows`` rows of a uniform random permutation with h5py fancy
   indexing (sorted indices, as h5py requires), extrapolated to a full epoch;
2. the latency of the first batch of ``epoch(e, start=late)`` against ``start=0``;
3. batches per second with a simulated training step of ``--step-ms`` (a sleep, which releases
   the GIL as a GPU step does), prefetch on against off, over ``--prefetch-batches`` batches of
   ``--prefetch-batch-size`` rows of ``--prefetch-dim`` float32 features (sized so that reading a
   batch costs about as much as the step: the ratio is at most 2x, when they are equal);
4. the peak RSS of a child process that writes ``--size-gib`` GiB through the streaming writer
   (``Catalog.writer``), chunk by chunk: its ``VmHWM`` (``/proc``), else ``getrusage(RUSAGE_CHILDREN)``
   (which on Linux also counts the parent's pages at the fork).

The figures against their targets are printed last, one per line.

Usage: ``python benchmarks/bench_data.py [--rows 2000000] [--size-gib 1]``. Runs in about two
minutes on 2 cores with the defaults. The files are freshly written, so they are read from the
page cache: this measures h5py/numpy overhead, not the disk (on a cold NFS file the fancy-index
gap is much larger, and so is what prefetch hides).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gwenlake_hpc.data import Catalog


def _time(fn, repeat: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=8, help="features per row (float32)")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--block-rows", type=int, default=1024)
    parser.add_argument("--buffer-blocks", type=int, default=64)
    parser.add_argument("--fancy-rows", type=int, default=20_000)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the file (default: a temp dir)")
    parser.add_argument("--step-ms", type=float, default=2.0, help="simulated training step (prefetch test)")
    parser.add_argument("--prefetch-batches", type=int, default=600)
    parser.add_argument("--prefetch-batch-size", type=int, default=2048)
    parser.add_argument("--prefetch-dim", type=int, default=256)
    parser.add_argument("--size-gib", type=float, default=1.0, help="size of the streamed write (target: 4)")
    parser.add_argument("--child-write", type=Path, default=None, help=argparse.SUPPRESS)  # the child's mode
    args = parser.parse_args()
    if args.child_write is not None:
        _child_write(args.child_write, args.size_gib)
        return

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        catalog = Catalog(tmp)
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        catalog.write(
            "bench.rows",
            {
                "idx": np.arange(args.rows, dtype=np.int64),
                "features": rng.standard_normal((args.rows, args.dim), dtype=np.float32),
            },
        )
        size_mb = catalog.path("bench.rows").stat().st_size / 2**20
        print(f"wrote {args.rows:,} rows ({size_mb:.0f} MiB) in {time.perf_counter() - t0:.2f} s")

        with catalog.open("bench.rows") as ds:
            b = ds.batches(
                args.batch_size, block_rows=args.block_rows, buffer_blocks=args.buffer_blocks
            )

            # 1. Full epoch, block shuffle.
            def full_epoch() -> None:
                n = 0
                for batch in b.epoch(1, seed=0):
                    n += len(batch["idx"])
                assert n == ds.rows

            t_epoch = _time(full_epoch)
            per_row_block = t_epoch / ds.rows
            print(
                f"block shuffle: full epoch {t_epoch:.2f} s ({ds.rows / t_epoch / 1e6:.2f} M rows/s,"
                f" {len(b)} batches of {args.batch_size})"
            )

            # Fancy indexing: the first fancy_rows positions of a uniform permutation.
            perm = np.random.default_rng(1).permutation(ds.rows)[: args.fancy_rows]
            sorted_idx = np.sort(perm)
            f_idx, f_feat = ds._ds["idx"], ds._ds["features"]

            def fancy() -> None:
                got = f_idx[sorted_idx]
                f_feat[sorted_idx]
                assert np.array_equal(got, sorted_idx)

            t_fancy = _time(fancy)
            per_row_fancy = t_fancy / args.fancy_rows
            print(
                f"h5py fancy index: {args.fancy_rows:,} random rows in {t_fancy:.2f} s"
                f" ({args.fancy_rows / t_fancy / 1e6:.3f} M rows/s),"
                f" full epoch extrapolated {per_row_fancy * ds.rows:.0f} s"
            )
            print(f"ratio fancy/block per row: {per_row_fancy / per_row_block:.1f}x slower")

            # 2. First-batch latency when resuming late in the epoch.
            # Late but in a full window (the last window may be short, which would flatter it).
            late = int(len(b) * 0.9)
            first0 = _time(lambda: next(b.epoch(1, start=0, seed=0)), repeat=7)
            first_late = _time(lambda: next(b.epoch(1, start=late, seed=0)), repeat=7)
            print(
                f"first batch latency: start=0 {first0 * 1e3:.1f} ms, start={late} {first_late * 1e3:.1f} ms"
                f" (ratio {first_late / first0:.2f}; one window = {b.window_rows:,} rows)"
            )

        ratio = _prefetch_ratio(catalog, args)
        peak, size, seconds = _streamed_write_peak(Path(tmp), args.size_gib)

    print("--- figures (target)")
    print(f"prefetch on/off throughput, {args.step_ms:g} ms step: {ratio:.2f}x (target >= 1.5x)")
    print(f"streaming write of {size / 2**30:.2f} GiB: peak RSS {peak / 2**30:.3f} GiB in {seconds:.0f} s"
          " (target <= 0.5 GiB for 4 GiB)")


def _prefetch_ratio(catalog: Catalog, args: argparse.Namespace) -> float:
    """Batches per second with prefetch on over off, with a ``step_ms`` sleep per batch."""
    rows = args.prefetch_batches * args.prefetch_batch_size
    rng = np.random.default_rng(2)
    with catalog.writer("bench.prefetch") as w:  # in chunks: the streaming writer, as a user would
        for a in range(0, rows, 65536):
            n = min(65536, rows - a)
            w.append({"idx": np.arange(a, a + n), "x": rng.standard_normal((n, args.prefetch_dim), dtype=np.float32)})
    step = args.step_ms / 1e3
    rates = {}
    with catalog.open("bench.prefetch") as ds:
        for prefetch in (False, True, False, True):  # interleaved, best of two: the machine is shared
            b = ds.batches(args.prefetch_batch_size, prefetch=prefetch)
            t0 = time.perf_counter()
            for batch in b.epoch(0):
                time.sleep(step)
            rate = len(b) / (time.perf_counter() - t0)
            rates[prefetch] = max(rate, rates.get(prefetch, 0.0))
        t0 = time.perf_counter()
        for batch in ds.batches(args.prefetch_batch_size, prefetch=False).epoch(0):
            pass
        read_ms = (time.perf_counter() - t0) / len(b) * 1e3
    print(f"prefetch: {len(b)} batches of {args.prefetch_batch_size} x {args.prefetch_dim} float32, reading"
          f" {read_ms:.2f} ms a batch, step {args.step_ms:g} ms: off {rates[False]:.0f} batches/s, on"
          f" {rates[True]:.0f} batches/s")
    return rates[True] / rates[False]


def _streamed_write_peak(tmp: Path, size_gib: float) -> tuple[int, int, float]:
    """Peak RSS (bytes) of a child writing ``size_gib`` GiB through ``Catalog.writer``; its size, seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child-write", str(tmp), "--size-gib", str(size_gib)],
                         env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    seconds = time.perf_counter() - t0
    print(out.strip())
    # The child's own high-water mark (VmHWM, reset at exec). getrusage(RUSAGE_CHILDREN) would also count this
    # process's pages: Linux keeps the fork's maximum RSS across the exec, and this process holds torch.
    hwm = [line.split()[1] for line in out.splitlines() if line.startswith("VmHWM")]
    peak = int(hwm[0]) * 1024 if hwm else resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    size = Catalog(tmp).path("bench.big").stat().st_size
    Catalog(tmp).path("bench.big").unlink()
    return peak, size, seconds


def _child_write(root: Path, size_gib: float) -> None:
    """Write ``size_gib`` GiB (int64 idx + float32 x[rows, 64]) in chunks of 16 MiB, as a new process."""
    dim, chunk = 64, 65536
    rows = int(size_gib * 2**30) // (8 + 4 * dim)
    rng = np.random.default_rng(3)
    with Catalog(root).writer("bench.big") as w:
        for a in range(0, rows, chunk):
            n = min(chunk, rows - a)
            w.append({"idx": np.arange(a, a + n), "x": rng.standard_normal((n, dim), dtype=np.float32)})
    print(f"streamed {rows:,} rows, revision {w.revision[:12]}")
    try:
        with open("/proc/self/status") as fh:
            print(next(line.strip() for line in fh if line.startswith("VmHWM")))  # kB
    except (OSError, StopIteration):
        pass


if __name__ == "__main__":
    main()
