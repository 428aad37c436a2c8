"""A Lightning Trainer as a job's loop (gwenlake_hpc.integrations.lightning), in real processes with real signals:
examples/lightning_churn.py's module on the churn data through tests/project/lightning_hooks.py (the same
training, with the tests' signal hooks)."""

from __future__ import annotations

import json
import signal

import pytest

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

from helpers.integrations import (checkpoints, history, make_framework_project, the_run,  # noqa: E402
                                  version_line, weights)

pytestmark = pytest.mark.slow

MODEL = "crm.churn-lightning"
# The adversarial pass's job (job.steps=200, job.eval_every=10) on the churn data: 128 customers a step, epoch 0 is
# steps 1..45 (5,634 customers), epoch 1 46..90, epoch 2 91..135: the resumes are in epochs 0 and 1 and at the end
# of epoch 1
JOB = "target: lightning_hooks:fit\nsteps: 200\neval_every: 10\nseed: 0\n"
WEIGHTS = "crm/churn-lightning/model.safetensors"


def _project(root):
    return make_framework_project(root, "lightning_hooks.py", "pl_t", JOB)


def test_sigterm_and_sigkills_resume_to_the_uninterrupted_weights_and_points(tmp_path):
    # The Trainer as users write it, with an MLFlowLogger of its own and SLURMEnvironment(auto_requeue=True)
    env = {"GWL_TEST_PL": json.dumps({"logger": "mlflow", "slurm_requeue": True})}
    straight = _project(tmp_path / "straight")
    v_straight = version_line(straight.run("+job=pl_t", env=env, check=0), MODEL)

    p = _project(tmp_path / "interrupted")
    # SIGTERM during step 25: Lightning's own SIGTERM handler (SIGTERMException) is not installed; the loop ends
    # after step 25 (the step in progress, issue 41), whose checkpoint is sealed; the job exits 75
    first = p.run("+job=pl_t", env={**env, "GWL_TEST_SIGTERM_AT": "25"}, check=75)
    out = first.stdout + first.stderr
    assert "loop ended after step 25" in out and "SIGTERMException" not in out, out
    assert "SLURMEnvironment(auto_requeue=True)" in out  # the warning that Lightning's requeue is off
    assert checkpoints(p, MODEL) == ["step-000000020", "step-000000025"]

    # SIGKILL as step 51 begins, step 50's (synchronous) checkpoint sealed: the point of step 50, which Lightning
    # logs after the hook that checkpoints, must be in the spool already (the adversarial pass lost it)
    second = p.run("+job=pl_t", env={**env, "GWL_TEST_SIGKILL_AT": "51", "GWENLAKE_CHECKPOINT_ASYNC": "0"},
                   check=-signal.SIGKILL)
    assert "resuming from step 25" in second.stdout + second.stderr, second.stderr
    assert checkpoints(p, MODEL) == ["step-000000040", "step-000000050"]

    # resumed in epoch 1 (the pass's input: every resume past the first epoch gave other weights), then a SIGKILL
    # with half of step 100's lightning.ckpt written: never sealed, never resumed from
    third = p.run("+job=pl_t", env={**env, "GWL_TEST_SIGKILL_IN_SAVE": "100"}, check=-signal.SIGKILL)
    assert "resuming from step 50" in third.stdout + third.stderr, third.stderr
    assert checkpoints(p, MODEL) == ["step-000000080", "step-000000090"]

    # resumed from step 90, the last batch of epoch 1 (the re-check's input: the spent iterator skipped epoch 2)
    last = p.run("+job=pl_t", env=env, check=0)
    out = last.stdout + last.stderr
    assert "resuming from step 90" in out and "not resumable" not in out, out
    assert checkpoints(p, MODEL) == ["step-000000190", "step-000000200"]
    v = version_line(last, MODEL)

    # Lightning restores the loader's position (StatefulDataLoader; the sampler's epoch set before it, by the
    # callback), the Run the RNG (dropout), the example's sampler each epoch's order: the same weights, bit for bit
    a, b = weights(straight, v_straight, WEIGHTS), weights(p, v, WEIGHTS)
    assert sorted(a) == sorted(b) and a
    for name in a:
        assert (a[name] == b[name]).all(), name

    # the MLFlowLogger's points land in the job's run: one run, no experiment "mine", no ./mlruns; `loss` one
    # point per step 1..200 (those after each resume point were logged twice), the uninterrupted run's values
    client, _ = the_run(p, MODEL)
    assert sorted(e.name for e in client.search_experiments()) == ["Default", MODEL]
    assert not (p.root / "mlruns").exists() and not (p.root / "lightning_logs").exists()
    losses = history(p, MODEL, "loss")
    assert sorted(losses) == list(range(1, 201))
    assert losses == history(straight, MODEL, "loss")

    # the version loads into a module built alike, and scores as the training reported
    import torch

    from examples.lightning_churn import ChurnModule
    from gwenlake_hpc import load_model, load_state
    loaded = load_model(MODEL, v, repo=p.root)
    hp = json.loads((loaded.path / "hparams.json").read_text())
    module = ChurnModule(**hp)
    load_state(loaded.path / "model.safetensors", model=module)
    assert torch.equal(module.model[0].weight, b["model.0.weight"])
    assert 0.7 < loaded.metrics["test_auc"] < 1.0


@pytest.mark.parametrize("extras, named", [
    ({"logger": "wandb"}, "logger"),  # wandb is not installed here: WandbLogger's constructor raises
    # the adversarial pass's input: MLFlowLogger() without a tracking_uri fails in its own constructor
    ({"logger": "mlflow_default"}, "MLFlowLogger(tracking_uri=mlflow.get_tracking_uri())"),
])
def test_settings_that_cannot_work_exit_2_naming_the_setting(tmp_path, extras, named):
    p = _project(tmp_path / "p")
    proc = p.run("+job=pl_t", env={"GWL_TEST_PL": json.dumps(extras)}, check=2)
    out = proc.stdout + proc.stderr
    assert named in out and "Traceback" not in out, out
    assert not list((p.root / "runs" / MODEL).glob("*/checkpoints/step-*")) and not (p.root / "mine").exists()


def test_a_csv_logger_of_the_users_is_kept_beside_the_jobs_run(tmp_path):
    """The adversarial pass's input: a CSVLogger of the user's own folder was dropped silently with Lightning's
    default logger; it is kept, and the job's run gets the points as well."""
    p = _project(tmp_path / "p")
    csv_dir = tmp_path / "csvlogs"
    p.run("+job=pl_t", "job.steps=30", env={"GWL_TEST_PL": json.dumps({"logger": "csv", "csv_dir": str(csv_dir)})},
          check=0)
    (metrics,) = csv_dir.rglob("metrics.csv")
    rows = metrics.read_text().splitlines()
    assert "loss" in rows[0].split(","), rows[0]
    assert len(rows) - 1 == 30  # one row a step, from Lightning alone (the early log of a checkpoint step is ours)
    assert sorted(history(p, MODEL, "loss")) == list(range(1, 31))


def test_an_epochs_run_resumed_from_an_epochs_last_batch_trains_every_epoch(tmp_path):
    """The re-check's input (job.epochs=2, job.eval_every=15, killed right after step 45's seal, the last batch
    of epoch 0): the resumed start stopped after one step of epoch 1 and committed a half-trained model."""
    args = ("+job=pl_t", "job.steps=null", "job.epochs=2", "job.eval_every=15")
    straight = _project(tmp_path / "straight")
    v_straight = version_line(straight.run(*args, check=0), MODEL)
    p = _project(tmp_path / "p")
    p.run(*args, env={"GWL_TEST_SIGKILL_AT": "46", "GWENLAKE_CHECKPOINT_ASYNC": "0"}, check=-signal.SIGKILL)
    last = p.run(*args, check=0)
    assert "resuming from step 45" in last.stdout + last.stderr, last.stderr
    assert checkpoints(p, MODEL) == ["step-000000075", "step-000000090"]
    a, b = weights(straight, v_straight, WEIGHTS), weights(p, version_line(last, MODEL), WEIGHTS)
    assert all((a[name] == b[name]).all() for name in a)
    assert sorted(history(p, MODEL, "loss")) == list(range(1, 91))


def test_a_start_refused_with_exit_2_is_no_restart(tmp_path):
    """Issue 40 item 7, the reported input: a Lightning job evicted once (SIGTERM, exit 75), then refused with
    exit 2 by a setting of its Trainer (a WandbLogger; a ModelCheckpoint of the user's then), then run again as it should be and
    finished, was tagged ``gwenlake.restarts=2``: the refused start trained nothing (no ``first_step``)."""
    p = _project(tmp_path / "p")
    p.run("+job=pl_t", "job.steps=40", env={"GWL_TEST_SIGTERM_AT": "25"}, check=75)
    refused = p.run("+job=pl_t", "job.steps=40",
                    env={"GWL_TEST_PL": json.dumps({"logger": "wandb"})}, check=2)
    assert "logger" in refused.stdout + refused.stderr
    last = p.run("+job=pl_t", "job.steps=40", check=0)
    assert "resuming from step 25" in last.stdout + last.stderr, last.stderr
    (run_dir,) = (p.root / "runs" / MODEL).iterdir()
    starts = json.loads((run_dir / "run.json").read_text())["starts"]
    assert [s["first_step"] for s in starts] == [1, None, 26], starts
    _, run = the_run(p, MODEL)
    assert run.info.status == "FINISHED" and run.data.tags["gwenlake.restarts"] == "1", run.data.tags
