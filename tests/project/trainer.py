"""A small training used by the end-to-end tests (copied into a temporary project with its conf/).

Test hooks come from environment variables, never from params, so they do not change the run key:
  GWL_TEST_SIGTERM_AT=k       the process sends itself SIGTERM during step k (a real signal)
  GWL_TEST_SIGTERM_RANK=r     ... only on rank r of a multi-task run (default: every rank)
  GWL_TEST_SIGKILL_IN_CKPT=k  SIGKILL half-way through writing the checkpoint of step k
  GWL_TEST_SIGKILL_AT=k       SIGKILL as step k begins (steps up to k-1 done, nothing of k)
  GWL_TEST_SIGKILL_AFTER_CKPT=k  the checkpoint of step k is synchronous, and SIGKILL follows its block at once
                              (with checkpoint.local_dir: sealed on the local level, its copy just begun)
  GWL_TEST_PAUSE=k:reached:go at step k, create file `reached` and wait for file `go` (may repeat, ';'-separated)
  GWL_TEST_SLEEP=s            sleep s seconds per step
  GWL_TEST_BAD=escape|column|raise|nooutput|str  misuse the API on purpose (write no output, return a str), or
                              raise at step 5
  GWL_TEST_NOTE=1             write output.path / "note.txt" directly (not through output.file)
  GWL_TEST_NAN_AT=k           the loss of step k is NaN (before backward: the weights turn NaN too)
  GWL_TEST_OWN_HANDLER=k      at step k install a SIGTERM handler of its own (as profilers do) that appends a line
                              to ./own_handler_calls
  GWL_TEST_CUSTOM_METRIC=1    each step also sends the loss with gwenlake_hpc.log_custom_metric (tag split:train)
  GWL_TEST_TAGGED=1           at each evaluation also log tagged metrics (gwenlake_hpc.log_metrics and run.log)
  GWL_TEST_NAMED=NAME          print last_checkpoint_path() at the start; at the end save a named checkpoint NAME
  GWL_TEST_ROLLOUTS=1         at each evaluation also log an RL rollout (a tool-calling conversation) as a trace
  GWL_TEST_SHORT_WAIT=r:g     the short fit creates file r, then waits for file g
  GWL_TEST_GLOBAL_BATCH=g     the per-rank batch size is g // world_size (instead of params.batch_size)
  GWL_TEST_SEEN=prefix        each rank appends "step epoch x0 x0 ..." (column x[:, 0] of its batch) to prefix.<rank>
  GWL_TEST_EXTRA_MB=m[:k]     checkpoints carry an extra float32 tensor of m MiB (from step k on), filled with
                              the step (no RNG drawn, so the training is the same as without it)
  GWL_TEST_CLOCK_SHIFT_S=s     time.time() is s seconds off (a host whose clock is behind or ahead)
  GWL_TEST_SLEEP_AT_IMPORT=file  at import, create `file` and sleep 600 s (GWL_TEST_SLEEP_AT_IMPORT_RANK=r: on
                              rank r only)
  GWL_TEST_SIGKILL_IN_OUTPUT=1  after the loop, write half of a file with a plain open() into the Output, then
                              SIGKILL while save_state writes a 128 MiB model there (its temporary file cut at
                              50 MiB, before its rename)
  GWL_TEST_FSYNC_BLOCK=k      from step k on, the checkpoint writer thread's next os.fsync blocks for good (in a C
                              call that releases the GIL, as an fsync on a hung file system does)
  GWL_TEST_SIGKILL=k:phase[:n] (fit_fsdp) rank GWL_TEST_SIGKILL_RANK (default 1) SIGKILLs itself at step k, at
                              phase step|before_write|mid_write|after_write|after_gather (see _SigkillPlan)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if os.environ.get("GWL_TEST_SLEEP_AT_IMPORT") and \
        os.environ.get("RANK", "0") == os.environ.get("GWL_TEST_SLEEP_AT_IMPORT_RANK", os.environ.get("RANK", "0")):
    Path(os.environ["GWL_TEST_SLEEP_AT_IMPORT"]).touch()  # a rank blocked before its loop (a stalled import)
    time.sleep(600)

if os.environ.get("GWL_TEST_CLOCK_SHIFT_S"):  # at import: before the job records this start's time
    _shift, _time = float(os.environ["GWL_TEST_CLOCK_SHIFT_S"]), time.time
    time.time = lambda: _time() + _shift

if os.environ.get("GWL_TEST_FSYNC_BLOCK"):  # at import: the writer thread calls os.fsync through the module
    import ctypes
    import threading

    _fsync_armed, _real_fsync = threading.Event(), os.fsync

    def fsync(fd):  # the name the hang verdict shows: the writer blocked "in fsync"
        if _fsync_armed.is_set() and threading.current_thread().name == "gwenlake-checkpoint-writer":
            print("test hook: the checkpoint writer blocks in fsync", file=sys.stderr, flush=True)
            while True:  # a signal ends libc's sleep early (the watchdog's dump): sleep again
                ctypes.CDLL(None).sleep(100000)  # GWL_TEST_FSYNC_BLOCK: the GIL released
        return _real_fsync(fd)

    os.fsync = fsync

import numpy as np
import torch
from torch import nn

import gwenlake_hpc
from gwenlake_hpc.transforms import train as train_short
from gwenlake_hpc import Input, Output, load_state, log_custom_metric, log_metrics, save_state, train


@dataclass
class Params:
    batch_size: int = 16
    lr: float = 0.01
    hidden: int = 8


def _pauses():
    out = {}
    for item in filter(None, os.environ.get("GWL_TEST_PAUSE", "").split(";")):
        step, reached, go = item.split(":")
        out[int(step)] = (Path(reached), Path(go))
    return out


@train(data=Input("t.rows"), output=Output("t.model"), steps=60, eval_every=10)
def fit(data, output, run, config: Params):
    model = nn.Sequential(nn.Linear(4, config.hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(config.hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    if run.resumed:
        load_state(run.resume_path / "state.safetensors", model=model, optimizer=opt)
    # Several tasks: DDP averages the gradients over the ranks (gloo on the CPU), each rank on its own shard.
    net = nn.parallel.DistributedDataParallel(model) if run.world_size > 1 else model
    sigterm_rank = int(os.environ.get("GWL_TEST_SIGTERM_RANK", run.rank))
    sigterm_at = int(os.environ.get("GWL_TEST_SIGTERM_AT", "-1"))
    kill_at = int(os.environ.get("GWL_TEST_SIGKILL_IN_CKPT", "-1"))
    kill_after = int(os.environ.get("GWL_TEST_SIGKILL_AFTER_CKPT", "-1"))
    sigkill_at = int(os.environ.get("GWL_TEST_SIGKILL_AT", "-1"))
    sleep_s = float(os.environ.get("GWL_TEST_SLEEP", "0"))
    # GWL_TEST_SLOW_STEPS=k:s,...: step k takes s seconds more (a slow first step, a long evaluation)
    slow_steps = {int(k): float(v) for k, v in (i.split(":") for i in filter(None, os.environ.get(
        "GWL_TEST_SLOW_STEPS", "").split(",")))}
    pauses = _pauses()
    extra_mb, _, extra_from = os.environ.get("GWL_TEST_EXTRA_MB", "0").partition(":")
    blob = torch.empty(int(float(extra_mb) * 2**20) // 4) if float(extra_mb) else None
    columns = ["x", "y", "nope"] if os.environ.get("GWL_TEST_BAD") == "column" else ["x", "y"]
    nan_at = int(os.environ.get("GWL_TEST_NAN_AT", "-1"))
    own_handler_at = int(os.environ.get("GWL_TEST_OWN_HANDLER", "-1"))
    custom = os.environ.get("GWL_TEST_CUSTOM_METRIC") == "1"
    named = os.environ.get("GWL_TEST_NAMED")
    if named:
        print(f"last named checkpoint: {gwenlake_hpc.last_checkpoint_path()}", flush=True)
    tagged = os.environ.get("GWL_TEST_TAGGED") == "1"
    rollouts = os.environ.get("GWL_TEST_ROLLOUTS") == "1"
    global_batch = os.environ.get("GWL_TEST_GLOBAL_BATCH")
    batch_size = int(global_batch) // run.world_size if global_batch else config.batch_size
    seen = os.environ.get("GWL_TEST_SEEN")
    if os.environ.get("GWL_TEST_RAISE_BEFORE_LOOP"):  # a failure before the loop, after some start-up time
        time.sleep(float(os.environ["GWL_TEST_RAISE_BEFORE_LOOP"]))
        raise ValueError("test hook: failed before the loop")
    for step, batch in run.steps(data.batches(batch_size, columns=columns)):
        if step == sigkill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if seen:
            with open(f"{seen}.{run.rank}", "a") as fh:
                fh.write(" ".join(map(repr, [step, run.epoch, *batch["x"][:, 0].tolist()])) + "\n")
        loss = nn.functional.mse_loss(net(batch["x"]).squeeze(-1), batch["y"])
        if step == nan_at:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.log({"loss": loss.item()})
        if custom:
            log_custom_metric("loss", loss.item(), tags={"split": "train", "step": step})
        if rollouts and run.at_eval:
            gwenlake_hpc.log_rollout(
                [{"role": "system", "content": "You check the weather."},
                 {"role": "user", "content": f"Weather at step {step}?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"call-{step}", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                 {"role": "tool", "tool_call_id": f"call-{step}", "content": "sunny"},
                 {"role": "assistant", "content": "It is sunny."}],
                reward=step / 100, task_id=f"task-{step}", metrics={"turns": 2}, rollout_id=f"{step:032x}")
        if tagged and run.at_eval:
            log_metrics({"mse": loss.item()}, tags={"split": "val", "class": "all"})
            run.log({"acc": 0.5 + step / 1000}, tags={"threshold": 0.5, "epoch": step // 10})
            run.log({"odd": 1.0}, tags={"colour": "red"})
        if step == 5 and os.environ.get("GWL_TEST_BAD") == "raise":
            raise RuntimeError("boom at step 5")
        if step == own_handler_at:
            def own(signum, frame):
                with open("own_handler_calls", "a") as fh:
                    fh.write(f"{signum}\n")
            signal.signal(signal.SIGTERM, own)
        if step == sigterm_at and run.rank == sigterm_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        if step in pauses:
            reached, go = pauses[step]
            reached.touch()
            while not go.exists():
                time.sleep(0.05)
        if sleep_s and os.environ.get("GWL_TEST_SLEEP_RANK", str(run.rank)) == str(run.rank):
            time.sleep(sleep_s)
        time.sleep(slow_steps.get(step, 0))
        _hang(step, run)
        if os.environ.get("GWL_TEST_FSYNC_BLOCK") == str(step):
            _fsync_armed.set()
        if run.at_eval:
            # The torn-file hook needs the file on disk inside the block: a synchronous checkpoint.
            with run.checkpoint(keep=3, sync=step in (kill_at, kill_after)) as ck:
                if os.environ.get("GWL_TEST_SLEEP_IN_CKPT"):
                    time.sleep(float(os.environ["GWL_TEST_SLEEP_IN_CKPT"]))
                path = ck.path("state.safetensors")
                extra = None
                if blob is not None and step >= int(extra_from or 0):
                    extra = {"blob": blob.fill_(float(step))}
                save_state(path, model=model, optimizer=opt, extra=extra)
                if step == kill_at:
                    # Leave a torn file behind, then die without any chance to clean up.
                    data_bytes = path.read_bytes()
                    path.write_bytes(data_bytes[: len(data_bytes) // 2])
                    os.kill(os.getpid(), signal.SIGKILL)
                ck.metrics = {"train_loss": loss.item()}
            if step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    if run.evicted:
        return None
    if named:
        Path("notes.txt").write_text(f"run {run.run_key}\n")
        gwenlake_hpc.checkpoint(model, path=named, metadata={"lr": config.lr, "seed": run.seed},
                                additional_files=["notes.txt"])
    if os.environ.get("GWL_TEST_BAD") == "escape":
        output.file("../escaped.txt").write_text("must not happen")
    if os.environ.get("GWL_TEST_BAD") == "nooutput":
        return {"final_loss": 0.0}
    if os.environ.get("GWL_TEST_BAD") == "str":
        return "done"
    if os.environ.get("GWL_TEST_SIGKILL_IN_OUTPUT"):
        _die_writing_output(output)
    save_state(output.file("model.safetensors"), model=model)
    if os.environ.get("GWL_TEST_NOTE"):
        (output.path / "note.txt").write_text(f"rank {run.rank} of {run.world_size}\n")
    model.eval()
    with torch.no_grad():
        full = data.read(["x", "y"])
        mse = nn.functional.mse_loss(model(torch.from_numpy(full["x"])).squeeze(-1), torch.from_numpy(full["y"]))
    return {"final_loss": mse.item()}


def _die_writing_output(output):
    """The reported input of a version holding a temporary file: a user's own file half written with open(), then
    a SIGKILL while ``save_state`` writes a ``Linear(4096, 8192)`` (128 MiB) into the Output: its temporary file is
    cut to 50 MiB at its fsync, before the rename."""
    with open(output.file("notes.txt"), "w") as fh:
        fh.write("half of a note")
    real_fsync = os.fsync

    def fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if ".model.safetensors." in name and name.endswith(".tmp"):
            os.truncate(fd, 50 * 2**20)
            os.kill(os.getpid(), signal.SIGKILL)
        real_fsync(fd)

    os.fsync = fsync
    save_state(output.file("model.safetensors"), model=nn.Linear(4096, 8192))


def _hang(step, run):
    """GWL_TEST_HANG=k:how (GWL_TEST_HANG_RANK: that rank only): at step k block for good, ``gil``: in a C call that
    holds the GIL (libc's sleep through ctypes.PyDLL), ``sleep``: time.sleep; the checkpoints before are sealed
    first (a GIL held for good stops the background seal too). GWL_TEST_HANG_ONCE=file: only while ``file`` does
    not exist (made first), so that the rerun goes on."""
    spec = os.environ.get("GWL_TEST_HANG", "")
    if not spec:
        return
    at, how = spec.split(":")
    if int(at) != step or os.environ.get("GWL_TEST_HANG_RANK", str(run.rank)) != str(run.rank):
        return
    run.wait_for_checkpoint()
    once = os.environ.get("GWL_TEST_HANG_ONCE")
    if once:
        if Path(once).exists():
            return
        Path(once).touch()
    print(f"test hook: hanging at step {step} ({how})", flush=True)
    if how == "gil":
        import ctypes

        while True:  # a signal ends libc's sleep early (the watchdog's dump): sleep again, the GIL held throughout
            ctypes.PyDLL(None).sleep(100000)
    else:
        while True:
            time.sleep(100000)  # GWL_TEST_HANG sleep


class _Rows(torch.utils.data.Dataset):
    """The dataset's rows through a torch Dataset, read in DataLoader worker processes."""

    def __init__(self, data):
        full = data.read(["x", "y"])
        self.x, self.y = torch.from_numpy(full["x"]), torch.from_numpy(full["y"])

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        hang = os.environ.get("GWL_TEST_LOADER_HANG")  # "index:marker": the worker blocks for good on that row
        if hang and int(hang.split(":", 1)[0]) == i and not Path(hang.split(":", 1)[1]).exists():
            Path(hang.split(":", 1)[1]).write_text(str(os.getpid()))
            while True:
                time.sleep(3600)
        return {"x": self.x[i], "y": self.y[i], "pid": os.getpid()}


@train(data=Input("t.rows"), output=Output("t.model"), steps=60, eval_every=10)
def fit_loader(data, output, run, config: Params):
    """The same model fed by a torch DataLoader with two worker processes (GWL_TEST_PAUSE works here too)."""
    model = nn.Sequential(nn.Linear(4, config.hidden), nn.ReLU(), nn.Linear(config.hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    if run.resumed:
        load_state(run.resume_path / "state.safetensors", model=model, optimizer=opt)
    pauses = _pauses()
    loader = torch.utils.data.DataLoader(_Rows(data), batch_size=config.batch_size, num_workers=2,
                                         persistent_workers=True)
    for step, batch in run.steps(loader):
        loss = nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.log({"loss": loss.item()})
        if step in pauses:
            reached, go = pauses[step]
            reached.write_text(" ".join(str(int(p)) for p in set(batch["pid"].tolist())))
            while not go.exists():
                time.sleep(0.05)
        if run.at_eval:
            with run.checkpoint(keep=3) as ck:
                save_state(ck.path("state.safetensors"), model=model, optimizer=opt)
    if run.evicted:
        return None
    save_state(output.file("model.safetensors"), model=model)
    return {"final_loss": loss.item()}


#: The same training set by epochs (3 epochs over the batches) instead of steps.
fit_epochs = train(data=Input("t.rows"), output=Output("t.model"), epochs=3, eval_every=4)(fit.fn)


@train(data=Input("t.rows"), output=Output("t.model"), steps=20, eval_every=10, name="declared", cpu="2",
       memory="500Mi", gpu="1", env={"GWL_DECLARED": "from the decorator"}, secrets=["GWL_TEST_TOKEN"],
       metadata={"team": "crm", "purpose": "resources test"}, max_retries=5)
def fit_declared(data, output, run, config: Params):
    """The same training with resources declared on the decorator (the SLURM launcher's defaults)."""
    print(f"GWL_DECLARED={os.environ.get('GWL_DECLARED', 'unset')}", flush=True)
    print(f"token present: {bool(os.environ.get('GWL_TEST_TOKEN'))}", flush=True)
    return fit.fn(data, output, run, config)


@train_short(data=Input("t.rows"), output=Output("t.model"))
def short(data, output, config: Params):
    """A short fit: least squares on the DataFrame (x_0..x_3 from the [rows, 4] column x)."""
    if os.environ.get("GWL_TEST_SHORT_WAIT"):  # reached:go, as GWL_TEST_PAUSE
        reached, go = (Path(p) for p in os.environ["GWL_TEST_SHORT_WAIT"].split(":"))
        reached.touch()
        while not go.exists():
            time.sleep(0.05)
    x = data[[f"x_{i}" for i in range(4)]].to_numpy()
    w, *_ = np.linalg.lstsq(x, data["y"].to_numpy(), rcond=None)
    np.save(output.file("w.npy"), w)
    print(f"short fit: {len(data)} rows, columns {list(data.columns)}, lr {config.lr}", flush=True)
    return {"mse": float(np.mean((x @ w - data["y"].to_numpy()) ** 2))}


def _sigkill(moment):
    """Say on stderr where this process dies (the tests check that the planned moment was reached), then die."""
    print(f"test hook: SIGKILL {moment}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class _KillingStream:
    """A DCP output stream that SIGKILLs the process once ``limit`` bytes went through it (those bytes are
    written and flushed first: a torn shard file is left behind)."""

    def __init__(self, stream, limit):
        self._stream, self._left, self._written = stream, limit, 0

    def write(self, data):
        view = memoryview(data).cast("B")
        if len(view) >= self._left:
            self._stream.write(view[: self._left])
            self._stream.flush()
            _sigkill(f"after {self._written + self._left} bytes of {self._stream.name}")
        self._left -= len(view)
        self._written += len(view)
        return self._stream.write(view)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _SigkillPlan:
    """GWL_TEST_SIGKILL=k:phase[:n]: the rank GWL_TEST_SIGKILL_RANK (default 1) SIGKILLs itself at step k.

    Phases, in the order a sharded checkpoint goes through them on that rank:
      step          during step k, after the optimizer step, outside any checkpoint block;
      before_write  inside the checkpoint block of step k, before its save_state;
      after_write   save_state returned, still inside the block (an asynchronous checkpoint, the default: the
                    shards only staged in host memory; a synchronous one: written, fsynced, hashed, recorded);
      mid_write     after n bytes (default 1) of its shard file ``__<rank>_0.distcp`` reached the file (DCP's
                    FileSystem streams are wrapped; if the shard is shorter, at the end of its write): in the
                    background writer's thread, while the loop goes on (asynchronous), or in the block;
      after_gather  just after the gather of the digests to rank 0, before rank 0's seal is confirmed (rank 0
                    seals): in the background writer's thread too (asynchronous).
      final         after the loop, before the final save_state of the model into the Output (rank 0 then
                    gathers the full model alone), k ignored;
      end           after that save_state, as the function returns (rank 0 commits, then waits at the job's
                    final barrier), k ignored.
    mid_write and after_gather patch a torch / gwenlake_hpc function in this process only (a test hook)."""

    PHASES = ("step", "before_write", "mid_write", "after_write", "after_gather", "final", "end")

    def __init__(self, rank):
        spec = os.environ.get("GWL_TEST_SIGKILL", "")
        self.step, self.phase, self.limit = -1, None, 1
        if spec and rank == int(os.environ.get("GWL_TEST_SIGKILL_RANK", "1")):
            step, phase, *limit = spec.split(":")
            assert phase in self.PHASES, spec
            self.step, self.phase, self.limit = int(step), phase, int(limit[0]) if limit else 1

    def at(self, step, phase):
        """SIGKILL now when (step, phase) is the plan's; arm the patched functions of mid_write/after_gather."""
        if step != self.step:
            return
        if phase == "before_write" and self.phase == "mid_write":
            self._arm_stream()
        elif phase == "before_write" and self.phase == "after_gather":
            self._arm_gather()
        elif phase == self.phase:
            _sigkill(f"at step {step}, {phase}")

    def _arm_stream(self):
        import contextlib

        from torch.distributed.checkpoint import filesystem

        original, limit = filesystem.FileSystem.create_stream, self.limit

        @contextlib.contextmanager
        def create_stream(fs, path, mode):
            with original(fs, path, mode) as stream:
                if "w" not in mode or not str(path).endswith(".distcp"):
                    yield stream
                    return
                yield _KillingStream(stream, limit)
                _sigkill(f"at the end of {path}, shorter than {limit} bytes")

        filesystem.FileSystem.create_stream = create_stream

    def _arm_gather(self):
        from gwenlake_hpc.runtime import distributed

        original, step = distributed.Dist.gather, self.step

        def gather(d, obj):
            out = original(d, obj)
            _sigkill(f"after the gather of step {step}")
            return out

        distributed.Dist.gather = gather


def _full_state(model, opt):
    """The full (unsharded) model and optimizer state on every rank (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@train(data=Input("t.rows"), output=Output("t.model"), steps=30, eval_every=5)
def fit_fsdp(data, output, run, config: Params):
    """The model sharded by FSDP2 (``fully_shard``) over the ranks, AdamW, a sharded ``save_state`` every 5 steps.

    Hooks (besides GWL_TEST_SIGTERM_AT / GWL_TEST_SIGTERM_RANK / GWL_TEST_SLEEP): GWL_TEST_DUMP=dir makes rank 0
    torch.save the full state right after each checkpoint (``saved-<step>.pt``) and right after the resume's
    load_state (``loaded-<step>-world-<n>.pt``); GWL_TEST_INIT_FROM=file loads a plain save_state file into the
    sharded model first (dumped as ``init.pt``); GWL_TEST_SIGKILL=k:phase[:n] SIGKILLs one rank at a moment of
    step k (see :class:`_SigkillPlan`); GWL_TEST_SAVE_RANK=r: only rank r calls save_state, GWL_TEST_PATH_RANK1=name: rank 1 saves
    under another name (users' mistakes); GWL_TEST_NAMED=name: at the end every rank saves a named checkpoint of the
    sharded model (``gwenlake_hpc.checkpoint``), GWL_TEST_NAMED_BAD_RANK=r: rank r gives it metadata that is not
    JSON (NaN), the others good metadata; GWL_TEST_NAMED_RANK=r: only rank r calls it; GWL_TEST_NAMED_PER_RANK=1:
    each rank names it ``<name>-<rank>``; GWL_TEST_NAMED_STATE_DICT=1: it is given ``model.state_dict()`` (DTensors);
    GWL_TEST_SIGTERM_BEFORE_LOOP_RANK=r: rank r sends itself SIGTERM right before ``run.steps()``.
    """
    torch.manual_seed(1234)  # the same initial weights on every rank and world size
    model = nn.Sequential(nn.Linear(4, config.hidden), nn.ReLU(), nn.Linear(config.hidden, 1))
    if run.world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (run.world_size,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr)
    run.prepare_checkpoint(model=model, optimizer=opt)  # each rank's staging copies made after the first step
    dump = Path(os.environ["GWL_TEST_DUMP"]) if os.environ.get("GWL_TEST_DUMP") else None
    if os.environ.get("GWL_TEST_INIT_FROM"):  # a plain save_state file into the sharded model
        load_state(os.environ["GWL_TEST_INIT_FROM"], model=model)
        full, _ = _full_state(model, opt)
        if dump is not None and run.is_main:
            torch.save(full, dump / "init.pt")
    if run.resumed:
        extra = load_state(run.resume_path / "state.safetensors", model=model, optimizer=opt)
        assert extra["step"] == run.start_step, extra
        full = _full_state(model, opt)
        if dump is not None and run.is_main:
            torch.save(full, dump / f"loaded-{run.start_step}-world-{run.world_size}.pt")
    sigterm_rank = int(os.environ.get("GWL_TEST_SIGTERM_RANK", run.rank))
    sigterm_at = int(os.environ.get("GWL_TEST_SIGTERM_AT", "-1"))
    kill = _SigkillPlan(run.rank)
    sleep_s = float(os.environ.get("GWL_TEST_SLEEP", "0"))
    if os.environ.get("GWL_TEST_SIGTERM_BEFORE_LOOP_RANK") == str(run.rank):
        os.kill(os.getpid(), signal.SIGTERM)  # a stop on this rank alone, before its loop (the others go on)
    for step, batch in run.steps(data.batches(config.batch_size)):
        loss = nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.log({"loss": loss.item()})
        kill.at(step, "step")
        if step == sigterm_at and run.rank == sigterm_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        if sleep_s:
            time.sleep(sleep_s)
        if run.at_eval:
            with run.checkpoint(keep=3) as ck:
                kill.at(step, "before_write")
                name = os.environ.get("GWL_TEST_PATH_RANK1", "state.safetensors") if run.rank == 1 else \
                    "state.safetensors"
                if os.environ.get("GWL_TEST_SAVE_RANK", str(run.rank)) == str(run.rank):
                    save_state(ck.path(name), model=model, optimizer=opt, extra={"step": step})
                kill.at(step, "after_write")
            if dump is not None:
                full = _full_state(model, opt)
                if run.is_main:
                    torch.save(full, dump / f"saved-{step}.pt")
    if run.evicted:
        return None
    if os.environ.get("GWL_TEST_NAMED") and os.environ.get("GWL_TEST_NAMED_RANK", str(run.rank)) == str(run.rank):
        bad = os.environ.get("GWL_TEST_NAMED_BAD_RANK") == str(run.rank)
        name = os.environ["GWL_TEST_NAMED"] + (f"-{run.rank}" if os.environ.get("GWL_TEST_NAMED_PER_RANK") else "")
        gwenlake_hpc.checkpoint(model.state_dict() if os.environ.get("GWL_TEST_NAMED_STATE_DICT") else model,
                                path=name, metadata={"lr": float("nan") if bad else config.lr, "seed": run.seed})
    kill.at(kill.step, "final")
    save_state(output.file("model.safetensors"), model=model)  # one full file, written by rank 0
    kill.at(kill.step, "end")
    return {"final_loss": run.summary()["loss"]}
