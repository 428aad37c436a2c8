"""The requeue decision taken after a job step (pure logic; the cluster tests exercise it for real)."""

import stat
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gwenlake_hpc.job.config import SlurmLauncherConfig
from gwenlake_hpc.base.errors import ConfigError
from gwenlake_hpc.launch.requeue import decide, parse_slurm_time
from gwenlake_hpc.launch.slurm import sbatch_parameters, setup_lines, write_secrets


@pytest.mark.parametrize("text, seconds", [
    ("0:45", 45), ("1:05", 65), ("10:00", 600), ("1:00:00", 3600), ("2-03:04:05", 183845),
    ("UNLIMITED", None), ("INVALID", None), ("", None),
])
def test_parse_slurm_time(text, seconds):
    assert parse_slurm_time(text) == seconds


def test_decisions():
    # time limit: little time left after a USR2 eviction, retries left -> requeue
    assert decide(75, 0, 3, 40, 30).action == "requeue"
    assert decide(75, 3, 3, 40, 30).action == "fail"
    # an eviction with plenty of time left is a preemption or scancel: SLURM decides, never a second requeue
    d = decide(75, 0, 3, 3000, 120)
    assert d.action == "leave" and "preemption" in d.reason
    assert decide(75, 0, 3, None, 120).action == "leave"  # unknown or unlimited time
    # a killed step (SIGKILL, OOM) is requeued while retries remain, then fails with the reason
    assert decide(137, 1, 3, None, 120).action == "requeue"
    d = decide(137, 3, 3, None, 120)
    assert d.action == "fail" and "signal 9" in d.reason
    assert decide(0, 0, 3, None, 120).action == "done"
    assert decide(1, 0, 3, None, 120).action == "fail"
    # a start that refused its settings or its run (another start holds it, a fence): never requeued
    d = decide(2, 0, 3, None, 120)
    assert d.action == "fail" and "exit 2" in d.reason and "traceback" not in d.reason
    # a scancel or preemption near the time limit: the job is no longer RUNNING, SLURM decides (no requeue
    # of a cancelled job, no second requeue of a preempted one)
    assert decide(75, 0, 3, 40, 30, state="RUNNING").action == "requeue"
    for state in ("COMPLETING", "CANCELLED", "PREEMPTED", "TIMEOUT"):
        d = decide(75, 0, 3, 40, 30, state=state)
        assert d.action == "leave" and state in d.reason
        assert decide(137, 0, 3, None, 30, state=state).action == "leave"
    # killed by the time-limit warning itself (SIGUSR2 before the handlers existed, e.g. during start-up): the
    # time-limit case, never "killed or out of memory"
    for rc in (128 + 12, -12):
        d = decide(rc, 0, 3, 100, 120)
        assert d.action == "requeue" and "time limit" in d.reason and "memory" not in d.reason
        assert decide(rc, 3, 3, 100, 120).action == "fail"
        assert decide(rc, 0, 3, 100, 120, state="COMPLETING").action == "leave"


def _launcher(**kw):
    return OmegaConf.merge(OmegaConf.structured(SlurmLauncherConfig), kw)


def test_sbatch_parameters_refuse_control_characters_and_bad_numbers():
    params = sbatch_parameters(_launcher(partition="gpu", mem_gb=8, gpus_per_node=2), "job")
    assert params["partition"] == "gpu" and params["mem"] == "8192M" and params["gpus_per_node"] == 2
    assert params["additional_parameters"]["requeue"] is True
    with pytest.raises(ConfigError, match="launcher.partition"):
        sbatch_parameters(_launcher(partition="gpu\nrm -rf /"), "job")
    with pytest.raises(ConfigError, match="signal_delay_s"):
        sbatch_parameters(_launcher(timeout_min=1, signal_delay_s=60), "job")
    with pytest.raises(ConfigError, match="launcher.env"):
        setup_lines(_launcher(env={"BAD NAME": "x"}), None)


def test_secrets_go_to_a_private_file_never_the_script(tmp_path):
    lc = _launcher(secrets=["API_TOKEN"])
    path = write_secrets(lc, tmp_path, environ={"API_TOKEN": "s3cr3t'$(x)"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == "API_TOKEN='s3cr3t'\"'\"'$(x)'\n"
    lines = setup_lines(lc, path)
    assert all("s3cr3t" not in line for line in lines)
    with pytest.raises(ConfigError, match="API_TOKEN is not set"):
        write_secrets(lc, tmp_path, environ={})


def test_additional_parameters_keys_and_resources_are_checked():
    with pytest.raises(ConfigError, match="not an sbatch option name"):
        sbatch_parameters(_launcher(additional_parameters={"mail-type=END --wrap": "x"}), "job")
    with pytest.raises(ConfigError, match="launcher.mem_gb"):
        sbatch_parameters(_launcher(mem_gb=-1), "job")
    assert sbatch_parameters(_launcher(additional_parameters={"mail-type": "END"}), "job")[
        "additional_parameters"]["mail-type"] == "END"


def test_status_takes_restarts_from_the_run_record_once_slurm_forgot_the_job(tmp_path, monkeypatch):
    import json

    from gwenlake_hpc.launch import status

    starts = [{"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "0", "SLURM_PROCID": "0"},  # another job of the run
              {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0"},
              {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1", "SLURM_PROCID": "0"},
              {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2", "SLURM_PROCID": "0"},
              {"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3",
               "SLURM_RESTART_COUNT": "1", "SLURM_PROCID": "0"}]
    info = {"starts": starts}
    assert status.restarts_from_record(info, "42") == 2
    assert status.restarts_from_record(info, "41") == 0
    assert status.restarts_from_record(info, "40_3") == 1
    assert status.restarts_from_record(info, "40_4") is None and status.restarts_from_record({}, "42") is None

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps(info))
    monkeypatch.setattr(status, "slurm_state", lambda job_id: ("COMPLETED", None))  # sacct: no Restarts field
    s = status.job_status({"job_id": "42", "run_dir": str(run_dir), "model": "t.model"})
    assert (s.state, s.restarts) == ("COMPLETED", 2)


def test_a_waited_array_is_polled_with_one_squeue_and_one_sacct(tmp_path):
    from gwenlake_hpc.launch import status

    polls = iter([
        ("77_0 RUNNING\n77_1 PENDING\n77_2 PENDING\n", "77_0|RUNNING\n77_[1-2]|PENDING\n"),
        ("77_1 RUNNING\n", "77_0|COMPLETED\n77_1|RUNNING\n77_2|CANCELLED by 0\n"),
        ("", "77_0|COMPLETED\n77_1|FAILED\n77_2|CANCELLED by 0\n"),
    ])
    calls = []
    current = {}

    def run(cmd):
        calls.append(cmd[0])
        if cmd[0] == "squeue":
            current["sacct"] = None
            squeue, current["sacct"] = next(polls)
            return squeue
        return current["sacct"]

    tasks = [{"job_id": f"77_{i}", "run_dir": str(tmp_path / f"r{i}")} for i in range(3)]
    got = status.wait_array(tasks, poll_s=0.0, run=run)
    assert [s.state for s in got] == ["COMPLETED", "FAILED", "CANCELLED"]
    assert calls == ["squeue", "sacct"] * 3  # per poll: one of each for the whole array


def test_a_job_step_started_by_boot_keeps_its_stop_handlers_when_submitit_installs_its_own(tmp_path):
    """submitit calls JobEnvironment._handle_signals right before the job; under boot it must leave our
    SIGUSR2/SIGTERM handlers in place (a signal in between used to end the job as "timed-out too many times")."""
    import os
    import subprocess
    import sys
    import textwrap

    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        import signal, sys
        from submitit.core import job_environment
        from gwenlake_hpc.launch import boot
        boot.install_early()
        if sys.argv[1] == "keep":
            boot.keep_our_handlers()
        before = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
        env = object.__new__(job_environment.JobEnvironment)  # its own __new__ wants a SLURM job
        job_environment.JobEnvironment._handle_signals(env, None, None)
        after = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
        print("kept" if after == before else "replaced")
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    said = {mode: subprocess.run([sys.executable, str(probe), mode], capture_output=True, text=True, env=env,
                                 timeout=120) for mode in ("keep", "plain")}
    assert said["keep"].stdout.strip() == "kept", said["keep"].stdout + said["keep"].stderr
    assert said["plain"].stdout.strip() == "replaced", said["plain"].stdout + said["plain"].stderr  # submitit's own


def test_the_retry_budget_counts_starts_in_a_row_without_progress_and_max_starts_caps_all():
    """launcher.max_retries bounds the starts in a row that sealed no newer checkpoint (``stalled``, this start
    included); launcher.max_starts bounds every start. A training requeued often but advancing each time goes on."""
    # the 4th start of a training that advances at every start: the old count (3/3 used) failed it here
    d = decide(75, 3, 3, 40, 30, stalled=0)
    assert d.action == "requeue" and "start 5/100" in d.reason and d.rule is None
    assert decide(137, 40, 3, None, 120, stalled=0).action == "requeue"  # killed, but it had advanced
    # starts without progress: up to max_retries in a row are requeued, the next one ends the job, rule named
    assert decide(75, 5, 3, 40, 30, stalled=3).action == "requeue"
    for rc, remaining in ((75, 40), (137, None), (128 + 12, 100)):
        d = decide(rc, 5, 3, remaining, 30, stalled=4)
        assert (d.action, d.rule) == ("fail", "launcher.max_retries") and "4 start(s) in a row" in d.reason
    # max_retries=0: only a start that advanced is requeued
    assert decide(75, 0, 0, 40, 30, stalled=0).action == "requeue"
    assert decide(75, 0, 0, 40, 30, stalled=1).rule == "launcher.max_retries"
    # the cap on all starts, progress or not (start 100 of 100 is the last)
    assert decide(75, 98, 3, 40, 30, stalled=0, max_starts=100).action == "requeue"
    d = decide(75, 99, 3, 40, 30, stalled=0, max_starts=100)
    assert (d.action, d.rule) == ("fail", "launcher.max_starts") and "100" in d.reason
    assert decide(137, 0, 3, None, 30, stalled=0, max_starts=1).rule == "launcher.max_starts"
    from gwenlake_hpc.launch.requeue import DEFAULT_MAX_STARTS

    assert SlurmLauncherConfig().max_starts == DEFAULT_MAX_STARTS == 100  # a script without --max-starts: the same
    # progress unknown (no run directory: a script without --run-dir): every start counts, as before
    assert decide(75, 2, 3, 40, 30).action == "requeue"
    assert decide(75, 3, 3, 40, 30).rule == "launcher.max_retries"
    # SLURM's own endings and the other outcomes name no rule
    assert decide(75, 0, 3, 40, 30, state="COMPLETING", stalled=9).rule is None
    assert decide(0, 0, 3, None, 30, stalled=9).action == "done"


def test_a_start_past_max_starts_fails_naming_the_rule_whatever_its_status():
    # SLURM requeued the job itself (a preemption) after the last start allowed: the job refused to train (1)
    d = decide(1, 1, 3, 500, 30, "RUNNING", stalled=0, max_starts=1)
    assert (d.action, d.rule) == ("fail", "launcher.max_starts") and "start 2 is past" in d.reason
    assert decide(1, 0, 3, 500, 30, "RUNNING", stalled=0, max_starts=1).rule is None  # the first start's own failure
    assert decide(0, 1, 3, 500, 30, "RUNNING", max_starts=1).action == "done"


def test_the_job_refuses_a_start_past_max_starts(tmp_path):
    from gwenlake_hpc.base.errors import StartLimitError
    from gwenlake_hpc.job.execute import check_start_limit

    check_start_limit({})  # outside a batch script
    check_start_limit({"GWENLAKE_MAX_STARTS": "2", "SLURM_RESTART_COUNT": "1"})  # start 2 of 2
    with pytest.raises(StartLimitError, match=r"start 3 of SLURM job 7 and launcher.max_starts=2"):
        check_start_limit({"GWENLAKE_MAX_STARTS": "2", "SLURM_RESTART_COUNT": "2", "SLURM_JOB_ID": "7"})


def test_every_batch_script_exports_the_start_cap():
    from gwenlake_hpc.launch.slurm import setup_lines
    from omegaconf import OmegaConf

    lc = OmegaConf.create({"name": "slurm", "max_starts": 7})
    assert "export GWENLAKE_MAX_STARTS=7" in setup_lines(lc, None)
    assert 'export GWENLAKE_MAX_STARTS="$MAX_STARTS"' in (Path(__file__).resolve().parents[2] / "sbatch" /
                                                           "train.sbatch").read_text()


def _fake_slurm(tmp_path, squeue: str, scontrol_show: str = ""):
    """squeue / scontrol on PATH answering fixed facts; ``scontrol requeue`` appends its job to ``requeued``."""
    import textwrap

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho '{squeue}'\n")
    (bin_dir / "scontrol").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = requeue ]; then echo "$2" >> {tmp_path / 'requeued'}; exit 0; fi
        echo '{scontrol_show}'
        """))
    for p in bin_dir.iterdir():
        p.chmod(0o755)
    return bin_dir


def _teardown(tmp_path, bin_dir, restarts, rc, *args):
    import os
    import subprocess
    import sys

    from gwenlake_hpc.launch import requeue

    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_RESTART_COUNT": str(restarts)}
    env.pop("SLURM_ARRAY_JOB_ID", None)
    # run as a plain file, as a container job's host runs it: the standard library only
    return subprocess.run([sys.executable, requeue.__file__, "--rc", str(rc), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def _sealed(run_dir, step, created):
    import json

    ck = run_dir / "checkpoints" / f"step-{step:09d}"
    ck.mkdir(parents=True)
    (ck / "MANIFEST.json").write_text(json.dumps({"step": step, "created": created, "run_key": run_dir.name,
                                                  "files": {}}))


def test_the_teardown_counts_progress_from_the_checkpoints_and_removes_secrets_when_the_job_ends(tmp_path):
    """The teardown as a real process, with squeue and scontrol answering fixed facts: a start that sealed a newer
    checkpoint is requeued even with launcher.max_retries=0, the next one that sealed none ends the job, named;
    the secrets file is kept across the requeue and removed at the end; the job's own record says it all."""
    import json

    run_dir = tmp_path / "runs" / "t.model" / "key1"
    _sealed(run_dir, 10, 1000.0)
    secrets = tmp_path / "secrets-abc.env"
    secrets.write_text("TOKEN=x\n")
    bin_dir = _fake_slurm(tmp_path, "RUNNING 0:40")
    common = ["--max-retries", "0", "--max-starts", "100", "--signal-delay", "30", "--run-dir", str(run_dir),
              "--secrets", str(secrets)]
    first = _teardown(tmp_path, bin_dir, 0, 75, *common, "--started", "900")  # step 10 sealed during this start
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "requeued").read_text().split() == ["42"] and secrets.exists()
    second = _teardown(tmp_path, bin_dir, 1, 75, *common, "--started", "1100")  # nothing sealed since
    assert second.returncode == 75 and "launcher.max_retries=0" in second.stderr, second.stderr
    assert (tmp_path / "requeued").read_text().split() == ["42"] and not secrets.exists()
    record = json.loads((run_dir / "slurm" / "42" / "teardown.json").read_text())
    assert [(s["restart"], s["newest_step"], s["progressed"], s["action"]) for s in record["starts"]] == [
        (0, 10, True, "requeue"), (1, 10, False, "fail")]
    assert record["starts"][-1]["rule"] == "launcher.max_retries" and record["stalled"] == 1


def test_after_a_first_start_progress_is_told_by_step_numbers_not_by_clocks(tmp_path):
    """The training's node may run behind the batch script's: a checkpoint sealed at 1050 by its clock, during a
    start that began at 1100 by the other's, is still progress, since its step is past the previous start's."""
    import json

    run_dir = tmp_path / "runs" / "t.model" / "key1"
    _sealed(run_dir, 10, 1000.0)
    bin_dir = _fake_slurm(tmp_path, "RUNNING 0:40")
    common = ["--max-retries", "0", "--signal-delay", "30", "--run-dir", str(run_dir)]
    assert _teardown(tmp_path, bin_dir, 0, 75, *common, "--started", "900").returncode == 0
    _sealed(run_dir, 20, 1050.0)  # sealed by a clock 50 s behind the batch script's
    second = _teardown(tmp_path, bin_dir, 1, 75, *common, "--started", "1100")
    assert second.returncode == 0, second.stderr
    assert (tmp_path / "requeued").read_text().split() == ["42", "42"]
    record = json.loads((run_dir / "slurm" / "42" / "teardown.json").read_text())
    assert [(s["newest_step"], s["progressed"]) for s in record["starts"]] == [(10, True), (20, True)]


def test_the_teardown_keeps_secrets_for_a_preemption_and_removes_them_after_a_scancel(tmp_path):
    """Both end the step with SLURM's state COMPLETING; a preempted job already shows its next restart
    (scontrol's Restarts) and no end time, a cancelled one its end time and no new restart."""
    secrets = tmp_path / "s.env"
    for show, kept in (("JobId=42 JobState=COMPLETING Restarts=1 EndTime=Unknown", True),
                       ("JobId=42 JobState=COMPLETING Restarts=0 EndTime=2026-12-01T15:36:36", False)):
        secrets.write_text("TOKEN=x\n")
        bin_dir = _fake_slurm(tmp_path, "COMPLETING 9:00", show)
        proc = _teardown(tmp_path, bin_dir, 0, 75, "--max-retries", "3", "--signal-delay", "30",
                         "--secrets", str(secrets))
        assert "SLURM is ending it" in proc.stderr and secrets.exists() == kept, proc.stderr
        assert not (tmp_path / "requeued").exists()


def _manifest(run_dir, step, created):
    import json

    ck = run_dir / "checkpoints" / f"step-{step:09d}"
    ck.mkdir(parents=True)
    (ck / "MANIFEST.json").write_text(json.dumps({"format": 2, "run_key": run_dir.name, "step": step,
                                                  "created": created, "files": {}, "metrics": {}}))


def test_status_shows_what_a_cancelled_sweep_task_did_itself_not_the_later_job_of_its_run(tmp_path, monkeypatch,
                                                                                         capsys):
    """Sweep task 50_1 was cancelled at step 30; job 60 reused its run key and finished at step 60 with a version.
    The task's line shows its own step and no version: from its teardown's record, else from the checkpoints
    sealed before the later job started. Job 60 shows the run's. A job a budget ended names the rule."""
    import json

    from gwenlake_hpc.launch import commands, status
    from gwenlake_hpc.launch.requeue import record_path

    runs = tmp_path / "runs"
    run_dir = runs / "t.model" / "key1"
    for step, created in ((10, 110.0), (20, 150.0), (30, 190.0), (40, 250.0), (60, 290.0)):
        _manifest(run_dir, step, created)
    done = {"version": "f" * 40, "final_step": 60, "time": 300.0}
    starts = [{"time": 100.0, "SLURM_JOB_ID": "51", "SLURM_ARRAY_JOB_ID": "50", "SLURM_ARRAY_TASK_ID": "1",
               "SLURM_PROCID": "0"}, {"time": 200.0, "SLURM_JOB_ID": "60", "SLURM_PROCID": "0"}]
    (run_dir / "run.json").write_text(json.dumps({"starts": starts, "completed": done, "completions": [done]}))
    states = {"50_1": ("CANCELLED", None), "60": ("COMPLETED", None), "70": ("FAILED", None)}
    monkeypatch.setattr(status, "slurm_state", lambda job_id, run=None: states[job_id])

    # no teardown record (the teardown did not run): the checkpoints sealed before job 60's start
    s = status.job_status({"job_id": "50_1", "run_dir": str(run_dir), "run_key": "key1"})
    assert (s.state, s.step, s.version) == ("CANCELLED", 30, None)
    assert s.checkpoint == run_dir / "checkpoints" / "step-000000030"
    later = status.job_status({"job_id": "60", "run_dir": str(run_dir), "run_key": "key1"})
    assert (later.step, later.version) == (60, "f" * 40)
    # its own record wins (a retention may have deleted its newest checkpoint since)
    record_path(run_dir, "50_1").parent.mkdir(parents=True)
    record_path(run_dir, "50_1").write_text(json.dumps({"starts": [{"newest_step": 20, "action": "leave",
                                                                    "rule": None}]}))
    assert status.job_status({"job_id": "50_1", "run_dir": str(run_dir), "run_key": "key1"}).step == 20

    # a job ended by a budget: the rule is on its status line
    other = runs / "t.model" / "key2"
    _manifest(other, 10, 110.0)
    (other / "run.json").write_text(json.dumps({"starts": [{"time": 100.0, "SLURM_JOB_ID": "70"}]}))
    record_path(other, "70").parent.mkdir(parents=True)
    record_path(other, "70").write_text(json.dumps({"starts": [{"newest_step": 10, "action": "fail",
                                                                "rule": "launcher.max_retries",
                                                                "reason": "time limit: not requeued"}]}))
    index = runs / ".gwenlake-jobs.jsonl"
    index.write_text("".join(json.dumps({"job_id": j, "run_dir": str(d), "model": "t.model", "run_key": d.name,
                                         "submitted": 9e9}) + "\n"
                             for j, d in (("50_1", run_dir), ("60", run_dir), ("70", other))))
    assert commands.print_status(runs, include_old=True) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["50_1"].split()[1:5] == ["CANCELLED", "0", "20", "-"] and "version" not in lines["50_1"]
    assert lines["60"].split()[3] == "60" and "version ffffffffffff" in lines["60"]
    assert "ended by launcher.max_retries" in lines["70"]


def test_cancel_removes_the_jobs_secrets_file(tmp_path, monkeypatch):
    """`cancel` (and a JobHandle's cancel) remove the secrets file of the cancelled job, or of every task of a
    cancelled array, once scancel accepted: a cancelled job's teardown may not get to run."""
    import json
    import os

    from gwenlake_hpc.launch import commands
    from gwenlake_hpc.launch.status import JobHandle

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scancel").write_text(f"#!/bin/sh\necho \"$1\" >> {tmp_path / 'cancelled'}\n")
    (bin_dir / "scancel").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    runs = tmp_path / "runs"
    runs.mkdir()
    files = {j: tmp_path / f"secrets-{j}.env" for j in ("80", "90_0", "90_1", "91")}
    for path in files.values():
        path.write_text("TOKEN=x\n")
    (runs / ".gwenlake-jobs.jsonl").write_text("".join(
        json.dumps({"job_id": j, "run_dir": str(tmp_path / j), "model": "t.model", "secrets": str(p)}) + "\n"
        for j, p in files.items()))
    assert commands.cancel("80", runs) == 0 and not files["80"].exists() and files["91"].exists()
    assert commands.cancel("90", runs) == 0 and not files["90_0"].exists() and not files["90_1"].exists()
    JobHandle("91", tmp_path / "91", secrets=files["91"]).cancel()
    assert not files["91"].exists()
    assert (tmp_path / "cancelled").read_text().split() == ["80", "90", "91"]


def test_an_array_task_sources_its_own_secrets_and_tells_the_teardown_its_run_directory(tmp_path):
    """A sweep's one batch script: each task sources its own secrets file (removed when that task ends) and its
    teardown gets that task's run directory and this start's time (bash runs the lines as sbatch would)."""
    import subprocess

    from gwenlake_hpc.launch.slurm import ARRAY_RUN_DIR, setup_lines, teardown_lines

    lc = _launcher(secrets=["API_TOKEN"])
    template = write_secrets(lc, tmp_path / "arr", environ={"API_TOKEN": "tok'en"}, tasks=2)
    assert template.name.startswith("secrets-") and template.name.endswith("-%a.env")
    files = sorted((tmp_path / "arr").iterdir())
    assert [f.name for f in files] == [template.name.replace("%a", i) for i in "01"]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert write_secrets(lc, tmp_path / "arr", environ={"API_TOKEN": "x"}) != template  # never shared
    run_dirs = [tmp_path / "runs" / "a b", tmp_path / "runs" / "c"]
    args = tmp_path / "printargs"
    args.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    args.chmod(0o755)
    script = "\n".join(setup_lines(lc, template, run_dirs) + ['printf "token=%s\\n" "$API_TOKEN"', "true"]
                       + teardown_lines(lc, python=str(args), run_dir=ARRAY_RUN_DIR, secrets=template))
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "SLURM_ARRAY_TASK_ID": "1"}).stdout.splitlines()
    assert out[0] == "token=tok'en"
    told = dict(zip(out[1::2], out[2::2]))  # the teardown's options, each with its value
    assert told["--run-dir"] == str(run_dirs[1]) and told["--secrets"] == str(files[1])
    assert told["--started"].isdigit() and told["--max-starts"] == "100"


def _hung(run_dir, name, step, written):
    import json

    from helpers.project import HANG_EXPECTED

    (run_dir.parent / HANG_EXPECTED).touch()  # a verdict on purpose (the suite's check for false alarms)
    folder = run_dir / "hangs" / name
    folder.mkdir(parents=True)
    (folder / "verdict.json").write_text(json.dumps({"step": step, "first": [1], "time": written, "line": "x"}))
    return folder


def test_a_hang_is_requeued_once_and_the_same_hang_at_the_same_step_again_fails_naming_the_stacks(tmp_path):
    """The teardown as a real process: a start the hang watchdog killed (exit 137, a new verdict) is requeued;
    the next start hanging at the same step ends the job, naming the rule and the stacks, with no third start;
    a hang at another step would have been requeued."""
    import json

    run_dir = tmp_path / "runs" / "t.model" / "key1"
    _sealed(run_dir, 20, 950.0)
    _hung(run_dir, "19990101-000000", 7, 500.0)  # an earlier job's hang: not this job's
    bin_dir = _fake_slurm(tmp_path, "RUNNING 0:40")
    common = ["--max-retries", "3", "--signal-delay", "30", "--run-dir", str(run_dir)]
    plain = _teardown(tmp_path, bin_dir, 0, 137, *common, "--started", "900")
    assert plain.returncode == 0 and "killed by signal 9 (out of memory or killed)" in plain.stderr, plain.stderr

    first = _hung(run_dir, "20261202-100000", 25, 1000.0)
    once = _teardown(tmp_path, bin_dir, 1, 137, *common, "--started", "910")
    assert once.returncode == 0, once.stderr
    assert f"hang at step 25 (stacks: {first}/rank*.txt): requeue" in once.stderr, once.stderr

    second = _hung(run_dir, "20261202-101000", 25, 1200.0)
    twice = _teardown(tmp_path, bin_dir, 2, 137, *common, "--started", "1100")
    assert twice.returncode == 137, twice.stderr
    assert (f"hang at step 25 (stacks: {second}/rank*.txt): the start before hung at the same step, so the hang "
            "recurs there: not requeued") in twice.stderr, twice.stderr
    assert (tmp_path / "requeued").read_text().split() == ["42", "42"]  # no third requeue
    record = json.loads((run_dir / "slurm" / "42" / "teardown.json").read_text())
    assert [(s["hang"] or {}).get("step") for s in record["starts"]] == [None, 25, 25]
    assert record["starts"][-1]["rule"] == "job.hang_timeout_s" and record["starts"][-1]["action"] == "fail"


def test_hangs_at_different_steps_are_requeued_within_the_budget():
    from gwenlake_hpc.launch.requeue import decide

    d = decide(137, 1, 3, None, 30, "RUNNING", 1, hang={"folder": "/r/hangs/b", "step": 31},
               previous_hang={"folder": "/r/hangs/a", "step": 25})
    assert d.action == "requeue" and d.reason.startswith("hang at step 31 (stacks: /r/hangs/b/rank*.txt): requeue")
    same = decide(137, 1, 3, None, 30, "RUNNING", 1, hang={"folder": "/r/hangs/b", "step": 25},
                  previous_hang={"folder": "/r/hangs/a", "step": 25})
    assert (same.action, same.rule) == ("fail", "job.hang_timeout_s")
    assert decide(75, 1, 3, 3000, 30, "RUNNING", 1, hang={"folder": "/r/hangs/b", "step": 25},
                  previous_hang={"step": 25}).action == "leave"  # an eviction is no hang
