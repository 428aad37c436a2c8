"""The runs root as a network filesystem on the local SLURM cluster (issue 27): each node's jobs see it through an
sshfs mount of their own (tests/helpers/sshfs.py node_mounts: one mount in each slurmd's mount namespace, with its
own 30 s cache and a ``flock`` the other node does not see), as jobs on two nodes of a real cluster do.

- two jobs of one run, one on each node at the same time: exactly one trains, the other exits 2 naming it;
- a job on the other node right after: it resumes from the newest checkpoint the first sealed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers.project import make_test_project
from helpers.slurm_cluster import finish, require_cluster, submit, wait_until
from helpers.sshfs import node_mounts

pytestmark = pytest.mark.slurm


def _common(runs: Path, db: Path, *extra: str) -> list[str]:
    return [f"paths.runs_root={runs}", f"tracking.uri=sqlite:///{db}", "launcher=slurm", "launcher.timeout_min=10",
            "launcher.cpus_per_task=1", "launcher.progress_every_s=5", "job.eval_every=10", *extra]


def _log(runs: Path, job: str) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(runs.glob(f"t.model/*/slurm/{job}/*_log.*")))


def test_two_jobs_of_one_run_on_two_nodes_through_two_mounts_exactly_one_trains(tmp_path):
    require_cluster()
    project = make_test_project(tmp_path / "p")
    db = tmp_path / "mlflow.db"  # beside the runs root: SQLite does not belong on a network filesystem
    reached, go = tmp_path / "reached", tmp_path / "go"
    with node_mounts(tmp_path / "runs") as runs:
        first = submit(project, *_common(runs, db, "job.steps=60", "+launcher.additional_parameters.nodelist=n1"),
                       env_vars={"GWL_TEST_PAUSE": f"25:{reached}:{go}"})
        wait_until(reached.exists, timeout=300, what="the job on n1 at step 25")
        # step 20 sealed through n1's mount; the same run submitted to n2 while n1's job holds it
        second = submit(project, *_common(runs, db, "job.steps=60", "+launcher.additional_parameters.nodelist=n2"))
        assert finish(second, timeout=300) == "FAILED"
        said = _log(runs, second)
        assert "is being trained by start" in said and "Traceback" not in said, said[-3000:]
        assert "refused its settings or its run (exit 2" in said  # the teardown's decision: not requeued
        go.touch()
        assert finish(first, timeout=400) == "COMPLETED", _log(runs, first)[-3000:]
        run_dir = next((runs / "t.model").iterdir())
        info = json.loads((run_dir / "run.json").read_text())
        assert info["completed"]["final_step"] == 60
        assert len(info["starts"]) == 1  # the refused job on n2 recorded no start of the run
        # A longer training of the same run on n2 at once: through n2's mount, it resumes from step 60.
        third = submit(project, *_common(runs, db, "job.steps=80", "+launcher.additional_parameters.nodelist=n2"))
        assert finish(third, timeout=400) == "COMPLETED", _log(runs, third)[-3000:]
        said = _log(runs, third)
        assert re.search(r"resuming from step 60 ", said), said[-3000:]
        info = json.loads((run_dir / "run.json").read_text())
        assert info["completions"][-1]["final_step"] == 80
        assert json.loads((run_dir / "checkpoints" / "LATEST.json").read_text())["step"] == 80
