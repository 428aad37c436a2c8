"""The goodput ledger of a real run of three starts (real processes): SIGTERMed, SIGKILLed after a checkpoint and
some steps (on a host whose clock is an hour behind), then finished."""

from __future__ import annotations

import json
import signal
import time

import pytest

from gwenlake_hpc.runtime import ledger as ledgers
from helpers.jobs import mlflow_runs, run_dir_of


def _timed(project, *args, env, check):
    began = time.monotonic()
    proc = project.run(*args, env=env)
    wall = time.monotonic() - began
    assert proc.returncode == check, proc.stdout + proc.stderr
    return proc, wall


def test_three_starts_sigterm_sigkill_finish_ledger(project):
    base = {"GWL_TEST_SLEEP": "0.05"}
    _, wall0 = _timed(project, "+job=t", env={**base, "GWL_TEST_SIGTERM_AT": "12"}, check=75)
    # killed as step 34 begins: step 30's checkpoint was sealed (3 s of slack at step 33), 31..33 are lost
    _, wall1 = _timed(project, "+job=t", env={**base, "GWL_TEST_SIGKILL_AT": "34", "GWL_TEST_SLOW_STEPS": "33:3",
                                              "GWL_TEST_CLOCK_SHIFT_S": "-3600"}, check=-signal.SIGKILL)
    _, wall2 = _timed(project, "+job=t", env=base, check=0)
    run_dir = run_dir_of(project)

    recs = ledgers.read_ledger(run_dir)
    assert [r["end"] for r in recs] == ["evicted", "killed", "finished"]
    assert [r["start"] for r in recs] == [0, 1, 2]
    # the stop during step 12 ends the loop after step 13 with its checkpoint; the next start resumes there
    assert [(r["first_step"], r["last_step"]) for r in recs] == [(1, 13), (14, 33), (31, 60)]
    assert recs[0]["stop_signal"] == "SIGTERM" and recs[0]["drain_s"] > 0
    assert ledgers.lost_steps(recs[0]) == 0
    assert recs[1]["next_resumed_at"] == 30 and ledgers.lost_steps(recs[1]) == 33 - 30
    assert ledgers.lost_steps(recs[2]) == 0
    for rec, wall in zip(recs, (wall0, wall1, wall2)):
        parts = ledgers.parts(rec)
        assert abs(sum(parts.values()) - rec["elapsed_s"]) < 1e-3, (parts, rec)
        # the process's own age, on its monotonic clock: never above what this side measured around it; the
        # killed start's last second (its last record) and the interpreter's exit are missing at most
        assert wall - 4.0 < rec["elapsed_s"] <= wall + 0.05, (rec, wall)
        assert parts["startup_s"] > 0 and parts["kept_s"] > 0
    # the killed start's lost time: the steps after its sealed checkpoint, 31..33 (step 33 took 3 s more)
    lost1 = ledgers.parts(recs[1])["lost_s"]
    assert 3.0 < lost1 < 3.0 + 3 * 2.0, recs[1]
    total = ledgers.summarize(recs)
    assert total["lost_steps"] == 3 and total["unannounced"] == 1 and total["starts"] == 3
    assert abs(total["allocated_s"] - sum(r["elapsed_s"] for r in recs)) < 1e-6
    assert 0 < total["goodput"] < 1
    assert total["goodput"] == total["kept_s"] / total["allocated_s"]

    # the version's lineage holds the same totals, and the clock-shifted start changed none of it
    info = json.loads((run_dir / "run.json").read_text())
    assert [s["first_step"] for s in info["starts"]] == [1, 14, 31]
    version = info["completed"]["version"]
    lineage = json.loads(project.git("show", f"{version}:t/model/lineage.json"))
    assert lineage["goodput"]["lost_steps"] == 3
    assert lineage["goodput"]["starts"] == 3
    assert lineage["goodput"]["ends"] == {"evicted": 1, "killed": 1, "finished": 1}

    # MLflow's goodput/* at the end and `report`'s report.json add up the same ledger
    client, runs = mlflow_runs(project)
    metrics = runs[0].data.metrics
    # logged as the last start's loop ended: the same kept time, less allocated (the commit came after)
    assert metrics["goodput/kept_s"] == pytest.approx(total["kept_s"], abs=1e-6), (metrics, total)
    assert total["goodput"] < metrics["goodput/goodput"] == pytest.approx(
        metrics["goodput/kept_s"] / metrics["goodput/allocated_s"], rel=1e-6)
    assert metrics["goodput/lost_steps"] == 3
    assert metrics["goodput/starts"] == 3 and metrics["goodput/unannounced"] == 1
    project.run("report", str(run_dir), check=0)
    report = json.loads((run_dir / "report.json").read_text())
    assert [s["end"] for s in report["starts"]] == ["evicted", "killed", "finished"]
    assert report["goodput"]["lost_steps"] == 3
    assert abs(report["goodput"]["goodput"] - total["goodput"]) < 1e-9
    assert abs(report["starts"][1]["lost_s"] - lost1) < 1e-9


def test_eval_every_auto_chooses_the_interval_from_the_run_s_steps_and_logs_it(project):
    # a 0.2 s stall in each checkpoint block, an interruption every 3.6 s assumed (job.mtbf_h=0.001): Young/Daly's
    # sqrt(2 C M) is about 1.2 s, over job.max_eval_interval_s=0.5, so every interval is 0.5 s of plain steps
    proc = project.run("+job=t", "job.eval_every=auto", "job.mtbf_h=0.001", "job.max_eval_interval_s=0.5",
                       "job.steps=150", env={"GWL_TEST_SLEEP": "0.02", "GWL_TEST_SLEEP_IN_CKPT": "0.2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client, runs = mlflow_runs(project)
    (r,) = runs
    steps = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "checkpoint/interval_steps")}
    seconds = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "checkpoint/interval_s")}
    costs = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "checkpoint/cost_s")}
    evals = sorted(steps)
    assert evals[0] == 3  # the first evaluation of a start: its third step
    assert len(evals) >= 3, steps
    # each evaluation comes the chosen number of steps after the one before it (the last step is one too)
    for a, b in zip(evals, evals[1:]):
        assert b == a + int(steps[a]) or b == 150, (a, b, steps)
    assert all(v == 0.5 for v in seconds.values()), seconds
    assert all(c > 0.1 for c in costs.values()), costs  # the block's 0.2 s, less the plain steps' noise
    assert all(v >= 1 for v in steps.values())
    # the checkpoints kept (keep=3) are at the last evaluation steps
    ck = run_dir_of(project) / "checkpoints"
    kept = sorted(int(p.name.split("-")[1]) for p in ck.glob("step-*"))
    assert kept == sorted(set(evals) | {150})[-3:], (kept, evals)


def test_auto_with_one_slow_plain_step_or_an_infinite_mean_time_keeps_a_sane_interval(project):
    """The adversarial pass's inputs: one slow plain step (step 2, 0.5 s) pinned the interval to 1 step for the
    whole run; job.mtbf_h=1e308 with a free checkpoint made it NaN, and the run raised at step 3."""
    env = {"GWL_TEST_SLOW_STEPS": "2:0.5"}
    proc = project.run("+job=t", "job.steps=60", "job.seed=5151", "job.eval_every=auto", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client, (r,) = mlflow_runs(project)
    steps = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "checkpoint/interval_steps")}
    assert min(steps.values()) >= 2, steps
    # the second interval measured plain steps again: a checkpoint costs milliseconds against a day's mean time
    # between interruptions, so the third evaluation is past the run's end
    assert len(steps) == 2 and max(steps.values()) > 60, steps

    proc = project.run("+job=t", "job.steps=20", "job.seed=4242", "job.eval_every=auto", "job.mtbf_h=1e308",
                       env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_kill_during_start_up_or_after_two_kills_is_timed_and_named_killed(project):
    """The adversarial pass's inputs: a SIGKILL 15 s into start-up (GWL_TEST_RAISE_BEFORE_LOOP=30) left a ledger
    of 1.8 s; two SIGKILLed starts, not resumed, were `report`ed as killed and running."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "GWL_TEST_RAISE_BEFORE_LOOP": "30"}
    job = subprocess.Popen([sys.executable, "-m", "gwenlake_hpc", "+job=t", "job.steps=50", "job.seed=1301"],
                           cwd=project.root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and ledgers.process_age_s(job.pid) < 15.0:
            time.sleep(0.2)
        age = ledgers.process_age_s(job.pid)
        job.kill()
    finally:
        job.wait(30)
    assert age >= 15.0
    (run,) = (project.root / "runs" / "t.model").iterdir()
    (rec,) = ledgers.read_ledger(run)
    assert rec["end"] == "killed" and rec["first_step"] is None
    assert age - 1.5 <= rec["elapsed_s"] <= age + 0.5, (rec, age)  # at most a second (FLUSH_EVERY_S) missing
    assert ledgers.parts(rec)["startup_s"] == rec["elapsed_s"]

    for kill_at in (10, 20):  # another run (seed 703): two starts SIGKILLed, none resumed
        proc = project.run("+job=t", "job.steps=40", "job.seed=703", env={"GWL_TEST_SIGKILL_AT": str(kill_at)})
        assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    killed = next(d for d in (project.root / "runs" / "t.model").iterdir() if d != run)
    project.run("report", str(killed), check=0)
    report = json.loads((killed / "report.json").read_text())
    assert [s["end"] for s in report["starts"]] == ["killed", "killed"] and report["goodput"]["unannounced"] == 2


def test_a_checkpoint_sealed_during_a_long_step_counts_as_kept_before_any_resume(project):
    """The adversarial pass's input (GWL_TEST_SLOW_STEPS=21:10, job.steps=40, SIGKILL during step 21): step 20's
    checkpoint was sealed in the background while step 21 ran, yet the ledger still said 10, and `report`
    counted 10 steps lost until the run was resumed."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "GWL_TEST_SLOW_STEPS": "21:10"}
    job = subprocess.Popen([sys.executable, "-m", "gwenlake_hpc", "+job=t", "job.steps=40", "job.seed=81"],
                           cwd=project.root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        run = None
        while time.monotonic() < deadline:
            runs = list((project.root / "runs" / "t.model").glob("*/checkpoints/step-000000020/MANIFEST.json"))
            if runs:
                run = runs[0].parents[2]
                break
            time.sleep(0.2)
        assert run is not None and job.poll() is None
        time.sleep(2 * ledgers.FLUSH_EVERY_S + 0.5)  # step 21 lasts 10 s more: the thread's records come
        job.kill()
    finally:
        job.wait(30)
    (rec,) = ledgers.read_ledger(run)
    assert rec["end"] == "killed" and rec["last_step"] == 20 and rec["sealed_step"] == 20, rec
    assert ledgers.lost_steps(rec) == 0


def _overlaps(fig) -> list[str]:
    """Every (legend, title) pair of ``fig`` whose window extents intersect, from the figure's own renderer."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    titles = [(ax, t) for ax in fig.axes for t in (ax.title, ax._left_title, ax._right_title) if t.get_text()]
    out = []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        out += [f"the legend of panel {fig.axes.index(ax)} ({box}) over the title {t.get_text()!r} of panel "
                f"{fig.axes.index(other)} ({t.get_window_extent(renderer)})"
                for other, t in titles if box.overlaps(t.get_window_extent(renderer))]
    return out


def test_the_reports_legends_leave_every_panel_title_readable(project):
    """Issue 40 item 8: `report` drew the legends over the panel titles (the loss panel's, and the goodput
    panel's, unreadable). A run of several metrics (tagged metrics at each evaluation), evicted once and
    finished: no legend's window extent intersects any title's, as the figure's renderer lays them out."""
    from gwenlake_hpc.cli.report import figure

    env = {"GWL_TEST_SLEEP": "0.02", "GWL_TEST_TAGGED": "1"}
    project.run("+job=t", env={**env, "GWL_TEST_SIGTERM_AT": "25"}, check=75)
    project.run("+job=t", env=env, check=0)
    run_dir = run_dir_of(project)
    fig, marks, recs = figure(run_dir)
    try:
        assert marks == [27] and [r["end"] for r in recs] == ["evicted", "finished"], (marks, recs)
        legends = [ax for ax in fig.axes if ax.get_legend() is not None]
        assert len(fig.axes) >= 5 and len(legends) >= 3, [ax.get_ylabel() for ax in fig.axes]
        assert fig.axes[-1]._left_title.get_text().startswith("goodput ")  # the ledger's bars, titled
        fig.savefig(run_dir / "report-test.png", dpi=100)  # to look at
        assert _overlaps(fig) == []
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
