"""Benchmark of checkpoints (a script, not a test): loop blocking, write speed, memory, resume.

Builds a model whose float32 parameters total ``--size-gib`` GiB (4096x4096 linear layers, no optimizer
state, so the state is exactly the parameters) and, side by side in one process, times:

- the loop blocking of ``with run.checkpoint() as ck: save_state(...)`` (asynchronous, the default), with the
  previous checkpoint already sealed, and of ``run.checkpoint(sync=True)``;
- synchronous ``torch.save`` + fsync, ``safetensors.torch.save_file`` + fsync, the blocking part of
  ``torch.distributed.checkpoint.async_save`` (one process), and a raw sequential write + fsync of as many bytes;
- the time an asynchronous checkpoint takes from the block's end until it is sealed (write, hash, fsync,
  manifest, rename), against the raw write of as many bytes;
- extra peak RSS (``VmHWM`` reset through ``/proc/self/clear_refs``) over the state size, for each of 10
  asynchronous checkpoints;
- resume: finding the newest intact checkpoint and ``load_state`` (verifying the digest while reading) against
  ``safetensors.torch.load_file`` + ``load_state_dict`` of the same file.

Prints one ``name value`` line per figure (seconds, bytes or ratios); the ratios of issue 9's targets add
``target OP X met|MISSED`` on their line. Usage:
``python benchmarks/bench_checkpoint.py [--size-gib 1] [--dir DIR] [--repeat 3]``. Resume is timed twice: with
the files in the page cache (as just written) and with their pages evicted first (``posix_fadvise
DONTNEED``: a requeued job on another node reads them from disk), both paths alike. Every timing is the
median of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gwenlake_hpc import load_state, save_state
from gwenlake_hpc.stores.checkpoints import CheckpointStore
from gwenlake_hpc.runtime.run import Run
from gwenlake_hpc.runtime.signals import StopRequest
from gwenlake_hpc.stores.tracking import NullTracker
from memory import reset_peak, vm_bytes


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def median_time(fn, repeat: int, before=None) -> float:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    layer_params = 4096 * 4096
    layers = max(1, round(args.size_gib * 2**30 / (layer_params * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers)])
    state_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    print(f"state_bytes {state_bytes}")
    print(f"cpu_threads {torch.get_num_threads()}")

    tmp = Path(tempfile.mkdtemp(prefix="bench-ck-", dir=args.dir))
    try:
        run = Run(run_dir=tmp / "run", run_key="bench", steps=10**9, epochs=None, eval_every=1, seed=0,
                  tracker=NullTracker(), stop=StopRequest(), progress="off")
        steps = run.steps()

        def checkpoint(sync: bool) -> tuple[float, float]:
            """(seconds the loop was blocked, seconds from the block's end until sealed) of one checkpoint."""
            next(steps)
            t0 = time.perf_counter()
            with run.checkpoint(sync=sync) as ck:
                save_state(ck.path("state.safetensors"), model=model)
            blocked = time.perf_counter() - t0
            run.wait_for_checkpoint()
            sealed = time.perf_counter() - t0
            run.store.retain(1)  # outside the timing: deleting old checkpoints is not writing this one
            return blocked, sealed - blocked

        base_rss = vm_bytes()
        peaks, blocks, seals = [], [], []
        for _ in range(10):
            peaked = reset_peak()
            b, s = checkpoint(sync=False)
            blocks.append(b)
            seals.append(s)
            if peaked:
                peaks.append((vm_bytes("VmHWM") - base_rss) / state_bytes)
        async_block = statistics.median(blocks[1:])
        async_seal = statistics.median(seals[1:])
        print(f"async_first_block_s {blocks[0]:.3f}")
        print(f"async_block_s {async_block:.3f}")
        print(f"async_sealed_s {async_seal:.3f}")
        sync_block = statistics.median(checkpoint(sync=True)[0] for _ in range(args.repeat))
        print(f"sync_checkpoint_block_s {sync_block:.3f}")
        if peaks:
            print(f"async_extra_peak_rss_over_state_first {peaks[0]:.3f}")
            print(f"async_extra_peak_rss_over_state_max_of_10 {max(peaks):.3f}")
            print(f"async_extra_peak_rss_over_state_last {peaks[-1]:.3f}")

        plain = tmp / "plain"
        plain.mkdir()

        def torch_save():
            torch.save(model.state_dict(), plain / "m.pt")
            fsync_file(plain / "m.pt")

        def st_save():
            from safetensors.torch import save_file

            save_file(model.state_dict(), str(plain / "m.safetensors"))
            fsync_file(plain / "m.safetensors")

        chunk = bytearray(64 << 20)

        def raw_write():
            with open(plain / "raw.bin", "wb", buffering=0) as fh:
                left = state_bytes
                while left > 0:
                    left -= fh.write(memoryview(chunk)[:min(left, len(chunk))])
                os.fsync(fh.fileno())

        def clean():
            for p in plain.iterdir():
                p.unlink()

        torch_save_s = median_time(torch_save, args.repeat, clean)
        print(f"torch_save_fsync_s {torch_save_s:.3f}")
        st_save_s = median_time(st_save, args.repeat, clean)
        print(f"safetensors_save_file_fsync_s {st_save_s:.3f}")
        raw_s = median_time(raw_write, args.repeat, clean)
        print(f"raw_write_fsync_s {raw_s:.3f}")
        try:
            import warnings

            import torch.distributed.checkpoint as dcp

            dcp_times = []
            for i in range(args.repeat):
                with warnings.catch_warnings():  # "assuming the intent is to save in a single process": yes
                    warnings.simplefilter("ignore")
                    t0 = time.perf_counter()
                    fut = dcp.async_save({"model": model.state_dict()}, checkpoint_id=str(plain / f"dcp-{i}"))
                    dcp_times.append(time.perf_counter() - t0)
                    fut.result()
            print(f"dcp_async_save_block_s {statistics.median(dcp_times):.3f}")
        except Exception as exc:  # an API that changes between torch versions: say why, go on
            print(f"dcp_async_save_block_s unavailable ({type(exc).__name__}: {str(exc)[:120]})")

        store = CheckpointStore(tmp / "run" / "checkpoints", "bench")
        target = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers)])

        def resume():
            ck = store.latest()
            load_state(ck.path / "state.safetensors", model=target)

        def plain_load():
            from safetensors.torch import load_file

            tensors = load_file(str(store.latest().path / "state.safetensors"))
            target.load_state_dict({k.removeprefix("model."): v for k, v in tensors.items()})

        def drop_cache():
            """Evict the checkpoint's pages from the page cache, as on a node that did not write it."""
            for f in store.latest().path.iterdir():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

        resume_s = median_time(resume, args.repeat)
        plain_s = median_time(plain_load, args.repeat)
        resume_cold_s = median_time(resume, args.repeat, drop_cache)
        plain_cold_s = median_time(plain_load, args.repeat, drop_cache)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), target.state_dict().values()))
        print(f"resume_verify_load_s {resume_s:.3f}")
        print(f"safetensors_load_file_s {plain_s:.3f}")
        print(f"resume_verify_load_cold_cache_s {resume_cold_s:.3f}")
        print(f"safetensors_load_file_cold_cache_s {plain_cold_s:.3f}")

        def ratio(name: str, value: float, op: str, target: float) -> None:
            met = value <= target if op == "<=" else value >= target
            print(f"{name} {value:.3f} target {op} {target} {'met' if met else 'MISSED'}")

        ratio("ratio_async_block_over_torch_save", async_block / torch_save_s, "<=", 0.10)
        print(f"ratio_sync_block_over_torch_save {sync_block / torch_save_s:.3f}")
        ratio("ratio_raw_write_over_sealed_write", raw_s / async_seal, ">=", 0.8)
        if peaks:
            ratio("ratio_extra_peak_rss_over_state", max(peaks), "<=", 1.1)
        ratio("ratio_resume_over_plain_load_cold_cache", resume_cold_s / plain_cold_s, "<=", 1.3)
        ratio("ratio_resume_over_plain_load_hot_cache", resume_s / plain_s, "<=", 1.3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
