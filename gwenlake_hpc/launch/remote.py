"""Submission to a remote SLURM cluster over SSH (``python -m gwenlake_hpc +job=NAME cluster=CLUSTER``).

The trip, from the workstation:

1. The working tree must be clean (tracked files equal HEAD) unless ``cluster.allow_dirty=true``; then the diff
   (``git diff --binary HEAD``) goes along and is applied on the cluster on top of the commit.
2. The commit reaches ``cluster.remote_dir`` (a git checkout on the shared filesystem) as a git bundle uploaded
   with SFTP (only the objects the cluster lacks), under ``refs/gwenlake/commits/<sha>`` so git's garbage
   collection keeps it; then a worktree of its own, ``<remote_dir>/.gwenlake/worktrees/<sha>[-<diff hash>]``,
   created under a temporary name and moved into place whole. A later submission never touches it, so pending
   and requeued jobs keep the exact code they were submitted with.
3. The job is planned on the login node in that worktree (``python -m gwenlake_hpc.launch.remote plan``): the
   config composes and validates there, datasets are materialised, and the run directory is known.
4. The sbatch script is rendered here (same shape as ``launcher=slurm``: ``--requeue``, ``--signal=USR2@N``,
   ``srun python -m gwenlake_hpc launcher.progress=lines <overrides>``, then the requeue teardown), every value
   shell-quoted, uploaded under a temporary name and renamed, and submitted with ``sbatch --parsable``.
5. The job id goes into the local ``<runs_root>/.gwenlake-jobs.jsonl`` with the cluster's connection settings,
   so ``status``, ``logs JOB [-f]`` and ``cancel JOB`` reach it through SSH.

Secrets (``launcher.secrets``) are written on the cluster into a 0600 file over SFTP and sourced by the job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import posixpath
import re
import shlex
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

from ..job.config_typed import launcher_node, typed_cluster, typed_launcher
from ..base.errors import EXIT_USAGE, ConfigError, GwenlakeError
from ..authoring.resources import Resources
from ..base.rules import has_control
from .container import ContainerStep, prepare
from .records import JOBS_INDEX, job_records
from .remote_jobs import wait_remote
from .ship import check_remote, local_code, make_worktree, send_commit, setup_script
from .slurm import (check_secrets, max_retries, sbatch_parameters, setup_lines, teardown_args, teardown_lines,
                    with_declared)
from .ssh import RemoteCommandError, SshConnection, SshTarget

log = logging.getLogger("gwenlake_hpc.launch.remote")

PLAN_MARK = "GWENLAKE_PLAN "
#: Overrides consumed here, never forwarded to the job: the cluster, the launcher (sbatch settings), Hydra's.
_LOCAL_KEYS = ("cluster", "launcher", "hydra", "paths")


@dataclass
class RemoteSubmission:
    """What a ``cluster=NAME`` submission did.

    Attributes:
        job_id: SLURM job id on the cluster.
        cluster: the cluster's name.
        commit: the commit the job runs (the workstation's HEAD).
        worktree: the job's checkout on the cluster.
        run_dir: the run directory on the cluster.
        stdout, stderr: the job's log files on the cluster (job id filled in).
        script: the uploaded sbatch script on the cluster.
        patch_sha256: sha256 of the uncommitted diff sent along (``allow_dirty``), else None.
        secrets_file: the job's 0600 secrets file on the cluster (its path; the job's teardown removes it when
            the job ends for good, ``cancel`` at once), else None.
    """

    job_id: str
    cluster: str
    commit: str
    worktree: str
    run_dir: str
    stdout: str
    stderr: str
    script: str
    patch_sha256: str | None = None
    secrets_file: str | None = None


# --- configuration ----------------------------------------------------------------------------------------------

def _override_key(ov: str) -> str:
    key = ov.split("=", 1)[0].lstrip("+~")
    return key


def job_overrides(task_overrides: Sequence[str]) -> list[str]:
    """The command-line overrides the job itself receives: all but ``cluster``, ``launcher``, ``hydra`` and
    ``paths`` ones (those are resolved here).

    Raises:
        ConfigError: an override with control characters (newlines).
    """
    out = []
    for ov in task_overrides:
        if has_control(ov):
            raise ConfigError(f"override {ov!r}: control characters (newlines) are not allowed")
        key = _override_key(ov)
        if key.split(".", 1)[0].split("/", 1)[0] in _LOCAL_KEYS:
            continue
        out.append(ov)
    return out


def effective_launcher(cfg: DictConfig, task_overrides: Sequence[str]) -> DictConfig:
    """The sbatch settings, a new DictConfig typed by ``launcher=slurm``'s schema: ``cluster.launcher`` (the
    cluster file's keys over that schema's defaults), then any ``launcher.KEY=`` override of the command line
    when ``launcher=slurm`` is given too.

    Raises:
        ConfigError: no ``cluster`` node, or a launcher value of a wrong type (named ``launcher.KEY``).
    """
    cluster = cfg.get("cluster")
    if cluster is None:
        raise ConfigError("no cluster given: add cluster=NAME (a file conf/cluster/NAME.yaml)")
    lc = launcher_node(cluster.get("launcher") or {})
    if cfg.launcher.get("name") == "slurm":
        for ov in task_overrides:
            key = _override_key(ov)
            if key.startswith("launcher."):
                sub = key[len("launcher."):]
                OmegaConf.update(lc, sub, OmegaConf.select(cfg, key), merge=False)
    return lc


def _remote_path(remote_dir: str, value: str) -> str:
    return value if value.startswith("/") else posixpath.normpath(posixpath.join(remote_dir, value))


# --- the cluster side ---------------------------------------------------------------------------------------------

def remote_plan(conn: SshConnection, cc: Any, worktree: str, overrides: Sequence[str],
                container: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Compose and plan the job on the login node, in its worktree; returns the plan's facts (run_dir, ...).

    ``container``: ``launcher.container`` and the GPU settings (plain data); the login node checks the image and
    the runtime there and makes the container's files (see :func:`gwenlake_hpc.launch.container.prepare`); the
    facts then hold ``container`` (the step's command, srun options, setup and teardown).

    Raises:
        ConfigError: the job config does not compose or plan there (the remote message is included).
    """
    extra = [f"--container={json.dumps(dict(container))}"] if container else []
    command = [str(cc.python), "-m", "gwenlake_hpc.launch.remote", "plan", *extra, *overrides]
    script = f"cd {shlex.quote(worktree)}\n{setup_script(cc)}exec {' '.join(shlex.quote(a) for a in command)}\n"
    rc, out, err = conn.script(script, check=False, timeout_s=900)
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith(PLAN_MARK)), None)
    if rc != 0 or line is None:
        msg = err.strip() or out.strip()
        last = "\n".join(msg.splitlines()[-8:])
        if rc == EXIT_USAGE:
            raise ConfigError(f"cluster {conn.target.name}: the job's config was refused on the cluster: {last}")
        raise GwenlakeError(f"cluster {conn.target.name}: planning the job on {conn.target.host} failed "
                            f"({rc}; `{' '.join(command[:4])} ...`): {last}")
    return json.loads(line[len(PLAN_MARK):])


def render_remote_script(lc: Any, cc: Any, job_name: str, worktree: str, run_dir: str, overrides: Sequence[str],
                         secrets_file: str | None, patch_file: str | None,
                         container: Mapping[str, Any] | None = None) -> str:
    """The sbatch script of a remote job: same shape as ``launcher=slurm``'s, values shell-quoted; ``container``
    is the plan's ``container`` fact (a :class:`gwenlake_hpc.launch.container.ContainerStep` as a dict).

    Raises:
        ConfigError: bad launcher values (see :func:`gwenlake_hpc.launch.slurm.sbatch_parameters`).
    """
    from .sbatch_script import render_sbatch

    params = sbatch_parameters(lc, job_name=job_name)
    # the interpreter: the cluster's, or the image's behind the container runtime (the login node made its files)
    interpreter = list(container["command"]) if container else [str(cc.python)]
    forwarded = ["launcher.progress=lines", f"launcher.progress_every_s={float(lc.progress_every_s)}", *overrides]
    command = " ".join(shlex.quote(w) for w in [*interpreter, "-u", "-m", "gwenlake_hpc", *forwarded])
    setup = [f"cd {shlex.quote(worktree)}", *[str(line) for line in cc.setup]]
    setup += setup_lines(lc, Path(secrets_file) if secrets_file else None)  # type: ignore[arg-type]
    if patch_file:  # the uncommitted diff applied in the worktree (cluster.allow_dirty), for the lineage
        setup.append(f"export GWENLAKE_CODE_PATCH={shlex.quote(patch_file)}")
        setup.append(f"export GWENLAKE_CODE_PATCH_SHA256={shlex.quote(posixpath.basename(patch_file)[:-5])}")
    secrets = Path(secrets_file) if secrets_file else None  # removed by the teardown when the job ends for good
    teardown = teardown_lines(lc, python=str(cc.python), run_dir=run_dir,  # its checkpoints tell progress
                              secrets=secrets)  # type: ignore[arg-type]
    srun_args: list[str] = []
    if container:
        setup += list(container["setup"])
        srun_args = list(container["srun_args"])
        teardown = ContainerStep(**container).teardown(max_retries(lc), typed_launcher(lc).signal_delay_s,
                                                       teardown_args(lc, run_dir, secrets))
    return render_sbatch(command, f"{run_dir}/slurm", params, setup=setup, teardown=teardown, srun_args=srun_args)


def _write_remote_secrets(conn: SshConnection, lc: Any, remote_dir: str) -> str | None:
    names = check_secrets(lc)
    if not names:
        return None
    path = f"{remote_dir}/.gwenlake/secrets/{uuid.uuid4().hex}.env"
    conn.write_private(path, "".join(f"{n}={shlex.quote(os.environ[n])}\n" for n in names))
    return path


def submit_remote(cfg: DictConfig, cluster_name: str, task_overrides: Sequence[str],
                  cwd: Path | None = None) -> RemoteSubmission | None:
    """Submit the job of ``cfg`` to the cluster ``cfg.cluster`` (see the module's docstring for the steps).

    Args:
        cfg: the composed config (with a ``cluster`` node).
        cluster_name: the name chosen with ``cluster=NAME``.
        task_overrides: the command line's overrides (Hydra's ``overrides.task``).
        cwd: the workstation's project directory (default: the current one).

    Returns:
        The submission, or None for ``launcher.dry_run`` (the script is printed, nothing submitted).

    Raises:
        ConfigError: dirty tree, bad cluster or launcher settings, unknown host key, authentication, remote
            checks (each names the field and the fix), a job config refused on the cluster.
        GwenlakeError: git, sbatch or a transfer failed (their messages are included).
    """
    cwd = Path(cwd or Path.cwd())
    for key in ("host", "remote_dir"):
        if OmegaConf.is_missing(cfg.cluster, key) or not cfg.cluster.get(key):
            raise ConfigError(f"cluster.{key} is not set in conf/cluster/{cluster_name}.yaml")
    cc = typed_cluster(cfg.cluster)  # a ClusterConfig, its rules checked
    target = SshTarget.from_config(cc, cluster_name)
    lc = effective_launcher(cfg, task_overrides)
    check_secrets(lc)
    sbatch_parameters(lc, job_name="check")  # refuse bad launcher values before any transfer
    overrides = job_overrides(task_overrides)
    code = local_code(cwd, cc.allow_dirty)
    for path in code.untracked[:20]:
        log.warning("untracked file %s is not sent to the cluster (add and commit it if the job needs it)", path)
    if code.patch:
        log.warning("sending uncommitted changes (cluster.allow_dirty=true): %d bytes of diff on top of %s",
                    len(code.patch), code.commit[:12])

    with SshConnection(target) as conn:
        remote_dir, have, refs = check_remote(conn, cc, code.commit)
        send_commit(conn, code, remote_dir, have, refs)
        worktree, digest = make_worktree(conn, remote_dir, code.commit, code.patch)
        job_ovs = [*overrides, *_remote_paths(cfg, remote_dir)]
        lc, facts = _plan_on_cluster(conn, cc, worktree, lc, job_ovs)
        run_dir = facts["run_dir"]
        if str(facts.get("tracking_uri") or "").startswith("sqlite"):
            log.warning("tracking.uri is SQLite on the cluster (%s): not safe for many concurrent jobs on a shared "
                        "filesystem; use an MLflow server (tracking.uri=http://host:5000)", facts["tracking_uri"])
        job_name = f"gwenlake:{facts['model']}:{facts['run_key']}"
        patch_file = f"{remote_dir}/.gwenlake/patches/{digest}.diff" if digest else None
        s = typed_launcher(lc)  # with what @train declared
        if s.dry_run:
            print(render_remote_script(lc, cc, job_name, worktree, run_dir, job_ovs,
                                       f"{remote_dir}/.gwenlake/secrets/<random>.env" if s.secrets else None,
                                       patch_file, facts.get("container")))
            return None
        secrets_file = _write_remote_secrets(conn, lc, remote_dir)
        script = render_remote_script(lc, cc, job_name, worktree, run_dir, job_ovs, secrets_file, patch_file,
                                      facts.get("container"))
        conn.makedirs(f"{run_dir}/slurm")
        script_path, job_id = _sbatch(conn, cc, cluster_name, worktree, remote_dir, script)
    sub = RemoteSubmission(job_id=job_id, cluster=cluster_name, commit=code.commit, worktree=worktree, run_dir=run_dir,
                           stdout=f"{run_dir}/slurm/{job_id}_0_log.out",
                           stderr=f"{run_dir}/slurm/{job_id}_0_log.err", script=script_path,
                           patch_sha256=digest, secrets_file=secrets_file)
    record_remote_job(_local_runs_root(cfg, cwd), sub, target, facts, overrides)
    return sub


def _remote_paths(cfg: DictConfig, remote_dir: str) -> list[str]:
    """The ``paths.*`` overrides of the job on the cluster: relative roots placed under ``remote_dir``."""
    paths = cfg.paths
    path_ovs = [f"paths.data_root={_remote_path(remote_dir, str(paths.data_root))}",
                f"paths.runs_root={_remote_path(remote_dir, str(paths.runs_root))}"]
    if paths.model_repo:
        path_ovs.append(f"paths.model_repo={_remote_path(remote_dir, str(paths.model_repo))}")
    return path_ovs


def _plan_on_cluster(conn: SshConnection, cc: Any, worktree: str, lc: Any,
                     job_ovs: Sequence[str]) -> tuple[Any, dict[str, Any]]:
    """Plan the job in its worktree on the cluster (:func:`remote_plan`). Returns the launcher settings with what
    ``@train`` declared (checked again) and the plan's facts.

    Raises:
        ConfigError: the job refused at planning, or a declared resource the launcher refuses.
    """
    s = typed_launcher(lc)
    ctr = {"container": dataclasses.asdict(s.container), "gpus_per_node": s.gpus_per_node, "gres": s.gres,
           "write": not s.dry_run}
    facts = remote_plan(conn, cc, worktree, job_ovs, ctr)
    if facts.get("resources"):  # @train(cpu=, memory=, gpu=, env=, secrets=...) under launcher.*
        lc = with_declared(lc, Resources.from_dict(facts["resources"]))
        check_secrets(lc)
        sbatch_parameters(lc, job_name="check")
    return lc, facts


def _sbatch(conn: SshConnection, cc: Any, cluster_name: str, worktree: str, remote_dir: str,
            script: str) -> tuple[str, str]:
    """Upload the batch script (atomically, under ``<remote_dir>/.gwenlake/scripts``) and submit it from the
    worktree. Returns ``(script path, SLURM job id)``.

    Raises:
        GwenlakeError: sbatch refused the job or printed no job id.
    """
    conn.makedirs(f"{remote_dir}/.gwenlake/scripts")
    script_path = f"{remote_dir}/.gwenlake/scripts/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}.sbatch"
    conn.write_atomic(script_path, script.encode(), mode=0o644)
    submit_script = f"cd {shlex.quote(worktree)}\n{setup_script(cc)}exec sbatch --parsable {shlex.quote(script_path)}\n"
    try:
        _, out, _ = conn.script(submit_script, timeout_s=120)
    except RemoteCommandError as exc:
        raise GwenlakeError(f"cluster {cluster_name}: sbatch refused the job: {exc.stderr.strip()[-1500:]}") from exc
    job_id = out.strip().splitlines()[-1].split(";")[0].strip()
    if not re.fullmatch(r"\d+(_\d+)?", job_id):
        raise GwenlakeError(f"cluster {cluster_name}: sbatch --parsable printed {out.strip()!r}, not a job id")
    return script_path, job_id


def _local_runs_root(cfg: DictConfig, cwd: Path) -> Path:
    """Where the workstation keeps its job index: ``paths.runs_root`` when relative (as on the cluster),
    else ``./runs``."""
    rr = str(cfg.paths.runs_root)
    return (cwd / ("runs" if rr.startswith("/") else rr)).resolve()


def record_remote_job(runs_root: Path, sub: RemoteSubmission, target: SshTarget, facts: dict[str, Any],
                      overrides: Sequence[str]) -> None:
    """Append the job to ``<runs_root>/.gwenlake-jobs.jsonl`` (the index of launch/slurm.py), with ``cluster``
    (its name) and ``ssh`` (the connection settings: host, port, user, key path, known_hosts; no secret)."""
    record = {"job_id": sub.job_id, "run_dir": sub.run_dir, "model": facts["model"], "run_key": facts["run_key"],
              "target": facts.get("target"), "submitted": time.time(), "stdout": sub.stdout, "stderr": sub.stderr,
              "folder": posixpath.dirname(sub.stdout), "overrides": list(overrides), "cluster": sub.cluster,
              "ssh": target.to_dict(), "commit": sub.commit, "worktree": sub.worktree, "script": sub.script,
              "patch_sha256": sub.patch_sha256, "secrets_file": sub.secrets_file}
    runs_root.mkdir(parents=True, exist_ok=True)
    with open(runs_root / JOBS_INDEX, "a") as fh:
        fh.write(json.dumps(record) + "\n")


# --- command line ------------------------------------------------------------------------------------------------

def cli_submit(cfg: DictConfig) -> int:
    """``cluster=NAME``: submit over SSH, print the job id, its commit, logs and run directory; with
    ``launcher.wait=true`` (or ``cluster.launcher.wait``), block and report the result. Returns the exit status."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    name = hc.runtime.choices.get("cluster") or "cluster"
    task = list(hc.overrides.task)
    try:
        sub = submit_remote(cfg, name, task)
    except GwenlakeError as exc:
        log.error("%s", exc)
        return exc.exit_code
    if sub is None:
        return 0
    print(f"submitted job {sub.job_id} to cluster {sub.cluster}\n  code {sub.commit}"
          + (f" + uncommitted diff {sub.patch_sha256[:12]}" if sub.patch_sha256 else "")
          + f"\n  worktree {sub.worktree}\n  run directory {sub.run_dir}\n  stdout {sub.stdout}\n  stderr {sub.stderr}"
          "\n  follow it with: python -m gwenlake_hpc logs " + sub.job_id + " -f", flush=True)
    if not effective_launcher(cfg, task).wait:
        return 0

    record = next(r for r in reversed(job_records(_local_runs_root(cfg, Path.cwd()))) if r["job_id"] == sub.job_id)
    final = wait_remote(record)
    print(f"job {sub.job_id}: {final.state}" + (f", model version {final.version}" if final.version else ""))
    return 0 if final.state.startswith("COMPLETED") else 1


def _plan_container(p: Any, cfg: Any, ctr: Mapping[str, Any]) -> dict[str, Any] | None:
    """The container step of a remote job, checked and made on the login node (see :func:`remote_plan`)."""
    from .slurm import job_container

    cc = dict(ctr.get("container") or {})
    if not cc.get("image") and p.tf.resources.image:
        cc["image"] = p.tf.resources.image  # @train(image=), as for launcher=slurm
    if not cc.get("image"):
        return None
    lc = OmegaConf.create({"container": cc, "gpus_per_node": ctr.get("gpus_per_node"), "gres": ctr.get("gres")})
    jc = job_container(cfg, p.tracking_uri)
    gpus = bool(lc.gpus_per_node or str(lc.gres or "").startswith("gpu") or p.tf.resources.gpus)
    step = prepare(lc, jc["paths"], p.run_dir / "slurm", Path.cwd(), jc["job"]["target"], gpus_requested=gpus,
                   write=bool(ctr.get("write", True)))
    return dataclasses.asdict(step) if step else None


def _plan_main(overrides: list[str]) -> int:
    """On the cluster, in the job's worktree: compose the config, plan the job, print its facts as JSON."""
    from hydra import compose, initialize_config_dir

    from ..job.config import conf_dir, register
    from ..job.plan import plan
    from ..job.resume import resume_point

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    register()
    ctr = None
    if overrides and overrides[0].startswith("--container="):
        ctr = json.loads(overrides[0][len("--container="):])
        overrides = overrides[1:]
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="gwenlake_plan"):
            cfg = compose(config_name="config", overrides=overrides)
        p = plan(cfg)
        resume_point(p)  # refused here, not after hours in the queue
        container = _plan_container(p, cfg, ctr) if ctr else None
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # Hydra's composition errors: usage errors
        if exc.__class__.__module__.startswith(("hydra", "omegaconf")):
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        raise
    print(PLAN_MARK + json.dumps({"run_dir": str(p.run_dir), "model": p.model_name, "run_key": p.key,
                                  "target": p.tf.target, "runs_root": str(p.runs_root),
                                  "tracking_uri": p.tracking_uri, "resources": p.tf.resources.to_dict(),
                                  "container": container}),
          flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gwenlake_hpc.launch.remote plan OVERRIDES...`` (run on the cluster by the submission)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "plan":
        print("usage: python -m gwenlake_hpc.launch.remote plan [overrides...]", file=sys.stderr)
        return EXIT_USAGE
    return _plan_main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
