"""Short jobs in subprocesses: tracking off touches no store; a second process on a run is refused (the long
end-to-end runs are in tests/integration/test_job_e2e.py)."""

from __future__ import annotations

import time

from helpers.jobs import run_dir_of


def test_tracking_false_touches_no_store(project):
    project.run("+job=t", "job.tracking=false", check=0)
    assert not (project.root / "runs" / "mlflow.db").exists()
    assert not (run_dir_of(project) / "tracking").exists()


def test_second_process_on_the_same_run_is_refused(project):
    f = project.root
    first = project.popen("+job=t", "job.tracking=false", env={"GWL_TEST_PAUSE": f"10:{f}/reached:{f}/go"})
    deadline = time.time() + 120
    while not (f / "reached").exists():
        assert time.time() < deadline
        time.sleep(0.05)
    second = project.run("+job=t", "job.tracking=false")
    assert second.returncode == 2 and "is being trained by pid" in second.stdout + second.stderr
    (f / "go").touch()
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, out + err


