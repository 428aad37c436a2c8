"""Benchmark of gwenlake_hpc.data batch reading (a script, not a test).

Writes a dataset of ``--rows`` rows (int64 ``idx`` + float32 ``features[rows, --dim]``) to a
temporary directory, then times:

1. a full shuffled epoch with the block shuffle of :class:`gwenlake_hpc.data.Batches`, against
   reading the first ``--fancy-rows`` rows of a uniform random permutation with h5py fancy
   indexing (sorted indices, as h5py requires), extrapolated to a full epoch;
2. the latency of the first batch of ``epoch(e, start=late)`` against ``start=0``.

Usage: ``python benchmarks/bench_data.py [--rows 2000000]``. Runs in well under a minute on 2 cores.
The file is freshly written, so it is read from the page cache: this measures h5py/numpy
overhead, not the disk (on a cold NFS file the fancy-index gap is much larger).
"""

from __future__ import annotations

import argparse
import statistics
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
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
