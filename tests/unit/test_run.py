"""Run: step numbering, at_eval, eviction at step boundaries, resume with computed data position."""

import gc
import logging
import math
import os
import time
import weakref

import numpy as np
import pytest
import torch

from gwenlake_hpc import Output, load_state, save_state, train
from gwenlake_hpc.data import Catalog
from gwenlake_hpc.base.errors import ConfigError, GwenlakeError
from gwenlake_hpc.runtime.rng import seed_everything
from gwenlake_hpc.runtime.run import Run
from gwenlake_hpc.runtime.signals import StopRequest


class Recorder:
    """Stands in for the MLflow tracker (tracking has its own real-server tests)."""

    run_id = "rec"

    def __init__(self):
        self.points = []
        self.tags = []

    def log_metrics(self, metrics, step):
        self.points.append((step, dict(metrics)))

    def set_tags(self, tags):
        self.tags.append(dict(tags))


def make_run(tmp_path, stop=None, **kw):
    args = dict(run_dir=tmp_path / "run", run_key="k", steps=10, epochs=None, eval_every=4, seed=0,
                tracker=Recorder(), stop=stop or StopRequest(), progress="off")
    args.update(kw)
    return Run(**args)


def test_fresh_run_steps_and_at_eval(tmp_path):
    run = make_run(tmp_path)
    seen = [(step, run.at_eval, run.stopping) for step, _ in run.steps()]
    assert [s for s, _, _ in seen] == list(range(1, 11))
    assert [s for s, e, _ in seen if e] == [4, 8, 10]
    assert not any(st for _, _, st in seen)
    assert not run.evicted and not run.resumed and run.start_step == 0


def test_stop_during_step_without_checkpoint_adds_a_final_step(tmp_path):
    stop = StopRequest()
    run = make_run(tmp_path, stop)
    steps = []
    for step, _ in run.steps():
        steps.append(step)
        if step == 3:
            stop.request("test")
        if step == 4:
            assert run.at_eval and run.stopping
            with run.checkpoint() as ck:
                ck.path("w").write_text("4")
    # stop arrived during 3 (no checkpoint) -> step 4 is the final step, with at_eval and stopping
    assert steps == [1, 2, 3, 4]
    assert run.evicted


def test_stop_during_checkpointed_step_ends_after_it(tmp_path):
    stop = StopRequest()
    run = make_run(tmp_path, stop, eval_every=2)
    steps = []
    for step, _ in run.steps():
        steps.append(step)
        if run.at_eval:
            stop.request("test") if step == 6 else None
            with run.checkpoint():
                pass
    assert steps == [1, 2, 3, 4, 5, 6] and run.evicted


def test_stop_before_step_makes_it_final(tmp_path, caplog):
    stop = StopRequest()
    run = make_run(tmp_path, stop)
    flags = []
    for step, _ in run.steps():
        flags.append((step, run.at_eval, run.stopping))
        if step == 2:
            stop.request("test")  # arrives during 2; 2 has no checkpoint
    assert flags[-1] == (3, True, True)
    with caplog.at_level(logging.WARNING):
        pass
    assert run.evicted


def test_final_step_without_checkpoint_warns(tmp_path, caplog):
    stop = StopRequest()
    stop.request("before start")
    run = make_run(tmp_path, stop)
    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.run"):
        steps = [s for s, _ in run.steps()]
    assert steps == [1] and run.evicted
    assert "without a checkpoint" in caplog.text


def test_resume_restores_step_rng_and_data_position(tmp_path):
    catalog = Catalog(tmp_path / "data")
    catalog.write("t.rows", {"idx": np.arange(100, dtype=np.int64)})
    ds = catalog.open("t.rows")

    def run_once(root, stop_at=None):
        seed_everything(0)
        run = make_run(root, steps=40, eval_every=5, seed=3)
        seen, draws = [], []
        for step, batch in run.steps(ds.batches(8, block_rows=16, buffer_blocks=2)):
            seen.append((step, batch["idx"].tolist()))
            draws.append(torch.rand(1).item())
            if run.at_eval:
                with run.checkpoint(keep=2):
                    pass
            if stop_at == step:
                break
        return run, seen, draws

    _, full, full_draws = run_once(tmp_path / "a")
    run1, first, _ = run_once(tmp_path / "b", stop_at=17)  # last checkpoint at 15
    run2, second, second_draws = run_once(tmp_path / "b")
    assert run2.resumed and run2.start_step == 15
    assert second == full[15:]  # same batches from step 16 on, 13 batches/epoch so epochs cross
    assert second_draws == full_draws[15:]  # torch RNG continues as if never stopped
    assert sorted(i for _, b in full[:13] for i in b) == list(range(100))


SHORT_FIT_WITHOUT_TORCH = """
import sys
from pathlib import Path
import gwenlake_hpc.job.execute, gwenlake_hpc.transforms
from gwenlake_hpc.runtime.rng import seed_everything
from gwenlake_hpc.runtime.run import Run
from gwenlake_hpc.runtime.signals import StopRequest
from gwenlake_hpc.stores.tracking import NullTracker
seed_everything(7)
seed_everything(5)  # the job's second Run (a damaged checkpoint set aside): the later seed wins
run = Run(run_dir=Path(sys.argv[1]), run_key="k", steps=1, epochs=None, eval_every=1, seed=5,
          tracker=NullTracker(), stop=StopRequest(), progress="off")
assert [s for s, _ in run.steps()] == [1]
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))[:5]
import torch
drawn = torch.rand(3).tolist()
torch.manual_seed(5)
print("seeded" if drawn == torch.rand(3).tolist() else f"not seeded: {drawn}")
"""


def test_a_one_step_run_loads_no_torch_and_seeds_it_when_imported_later(tmp_path):
    """A short fit's Run needs no torch (its import costs seconds); user code that imports torch afterwards
    still gets it seeded with the run's seed, as if it had been imported first."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SHORT_FIT_WITHOUT_TORCH, str(tmp_path / "run")], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "seeded", out.stdout + out.stderr[-2000:]


PROBE_THEN_IMPORT = """
import importlib.util, sys
from gwenlake_hpc.runtime.rng import seed_everything
seed_everything(5)
assert importlib.util.find_spec("torch") is not None  # as transformers, accelerate, lightning do
import torch
drawn = torch.rand(3).tolist()
torch.manual_seed(5)
hooks = [type(f).__name__ for f in sys.meta_path if "Torch" in type(f).__name__]
print("seeded" if drawn == torch.rand(3).tolist() else f"not seeded: {drawn}", hooks)
"""

IMPORTED_PAST_THE_HOOK = """
import base64, importlib.abc, importlib.machinery, sys
from gwenlake_hpc.runtime.rng import rng_state, seed_everything

class Bypass(importlib.abc.MetaPathFinder):  # a third-party import hook ahead of gwenlake's
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.PathFinder.find_spec(name, path, target) if name == "torch" else None

seed_everything(5)
sys.meta_path.insert(0, Bypass())
import torch
read = rng_state()["torch"]  # the Run's first read of the RNG gives torch its pending seed
torch.manual_seed(5)
first = "seeded" if read == base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode() else "not seeded"
seed_everything(9)  # a later seed (a second Run in this process) still reaches torch
drawn = torch.rand(3).tolist()
torch.manual_seed(9)
hooks = [type(f).__name__ for f in sys.meta_path if "Torch" in type(f).__name__]
print(first, "seeded" if drawn == torch.rand(3).tolist() else "not seeded", hooks)
"""


@pytest.mark.parametrize("script,want", [(PROBE_THEN_IMPORT, "seeded []"),
                                         (IMPORTED_PAST_THE_HOOK, "seeded seeded []")])
def test_torch_gets_the_seed_after_a_find_spec_probe_or_an_import_past_the_hook(tmp_path, script, want):
    """``importlib.util.find_spec("torch")`` before ``import torch`` must not lose the deferred seed; a torch
    imported by a hook that bypasses gwenlake's is seeded when the Run first reads the RNG; either way the
    hook is gone once torch is seeded."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and out.stdout.strip() == want, out.stdout + out.stderr[-2000:]


def test_epochs_length_and_errors(tmp_path):
    run = make_run(tmp_path, steps=None, epochs=3)
    assert [s for s, _ in run.steps([1, 2, 3, 4])][-1] == 12
    assert run.steps_for(10, 4) == 9
    with pytest.raises(ConfigError, match="job.steps or job.epochs"):
        list(make_run(tmp_path / "x", steps=None).steps())
    with pytest.raises(ConfigError, match="eval_every"):
        make_run(tmp_path / "y", eval_every=0)
    with pytest.raises(ConfigError, match="keep"):
        r = make_run(tmp_path / "z")
        with r.checkpoint(keep=0):
            pass


def test_log_tags_and_summary(tmp_path):
    run = make_run(tmp_path, steps=2)
    for step, _ in run.steps():
        run.log({"loss": torch.tensor(0.5 * step)})
    run.log({"auc": 0.8}, tags={"split": "test", "class": "churn"})
    assert run.tracker.points[-1] == (2, {"auc/class:churn/split:test": 0.8})
    assert run.tracker.tags == [{"gwenlake.metric_tags.auc/class:churn/split:test": '{"class": "churn", "split": "test"}'}]
    run.log({"auc": 0.9}, tags={"split": "test", "class": "churn"})
    assert len(run.tracker.tags) == 1  # recorded once per series
    assert run.summary()["loss"] == 1.0 and run.summary()["step"] == 2.0


def test_metric_tags_step_and_epoch_give_the_x_axis_and_odd_values_are_made_safe(tmp_path, caplog):
    from gwenlake_hpc.runtime.current import active, current_run, log_metrics

    run = make_run(tmp_path, steps=3)
    for step, _ in run.steps():
        run.log({"acc": 0.5}, tags={"threshold": 0.5, "epoch": step * 10})
    tagged = [p for p in run.tracker.points if not any(k.startswith("time/") for k in p[1])]
    assert tagged == [(10, {"acc/threshold:0.5": 0.5}), (20, {"acc/threshold:0.5": 0.5}), (30, {"acc/threshold:0.5": 0.5})]
    run.log({"f1": 0.1}, tags={"epoch": 2, "step": 7, "model_version": "crm.churn@ab:c/d"})
    assert run.tracker.points[-1] == (7, {"f1/model_version:crm.churn_ab_c_d": 0.1})  # step wins; ':' '/' '@' -> _
    with caplog.at_level("WARNING", logger="gwenlake_hpc.tracking"):
        run.log({"x": 1.0}, tags={"colour": "red"})
        run.log({"x": 2.0}, tags={"colour": "blue"})
    assert sum("'colour' is not one of" in r.getMessage() for r in caplog.records) == 1
    for bad in ({"bad tag": 1}, {"epoch": "two"}, {"step": -1}, {"step": 1.5}, {"split": None}, "split=val",
                {"split": "x" * 300}):
        with pytest.raises(ValueError, match="metric tag|MLflow takes 250"):
            run.log({"x": 1.0}, tags=bad)
    run.log({"auc": 0.1}, tags={"split": "a/b"})
    with pytest.raises(ValueError, match="both make the series 'auc/split:a_b'"):
        run.log({"auc": 0.2}, tags={"split": "a_b"})  # would merge with a/b, and one of the points be lost
    with pytest.raises(GwenlakeError, match="no training runs in this process"):
        log_metrics({"x": 1.0})
    with active(run):
        assert current_run() is run and os.environ["GWENLAKE_RUN_ID"] == "k"
        log_metrics({"y": 3.0}, tags={"split": "val"}, step=2)
    assert run.tracker.points[-1] == (2, {"y/split:val": 3.0})


def test_progress_line_reports_rate_and_eta():
    from gwenlake_hpc.runtime.progress import Progress

    p = Progress(total=1000, start=200, mode="lines", every_s=30)
    p.loss = 0.25
    line = p.line(600, now=p._t0 + 4.0)  # 400 steps in 4 s
    assert line == "step 600/1000 (60.0%) loss 0.25 100.0 steps/s ETA 0:00:04"


def test_a_dataloader_over_an_iterable_dataset_without_len_runs_job_steps(tmp_path):
    """torch's DataLoader defines __len__, which raises TypeError for an IterableDataset without one: the
    length is then unknown, job.steps sets it, and the stream is re-iterated as epochs."""
    import torch

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    run = make_run(tmp_path, steps=10)
    got = [(step, int(batch)) for step, batch in run.steps(loader)]
    assert got == [(s, (s - 1) % 4) for s in range(1, 11)]
    with pytest.raises(ConfigError, match="set job.steps"):
        list(make_run(tmp_path / "e", steps=None, epochs=2).steps(loader))


@pytest.mark.parametrize("where", ["sampler", "batch_sampler"])
def test_a_distributed_sampler_gets_each_epoch_also_on_a_resume(tmp_path, where):
    """As Lightning and Accelerate do, run.steps calls set_epoch on the DataLoader's sampler (or its batch
    sampler's) at each epoch, also the epoch a resume lands in; one replica, so no process group is needed."""
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

    rows = list(range(12))

    def loader():
        sampler = DistributedSampler(rows, num_replicas=1, rank=0, seed=7)
        if where == "sampler":
            return DataLoader(rows, batch_size=3, sampler=sampler)
        return DataLoader(rows, batch_sampler=BatchSampler(sampler, 3, drop_last=False))

    def run_once(root, stop_at=None):
        run = make_run(root, steps=None, epochs=3, eval_every=5)
        seen = []
        for step, batch in run.steps(loader()):
            seen.append((step, run.epoch, batch.tolist()))
            if run.at_eval:
                with run.checkpoint(keep=1):
                    pass
            if step == stop_at:
                break
        return run, seen

    ref = DistributedSampler(rows, num_replicas=1, rank=0, seed=7)
    want = []
    for e in range(3):
        ref.set_epoch(e)
        order = list(ref)
        want += [(1 + e * 4 + i, e, order[3 * i:3 * i + 3]) for i in range(4)]
    orders = {e: [i for _, e2, b in want if e2 == e for i in b] for e in range(3)}
    assert len({tuple(o) for o in orders.values()}) == 3 and sorted(orders[2]) == rows  # 3 different orders
    _, full = run_once(tmp_path / "a")
    assert full == want
    run_once(tmp_path / "b", stop_at=7)  # checkpoint at step 5: the resume lands in epoch 1, batch 1
    run2, second = run_once(tmp_path / "b")
    assert run2.start_step == 5 and second == want[5:]


class _NoisyRows(torch.utils.data.Dataset):
    """Row i is ``[i/24] * 3`` plus fresh torch noise at each read: drawn from a worker's RNG in a worker, from
    the training's own stream without workers."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.full((3,), i / 24) + torch.randn(3), i


@train(output=Output("t.noisy"), epochs=3, eval_every=4)
def _fit_noisy(output, run, config):
    """A model with dropout over a DataLoader of noisy rows; returns each step's rows, inputs and loss, and
    the final weights."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if run.resumed:
        load_state(run.resume_path / "state.safetensors", model=model, optimizer=opt)
    loader = torch.utils.data.DataLoader(_NoisyRows(), batch_size=4, shuffle=config["shuffle"],
                                         num_workers=config["workers"])
    seen = []
    for step, (x, rows) in run.steps(loader):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append((step, rows.tolist(), x.tolist(), loss.item()))
        if run.at_eval:
            with run.checkpoint(keep=1) as ck:
                save_state(ck.path("state.safetensors"), model=model, optimizer=opt)
        if step == config["stop_at"]:
            break
    return seen, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("workers,shuffle", [(0, False), (0, True), (2, False), (2, True)])
def test_a_dataloader_run_stopped_twice_ends_bit_identical(tmp_path, workers, shuffle):
    """Creating a DataLoader's iterator draws from the global torch RNG (its workers' base seed; with
    shuffle=True its sampler's seed too): a resume that lands mid-epoch must redo that draw from the state
    the epoch began with, then continue the training's own stream (dropout, noise read without workers)
    from the checkpoint's state. 6 batches an epoch, checkpoints every 4 steps: the first resume lands at
    batch 2 of epoch 1, the second at the start of epoch 2."""
    params = {"workers": workers, "shuffle": shuffle}
    full, weights = _fit_noisy.local({**params, "stop_at": 0}, seed=3)
    parts = [_fit_noisy.local({**params, "stop_at": stop}, seed=3, run_dir=tmp_path / "r")
             for stop in (9, 13, 0)]
    assert [s for s, *_ in full] == list(range(1, 19))
    assert sorted(r for _, rows, _, _ in full[:6] for r in rows) == list(range(24))
    resumed = parts[0][0][:8] + parts[1][0][:4] + parts[2][0]  # steps 1-8, 9-12 (the checkpoints), 13-18
    assert [s for s, *_ in parts[1][0]] == list(range(9, 14)) and parts[2][0][0][0] == 13
    assert resumed == full  # same rows, same noise, same losses, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(parts[2][1], weights))


def test_persistent_workers_keep_their_first_epoch_and_the_run_warns(tmp_path, caplog):
    """The workers' copy of the dataset is made once: set_epoch in the main process cannot reach it."""
    import torch

    class Stream(torch.utils.data.IterableDataset):
        epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __iter__(self):
            return iter([self.epoch * 10 + i for i in range(3)])

    def batches(root, persistent):
        loader = torch.utils.data.DataLoader(Stream(), batch_size=None, num_workers=1, persistent_workers=persistent)
        return [int(b) for _, b in make_run(root, steps=6).steps(loader)], loader.dataset.epoch

    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.run"):
        assert batches(tmp_path / "a", persistent=True) == ([0, 1, 2, 0, 1, 2], 1)
        assert "DataLoader(persistent_workers=True) keeps the copy of Stream" in caplog.text
        caplog.clear()
        assert batches(tmp_path / "b", persistent=False) == ([0, 1, 2, 10, 11, 12], 1)  # a fresh copy an epoch
        assert "persistent_workers" not in caplog.text


class DurableRecorder(Recorder):
    """A Recorder that notes when the Run asks for the points so far to be made durable (before a seal)."""

    def __init__(self):
        super().__init__()
        self.durable_at = []  # (number of points queued then, step being sealed)

    def make_durable(self, timeout_s):
        self.durable_at.append(len(self.points))


@pytest.mark.parametrize("sync", [True, False])
def test_an_evaluation_steps_time_breakdown_is_made_durable_with_its_checkpoint(tmp_path, sync):
    # A kill after the seal must not lose the breakdown of the step the resumed run starts after.
    t0 = time.perf_counter()
    run = make_run(tmp_path, tracker=DurableRecorder(), steps=12, eval_every=4, checkpoint_async=not sync)
    for step, _ in run.steps():
        if step in (4, 12):  # 8: an evaluation step without a checkpoint
            with run.checkpoint() as ck:
                ck.path("w").write_text(str(step))
        run.wait_for_checkpoint()
    times = [(i, s) for i, (s, values) in enumerate(run.tracker.points) if "time/compute" in values]
    assert [s for _, s in times] == [4, 8, 12]  # one breakdown per evaluation step, none twice
    first_seal, last_seal = run.tracker.durable_at
    assert times[0][0] < first_seal and times[2][0] < last_seal  # queued before the seal's points were made durable
    elapsed_s = time.perf_counter() - t0
    breakdowns = [values for _, values in run.tracker.points if "time/compute" in values]
    assert all(set(b) == {"time/input", "time/compute", "time/checkpoint", "time/tracking"} for b in breakdowns)
    assert all(0.0 <= v < math.inf for b in breakdowns for v in b.values())
    # Seconds per step over windows of 4 steps: disjoint parts of the loop, so they add up to no more than its time.
    assert sum(4 * sum(b.values()) for b in breakdowns) <= elapsed_s
    assert breakdowns[0]["time/checkpoint"] > 0 and breakdowns[2]["time/checkpoint"] > 0  # the blocks at 4 and 12


def test_a_finished_run_frees_its_checkpoint_buffers_without_a_gc_pass(tmp_path):
    # The Run's parts must not hold each other in a cycle: the host buffers of asynchronous snapshots (pinned
    # memory on a GPU) would outlive the Run until the next GC pass, and a second Run in the process add its own.
    model = torch.nn.Linear(3, 2)
    gc.disable()
    try:
        run = make_run(tmp_path, steps=4, eval_every=2, checkpoint_async=True)
        for _step, _ in run.steps():
            run.log({"loss": 0.5})
            if run.at_eval:
                with run.checkpoint(keep=1) as ck:
                    save_state(ck.path("state.safetensors"), model=model)
                    ck.metrics = {"auc": 0.5}
        assert run.summary()["auc"] == 0.5
        buffers = weakref.ref(run._checkpoints.buffers)
        del run, ck
        assert buffers() is None
    finally:
        gc.enable()


def test_check_handlers_puts_ours_back_chained_and_names_what_replaced_it(caplog):
    import signal

    from gwenlake_hpc.runtime.signals import StopRequest

    stop = StopRequest()
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop.install()
    try:
        assert stop.check_handlers() == []  # ours everywhere: nothing to do (the check of every step)
        theirs = []
        signal.signal(signal.SIGTERM, lambda signum, frame: theirs.append(signum))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert stop.check_handlers() == ["SIGTERM", "SIGINT"]
        assert stop.check_handlers() == []  # the chained handlers count as ours
        assert any("SIGINT was replaced (by ignore)" in r.getMessage() for r in caplog.records)
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # ours records the stop, then theirs runs
        assert stop.requested and stop.reason == "SIGTERM" and theirs == [signal.SIGTERM]
    finally:
        stop.uninstall()
    assert {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} == before
