"""Multi-task runs (torch.distributed on gloo) without a cluster: two processes with torchrun's environment.

The same code path runs under SLURM (tests/cluster/test_slurm.py covers 2 tasks on a node and 2 nodes there): the
stop decision agreed by all ranks, rank 0 writing the one checkpoint with every rank's RNG and data position,
and a resume that ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json

import pytest

from helpers.ranks import launch, model_of, version_in

pytestmark = pytest.mark.slow


def test_stop_seen_by_one_rank_stops_all_and_resume_is_bit_identical(project):
    ref = launch(project, "+job=t", "paths.runs_root=runs-ref")
    assert [r[0] for r in ref] == [0, 0], ref[0][2][-3000:] + ref[1][2][-3000:]
    assert "model t.model version" in ref[0][1] and "model t.model version" not in ref[1][1]  # rank 0 commits
    reference = model_of(project, version_in(ref[0][1]))

    # SIGTERM reaches rank 1 only, during step 23: both ranks end after step 24 with one checkpoint.
    first = launch(project, "+job=t", env={"GWL_TEST_SIGTERM_AT": "23", "GWL_TEST_SIGTERM_RANK": "1"})
    assert [r[0] for r in first] == [75, 75], first[0][2][-3000:] + "\n=====\n" + first[1][2][-6000:]
    for rc, so, se in first:
        assert "loop ended after step 24" in so + se, so + se
    # Every rank logs the real reason, rank 0 too (it got no signal).
    assert "stop requested (SIGTERM on rank 1): loop ended" in first[0][1] + first[0][2], first[0][2][-3000:]
    assert "stop requested (SIGTERM): loop ended" in first[1][1] + first[1][2]
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    ck = run_dir / "checkpoints" / "step-000000024"
    manifest = json.loads((ck / "MANIFEST.json").read_text())
    assert "gwenlake-ranks/rank-00001.json" in manifest["files"] and "state.safetensors" in manifest["files"]
    rank1 = json.loads((ck / "gwenlake-ranks" / "rank-00001.json").read_text())
    assert rank1["data_position"] == {"epoch": 3, "next_global_batch": 24, "rank": 1, "world_size": 2}
    state0 = json.loads((ck / "gwenlake-run-state.json").read_text())
    assert state0["world_size"] == 2 and state0["rng"] != rank1["rng"]  # each rank's own RNG
    assert not list(run_dir.glob("output/*"))  # nothing committed

    second = launch(project, "+job=t", env={"GWL_TEST_NOTE": "1"})
    assert [r[0] for r in second] == [0, 0], second[0][2][-3000:] + second[1][2][-3000:]
    assert all("resuming from step 24" in so + se for _, so, se in second)
    version = version_in(second[0][1])
    resumed = model_of(project, version)
    # rank 0's output is the one committed; rank 1 wrote its own into a scratch folder, never the commit
    assert project.git("show", f"{version}:t/model/note.txt") == "rank 0 of 2"
    assert resumed.keys() == reference.keys()
    for k in reference:
        assert (resumed[k] == reference[k]).all(), k
    # The data: 200 rows in batches of 16 = 13 batches an epoch, 6 a rank; 60 steps = 10 epochs.
    info = json.loads((run_dir / "run.json").read_text())
    assert [s["world_size"] for s in info["starts"]] == [2, 2]


def test_a_rank_that_dies_does_not_hang_the_others(project):
    res = launch(project, "+job=t", env={"GWL_TEST_BAD": "raise"}, timeout=120)
    assert all(rc != 0 for rc, _, _ in res), [r[0] for r in res]
    assert "boom at step 5" in "".join(so + se for _, so, se in res)


def test_epochs_run_refuses_another_number_of_ranks(project):
    first = project.run("+job=t", "job.target=trainer.py:fit_epochs", env={"GWL_TEST_SIGTERM_AT": "15"})
    assert first.returncode == 75, first.stderr[-2000:]
    res = launch(project, "+job=t", "job.target=trainer.py:fit_epochs")
    assert [rc for rc, _, _ in res] == [2, 2]
    text = "".join(so + se for _, so, se in res)
    assert "written by 1 rank(s) and this job has 2" in text and "job.steps" in text
    assert "model t.model version" not in text
    again = project.run("+job=t", "job.target=trainer.py:fit_epochs", check=0)  # one task again: resumes
    assert "resuming from step 16" in again.stdout + again.stderr


def test_resume_on_one_rank_with_the_same_global_batch_reads_every_sample_once(project):
    """2 ranks x 20 rows, SIGTERMed during step 7 (checkpoint of step 8, in epoch 1), resumed on 1 rank x 40 rows:
    the 60 steps are 12 epochs of the 200 rows and every epoch reads each row once."""
    from gwenlake_hpc.data import Catalog

    env = {"GWL_TEST_GLOBAL_BATCH": "40", "GWL_TEST_SEEN": str(project.root / "seen")}
    first = launch(project, "+job=t", env={**env, "GWL_TEST_SIGTERM_AT": "7"})
    assert [r[0] for r in first] == [75, 75], first[0][2][-3000:] + first[1][2][-3000:]
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    state = json.loads((run_dir / "checkpoints" / "step-000000008" / "gwenlake-run-state.json").read_text())
    assert state["data"]["samples"] == 8 * 40 and state["data"]["epoch"] == 1
    assert state["data"]["remaining"] == [[60, 100], [160, 200]]  # 3 batches of 20 read from each rank's shard
    second = project.run("+job=t", env=env, check=0)
    assert "resuming from step 8" in second.stdout + second.stderr
    assert "2 rank(s) of 20 (global batch 40)" in second.stdout + second.stderr
    row = {float(v): i for i, v in enumerate(Catalog(project.root / "data").open("t.rows").read(["x"])["x"][:, 0])}
    epochs: dict[int, list[int]] = {}
    steps = set()
    for rank in (0, 1):
        for line in (project.root / f"seen.{rank}").read_text().splitlines():
            step, epoch, *xs = (float(v) for v in line.split())
            steps.add(step)
            epochs.setdefault(int(epoch), []).extend(row[x] for x in xs)
    assert steps == set(range(1, 61))
    assert sorted(epochs) == list(range(12))
    for epoch, rows in epochs.items():
        assert sorted(rows) == list(range(200)), epoch  # no sample skipped or read twice


def test_a_rank_that_never_joins_is_one_line_on_each_side_and_nothing_is_written(project):
    """The adversary's input: rank 0 started alone (its rank 1 never starts), and rank 1 alone (its rank 0's store
    never answers), ``GWENLAKE_DIST_TIMEOUT_S`` short. Each ended after the timeout in a traceback of the store
    (``DistStoreError: ... 1/2 clients joined``). Now one line each naming what joined, exit 1, and no run
    directory."""
    import os
    import subprocess
    import sys

    from helpers.mlflow_server import free_port

    procs = []
    for rank in (0, 1):  # each on a port of its own: neither ever meets the other
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "GWENLAKE_DIST_TIMEOUT_S": "8"}
        procs.append(subprocess.Popen([sys.executable, "-m", "gwenlake_hpc", "+job=t"], cwd=project.root, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    for rank, (rc, so, se) in enumerate(out):
        text = so + se
        assert rc == 1, (rank, text)
        assert f"rank {rank} of 2: the job's process group did not form within 8 s" in text, text
        assert "Traceback (most recent call last)" not in text, text  # (c10d's own C++ log lines stay: torch's)
    assert "(1 of 2 ranks joined)" in out[0][1] + out[0][2]
    assert not (project.root / "runs" / "t.model").exists()
