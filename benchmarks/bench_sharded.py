"""Benchmark of sharded checkpoints (a script, not a test): 2 gloo ranks, FSDP2 model + AdamW state.

The script starts itself twice with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), builds
on each rank a model of 1024x1024 float32 linear layers whose parameters and AdamW state (``exp_avg``,
``exp_avg_sq``) total ``--size-mib`` MiB, shards it with ``fully_shard`` and takes one optimizer step. Side by
side in one run, per rank (each rank's figure on its own line, ``_rank0`` / ``_rank1``):

- ``write_full_model`` (one consolidated safetensors model file, tensor by tensor) time, and its extra peak RSS
  (``VmHWM`` reset through ``/proc/self/clear_refs``) over the rank's shard of the whole state and over the
  largest full tensor; measured first, before the other figures' allocations are there to be reused;
- the loop blocking of ``dcp.async_save`` (as called without a stager: a new staging copy each time), of
  ``dcp.async_save`` with one ``DefaultStager`` kept across calls (its copies reused; the first call left out)
  and of ``dcp.save`` of the sharded state;
- a raw write + fsync of as many bytes as the rank's shard, against ``dcp.save`` of it;
- ``dcp.load`` of that checkpoint on the 2 ranks, and on 1 process (rank 0, ``no_dist``, into an unsharded
  model), which reshards;
- with ``--ours``, the same for our code, on a real :class:`~gwenlake_hpc.runtime.run.Run` of 2 ranks (built
  as the unit tests build one): the loop blocking of ``with run.checkpoint() as ck: save_state(...)``
  (asynchronous, the default; the first checkpoint is left out of the median), and of the block plus an
  optimizer ``step()`` right after it (which waits for the staging copy: the worst case, no forward/backward
  to overlap it with); the time of the whole sealed
  checkpoint (from the block's start until rank 0's background seal is done and every rank knows it) against a
  raw write + fsync of the same bytes (each rank as many bytes as its files in the sealed checkpoint, until every
  rank's are durable); ``load_state`` of the sealed checkpoint (verify + load) on the 2 ranks and on 1 process (a
  child process without a process group, into an unsharded model: DCP reshards), each against ``dcp.load`` of the
  same folder in the same conditions; and the extra peak RSS during our checkpoints (the first included) over the
  rank's shard bytes; beside ``dcp.load``, what restoring the model and optimizer takes with DCP alone
  (``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``, as torchtitan's Stateful wrappers do: ``dcp.load``
  alone leaves the optimizer's param groups unrestored), and both on 2 ranks from the disk (the folder evicted
  from the page cache before each: ``posix_fadvise``), as a resume on another node reads it. Before each peak-RSS figure freed heap memory is given back (``malloc_trim``), so that a
  reused allocation cannot hide a peak.

Prints one ``name value`` line per figure (seconds, bytes or ratios), from rank 0; ratios of issue 23's targets
add ``target OP X met|MISSED``, and the ``target_*`` lines at the end give the four targets' worst rank. Every
timing is the median of ``--repeat`` runs, with a barrier before each. The ``loadavg_1min`` line says how loaded
the machine was.
Usage: ``python benchmarks/bench_sharded.py [--size-mib 256] [--dir DIR] [--repeat 3] [--ours]``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from memory import drop_cached, reset_peak, vm_bytes, write_fsync

WIDTH = 1024


def give_back_heap() -> None:
    """Return freed heap memory to the system (glibc ``malloc_trim``), so the next peak-RSS figure is not hidden
    by memory an earlier figure freed and the allocator kept."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure may then read low
        pass


def build(layers: int, shard: bool, world: int = 1):
    """The benchmark's model (``layers`` 1024x1024 float32 linear layers, sharded by ``fully_shard`` over
    ``world`` ranks when ``shard``) and its AdamW, after one step (so the optimizer state exists)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def dcp_restore(model, opt, folder: Path, no_dist: bool = False) -> None:
    """What restoring a model and its optimizer takes with DCP alone (as torchtitan's Stateful wrappers do):
    ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict`` (the last applies the param groups)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(folder), no_dist=no_dist)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


def one_process_load(folder: Path, layers: int, repeat: int) -> None:
    """In a process without a process group: median seconds of ``load_state`` and of ``dcp.load`` of the DCP
    folder ``folder`` into an unsharded model, printed as one JSON line ``{"ours": s, "dcp": s}``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from gwenlake_hpc import load_state

    warnings.simplefilter("ignore", UserWarning)
    torch.set_num_threads(1)
    model, opt = build(layers, shard=False)
    times: dict[str, list[float]] = {"ours": [], "dcp": [], "dcp_restore": []}
    for _ in range(repeat):
        t0 = time.perf_counter()
        dcp_restore(model, opt, folder, no_dist=True)
        times["dcp_restore"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        load_state(folder, model=model, optimizer=opt)
        times["ours"].append(time.perf_counter() - t0)
        msd, osd = get_state_dict(model, opt)
        t0 = time.perf_counter()
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(folder), no_dist=True)
        times["dcp"].append(time.perf_counter() - t0)
    print(json.dumps({k: statistics.median(v) for k, v in times.items()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=float, default=256.0)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ours", action="store_true", help="also time run.checkpoint() + sharded save_state")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are stopped")
    parser.add_argument("--one-process-load", type=Path, default=None, help=argparse.SUPPRESS)  # the child's mode
    args = parser.parse_args()
    if args.one_process_load is not None:
        return one_process_load(args.one_process_load, layers_of(args.size_mib), args.repeat)
    if "RANK" in os.environ:
        return worker(args)

    tmp = Path(tempfile.mkdtemp(prefix="bench-sharded-", dir=args.dir))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "BENCH_DIR": str(tmp),
                   "GWENLAKE_DIST_TIMEOUT_S": str(int(args.timeout))}
            procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env,
                                          stdout=None if rank == 0 else subprocess.DEVNULL))
        deadline = time.monotonic() + args.timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"rank_timed_out after {args.timeout:.0f} s (the figures above are complete)", flush=True)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(max(p.returncode or 0 for p in procs))


def layers_of(size_mib: float) -> int:
    """Layers for a state of about ``size_mib`` MiB: parameters + exp_avg + exp_avg_sq, three float32 copies."""
    return max(1, round(size_mib * 2**20 / (3 * WIDTH * WIDTH * 4)))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from gwenlake_hpc.runtime.distributed import setup
    from gwenlake_hpc.stores.checkpoints.consolidate import write_full_model

    warnings.simplefilter("ignore", UserWarning)  # FSDP2's and DCP's notices, once per call
    torch.set_num_threads(1)
    d = setup()
    rank, world = d.rank, d.world_size
    tmp = Path(os.environ["BENCH_DIR"])
    layers = layers_of(args.size_mib)

    model, opt = build(layers, shard=True, world=world)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}

    def local_bytes(value) -> int:
        if isinstance(value, dict):
            return sum(local_bytes(v) for v in value.values())
        if isinstance(value, torch.Tensor):
            t = value.to_local() if hasattr(value, "to_local") else value
            return t.numel() * t.element_size()
        return 0

    shard_bytes = local_bytes(state)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    out: list[tuple[str, str]] = []  # this rank's figures, printed by rank 0 in order

    def figure(name: str, value) -> None:
        out.append((name, f"{value:.3f}" if isinstance(value, float) else str(value)))

    def timed(fn, before=None) -> float:
        times = []
        for i in range(args.repeat):
            if before is not None:
                before(i)
            dist.barrier()
            t0 = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t0)
        dist.barrier()
        return statistics.median(times)

    figure("state_bytes", full_bytes)
    figure("shard_bytes", shard_bytes)

    # write_full_model first: later figures' freed memory would otherwise be reused and hide its peak.
    base = vm_bytes("VmRSS")
    peaked = reset_peak()
    t0 = time.perf_counter()
    write_full_model(tmp / "model-0.safetensors", model)
    first = time.perf_counter() - t0
    peak = vm_bytes("VmHWM") - base if peaked else None
    figure("write_full_model_first_s", first)
    figure("write_full_model_s", timed(lambda i: write_full_model(tmp / f"model-{i}.safetensors", model)))
    if peak is not None:
        figure("write_full_model_extra_peak_rss_over_shard", peak / shard_bytes)
        figure("write_full_model_extra_peak_rss_over_largest_tensor", peak / largest)

    def clean(i):
        dist.barrier()
        if rank == 0:
            for p in tmp.glob("dcp-*"):
                shutil.rmtree(p, ignore_errors=True)

    # Every rank writes the same folder: dcp.save is collective, its checkpoint_id must agree.
    save_s = timed(lambda i: dcp.save(state, checkpoint_id=str(tmp / f"dcp-{i}")), clean)
    figure("dcp_save_block_s", save_s)
    blocks = []
    give_back_heap()
    base = vm_bytes("VmRSS")
    peaked = reset_peak()
    for i in range(args.repeat):
        clean(i)
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(tmp / f"dcp-{i}"))
        blocks.append(time.perf_counter() - t0)
        fut.result()
        dist.barrier()
    async_peak = vm_bytes("VmHWM") - base if peaked else None
    async_s = statistics.median(blocks)
    figure("dcp_async_save_block_s", async_s)
    if async_peak is not None:  # for comparison with ours: its staging copy (and the rest)
        figure("dcp_async_save_extra_peak_rss_over_shard", async_peak / shard_bytes)

    # dcp.async_save with one DefaultStager kept across calls (its host copies reused, as ours are): the
    # figure to read beside ours when a training keeps its own stager; the first call allocates, left out.
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    reused = []
    for i in range(args.repeat + 1):
        clean(i)
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(tmp / f"dcp-{i}"), async_stager=stager)
        reused.append(time.perf_counter() - t0)
        fut.result()
        dist.barrier()
    stager.close()
    reused_s = statistics.median(reused[1:])
    figure("dcp_async_save_reused_stager_block_s", reused_s)

    def raw_write(i):
        write_fsync(tmp / f"raw-{rank}.bin", shard_bytes)

    raw_s = timed(raw_write)
    figure("raw_write_fsync_shard_s", raw_s)

    ck = str(tmp / f"dcp-{args.repeat}")  # the last async_save's (reused stager), left by clean()
    load_s = timed(lambda i: dcp.load(state, checkpoint_id=ck))
    figure("dcp_load_2_ranks_s", load_s)
    if rank == 0:  # the 2-rank checkpoint into an unsharded model on 1 process: DCP reshards
        plain, plain_opt = build(layers, shard=False)
        pm, po = get_state_dict(plain, plain_opt)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            dcp.load({"model": pm, "optim": po}, checkpoint_id=ck, no_dist=True)
            times.append(time.perf_counter() - t0)
        load1_s = statistics.median(times)
        figure("dcp_load_1_process_s", load1_s)
    dist.barrier()

    ours: dict = {}
    if args.ours:
        ours = our_figures(args, d, tmp, model, opt, timed, shard_bytes, layers)
    else:
        ours = {"block_s": "n/a (pass --ours)"}
    for name, value in ours.items():
        figure(name if name.startswith(("raw_", "dcp_")) else "ours_" + name, value)
    ours_block = ours.get("block_s")

    def ratio(name: str, num, den, op: str | None = None, target: float | None = None) -> None:
        if not isinstance(num, float) or not isinstance(den, float) or den <= 0:
            figure(name, "n/a")
            return
        value = num / den
        if op is None:
            figure(name, value)
            return
        met = value <= target if op == "<=" else value >= target
        figure(name, f"{value:.3f} target {op} {target} {'met' if met else 'MISSED'}")

    targets: dict[str, tuple[float, str, float]] = {}  # this rank's target ratios, for the worst-rank lines

    def target(name: str, num, den, op: str, goal: float) -> None:
        ratio(name, num, den, op, goal)
        if isinstance(num, float) and isinstance(den, float) and den > 0:
            targets[name] = (num / den, op, goal)

    # (a) loop blocking; (b) throughput of our sealed write over a raw write+fsync of the same bytes (raw
    # seconds / ours); (c) resume (verify + load) over dcp.load; (d) extra peak RSS over the shard.
    target("ratio_ours_block_over_dcp_async_save", ours_block, async_s, "<=", 0.5)
    target("ratio_raw_write_over_ours_sealed_write", ours.get("raw_write_fsync_ours_bytes_s"),
           ours.get("sealed_write_s"), ">=", 0.8)
    target("ratio_ours_load_state_2_ranks_over_dcp_load", ours.get("load_state_2_ranks_s"),
           ours.get("dcp_load_ours_2_ranks_s"), "<=", 1.3)
    if rank == 0:
        target("ratio_ours_load_state_1_process_over_dcp_load", ours.get("load_state_1_process_s"),
               ours.get("dcp_load_ours_1_process_s"), "<=", 1.3)
    ratio("ratio_ours_load_state_2_ranks_over_dcp_restore", ours.get("load_state_2_ranks_s"),
          ours.get("dcp_restore_ours_2_ranks_s"))
    ratio("ratio_ours_load_state_2_ranks_cold_over_dcp_load_cold", ours.get("load_state_2_ranks_cold_s"),
          ours.get("dcp_load_ours_2_ranks_cold_s"))
    if rank == 0:
        ratio("ratio_ours_load_state_1_process_over_dcp_restore", ours.get("load_state_1_process_s"),
              ours.get("dcp_restore_ours_1_process_s"))
    peak = ours.get("checkpoint_extra_peak_rss_over_shard")
    if isinstance(peak, float):
        target("ratio_ours_extra_peak_rss_over_shard", peak, 1.0, "<=", 1.1)
    ratio("ratio_ours_block_over_dcp_async_save_reused_stager", ours_block, reused_s)
    ratio("ratio_ours_block_plus_next_optimizer_step_over_dcp_async_save",
          ours.get("block_plus_next_optimizer_step_s"), async_s)
    ratio("ratio_dcp_async_save_block_over_dcp_save", async_s, save_s)
    ratio("ratio_raw_write_over_dcp_save", raw_s, save_s)
    if rank == 0:
        ratio("ratio_dcp_load_1_process_over_2_ranks", load1_s, load_s)

    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    worst: list = [None] * world
    dist.all_gather_object(worst, targets)
    if rank == 0:
        print(f"loadavg_1min {os.getloadavg()[0]:.2f}")
        print(f"cpu_count {os.cpu_count()}")
        print(f"world_size {world}")
        for r, figures in enumerate(everyone):
            for name, value in figures:
                if name in ("state_bytes", "world_size") and r:
                    continue
                print(f"{name}{'' if name == 'state_bytes' else f'_rank{r}'} {value}", flush=True)
        for name in dict.fromkeys(k for t in worst for k in t):
            values = [(t[name][0], r) for r, t in enumerate(worst) if name in t]
            _, op, goal = next(t[name] for t in worst if name in t)
            value, r = max(values) if op == "<=" else min(values)
            met = value <= goal if op == "<=" else value >= goal
            print(f"target_{name.removeprefix('ratio_').removeprefix('ours_')} {value:.3f} target {op} {goal} "
                  f"{'met' if met else 'MISSED'} (worst: rank {r})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def our_figures(args, d, tmp: Path, model, opt, timed, shard_bytes: int, layers: int) -> dict:
    """Our code's figures (see the module's docstring), by name (seconds, ratios), or ``{"block_s": "n/a
    (why)"}`` when our checkpoint fails on a rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from gwenlake_hpc import load_state, save_state
    from gwenlake_hpc.runtime.run import Run
    from gwenlake_hpc.runtime.signals import StopRequest
    from gwenlake_hpc.stores.tracking import NullTracker

    blocks, stepped, sealed = [], [], []
    give_back_heap()
    base = vm_bytes("VmRSS")
    peaked = reset_peak()
    try:
        run = Run(run_dir=tmp / "run", run_key="bench", steps=10**9, epochs=None, eval_every=1, seed=0,
                  tracker=NullTracker(), stop=StopRequest(), progress="off", dist=d)
        steps = run.steps()
        for _ in range(args.repeat + 1):
            next(steps)
            dist.barrier()
            t0 = time.perf_counter()
            with run.checkpoint() as ck:
                save_state(ck.path("state.safetensors"), model=model, optimizer=opt)
            blocks.append(time.perf_counter() - t0)
            opt.step()  # no gradients: changes nothing, but waits for the staging copy as any step does
            stepped.append(time.perf_counter() - t0)
            run.wait_for_checkpoint()  # rank 0: its background seal; the others have nothing in flight
            dist.barrier()
            sealed.append(time.perf_counter() - t0)
        error = None
    except Exception as exc:  # say which rank failed and why, go on with the other figures
        error = f"{type(exc).__name__}: {str(exc)[:100]}"
    peak = vm_bytes("VmHWM") - base if peaked else None
    errors = [None] * d.world_size
    dist.all_gather_object(errors, error)
    failed = next((e for e in errors if e), None)
    if failed:
        return {"block_s": f"n/a ({failed})"}
    figures: dict = {"block_s": statistics.median(blocks[1:]),  # the first allocates the host buffers
                     "first_block_s": blocks[0], "sealed_write_s": statistics.median(sealed[1:]),
                     # the block and an optimizer step right after it, which waits for the staging copy: the
                     # loop's delay when its next step has no forward/backward to overlap the copy with
                     "block_plus_next_optimizer_step_s": statistics.median(stepped[1:])}
    if peak is not None:
        figures["checkpoint_extra_peak_rss_over_shard"] = peak / shard_bytes

    # This rank's bytes in the newest sealed checkpoint: its shard file(s) and rank state; rank 0 the rest too.
    name = [run.latest_checkpoint.path.name if d.rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    ckdir = run.store.root / name[0]
    files = json.loads((ckdir / "MANIFEST.json").read_text())["files"]

    def mine(rel: str) -> bool:
        if rel.startswith("state.safetensors/__"):
            return rel.startswith(f"state.safetensors/__{d.rank}_")
        if rel.startswith("gwenlake-ranks/"):
            return rel == f"gwenlake-ranks/rank-{d.rank:05d}.json"
        return d.rank == 0
    own = sum(e["size"] for rel, e in files.items() if mine(rel))
    if d.rank == 0:
        own += (ckdir / "MANIFEST.json").stat().st_size
    figures["checkpoint_bytes"] = own
    def raw_write(i):
        write_fsync(tmp / f"raw-ours-{d.rank}.bin", own)
        dist.barrier()  # until every rank's bytes are durable, as the seal waits for every rank

    figures["raw_write_fsync_ours_bytes_s"] = timed(raw_write)

    folder = ckdir / "state.safetensors"
    figures["load_state_2_ranks_s"] = timed(lambda i: load_state(folder, model=model, optimizer=opt))
    msd, osd = get_state_dict(model, opt)
    figures["dcp_load_ours_2_ranks_s"] = timed(lambda i: dcp.load({"model": msd, "optim": osd},
                                                             checkpoint_id=str(folder)))
    figures["dcp_restore_ours_2_ranks_s"] = timed(lambda i: dcp_restore(model, opt, folder))
    # The same from the disk (the folder evicted from the page cache before each), as a resume on another node.
    cold = (lambda i: drop_cached(folder)) if d.rank == 0 else None
    figures["load_state_2_ranks_cold_s"] = timed(lambda i: load_state(folder, model=model, optimizer=opt), cold)
    figures["dcp_load_ours_2_ranks_cold_s"] = timed(lambda i: dcp.load({"model": msd, "optim": osd},
                                                                  checkpoint_id=str(folder)), cold)
    if d.rank == 0:  # a child process without a process group; rank 1 waits at the barrier meanwhile
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        child = subprocess.run([sys.executable, __file__, "--one-process-load", str(folder),
                                "--size-mib", str(args.size_mib), "--repeat", str(args.repeat)],
                               env=env, capture_output=True, text=True, timeout=args.timeout)
        if child.returncode == 0:
            one = json.loads(child.stdout.strip().splitlines()[-1])
            figures["load_state_1_process_s"] = one["ours"]
            figures["dcp_load_ours_1_process_s"] = one["dcp"]
            figures["dcp_restore_ours_1_process_s"] = one["dcp_restore"]
        else:
            figures["load_state_1_process_s"] = f"n/a (exit {child.returncode}: {child.stderr[-200:]!r})"
    dist.barrier()
    return figures


if __name__ == "__main__":
    main()
