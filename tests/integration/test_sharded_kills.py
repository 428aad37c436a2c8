"""SIGKILL of rank 1 alone, at seeded random moments of a 2-rank FSDP2 training (issue 23), 5 trials: each
phase once (``GWL_KILL_TRIALS``: a multiple of 5; 20 was the issue's pass, kept for a deeper run).

Job ``t`` with ``job.target=trainer.py:fit_fsdp`` (two linear layers under ``fully_shard``, gloo, a sharded
``save_state`` every 2 steps here, asynchronous checkpoints, ``keep=3``). The trainer's ``GWL_TEST_SIGKILL=k:phase[:n]``
hook makes rank 1 SIGKILL itself at step ``k``, at one of the moments a sharded checkpoint goes through on that
rank: during a training step (``step``), in the checkpoint block before its ``save_state`` (``before_write``)
and after it, its shards staged in host memory (``after_write``), then in its background writer's thread after
``n`` bytes of its shard file (``mid_write``: a torn ``__1_0.distcp`` left in the partial folder) and after the
digests are gathered to rank 0, while rank 0 seals (``after_gather``). Each phase is drawn trials/5 times, the steps
at random (seed ``GWL_KILL_SEED``, default 23; the plan of every trial is printed).

After each kill rank 0 must exit on its own (the connection to rank 1 closes; the wait is bounded here), and
the next launch of the same run must resume from the newest sealed ``step-N`` folder found before it, whose
manifest lists both ranks' shards, never from the partial folder the kill left. To keep the runtime small the
trials share runs of 10 trials each, serially: the launch after a kill is both the rerun that is checked and
the next trial's killed launch; each run ends with a rerun that finishes on both ranks (exit 0) and commits a
version.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time

import pytest

from helpers.mlflow_server import free_port
from helpers.project import make_test_project

pytestmark = pytest.mark.slow

FSDP = ("+job=t", "job.target=trainer.py:fit_fsdp", "job.steps=50", "job.eval_every=2")
EVERY = 2
PHASES = ("step", "before_write", "mid_write", "after_write", "after_gather")
SHARDS = ("state.safetensors/.metadata", "state.safetensors/__0_0.distcp", "state.safetensors/__1_0.distcp")
#: What rank 1 says (the trainer's hook) just before it SIGKILLs itself, by phase.
MOMENTS = {
    "step": r"test hook: SIGKILL at step {step}, step",
    "before_write": r"test hook: SIGKILL at step {step}, before_write",
    "mid_write": r"test hook: SIGKILL (after \d+ bytes of |at the end of )\S*/state\.safetensors/__1_0\.distcp",
    "after_write": r"test hook: SIGKILL at step {step}, after_write",
    "after_gather": r"test hook: SIGKILL after the gather of step {step}",
}
#: Seconds a launch may take before the test calls it a hang (the collectives time out after 30 s here).
WAIT_S = 150


def _launch(project, *args, env=None):
    """Both ranks of ``python -m gwenlake_hpc ARGS`` (torchrun's environment); [(rc, output)] by rank.

    Fails the test, after killing what is left, when the ranks have not all exited within WAIT_S."""
    port = free_port()
    procs = []
    for rank in range(2):
        e = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
             "GWENLAKE_DIST_TIMEOUT_S": "30", **(env or {})}
        e.pop("GWENLAKE_CONF", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "gwenlake_hpc", *args], cwd=project.root, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + WAIT_S
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            out.append((p.returncode, text))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        texts = [p.communicate()[0] for p in procs]
        pytest.fail(f"a rank did not exit within {WAIT_S} s (a hang):\n" + "\n=====\n".join(t[-4000:] for t in texts))
    return out


def _text(results):
    return "\n=====\n".join(text[-5000:] for _, text in results)


def _sealed(checkpoints):
    """{step: manifest} of the sealed ``step-N`` folders (those with a manifest) in ``checkpoints``."""
    found = {}
    for p in checkpoints.glob("step-*") if checkpoints.is_dir() else ():
        if re.fullmatch(r"step-\d{9}", p.name) and (p / "MANIFEST.json").is_file():
            found[int(p.name[5:])] = json.loads((p / "MANIFEST.json").read_text())
    return found


def _check_whole(checkpoints, sealed):
    """Every sealed checkpoint lists every rank's shard, each on disk with its size."""
    for step, manifest in sealed.items():
        files = manifest["files"]
        assert set(SHARDS) <= set(files), (step, sorted(files))
        for rel in SHARDS:
            assert (checkpoints / f"step-{step:09d}" / rel).stat().st_size == files[rel]["size"], (step, rel)
        assert "gwenlake-ranks/rank-00001.json" in files, (step, sorted(files))


def _resumed_from(results):
    """The step both ranks say they resume from (None: both start from step 0)."""
    steps = set()
    for _, text in results:
        m = re.search(r"resuming from step (\d+)", text)
        steps.add(int(m.group(1)) if m else None)
    assert len(steps) == 1, ("the ranks resumed from different steps", steps, _text(results))
    return steps.pop()


def _plan(seed, trials):
    """[(step offset, phase, bytes)] by trial: each phase trials/5 times in a seeded random order; the step
    offset counts the checkpoint steps (or, for ``step``, the steps) after the resume point."""
    rng = random.Random(seed)
    phases = list(PHASES) * (trials // len(PHASES))
    rng.shuffle(phases)
    plan = []
    for phase in phases:
        offset = rng.randint(1, 2 * EVERY) if phase == "step" else rng.randint(1, 2)
        plan.append((offset, phase, rng.randint(1, 40000) if phase == "mid_write" else 0))
    return plan


def test_sigkill_of_rank_1_at_random_moments_resumes_from_the_newest_whole_checkpoint(tmp_path):
    seed = int(os.environ.get("GWL_KILL_SEED", "23"))
    count = int(os.environ.get("GWL_KILL_TRIALS", "5"))
    plan = _plan(seed, count)
    project = make_test_project(tmp_path / "project")
    hit: dict[str, int] = {}
    torn: list = []  # mid_write: the bytes of rank 1's shard on disk when it died ("end": all of them)
    resumes = []
    started = time.monotonic()
    for chain, trials in enumerate(plan[k:k + 10] for k in range(0, count, 10)):
        root = f"runs-{chain}"
        args = (*FSDP, f"paths.runs_root={root}")
        checkpoints = None
        expected = None  # the step the next launch must resume from (None: from step 0)
        for i, (offset, phase, n) in enumerate(trials, start=chain * 10):
            base = expected or 0
            if phase == "step":
                step = base + offset
            else:  # a checkpoint step: the first or second after the resume point
                step = (base // EVERY + offset) * EVERY
            spec = f"{step}:{phase}" + (f":{n}" if phase == "mid_write" else "")
            print(f"trial {i} (seed {seed}, run {root}): SIGKILL rank 1 at step {step}, phase {phase}"
                  + (f" after {n} bytes of its shard" if n else "") + f"; resume expected from {expected}",
                  flush=True)
            res = _launch(project, *args, env={"GWL_TEST_SIGKILL": spec})
            assert _resumed_from(res) == expected, (spec, _text(res))
            assert res[1][0] == -9, (spec, _text(res))  # rank 1 was killed, at the planned moment:
            assert re.search(MOMENTS[phase].format(step=step), res[1][1]), (spec, _text(res))
            if phase == "mid_write":
                torn.append(int(re.search(r"after (\d+) bytes", res[1][1]).group(1))
                            if "bytes of" in res[1][1] else "end")
            assert res[0][0] not in (0, -9), (spec, _text(res))  # rank 0 failed on its own, did not hang
            hit[phase] = hit.get(phase, 0) + 1
            resumes.append(expected)
            if checkpoints is None:
                checkpoints = next((project.root / root / "t.model").iterdir()) / "checkpoints"
            sealed = _sealed(checkpoints)
            _check_whole(checkpoints, sealed)
            newest = max(sealed, default=None)
            # The newest sealed checkpoint is never older than the last one confirmed before the kill, nor
            # newer than the step being killed.
            assert (newest or 0) >= (expected or 0) and (newest or 0) <= step, (spec, newest, sorted(sealed))
            if phase != "after_gather":  # rank 1's digests never reached rank 0: step k is not sealed
                assert (newest or 0) < step, (spec, sorted(sealed))
            expected = newest
        final = _launch(project, *args)
        assert [rc for rc, _ in final] == [0, 0], _text(final)
        assert _resumed_from(final) == expected, _text(final)
        resumes.append(expected)
        assert "model t.model version " in final[0][1], _text(final)
        _check_whole(checkpoints, _sealed(checkpoints))
        assert not list(checkpoints.glob(".partial-*")), sorted(p.name for p in checkpoints.iterdir())
    print(f"phases hit: {hit}; mid_write kills after bytes {torn}; resumed from steps {resumes}; "
          f"{time.monotonic() - started:.0f} s", flush=True)
    assert hit == {phase: count // len(PHASES) for phase in PHASES}
