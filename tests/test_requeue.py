"""The requeue decision taken after a job step (pure logic; the cluster tests exercise it for real)."""

import stat

import pytest
from omegaconf import OmegaConf

from gwenlake_hpc.config import SlurmLauncherConfig
from gwenlake_hpc.errors import ConfigError
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
