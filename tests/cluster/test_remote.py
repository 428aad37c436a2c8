"""Submission over SSH (cluster=NAME): a real sshd on loopback (tests/helpers/sshd_server.py) in front of the real local
SLURM cluster. The ``project`` fixture is the workstation; a separate clone of it is the cluster's checkout
(``cluster.remote_dir``). Skipped with the reason where sshd or the cluster is missing."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from helpers.project import Project, files_under, git, make_churn_project
from helpers.slurm_cluster import require_cluster
from helpers.sshd_server import SshServer, require_sshd

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    require_sshd()
    server = SshServer.start(tmp_path_factory.mktemp("sshd") / "ssh")
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _services(sshd):
    require_cluster()


def cluster_yaml(sshd: SshServer, remote: Path, **extra) -> str:
    lines = ["defaults:", "  - cluster_schema", "  - _self_", "host: 127.0.0.1", f"port: {sshd.port}",
             f"user: {sshd.user}", f"key_file: {sshd.client_key}", f"known_hosts: {sshd.known_hosts}",
             f"remote_dir: {remote}", f"python: {sys.executable}", "launcher:", "  timeout_min: 5",
             "  signal_delay_s: 60", "  progress_every_s: 1"]
    lines += [f"{k}: {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def user_cluster_yaml(sshd: SshServer, remote: Path) -> str:
    """The file a user writes from the README's list of keys: these seven, no defaults list, no launcher."""
    return (f"host: 127.0.0.1\nport: {sshd.port}\nuser: {sshd.user}\nkey_file: {sshd.client_key}\n"
            f"known_hosts: {sshd.known_hosts}\nremote_dir: {remote}\npython: {sys.executable}\n")


class Remote:
    """The workstation (``ws``, a Project) and the cluster's checkout (``remote``)."""

    def __init__(self, ws: Project, remote: Path, sshd: SshServer):
        self.ws, self.remote, self.sshd = ws, remote, sshd

    def submit(self, *overrides, check=0, env=None) -> tuple[str, subprocess.CompletedProcess]:
        proc = self.ws.run("+job=t", "cluster=test", *overrides, env=env, timeout=300)
        if check is not None and proc.returncode != check:
            sshd_log = "\n".join((self.sshd.folder / "sshd.log").read_text().splitlines()[-30:])
            raise AssertionError(f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}\n"
                                 f"SSHD LOG (last lines):\n{sshd_log}")
        m = re.search(r"submitted job (\d+) to cluster test", proc.stdout)
        return (m.group(1) if m else ""), proc

    def lineage(self, version: str) -> dict:
        return json.loads(git(self.remote, "show", f"{version}:t/model/lineage.json"))

    def job_record(self, job_id: str) -> dict:
        lines = (self.ws.root / "runs" / ".gwenlake-jobs.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines if json.loads(x)["job_id"] == job_id][-1]


@pytest.fixture
def rc(project, sshd, tmp_path) -> Remote:
    """A cluster checkout cloned from the workstation, then one more local commit it does not have (so the
    submission must bring it)."""
    remote = tmp_path / "cluster" / "project"
    git(tmp_path, "clone", "-q", str(project.root), str(remote))
    shutil.copytree(project.root / "data", remote / "data")  # the cluster's catalog (data/ is not in git)
    (project.root / "NOTES.md").write_text("a commit the cluster does not have yet\n")
    project.git("add", "NOTES.md")
    project.git("commit", "-q", "-m", "notes")
    (project.root / "conf" / "cluster" / "test.yaml").write_text(cluster_yaml(sshd, remote))  # untracked
    return Remote(project, remote, sshd)


def test_submit_follow_logs_completed_and_model_at_the_pinned_commit(rc):
    head = rc.ws.git("rev-parse", "HEAD")
    remote_head = git(rc.remote, "rev-parse", "HEAD")
    t0 = time.monotonic()
    job, proc = rc.submit()
    t_submit = time.monotonic() - t0
    assert f"code {head}" in proc.stdout
    logs = rc.ws.run("logs", job, "-f", check=0, timeout=300)
    t_done = time.monotonic() - t0
    version = re.search(r"model t\.model version ([0-9a-f]{40})", logs.stdout).group(1)
    status = rc.ws.run("status", check=0).stdout
    assert re.search(rf"^\s*{job}\s+COMPLETED\s+0\s+60\s+\w{{32}}\s+t\.model/\S+\s+version {version[:12]}\s+on test",
                     status, re.M), status
    lineage = rc.lineage(version)
    assert lineage["code"]["commit"] == head and lineage["code"]["dirty"] is False
    worktree = rc.remote / ".gwenlake" / "worktrees" / head
    assert lineage["code"]["repo"] == str(worktree)
    assert git(rc.remote, "rev-parse", f"{version}^") == head  # the version's tree is that code plus the model
    # the cluster's own checkout was not moved or dirtied; the job's code lives in its own worktree
    assert git(rc.remote, "rev-parse", "HEAD") == remote_head and git(rc.remote, "status", "--porcelain") == ""
    assert git(worktree, "rev-parse", "HEAD") == head
    scripts = os.listdir(rc.remote / ".gwenlake" / "scripts")
    assert len(scripts) == 1 and scripts[0].endswith(".sbatch")  # no temporary upload left behind
    record = rc.job_record(job)
    assert record["cluster"] == "test" and record["commit"] == head and record["ssh"]["port"] == rc.sshd.port
    from gwenlake_hpc.launch.remote_jobs import RemoteJobHandle

    handle = RemoteJobHandle(record)  # the Python handle, through SSH
    final = handle.wait(timeout=60)
    assert (final.state, final.step, final.version) == ("COMPLETED", 60, version) and handle.run_id
    print(f"submit {t_submit:.1f} s, submit to COMPLETED (logs -f returned) {t_done:.1f} s")

    # A later commit gets its own worktree; the first one (under a possibly requeued job) is unchanged.
    (rc.ws.root / "NOTES.md").write_text("changed\n")
    rc.ws.git("commit", "-q", "-am", "more notes")
    _, dry = rc.submit("cluster.launcher.dry_run=true")
    new_head = rc.ws.git("rev-parse", "HEAD")
    assert "#SBATCH --requeue" in dry.stdout and f"worktrees/{new_head}" in dry.stdout
    assert git(worktree, "rev-parse", "HEAD") == head and (worktree / "NOTES.md").read_text().startswith("a commit")
    assert git(rc.remote / ".gwenlake" / "worktrees" / new_head, "rev-parse", "HEAD") == new_head


def test_unknown_host_key_is_rejected_with_its_fingerprint(rc, tmp_path):
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    job, proc = rc.submit(f"cluster.known_hosts={empty}", check=2)
    fp = subprocess.run(["ssh-keygen", "-lf", str(rc.sshd.host_key) + ".pub"], capture_output=True,
                        text=True).stdout.split()[1]
    assert fp.startswith("SHA256:") and fp in (proc.stdout + proc.stderr), (proc.stdout + proc.stderr)
    assert f"ssh-keyscan -p {rc.sshd.port} -t ssh-ed25519 127.0.0.1 >> {empty}" in (proc.stdout + proc.stderr)
    assert "cluster.known_hosts" in (proc.stdout + proc.stderr) and empty.read_text() == ""  # nothing trusted on first use
    # a known host whose key changed is refused too
    other = tmp_path / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = tmp_path / "known_hosts_wrong"
    wrong.write_text(f"[127.0.0.1]:{rc.sshd.port} {' '.join((tmp_path / 'other_host_key.pub').read_text().split()[:2])}\n")
    _, proc = rc.submit(f"cluster.known_hosts={wrong}", check=2)
    assert "CHANGED" in (proc.stdout + proc.stderr) and fp in (proc.stdout + proc.stderr) and "ssh-keygen" in (proc.stdout + proc.stderr)


def test_wrong_key_and_wrong_user_are_clear_errors(rc, tmp_path):
    stranger = tmp_path / "stranger_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    _, proc = rc.submit(f"cluster.key_file={stranger}", check=2)
    assert "authentication failed as root@127.0.0.1" in (proc.stdout + proc.stderr) and f"key {stranger} (cluster.key_file)" \
        in (proc.stdout + proc.stderr), (proc.stdout + proc.stderr)
    _, proc = rc.submit("cluster.user=nobody", check=2)
    assert "authentication failed as nobody@127.0.0.1" in (proc.stdout + proc.stderr) and "cluster.user" in (proc.stdout + proc.stderr)
    _, proc = rc.submit(f"cluster.key_file={tmp_path / 'missing_key'}", check=2)
    assert "cluster.key_file" in (proc.stdout + proc.stderr) and "no such file" in (proc.stdout + proc.stderr)
    _, proc = rc.submit("cluster.key_file=null", env={"SSH_AUTH_SOCK": ""}, check=2)  # no key, no agent
    assert "no key to log in as root@127.0.0.1" in proc.stdout + proc.stderr and "cluster.key_file" in proc.stdout


def test_remote_dir_not_a_checkout_and_missing_sbatch(rc, tmp_path):
    plain = tmp_path / "not-a-checkout"
    plain.mkdir()
    _, proc = rc.submit(f"cluster.remote_dir={plain}", check=2)
    assert f"cluster.remote_dir={plain} on 127.0.0.1 is not a git checkout" in (proc.stdout + proc.stderr), (proc.stdout + proc.stderr)
    _, proc = rc.submit(f"cluster.remote_dir={tmp_path / 'nowhere'}", check=2)
    assert "does not exist on 127.0.0.1" in (proc.stdout + proc.stderr)
    _, proc = rc.submit("cluster.setup=['export PATH=/nonexistent']", check=2)
    assert "sbatch is not found on 127.0.0.1" in (proc.stdout + proc.stderr) and "cluster.setup" in (proc.stdout + proc.stderr)


def test_dirty_tree_refused_unless_allowed_then_diff_applied_and_recorded(rc):
    trainer = rc.ws.root / "trainer.py"
    trainer.write_text(trainer.read_text() + "\nLOCAL_EDIT = 'not committed'\n")
    head = rc.ws.git("rev-parse", "HEAD")
    _, proc = rc.submit(check=2)
    assert "uncommitted changes to 1 tracked file(s) (trainer.py)" in proc.stdout + proc.stderr
    assert "cluster.allow_dirty=true" in proc.stdout + proc.stderr
    assert not (rc.remote / ".gwenlake" / "worktrees").exists()  # refused before anything reached the cluster

    job, proc = rc.submit("cluster.allow_dirty=true")
    diff = subprocess.run(["git", "diff", "--binary", "HEAD"], cwd=rc.ws.root, capture_output=True).stdout
    import hashlib
    digest = hashlib.sha256(diff).hexdigest()
    assert f"code {head} + uncommitted diff {digest[:12]}" in proc.stdout
    logs = rc.ws.run("logs", job, "-f", check=0, timeout=300).stdout
    version = re.search(r"model t\.model version ([0-9a-f]{40})", logs).group(1)
    lineage = rc.lineage(version)
    assert lineage["code"]["commit"] == head and lineage["code"]["dirty"] is True
    wt = rc.remote / ".gwenlake" / "worktrees" / f"{head}-{digest[:12]}"
    assert lineage["code"]["repo"] == str(wt)
    assert "LOCAL_EDIT = 'not committed'" in (wt / "trainer.py").read_text()
    assert subprocess.run(["git", "diff", "--binary", "HEAD"], cwd=wt, capture_output=True).stdout == diff
    assert (rc.remote / ".gwenlake" / "patches" / f"{digest}.diff").read_bytes() == diff
    patch = lineage["code"]["patch"]
    assert patch["sha256"] == digest and patch["diff"].encode() == diff
    # a worktree changed on the cluster behind our back is never reused for a submission
    (wt / "trainer.py").write_text((wt / "trainer.py").read_text() + "\nTAMPERED = True\n")
    _, proc = rc.submit("cluster.allow_dirty=true", "cluster.launcher.dry_run=true", check=1)
    assert f"the worktree {wt} no longer holds exactly {head[:12]} + the diff (files changed)" in proc.stdout


def test_logs_follow_recovers_from_a_dropped_connection(rc):
    job, _ = rc.submit("+cluster.launcher.env.GWL_TEST_SLEEP=0.25")
    proc = rc.ws.popen("logs", job, "-f")
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(line.startswith("step ") for line in out):
        time.sleep(0.2)
    assert any(line.startswith("step ") for line in out), "".join(out)
    killed = rc.sshd.kill_sessions()  # the sshd processes serving the follower's connection die
    t_kill = time.monotonic()
    assert killed >= 1
    proc.wait(timeout=300)
    reader.join(timeout=10)
    err = proc.stderr.read()
    text = "".join(out)
    assert proc.returncode == 0, err
    assert "re-established; continuing at byte" in err, err
    assert text.count("model t.model version") == 1 and text.count("run directory:") == 1, text
    steps = [int(m) for m in re.findall(r"^step (\d+)/60", text, re.M)]
    assert steps == sorted(steps) and len(steps) == len(set(steps))  # nothing repeated, nothing reordered
    print(f"follower ended {time.monotonic() - t_kill:.1f} s after the connection was killed; {len(steps)} progress "
          "lines, none twice")


def test_cancel_over_ssh_keeps_checkpoints(rc):
    job, _ = rc.submit("+cluster.launcher.env.GWL_TEST_SLEEP=0.3", "cluster.launcher.secrets=[GWL_TEST_SECRET]",
                       env={"GWL_TEST_SECRET": "s3cr3t"})
    record = rc.job_record(job)
    secrets_file = Path(record["secrets_file"])
    assert secrets_file.parent == rc.remote / ".gwenlake" / "secrets" and secrets_file.exists()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(Path(record["run_dir"]).glob("checkpoints/step-*")):
        time.sleep(0.3)
    proc = rc.ws.run("cancel", job, check=0)
    assert f"cancelled {job} on test" in proc.stdout
    from gwenlake_hpc.launch.remote_jobs import wait_remote

    final = wait_remote(record, timeout_s=120, poll_s=0.5)
    assert final.state.startswith("CANCELLED") and final.step is not None and final.step >= 10
    assert final.version is None
    assert not secrets_file.exists()  # removed by `cancel`, whether or not the cancelled job's teardown ran


def test_hostile_values_run_nothing_and_secrets_stay_out_of_scripts(rc, tmp_path):
    marker = Path(f"/tmp/gwenlake-pwned-{uuid.uuid4().hex}")
    name = f"x; touch {marker}1 $(touch {marker}2) `touch {marker}3` \"q\" ' && touch {marker}4"
    hydra_value = "'" + name.replace("\\", "\\\\").replace("'", "\\'") + "'"
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    job, proc = rc.submit(f"job.model={hydra_value}", "cluster.launcher.secrets=[GWL_TEST_SECRET]",
                          f"+cluster.launcher.env.GWL_EVIL='$(touch {marker}5)'",
                          env={"GWL_TEST_SECRET": secret})
    logs = rc.ws.run("logs", job, "-f", check=0, timeout=300).stdout
    version = re.search(r"model t\.model version ([0-9a-f]{40})", logs).group(1)
    assert rc.lineage(version)["run_name"] == name  # the value arrived intact, as data
    assert not list(Path("/tmp").glob(marker.name + "*"))  # and ran nothing, on submission nor in the job
    scripts = list((rc.remote / ".gwenlake" / "scripts").glob("*.sbatch"))
    assert len(scripts) == 1 and secret not in scripts[0].read_text()
    # the job's secrets file is gone once the job COMPLETED (its teardown removed it); its folder stays private
    secrets_file = Path(rc.job_record(job)["secrets_file"])
    assert secrets_file.parent == rc.remote / ".gwenlake" / "secrets" and not secrets_file.exists()
    assert stat.S_IMODE(secrets_file.parent.stat().st_mode) == 0o700
    assert rc.lineage(version)["run_name"] == name and list(secrets_file.parent.iterdir()) == []
    assert secret not in (rc.ws.root / "runs" / ".gwenlake-jobs.jsonl").read_text()
    assert secret not in logs and secret not in proc.stdout + proc.stderr


def test_failed_upload_leaves_no_partial_file(rc):
    from gwenlake_hpc.launch.ssh import SshConnection, SshTarget
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"host": "127.0.0.1", "port": rc.sshd.port, "user": rc.sshd.user,
                            "key_file": str(rc.sshd.client_key), "known_hosts": str(rc.sshd.known_hosts)})

    class Broken(io.RawIOBase):
        """A source that fails half-way, as a dropped connection or a full disk would."""

        def __init__(self):
            self.sent = 0

        def read(self, n=-1):
            if self.sent:
                raise OSError("source failed half-way")
            self.sent += 1
            return b"#!/bin/bash\n" + b"#" * 100_000

    folder = rc.remote / ".gwenlake" / "scripts"
    folder.mkdir(parents=True)
    with SshConnection(SshTarget.from_config(cfg, "test")) as conn:
        with pytest.raises(OSError, match="half-way"):
            conn.write_atomic(str(folder / "job.sbatch"), Broken())
        assert os.listdir(folder) == []  # neither the final name nor the temporary one
        conn.write_atomic(str(folder / "job.sbatch"), b"#!/bin/bash\ntrue\n")
        assert os.listdir(folder) == ["job.sbatch"]
        # how a submission writes its secrets: the file 0600, its folder 0700
        private = rc.remote / ".gwenlake" / "secrets" / "x.env"
        conn.write_private(str(private), "GWL_TEST_SECRET=s3cr3t\n")
        assert private.read_text() == "GWL_TEST_SECRET=s3cr3t\n"
        assert stat.S_IMODE(private.stat().st_mode) == 0o600 and stat.S_IMODE(private.parent.stat().st_mode) == 0o700


def test_status_commands_reconnect_after_a_drop(rc):
    from gwenlake_hpc.launch.ssh import SshConnection, SshTarget
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"host": "127.0.0.1", "port": rc.sshd.port, "user": rc.sshd.user,
                            "key_file": str(rc.sshd.client_key), "known_hosts": str(rc.sshd.known_hosts)})
    with SshConnection(SshTarget.from_config(cfg, "test")) as conn:
        assert conn.run(["sinfo", "-h", "-o", "%P"], retry=True)[1].split() == ["low*", "high"]
        assert rc.sshd.kill_sessions() >= 1
        time.sleep(0.5)
        assert conn.run(["sinfo", "-h", "-o", "%P"], retry=True)[1].split() == ["low*", "high"]
        assert conn.read_from(str(rc.remote / "trainer.py"), 0, 19) == b'"""A small training'
        assert conn.reconnects == 1


def test_proxy_jump_through_a_bastion(rc):
    # the same sshd serves as the bastion: the connection to the cluster is a direct-tcpip channel through it
    log = rc.sshd.folder / "sshd.log"
    before = log.read_text().count("Accepted publickey")
    _, proc = rc.submit(f"cluster.proxy_jump={rc.sshd.user}@127.0.0.1:{rc.sshd.port}", "cluster.launcher.dry_run=true")
    assert "#SBATCH --requeue" in proc.stdout and "srun" in proc.stdout
    assert log.read_text().count("Accepted publickey") - before == 2  # the bastion, then the cluster through it
    _, bad = rc.submit("cluster.proxy_jump='-oProxyCommand=x'", check=2)
    assert "cluster.proxy_jump" in bad.stdout + bad.stderr


@pytest.mark.slow
def test_done_when_churn_from_a_workstation_clone_through_sshd(sshd, tmp_path):
    """The issue's "Done when": one command on a workstation clone submits the churn job through sshd to the
    cluster, and the model's lineage names the exact commit that trained it. The cluster file is the one a user
    writes from the README (no schema line, no launcher keys): the schema and its defaults apply all the same."""
    origin = make_churn_project(tmp_path / "origin", message="churn project").root
    cluster_dir = tmp_path / "cluster" / "churn"
    git(tmp_path, "clone", "-q", str(origin), str(cluster_dir))
    ws_dir = tmp_path / "workstation" / "churn"
    git(tmp_path, "clone", "-q", str(origin), str(ws_dir))
    (ws_dir / "README.md").write_text("my change, committed on the workstation only\n")
    git(ws_dir, "add", "README.md")
    git(ws_dir, "commit", "-q", "-m", "workstation commit")
    head = git(ws_dir, "rev-parse", "HEAD")
    (ws_dir / "conf" / "cluster" / "test.yaml").write_text(user_cluster_yaml(sshd, cluster_dir))
    ws = Project(ws_dir)
    t0 = time.monotonic()
    proc = ws.run("+job=churn", "cluster=test", "job.steps=300", "cluster.launcher.wait=true", check=0, timeout=900)
    elapsed = time.monotonic() - t0
    m = re.search(r"job (\d+): COMPLETED, model version ([0-9a-f]{40})", proc.stdout)
    assert m, proc.stdout + proc.stderr
    version = m.group(2)
    lineage = json.loads(git(cluster_dir, "show", f"{version}:crm/churn/lineage.json"))
    metrics = json.loads(git(cluster_dir, "show", f"{version}:crm/churn/metrics.json"))
    assert lineage["code"]["commit"] == head and lineage["code"]["dirty"] is False
    assert lineage["final_step"] == 300 and git(cluster_dir, "rev-parse", f"{version}^") == head
    assert lineage["datasets"]["training_set"]["rows"] == 5634
    print(f"churn over SSH: one command {elapsed:.1f} s, job {m.group(1)}, test_auc {metrics['test_auc']:.4f}, "
          f"code {head[:12]}")


def test_a_container_job_over_ssh_is_checked_and_made_on_the_login_node(rc, tmp_path):
    from helpers.oci_bundle import make_bundle

    runs_before = files_under(rc.remote / "runs")
    _, proc = rc.submit(f"cluster.launcher.container.image={tmp_path}/nothing", check=2)
    assert "launcher.container.image" in proc.stdout + proc.stderr and "does not exist" in proc.stdout + proc.stderr
    assert files_under(rc.remote / "runs") == runs_before  # refused before anything was written: no bundle, no run
    sif = tmp_path / "train.sif"  # an image file, but no Apptainer on the login node (none on this machine)
    sif.write_bytes(b"not really an image")
    _, proc = rc.submit(f"cluster.launcher.container.image={sif}", "cluster.launcher.container.runtime=apptainer",
                        check=2)
    assert "launcher.container.runtime=apptainer: `apptainer` is not installed" in proc.stdout + proc.stderr
    bundle = make_bundle(tmp_path / "bundle")
    job, proc = rc.submit(f"cluster.launcher.container.image={bundle}",
                          f"cluster.launcher.container.python={sys.executable}")
    logs = rc.ws.run("logs", job, "-f", check=0, timeout=300)
    version = re.search(r"model t\.model version ([0-9a-f]{40})", logs.stdout).group(1)
    lineage = rc.lineage(version)
    assert lineage["container"]["runtime"] == "oci" and lineage["container"]["image"] == str(bundle)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", lineage["container"]["digest"])
    script = (rc.remote / ".gwenlake" / "scripts").glob("*.sbatch")
    text = next(script).read_text()
    assert "--container=" in text and "gwenlake-requeue.py --rc" in text
