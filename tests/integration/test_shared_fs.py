"""Shared filesystems as clusters have them (issue 27): the runs root on a real network filesystem, one folder
served by the tests' sshd and mounted twice with sshfs (tests/helpers/sshfs.py), each mount a "node" with its own
30 s attribute and listing cache and a ``flock`` that the other mount does not see.

- the run's lease holds across the mounts where ``flock`` does not (two starts at once: exactly one trains);
- a holder SIGKILLed is broken at once on its host; one SIGSTOPped is broken after ``job.lease_timeout_s``, and
  when it wakes up it is fenced: its seal, spool and commit are refused, it exits 2, the newer start finishes;
- a checkpoint sealed through one mount is found through the other while the other's listing hides it (the
  run's pointer), and a step folder the server has is never written over.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers.jobs import assert_one_point_per_step
from helpers.project import REPO, make_test_project
from helpers.sshfs import two_mounts

# slow, and mostly waiting (lease timeouts, sshfs round trips over ssh, cache waits): beside the cluster's tests
pytestmark = [pytest.mark.slow, pytest.mark.waits]


@pytest.fixture
def mounts(tmp_path):
    with two_mounts(tmp_path / "fs") as m:
        yield m


def _wait_file(path: Path, timeout_s: float = 180.0, proc=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended ({proc.returncode}) before {path} appeared:\n"
                                 f"{proc.stdout.read() if proc.stdout else ''}{proc.stderr.read() if proc.stderr else ''}")
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout_s} s"
        time.sleep(0.1)


# --- the lease, in processes of its own ----------------------------------------------------------------------

_HOLDER = textwrap.dedent("""
    import sys, time, pathlib
    sys.path.insert(0, {repo!r})
    from gwenlake_hpc.base.lease import Lease, FencedError
    run_dir, ask = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    lease = Lease(run_dir, timeout_s=float(sys.argv[3])).acquire()
    print("held", lease.fence, flush=True)
    while not ask.exists():
        time.sleep(0.05)
    try:
        lease.check("sealing a checkpoint")
        print("still holds", flush=True)
    except FencedError as exc:
        print("FENCED", exc, flush=True)
""")


def _holder(tmp_path, run_dir: Path, timeout_s: float):
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER.format(repo=str(REPO)))
    ask = tmp_path / f"ask-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir), str(ask), str(timeout_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("held"), line + proc.stderr.read()
    return proc, ask, int(line.split()[1])


def test_flock_is_local_to_a_mount_and_the_lease_is_not(mounts, tmp_path, caplog):
    import fcntl

    from gwenlake_hpc.base.lease import Lease, RunHeldError

    (mounts.server / "run").mkdir()
    run_a, run_b = mounts.a / "run", mounts.b / "run"
    # The failure this issue starts from: both mounts grant the same flock.
    fa, fb = open(run_a / ".lock", "a+"), open(run_b / ".lock", "a+")
    fcntl.flock(fa.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(fb.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # no BlockingIOError: local to mount b
    fa.close(), fb.close()

    proc, ask, fence = _holder(tmp_path, run_a, timeout_s=60)
    assert fence == 1
    with pytest.raises(RunHeldError, match=f"pid {proc.pid} on "):
        Lease(run_b, timeout_s=60).acquire()
    # SIGKILLed on this host: its pid is gone, so the next start breaks it at once (no timeout to wait).
    proc.kill()
    proc.wait()
    caplog.set_level("WARNING", logger="gwenlake_hpc.lease")
    t0 = time.monotonic()
    lease = Lease(run_b, timeout_s=60).acquire()
    assert time.monotonic() - t0 < 30
    assert lease.fence == 2 and (mounts.server / "run" / ".fence").read_text().strip() == "2"
    assert any(f"process {proc.pid}" in r.getMessage() and "broke the lease" in r.getMessage()
               for r in caplog.records), caplog.text
    lease.check("sealing")  # the holder passes its own check
    lease.release()
    assert not (mounts.server / "run" / ".lease").exists()


def test_a_stopped_holder_is_broken_after_the_timeout_then_fenced(mounts, tmp_path):
    from gwenlake_hpc.base.lease import Lease

    (mounts.server / "run").mkdir()
    proc, ask, fence = _holder(tmp_path, mounts.a / "run", timeout_s=4)
    os.kill(proc.pid, signal.SIGSTOP)  # its renewing thread stops with it
    try:
        t0 = time.monotonic()
        newer = Lease(mounts.b / "run", timeout_s=4, wait_s=120).acquire()
        waited = time.monotonic() - t0
        assert 4 <= waited < 120, waited  # observed unchanged for the timeout by this process's own clock
        assert newer.fence == fence + 1
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    ask.touch()
    out, err = proc.communicate(timeout=60)
    assert "FENCED sealing a checkpoint refused" in out, out + err
    assert f"start {fence} (pid {proc.pid}" in out
    newer.check("sealing")  # the newer start still holds it
    newer.release()


# --- the newest checkpoint through a cached listing -----------------------------------------------------------

def _seal(store, step: int, payload: bytes):
    pending = store.begin(step)
    pending.path("weights.bin").write_bytes(payload)
    return pending.commit({"step": step})


def test_a_checkpoint_the_listing_hides_is_found_by_the_pointer_and_never_overwritten(mounts):
    from gwenlake_hpc.base.errors import CheckpointError
    from gwenlake_hpc.stores.checkpoints import CheckpointStore

    a = CheckpointStore(mounts.a / "run" / "checkpoints", "key")
    _seal(a, 10, b"ten")
    b = CheckpointStore(mounts.b / "run" / "checkpoints", "key")
    assert [c.step for c in b.complete()] == [10]  # mount b lists the folder now: cached for 30 s
    sealed = _seal(a, 20, b"twenty")
    server_ck = mounts.server / "run" / "checkpoints" / "step-000000020"
    manifest = (server_ck / "MANIFEST.json").read_bytes()
    assert "step-000000020" not in os.listdir(b.root), "mount b's listing is not cached: the test proves nothing"
    # The pointer, read by opening the file, names step 20; it is opened by its path through mount b.
    assert [c.step for c in b.complete()] == [10, 20]
    latest = b.latest()
    assert latest.step == 20 and (latest.path / "weights.bin").read_bytes() == b"twenty"
    assert latest.manifest == sealed.manifest
    # A start on mount b that seals step 20 again (as one resumed from step 10 would) never writes over it.
    with pytest.raises(CheckpointError, match="step 20"):
        _seal(b, 20, b"other")
    assert (server_ck / "MANIFEST.json").read_bytes() == manifest
    assert (server_ck / "weights.bin").read_bytes() == b"twenty"
    # A pointer that names a checkpoint the server does not have (deleted by hand): a bounded wait for a lagging
    # cache, then the pointer is damaged (issue 40 item 13d): set aside, and the listing decides.
    pointer = json.loads((mounts.server / "run" / "checkpoints" / "LATEST.json").read_text())
    (mounts.server / "run" / "checkpoints" / "LATEST.json").write_text(json.dumps(
        {**pointer, "step": 30, "name": "step-000000030"}))
    t0 = time.monotonic()
    assert [c.step for c in b.complete(wait_s=2, repair=True)] == [10, 20]
    assert time.monotonic() - t0 >= 2
    assert not (mounts.server / "run" / "checkpoints" / "LATEST.json").exists()
    assert [p.name.startswith(".damaged-LATEST.json-") for p in (mounts.server / "run" / "checkpoints").iterdir()
            ].count(True) == 1
    assert [c.step for c in b.complete()] == [10, 20]  # no wait: the listing (and what it can open) as it is


# --- whole jobs on two mounts ------------------------------------------------------------------------------------

def _job_args(mount: Path, tracking_db: Path, *extra: str) -> list[str]:
    return ["+job=t", f"paths.runs_root={mount / 'runs'}", f"tracking.uri=sqlite:///{tracking_db}",
            "launcher.progress=off", *extra]


@pytest.fixture
def project(tmp_path):
    return make_test_project(tmp_path / "proj")


def test_two_starts_of_one_run_on_two_mounts_exactly_one_trains(mounts, project, tmp_path):
    db = tmp_path / "mlflow.db"
    for attempt in range(2):  # every time, whichever mount comes first
        model = f"job.model=race{attempt}"
        # whichever trains waits at step 5 until the other has ended: they overlap however slow a start-up is
        go = tmp_path / f"go{attempt}"
        env = {"GWL_TEST_PAUSE": f"5:{tmp_path / f'reached{attempt}'}:{go}"}
        first, second = (mounts.a, mounts.b) if attempt == 0 else (mounts.b, mounts.a)
        p1 = project.popen(*_job_args(first, db, model, "job.steps=60", "job.eval_every=20"), env=env)
        p2 = project.popen(*_job_args(second, db, model, "job.steps=60", "job.eval_every=20"), env=env)
        deadline = time.monotonic() + 300
        while p1.poll() is None and p2.poll() is None:
            assert time.monotonic() < deadline, "neither start ended in 300 s"
            time.sleep(0.1)
        go.touch()
        out1, out2 = p1.communicate(timeout=600), p2.communicate(timeout=600)
        rcs = sorted([p1.returncode, p2.returncode])
        said = "".join(out1 + out2)
        assert rcs == [0, 2], said
        refused = out1 if p1.returncode == 2 else out2
        assert "is being trained by start" in "".join(refused), said
        assert "Traceback" not in "".join(refused)
        run_dir = next((mounts.server / "runs" / "t.model").glob(f"race{attempt}-*"))
        info = json.loads((run_dir / "run.json").read_text())
        assert len(info["starts"]) == 1 and info["completed"]["final_step"] == 60
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-")) == \
            ["step-000000020", "step-000000040", "step-000000060"]


def test_an_old_start_that_wakes_up_is_fenced_and_the_newer_one_finishes(mounts, project, tmp_path):
    """Start A trains through mount a, is frozen (SIGSTOP) at step 25; start B of the same run through mount b
    waits for the lease, breaks it after job.lease_timeout_s, resumes from step 20 and finishes; A, woken up,
    may seal, spool and commit nothing: it exits 2 and B's checkpoints, version and MLflow points are intact."""
    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    reached, go = tmp_path / "reached", tmp_path / "go"
    common = ("job.steps=60", "job.eval_every=10", "job.lease_timeout_s=4", "job.tracking=true")
    a = project.popen(*_job_args(mounts.a, db, *common),
                      env={"GWL_TEST_PAUSE": f"25:{reached}:{go}"})
    _wait_file(reached, proc=a)
    # frozen once step 20's checkpoint, written in the background, is sealed (a loaded machine may take a while)
    deadline = time.monotonic() + 180
    while not any(json.loads(f.read_text() or "{}").get("step") == 20
                  for f in (mounts.server / "runs").glob("t.model/*/checkpoints/LATEST.json")):
        assert time.monotonic() < deadline, "step 20's checkpoint was not sealed in 180 s"
        time.sleep(0.1)
    os.kill(a.pid, signal.SIGSTOP)
    try:
        b = project.run(*_job_args(mounts.b, db, *common, "job.lease_wait_s=120"), timeout=600)
    finally:
        go.touch()
        os.kill(a.pid, signal.SIGCONT)
    out_a, err_a = a.communicate(timeout=300)
    said_b, said_a = b.stdout + b.stderr, out_a + err_a
    assert b.returncode == 0, said_b
    assert "broke the lease of run" in said_b and "resuming from step 20" in said_b, said_b
    assert a.returncode == 2, said_a
    assert "refused: start 1 " in said_a and "no longer holds run" in said_a, said_a
    assert "Traceback" not in said_a
    assert "model t.model version" not in said_a
    run_dir = next((mounts.server / "runs" / "t.model").iterdir())
    info = json.loads((run_dir / "run.json").read_text())
    assert info["completed"]["final_step"] == 60 and len(info["starts"]) == 2
    assert json.loads((run_dir / "checkpoints" / "LATEST.json").read_text())["step"] == 60
    # Only B's checkpoints past step 20: A sealed nothing after it woke up (its eviction checkpoint was refused).
    steps = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert steps[-1] == 60 and 26 not in steps
    assert not list((run_dir / "checkpoints").glob(".partial-*"))
    client = MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("t.model").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert_one_point_per_step(client, runs[0].info.run_id, "loss", range(1, 61))


def test_every_point_reaches_mlflow_from_a_runs_root_on_a_network_filesystem(mounts, project, tmp_path):
    """The adversarial pass's input: two runs in a row through one sshfs mount (steps of 0.1 s): the second kept
    10 of its 30 points. A spool segment made under a temporary name and hard-linked to its final one is two
    inodes to a FUSE client: the delivery, opening the final name, saw neither the writer's lock nor its size,
    and removed the live segment as delivered."""
    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    for name in ("solo0", "solo1"):
        project.run(*_job_args(mounts.a, db, f"job.model={name}", "job.steps=30", "job.eval_every=10",
                               "job.tracking=true"), env={"GWL_TEST_SLEEP": "0.1"}, check=0, timeout=600)
    client = MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("t.model").experiment_id])
    assert sorted(r.info.run_name.split("-")[0] for r in runs) == ["solo0", "solo1"]
    for r in runs:
        assert r.info.status == "FINISHED"
        assert_one_point_per_step(client, r.info.run_id, "loss", range(1, 31))
        assert "final_loss" in r.data.metrics


# --- two levels: a node-local first level, the shared level second (checkpoint.local_dir) ---------------------

def _steps(folder: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in folder.iterdir() if p.name.startswith("step-")) if folder.is_dir() else []


def _local_checkpoints(node: Path) -> Path:
    return next(node.glob("gwenlake-checkpoints/run-*/checkpoints"))


def _killed_after_local_seal(project, mount: Path, db: Path, model: str, node: Path, tmp_path: Path) -> Path:
    """A start through ``mount`` with its local level in ``node``, SIGKILLed as the block of step 30's checkpoint
    (32 MiB more than the others) ends: sealed on the local level, its copy to the shared level just begun. It
    waits at step 29 until step 20 is on the shared level, so that level's newest is step 20. Returns the run
    directory (through ``mount``)."""
    reached, go = tmp_path / f"reached-{model}", tmp_path / f"go-{model}"
    a = project.popen(*_job_args(mount, db, f"job.model={model}", f"checkpoint.local_dir={node}"),
                      env={"GWL_TEST_SIGKILL_AFTER_CKPT": "30", "GWL_TEST_EXTRA_MB": "32:30",
                           "GWL_TEST_PAUSE": f"29:{reached}:{go}"})
    _wait_file(reached, proc=a)
    run_dir = next((mount / "runs" / "t.model").glob(f"{model}-*"))
    # seen on the server itself (fs/server beside the mounts fs/a and fs/b), not through a cached listing
    _wait_file(mount.parent / "server" / "runs" / "t.model" / run_dir.name / "checkpoints" / "step-000000020", proc=a)
    go.touch()
    out, err = a.communicate(timeout=600)
    assert a.returncode == -signal.SIGKILL, out + err
    assert _steps(_local_checkpoints(node))[-1] == 30
    return run_dir


def test_a_kill_after_the_local_seal_resumes_from_it_on_that_node_and_from_the_shared_level_elsewhere(
        mounts, project, tmp_path):
    db = tmp_path / "mlflow.db"
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    for model, mount, node in (("same", mounts.a, node_a), ("other", mounts.b, node_b)):
        shutil.rmtree(node_a, ignore_errors=True)
        run_dir = _killed_after_local_seal(project, mounts.a, db, model, node_a, tmp_path)
        server = mounts.server / "runs" / "t.model" / run_dir.name
        shared = _steps(server / "checkpoints")
        assert shared == [10, 20], shared  # the kill came before step 30's copy was sealed
        b = project.run(*_job_args(mount, db, f"job.model={model}", f"checkpoint.local_dir={node}"), check=0,
                        timeout=600)
        said = b.stdout + b.stderr
        if model == "same":  # the same node: the newer local checkpoint, then copied to the shared level
            assert "resuming from step 30 " in said and "resuming from the node-local level" in said, said
        else:  # another node: its local level is empty, the shared level's newest
            assert f"resuming from step {shared[-1]} ({mount / 'runs'}" in said, said
        info = json.loads((server / "run.json").read_text())
        assert info["completed"]["final_step"] == 60
        # the copier copies the newest sealed local checkpoint (one sealed while a copy runs replaces an older
        # one that waits), then keep=3 on both levels
        copied = _steps(server / "checkpoints")
        assert copied[-1] == 60 and len(copied) <= 3 and 10 not in copied, copied
        assert json.loads((server / "checkpoints" / "LATEST.json").read_text())["step"] == 60
        # the version is committed and the newest is on the shared level: the node keeps nothing of the run,
        # and status has no levels to show
        assert not list(node.glob("gwenlake-checkpoints/run-*")), list(node.rglob("*"))
        assert not (server / "checkpoints" / "LEVELS.json").exists()


def test_a_run_directory_deleted_and_made_anew_does_not_resume_from_a_node(mounts, project, tmp_path):
    """The adversarial pass's input: a finished run's directory deleted by hand, the same job run again: it
    resumed from the node-local level (and committed a version of nothing trained)."""
    db = tmp_path / "mlflow.db"
    node = tmp_path / "node-a"
    run_dir = _killed_after_local_seal(project, mounts.a, db, "anew", node, tmp_path)
    shutil.rmtree(run_dir)  # by hand, on this node (through its mount)
    again = project.run(*_job_args(mounts.a, db, "job.model=anew", f"checkpoint.local_dir={node}"), check=0,
                        timeout=600)
    said = again.stdout + again.stderr
    assert "no checkpoint of this run" in said and "resuming from" not in said, said
    info = json.loads((mounts.server / "runs" / "t.model" / run_dir.name / "run.json").read_text())
    assert info["completed"]["final_step"] == 60 and len(info["starts"]) == 1


def test_a_damaged_local_copy_falls_back_to_the_shared_level(mounts, project, tmp_path):
    db = tmp_path / "mlflow.db"
    node = tmp_path / "node-a"
    run_dir = _killed_after_local_seal(project, mounts.a, db, "damaged", node, tmp_path)
    shared = _steps(mounts.server / "runs" / "t.model" / run_dir.name / "checkpoints")
    assert shared == [10, 20], shared
    state = _local_checkpoints(node) / "step-000000030" / "state.safetensors"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a bit flipped on the node's disk: same size, its digest no longer matches
    state.write_bytes(bytes(raw))
    b = project.run(*_job_args(mounts.a, db, "job.model=damaged", f"checkpoint.local_dir={node}"), check=0,
                    timeout=600)
    said = b.stdout + b.stderr
    assert "is damaged" in said, said
    assert f"resuming from step {shared[-1]} ({mounts.a / 'runs'}" in said, said
    assert "set aside as .damaged-step-000000030-" in said
    server = mounts.server / "runs" / "t.model" / run_dir.name
    assert json.loads((server / "run.json").read_text())["completed"]["final_step"] == 60
    assert _steps(server / "checkpoints")[-1] == 60


def test_an_eviction_waits_for_the_shared_copy_within_its_bound_and_says_which_level(mounts, project, tmp_path):
    db = tmp_path / "mlflow.db"
    node = tmp_path / "node-a"
    env = {"GWL_TEST_SIGTERM_AT": "35", "GWL_TEST_EXTRA_MB": "32"}
    waited = project.run(*_job_args(mounts.a, db, "job.model=waits", f"checkpoint.local_dir={node}"), env=env,
                         check=75, timeout=600)
    said = waited.stdout + waited.stderr
    run_dir = next((mounts.server / "runs" / "t.model").glob("waits-*"))
    assert "newest checkpoint: step 36 on both levels" in said, said
    assert _steps(run_dir / "checkpoints")[-1] == 36
    # No time to wait (checkpoint.shared_wait_s=0): the start exits once the local seal is done, and says so.
    quick = project.run(*_job_args(mounts.a, db, "job.model=quick", f"checkpoint.local_dir={node}",
                                   "checkpoint.shared_wait_s=0"), env=env, check=75, timeout=600)
    said = quick.stdout + quick.stderr
    run_dir = next((mounts.server / "runs" / "t.model").glob("quick-*"))
    assert "newest checkpoint: step 36 sealed on the node-local level" in said, said
    assert "was not done within checkpoint.shared_wait_s" in said and "the shared level's newest may stay " in said
    # (the copy goes on in its thread while the start ends: it may still land before the process exits)
    # The next start on this node resumes from the local one, and copies it up.
    again = project.run(*_job_args(mounts.a, db, "job.model=quick", f"checkpoint.local_dir={node}"), check=0,
                        timeout=600)
    assert "resuming from step 36 " in again.stdout + again.stderr
