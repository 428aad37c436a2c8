"""Bad settings, in process (fast tier): exit status 2, a message naming the key, and nothing written or deleted.

The command line's own entry point (``gwenlake_hpc.cli.dispatch.main``) runs here, in the test's process, against a
project trained once; ``tests/*/test_bad_input*.py`` keeps a few of the same cases as real subprocesses. The
rules themselves (``gwenlake_hpc.base.rules``, applied by the config dataclasses) are tested below on their own.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from gwenlake_hpc.job.config_typed import typed, typed_launcher
from gwenlake_hpc.base.errors import ConfigError


def snapshot(root):
    """sha256 of every file under runs/ (run.json included: a refused job records no start; the lock and the fence
    counter, which a start refused after taking the run moves, excluded)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "runs").rglob("*")) if p.is_file() and p.name not in ("mlflow.db", ".lock", ".fence", ".lease")}


#: conf/cluster/NAME.yaml files as users write them: the README's keys, most without the defaults list that names
#: the schema (the schema applies all the same). The key file exists (it is checked before any connection).
_USER = ("host: login.example.org\nport: 22\nuser: me\nkey_file: afile\nknown_hosts: ~/.ssh/known_hosts\n"
         "remote_dir: /shared/me/project\npython: python3\n")
CLUSTER_FILES = {
    "user": _USER,
    "badport": _USER.replace("port: 22", "port: twenty-two"),
    "typo": _USER + "hots: login2.example.org\n",
    "nohost": _USER.replace("host: login.example.org\n", ""),
    "badlauncher": _USER + "launcher:\n  timeout_min: soon\n",
    "scalarlauncher": _USER + "launcher: 5\n",
    "scalarcontainer": _USER + "launcher:\n  container: train.sif\n",
    "alist": "- host: login.example.org\n",
    "schemabadport": "defaults:\n  - cluster_schema\n  - _self_\n" + _USER.replace("port: 22", "port: 0x"),
    "badyaml": _USER + "setup: [unclosed\n",
}
#: Launcher and job files (conf/GROUP/NAME.yaml) a user may get wrong.
GROUP_FILES = {
    "launcher/badyaml": "defaults:\n  - slurm_schema\n  - _self_\npartition: [unclosed\n",
    "launcher/noname": "partition: high\n",  # neither name: slurm nor the schema: was "not in 'LauncherConfig'"
    "launcher/empty": "",  # ran locally without a word
    "job/badyaml": "target: trainer.py:fit\nparams: {lr: 0.1\n",
    "job/dupkey": "target: trainer.py:fit\ntarget: trainer.py:fit\n",
    "job/defaults5": "defaults: 5\ntarget: trainer.py:fit\n",
    "job/defaultsmap": "defaults: {a: 1}\ntarget: trainer.py:fit\n",
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tests' project with one finished run (in process), a plain file and a symlink loop."""
    from helpers.project import make_test_project
    from gwenlake_hpc.cli.dispatch import main

    project = make_test_project(tmp_path_factory.mktemp("config-errors") / "project")
    mp = pytest.MonkeyPatch()
    mp.chdir(project.root)
    mp.delenv("GWENLAKE_CONF", raising=False)
    try:
        assert main(["+job=t", "job.tracking=false", "job.steps=20", "launcher.progress=off"]) == 0
        (project.root / "afile").write_text("a plain file where a folder is expected\n")
        (project.root / "loop1").symlink_to("loop2")
        (project.root / "loop2").symlink_to("loop1")
        for name, text in CLUSTER_FILES.items():
            (project.root / "conf" / "cluster" / f"{name}.yaml").write_text(text)
        for name, text in GROUP_FILES.items():
            (project.root / "conf" / f"{name}.yaml").write_text(text)
        yield project
    finally:
        mp.undo()


@pytest.mark.parametrize("args, needle", [
    (["+job=nope"], "job/nope"),
    (["+job=t", "job.bogus=1"], "bogus"),
    (["+job=t", "paths.nope=x"], "nope"),
    (["+job=t", "job.steps=many"], "steps"),
    (["+job=t", "job.params.nope=1"], "nope"),
    (["+job=t", "+job.params.nope=1"], "job.params.nope"),  # added, then refused by the dataclass
    (["+job=t", "job.params.lr=fast"], "job.params.lr"),
    (["+job=t", "job.resume=maybe"], "resume"),
    (["+job=t", "job.resume=never", "job.steps=90"], "job.resume=never"),
    (["+job=t", "job.steps=5"], "job.steps=5 is below step 20"),  # the run holds a checkpoint of step 20
    (["+job=t", "job.target=trainer.py:nothing"], "nothing"),
    (["+job=t", "job.target=no_such_module:fit"], "no_such_module"),
    ([], "+job=NAME"),
    (["+job=t", "job.steps=-5"], "job.steps=-5"),
    (["+job=t", "job.steps=0"], "job.steps=0: must be a whole number >= 1"),  # would commit an untrained model
    (["+job=t", "job.epochs=0"], "job.epochs=0"),
    (["+job=t", "job.eval_every=0"], "job.eval_every"),
    (["+job=t", "job.on_nonfinite=ignore"], "job.on_nonfinite"),
    (["+job=t", "launcher.progress=banana"], "launcher.progress='banana': use auto, bar, lines or off"),
    (["+job=t", "launcher.progress_every_s=0"], "launcher.progress_every_s=0"),
    (["+job=t", "launcher.name=slrum"], "launcher.name='slrum': use local or slurm"),  # not a silent local run
    (["+job=t", "job.seed=-1"], "job.seed"),  # refused before a run directory is made for that seed
    (["+job=t", "job.steps=10", "job.epochs=2"], "both set"),  # never one of the two silently ignored
    (["+job=t", "tracking.flush_interval_s=0"], "tracking.flush_interval_s=0"),
    (["+job=t", "tracking.finish_timeout_s=-1"], "tracking.finish_timeout_s=-1"),
    # Folders the job would only fail on later (the model repository: after the whole training).
    (["+job=t", "paths.data_root=afile"], "afile is a file, not a folder"),
    (["+job=t", "paths.runs_root=afile"], "afile is a file, not a folder"),
    (["+job=t", "paths.runs_root=/proc/gwenlake-runs"], "paths.runs_root=/proc/gwenlake-runs cannot be written"),
    (["+job=t", "paths.model_repo=afile"], "paths.model_repo="),
    (["+job=t", "paths.model_repo=conf"], "is not a git repository"),
    (["+job=t", "paths.model_repo=afile/x"], "cannot be created"),  # found before the training, not after
    (["+job=t", "paths.runs_root=loop1"], "paths.runs_root='loop1' cannot be resolved"),  # a symlink loop
    (["+job=t", "paths.runs_root="], "paths.runs_root is empty"),
    (["+job=t", "job.seed=99999999999999999999999"], "job.seed"),
    (["+job=t", "job.steps=99999999999999999999999"], "job.steps"),
    (["+job=t", "job.model=modèle"], "job.model='modèle'"),  # Hydra's lexer refuses it unquoted: say how
    (["+job=t", "paths.runs_root='ru\nns'"], "holds control characters"),
    (["+job=t", "checkpoint.local_dir=rel/dir"], "checkpoint.local_dir='rel/dir': must be an absolute path"),
    (["+job=t", "checkpoint.shared_wait_s=-1"], "checkpoint.shared_wait_s=-1"),
    # the adversarial pass's input: a "local" level inside the runs root (published with the model's output)
    (["+job=t", "paths.runs_root=/tmp", "checkpoint.local_dir=/tmp/run/output"],
     "checkpoint.local_dir=/tmp/run/output is inside paths.runs_root=/tmp"),
    (["+job=t", "statsd.port=70000"], "statsd.port=70000 is not a UDP port"),
    (["+job=t", "statsd.port=x"], "statsd.port"),  # the schema's type check
    (["+job=t", "statsd.prefix='a:b'"], "statsd.prefix='a:b'"),
    (["+job=t", "statsd.host=' '"], "statsd.host=' ' is not a host name"),
    # sbatch settings: refused at planning, before anything is submitted (no cluster needed)
    (["+job=t", "launcher=slurm", "launcher.timeout_min=0"], "launcher.timeout_min=0"),
    (["+job=t", "launcher=slurm", "launcher.signal_delay_s=7200"], "launcher.signal_delay_s=7200"),
    (["+job=t", "launcher=slurm", "launcher.max_retries=-1"], "launcher.max_retries=-1"),
    (["+job=t", "launcher=slurm", "launcher.max_starts=0"], "launcher.max_starts=0: must be a whole number >= 1"),
    (["+job=t", "launcher=slurm", "launcher.nodes=0"], "launcher.nodes=0"),
    (["+job=t", "launcher=slurm", "launcher.mem_gb=0"], "launcher.mem_gb=0"),
    (["+job=t", "launcher=slurm", "launcher.partition='a\nb'"], "control characters"),
    # issue 40 item 13a, the input tried by hand: the folder reached the #SBATCH --output line raw, printing a
    # live #SBATCH --uid=0 directive and a touch command
    (["+job=t", "launcher=slurm", "launcher.dry_run=true",
      "launcher.folder='/x/f\n#SBATCH --uid=0\ntouch /x/injproof #'"],
     "launcher.folder='/x/f\\n#SBATCH --uid=0\\ntouch /x/injproof #': control characters (newlines) are not "
     "allowed in the sbatch script's #SBATCH --output and --error lines: give it on one line"),
    # the other paths written into a script: the image (setup lines, the step's command), the cluster's checkout
    (["+job=t", "launcher=slurm", "launcher.dry_run=true", "launcher.container.image='/x/i.sif\ntouch /x/p'"],
     "launcher.container.image='/x/i.sif\\ntouch /x/p': control characters"),
    (["+job=t", "cluster=user", "cluster.remote_dir='/shared/me\ntouch /x/p'"],
     "cluster.remote_dir='/shared/me\\ntouch /x/p': control characters"),
    (["+job=t", "cluster=user", "cluster.python='python3\nid'"], "cluster.python='python3\\nid': control"),
    (["+job=t", "launcher=slurm", "+launcher.additional_parameters.Mail=x"], "'Mail' is not an sbatch option"),
    (["+job=t", "launcher=slurm", "launcher.container.runtime=docker"], "launcher.container.runtime='docker'"),
    (["+job=t", "launcher=slurm", "launcher.mem_gb=inf"], "launcher.mem_gb=inf: must be a finite number"),
    (["+job=t", "launcher=slurm", "launcher.mem_gb=1e-9"], "at least 1/1024 (1 MiB)"),  # not --mem=0: all of it
    # plain overrides checked before Hydra (the adversarial pass's inputs: Hydra said "use +job.stesp=10", or
    # printed OmegaConf's internals)
    (["+job=t", "job.stesp=10"], "job.stesp: no such setting (did you mean job.steps?)"),
    (["+job=t", "job.steps=abc"], "job.steps='abc': give a whole number or null"),
    (["+job=t", "launcher=slurm", "launcher.timeout_min=1.5"], "launcher.timeout_min=1.5: give a whole number"),
    (["+job=t", "launcher=slurm", "launcher.partiton=x"], "launcher.partiton: no such setting (did you mean "
                                                          "launcher.partition?)"),
    (["+job=t", "launcher=slurm", "launcher.container.imag=x"], "did you mean launcher.container.image?"),
    (["+job=t", "tracking.flush_interval_s=fast"], "tracking.flush_interval_s='fast': give a number"),
    (["+job=t", "job.resume=bogus"], "job.resume='bogus': give one of auto, never"),
    (["+job=t", "job.on_nonfinite=ignore"], "job.on_nonfinite='ignore': give one of stop, warn"),
    (["+job=t", "job.hang_timeout_s=soon"], "job.hang_timeout_s='soon': use auto (the default"),
    (["+job=t", "job.hang_timeout_s=-5"], "job.hang_timeout_s=-5: use auto"),
    (["+job=t", "job.slow_rank_factor=0.5"], "job.slow_rank_factor=0.5: must be a number > 1 (a factor), or 0"),
    (["+job=t", "job.slow_rank_factor=fast"], "job.slow_rank_factor"),
    # job.eval_every=auto's companions (issue 25)
    (["+job=t", "job.eval_every=auto", "job.mtbf_h=0"], "job.mtbf_h=0: must be a number > 0 (hours"),
    (["+job=t", "job.eval_every=auto", "job.mtbf_h=-3"], "job.mtbf_h=-3: must be a number > 0"),
    (["+job=t", "job.eval_every=auto", "job.mtbf_h=often"], "job.mtbf_h='often': must be a number > 0"),
    (["+job=t", "job.eval_every=auto", "job.max_eval_interval_s=0"], "job.max_eval_interval_s=0"),
    # the adversarial pass's input: null passed the check, then the job raised a TypeError with a run written
    (["+job=t", "job.steps=8", "job.seed=15043", "job.eval_every=auto", "job.max_eval_interval_s=null"],
     "job.max_eval_interval_s=None: must be a number > 0 (seconds"),
    (["+job=t", "job.eval_every=sometimes"], "job.eval_every='sometimes': must be a whole number >= 1 (or auto"),
    (["+job=tt"], "job=tt: there is no"),  # a missing file: the files there, the closest one
    (["+job=t", "launcher=slrum"], "launcher=slrum: there is no"),
    (["+job=t", "launcher=slrum"], "(did you mean launcher=slurm?)"),
    (["+job=t", "cluster=nonexistent"], "cluster=nonexistent: there is no"),
    # the adversarial pass's input: sbatch refused it after the plan (exit 1)
    (["+job=t", "launcher=slurm", "launcher.gres=gpu:a:b"],
     "launcher.gres='gpu:a:b': give generic resources as NAME[:TYPE][:COUNT]"),
    (["+job=t", "launcher=slurm", "launcher.gres=gpu:0"], "launcher.gres='gpu:0'"),
    (["+job=t", "launcher=slurm", "launcher.timeout_min=99999999999"], "from 1 to 525600"),
    # what the run's checkpoints rule out is refused at submission, not after hours in the queue
    (["+job=t", "launcher=slurm", "job.steps=5"], "job.steps=5 is below step 20"),
    (["+job=t", "launcher=slurm", "job.resume=never", "job.steps=90"], "job.resume=never"),
    (["+job=t", "paths.model_repo=/proc/gwenlake-repo"], "a folder cannot be made in it"),  # not after training
    (["+job=t", "paths.model_repo="], "paths.model_repo is empty"),  # as paths.runs_root=, not a silent default
    # A sweep with one bad task: its message, nothing submitted.
    (["-m", "+job=t", "launcher=slurm", "job.params.lr=0.1,fast"], "could not be converted to Float"),
    # Tracking URIs that could only fail later, slowly, as an "outage" of minutes.
    (["+job=t", "tracking.uri=file:///tmp/mlruns"], "tracking.uri"),
    (["+job=t", "tracking.uri=http://"], "names no host"),
    (["+job=t", "tracking.uri=http://127.0.0.1:notaport"], "the port is not a number"),
    (["+job=t", "tracking.uri=sqlite://"], "in-memory SQLite store"),
    (["+job=t", "tracking.uri=mysql://u@127.0.0.1/db"], "needs the Python package MySQLdb"),
    (["+job=t", "tracking.uri=sqlite:////proc/gwenlake/mlflow.db"], "the store's folder /proc/gwenlake cannot"),
    # Cluster files (CLUSTER_FILES): refused before any connection, schema line or not.
    (["+job=t", "cluster=user", "cluster.launcher.timeout_min=0"], "cluster.launcher.timeout_min=0: must be"),
    (["+job=t", "cluster=user", "cluster.launcher.secrets=[GWL_UNSET_TOKEN]"], "GWL_UNSET_TOKEN is not set"),
    (["+job=t", "cluster=badport"], "cluster.port"),
    (["+job=t", "cluster=typo"], "cluster.hots"),
    (["+job=t", "cluster=nohost"], "cluster.host is not set"),
    (["+job=t", "cluster=badlauncher"], "cluster.launcher.timeout_min"),
    (["+job=t", "cluster=scalarlauncher"], "cluster.launcher=5: give a section"),
    (["+job=t", "cluster=scalarcontainer"], "cluster.launcher.container='train.sif': give a section"),
    (["+job=t", "cluster=alist"], "alist.yaml): the file holds a list, not a mapping"),
    (["+job=t", "cluster=schemabadport"], "cluster.port"),
    (["+job=t", "cluster=null"], "cluster=null: cluster takes the name of a file"),  # Hydra: a traceback
    (["+job=null"], "+job=null: job takes the name of a file"),
    # Unknown keys added with + under a typed node: refused, not silently ignored (job.params, launcher.env,
    # launcher.additional_parameters and launcher.container.env are free-form on purpose).
    (["+job=t", "launcher=slurm", "launcher.dry_run=true", "+launcher.partiton=high"],
     "launcher.partiton: no such setting (did you mean launcher.partition?)"),
    (["+job=t", "+paths.foo=1", "launcher=slurm", "launcher.dry_run=true"], "paths.foo: no such setting"),
    (["+job=t", "+job.foo=1"], "job.foo: no such setting"),
    (["+job=t", "+tracking.foo=1"], "tracking.foo: no such setting"),
    (["+job=t", "+statsd.hots=x"], "statsd.hots: no such setting (did you mean statsd.host?)"),
    (["+job=t", "+foo=1"], "foo: no such setting at the top level"),
    (["+job=t", "launcher=slurm", "+launcher.container.imag=x.sif"], "launcher.container.imag: no such setting"),
    (["+job=t", "+launcher.partition=high"], "launcher.partition is a setting of launcher=slurm"),
    # the adversary's input: without the +, Hydra said "Key 'folder' not in 'LauncherConfig'"
    (["+job=t", "launcher.folder=x"], "launcher.folder is a setting of launcher=slurm: add `name: slurm`"),
    (["+job=t", "cluster=user", "+cluster.foo=1"], "cluster.foo: no such setting"),
    (["+job=t", "cluster=user", "+cluster.launcher.partiton=x"], "cluster.launcher.partiton: no such setting"),
    (["+job=t", "cluster=user", "+cluster.launcher.container.foo=x"], "cluster.launcher.container.foo: no such"),
    (["+job=t", "cluster=user", "+job.foo=1"], "job.foo: no such setting"),  # refused here, not on the cluster
    # Group files: a YAML error names the file and line, a misshapen defaults list the file; no traceback.
    (["+job=t", "cluster=badyaml"], "cluster/badyaml.yaml, line 9: not valid YAML"),
    (["+job=t", "launcher=badyaml"], "launcher/badyaml.yaml, line 5: not valid YAML"),
    (["+job=badyaml"], "job/badyaml.yaml, line 3: not valid YAML"),
    (["+job=dupkey"], "job/dupkey.yaml, line 2: not valid YAML: found duplicate key target"),
    (["+job=defaults5"], "job/defaults5.yaml): defaults: 5 is not a list"),
    (["+job=defaultsmap"], "job/defaultsmap.yaml): defaults: {'a': 1} is not a list"),
    (["+job=t", "launcher=noname"], "launcher.partition is a setting of launcher=slurm: add `name: slurm`"),
    (["+job=t", "launcher=empty"], "launcher/empty.yaml) is empty"),
    (["+job=t", "cluster=user", "cluster.connect_timeout_s=-5"], "cluster.connect_timeout_s=-5.0: must be"),
    (["+job=t", "cluster=user", "cluster.connect_timeout_s=nan"], "cluster.connect_timeout_s=nan: must be"),
])
def test_a_bad_setting_exits_2_names_the_key_and_changes_nothing(trained, args, needle, monkeypatch, capfd,
                                                                 caplog):
    from gwenlake_hpc.cli.dispatch import main

    monkeypatch.chdir(trained.root)
    monkeypatch.delenv("GWENLAKE_CONF", raising=False)
    before = snapshot(trained.root)
    tracking = "job.tracking=true" if "tracking." in " ".join(args) else "job.tracking=false"
    assert main([*args, tracking]) == 2
    out = capfd.readouterr()
    said = out.out + out.err + caplog.text
    assert needle in said, said
    assert "Traceback" not in said, said
    assert snapshot(trained.root) == before


def test_the_config_files_hydra_reads_are_checked_first_defaults_included(tmp_path):
    from gwenlake_hpc.job.config_files import check_group_choices

    conf = tmp_path / "conf"
    (conf / "launcher").mkdir(parents=True)
    (conf / "config.yaml").write_text("defaults:\n  - launcher: mine\n  - _self_\n")
    (conf / "launcher" / "mine.yaml").write_text("defaults:\n  - base\n  - _self_\nname: slurm\n")
    (conf / "launcher" / "base.yaml").write_text("name: slurm\npartition: [a\n")
    (conf / "launcher" / "ok.yaml").write_text("name: slurm\n")
    with pytest.raises(ConfigError, match=r"launcher/base\.yaml, line 3: not valid YAML: .*flow sequence at line 2"):
        check_group_choices([], conf)  # config.yaml's default launcher, and the file its defaults name
    assert check_group_choices(["launcher=ok"], conf) is None  # another one chosen: the broken file is not read
    (conf / "config.yaml").write_text("defaults: [launcher: mine\n")
    with pytest.raises(ConfigError, match=r"config\.yaml, line 2: not valid YAML"):
        check_group_choices(["launcher=ok"], conf)


# --- the rules, on the typed configs ----------------------------------------------------------------------------

def test_typed_gives_the_dataclasses_with_the_values():
    s = typed({"job": {"target": "m:f", "steps": 7, "resume": "never", "params": {"lr": 0.1}},
               "launcher": {"name": "slurm", "timeout_min": 30, "signal_delay_s": 60},
               "tracking": {"flush_interval_s": 0.5}})
    assert (s.job.steps, s.job.resume.value, s.job.params) == (7, "never", {"lr": 0.1})
    assert type(s.launcher).__name__ == "SlurmLauncherConfig" and (s.launcher.timeout_min, s.launcher.nodes) == (30, 1)
    assert s.tracking.flush_interval_s == 0.5 and s.tracking.finish_timeout_s == 60.0  # the schema's default
    assert type(typed({"job": {"target": "m:f"}}).launcher).__name__ == "LauncherConfig"  # none given: local


@pytest.mark.parametrize("cfg, needle", [
    ({"job": {"target": "m:f", "stepz": 3}}, "job.stepz"),  # an unknown key, named with its node
    ({"job": {"target": "m:f", "steps": "x"}}, "job.steps"),
    ({"job": {"target": "m:f", "steps": True}}, "job.steps"),
    ({"job": {"target": "m:f"}, "cluster": {"port": 22}}, "cluster.host is not set"),
    ({"job": {"target": "m:f"}, "launcher": {"name": "slurm", "timeout_min": 1, "signal_delay_s": 60}},
     "launcher.signal_delay_s=60: must be between 1 and the time limit (60 s)"),
    ({"job": {"target": "m:f"}, "launcher": {"name": "slurm", "gpus_per_node": 0}}, "launcher.gpus_per_node=0"),
    ({"job": {"target": "m:f"}, "launcher": {"name": "slurm", "additional_parameters": {"mail-type": ["a"]}}},
     "give a single value"),
    ({"job": {"target": "m:f"}, "statsd": {"port": 0}}, "statsd.port=0"),
    ({"job": {"target": "m:f"}, "cluster": {"host": "h", "remote_dir": "/r", "launcher": {"timeout_min": 0}}},
     "cluster.launcher.timeout_min=0"),
])
def test_typed_refuses_a_bad_value_naming_its_key(cfg, needle):
    with pytest.raises(ConfigError) as err:
        typed(cfg)
    assert needle in str(err.value)


def test_the_sbatch_parameters_read_the_typed_launcher():
    from gwenlake_hpc.launch.slurm import sbatch_parameters

    params = sbatch_parameters({"partition": "gpu", "mem_gb": 1.5, "timeout_min": 10, "additional_parameters":
                                {"mail-type": "END"}}, job_name="gwenlake:m:k")
    assert params["partition"] == "gpu" and params["mem"] == "1536M" and params["time"] == 10
    assert params["additional_parameters"] == {"requeue": True, "mail-type": "END"}
    assert typed_launcher({"timeout_min": 10}).signal_delay_s == 120
    with pytest.raises(ConfigError, match="launcher.timeout_min=0"):
        sbatch_parameters({"timeout_min": 0}, job_name="j")


def test_fit_local_and_fit_submit_refuse_bad_values_as_the_command_line_does(trained, monkeypatch):
    from gwenlake_hpc.job.plan import load_target

    monkeypatch.chdir(trained.root)
    monkeypatch.delenv("GWENLAKE_CONF", raising=False)
    fit = load_target(f"{trained.root / 'trainer.py'}:fit")
    for seed in (1.5, True, -1, 2**64, "abc"):
        with pytest.raises(ConfigError, match=f"seed={seed!r}: must be an integer from 0"):
            fit.local(steps=3, seed=seed, data_root=trained.root / "data")
    with pytest.raises(ConfigError, match="could not be converted to Integer"):
        fit.submit("job.seed=1.5")  # Hydra's own refusal, as a usage error
    with pytest.raises(ConfigError, match="fit.submit\\(\\) submits to SLURM"):
        fit.submit("launcher.name=local")  # not a silent submission
    with pytest.raises(ConfigError, match="launcher.mem_gb=inf"):
        fit.submit("launcher.mem_gb=inf")


def test_the_run_and_fit_local_apply_the_same_rules(tmp_path):
    from gwenlake_hpc.runtime.run import Run
    from gwenlake_hpc.runtime.signals import StopRequest
    from gwenlake_hpc.stores.tracking.null_tracker import NullTracker

    common = dict(run_dir=tmp_path / "r", run_key="k", epochs=None, seed=0, tracker=NullTracker(),
                  stop=StopRequest(), progress="off")
    with pytest.raises(ConfigError, match="job.eval_every=0: must be a whole number >= 1"):
        Run(steps=5, eval_every=0, **common)
    with pytest.raises(ConfigError, match="job.resume='later': use auto or never"):
        Run(steps=5, eval_every=1, resume="later", **common)
    assert not os.path.exists(tmp_path / "r")  # refused before the checkpoint store is made


def test_a_sweep_dry_run_submits_nothing_and_writes_nothing(trained, monkeypatch, capfd, tmp_path):
    """The adversarial pass's command: `-m ... launcher=slurm launcher.dry_run=true` called sbatch (a job array)."""
    from gwenlake_hpc.cli.dispatch import main

    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    calls = tmp_path / "sbatch-calls"
    (fakebin / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho refused >&2\nexit 1\n")
    (fakebin / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")
    monkeypatch.chdir(trained.root)
    monkeypatch.delenv("GWENLAKE_CONF", raising=False)
    before = snapshot(trained.root)
    runs = sorted(p.relative_to(trained.root) for p in (trained.root / "runs").rglob("*"))
    code = main(["-m", "+job=t", "launcher=slurm", "launcher.dry_run=true", "job.tracking=false",
                 "job.params.lr=1e-3,3e-4"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert not calls.exists(), calls.read_text()
    assert "dry run: a job array of 2 task(s)" in out and "#SBATCH" in out, out
    assert "job.params.lr=0.001" in out and "job.params.lr=0.0003" in out, out
    assert snapshot(trained.root) == before
    assert sorted(p.relative_to(trained.root) for p in (trained.root / "runs").rglob("*")) == runs  # no folder


def test_a_launcher_file_of_only_name_slurm_takes_plain_overrides(trained, monkeypatch, capfd, tmp_path):
    """The adversarial pass's file: `name: slurm` + `partition: gpu`, no defaults line naming the schema. Hydra
    refused `launcher.dry_run=true` ("use +launcher.dry_run=true"); the settings it leaves out now take plain
    overrides, checked as any other."""
    import shutil

    from gwenlake_hpc.cli.dispatch import main

    conf = tmp_path / "conf"
    shutil.copytree(trained.root / "conf", conf)
    (conf / "launcher" / "mine.yaml").write_text("name: slurm\npartition: gpu\n")
    monkeypatch.chdir(trained.root)
    monkeypatch.setenv("GWENLAKE_CONF", str(conf))
    before = snapshot(trained.root)
    assert main(["+job=t", "launcher=mine", "launcher.dry_run=true", "launcher.timeout_min=30",
                 "job.tracking=false"]) == 0
    out = capfd.readouterr().out
    assert "#SBATCH --partition=gpu" in out and "#SBATCH --time=30" in out, out
    assert main(["+job=t", "launcher=mine", "launcher.dry_run=true", "launcher.timeout_min=0",
                 "job.tracking=false"]) == 2
    said = capfd.readouterr()
    assert "launcher.timeout_min=0: must be a whole number" in said.out + said.err
    assert snapshot(trained.root) == before
