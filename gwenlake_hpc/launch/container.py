"""The job step inside a container image (``launcher.container``): Apptainer/Singularity or SLURM's OCI support.

- ``apptainer`` / ``singularity``: the step's command becomes ``apptainer exec [--nv] --bind ... IMAGE python3 -m
  gwenlake_hpc.launch.boot ...``. Apptainer shares the host's process namespace, so SLURM's signals reach the
  training as without a container (no init process in between).
- ``oci``: ``srun --container=BUNDLE``. SLURM takes the bundle's ``config.json``, puts the step's command and
  environment into it and runs it with the runtime named in the node's ``oci.conf`` (runc, crun). We write a
  derived bundle in the job's folder: the user's ``config.json`` with the binds added and the root file system
  given by absolute path, so the user's bundle is never modified.

Both: the runs, data and model-repository roots, the job's folder and the submitting directory are bound at
the same paths; the batch script computes the image's identity on the host at every start (a requeue runs it
again) and exports it for the job (:mod:`gwenlake_hpc.job.run_environment`), and the requeue teardown runs on the
host with its ``python3`` from a copy of :mod:`gwenlake_hpc.launch.requeue` (standard library only).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..base import rules
from ..job.config import ContainerConfig
from ..job.config_typed import typed_launcher
from ..base.errors import ConfigError
from ..base.fsutil import write_atomic
from ..job.run_environment import ENV_DIGEST, ENV_HOST_MNT_NS, ENV_IMAGE, ENV_PIN, ENV_RUNTIME, ENV_RUNTIME_VERSION

log = logging.getLogger("gwenlake_hpc.launch.container")

#: Image references a runtime pulls itself (no file to check or hash on the host).
REMOTE_SCHEMES = ("docker://", "oras://", "library://", "shub://", "http://", "https://")
#: The NVIDIA container toolkit's OCI hook (``gpu`` with ``runtime=oci``).
NVIDIA_HOOK = "nvidia-container-runtime-hook"
#: Where SLURM looks for oci.conf: beside slurm.conf (``$SLURM_CONF``), the usual place, a configless node's cache.
OCI_CONF_DIRS = ("/etc/slurm", "/run/slurm/conf", "/var/spool/slurmd/conf-cache")


@dataclass(frozen=True)
class ContainerStep:
    """How the job step enters its container.

    Attributes:
        runtime: ``apptainer``, ``singularity`` or ``oci``.
        image: the image as the job records it (absolute path, or the reference).
        command: the words that start the image's Python (``apptainer exec ... IMAGE python3``; for ``oci``
            just the interpreter: SLURM puts the whole command into the bundle).
        srun_args: options for ``srun`` (``--container=BUNDLE`` for ``oci``).
        setup: batch-script lines (host side): the environment and the image's identity for the job.
        teardown_script: the standalone copy of the requeue teardown, run with the host's ``python3``.
        binds: ``(source, destination, mode)`` bound into the container.
    """

    runtime: str
    image: str
    command: list[str]
    srun_args: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    teardown_script: str | None = None
    binds: list[tuple[str, str, str]] = field(default_factory=list)

    def python(self, module: str = "gwenlake_hpc.launch.boot") -> str:
        """The step's interpreter command (shell-quoted), e.g. for submitit's ``python`` parameter."""
        return " ".join(shlex.quote(w) for w in [*self.command, "-m", module])

    def teardown(self, max_retries: int, signal_delay_s: int, more: str = "") -> list[str]:
        """The requeue teardown on the host (see :func:`gwenlake_hpc.launch.slurm.teardown_lines`); ``more``:
        further options, already shell-quoted (:func:`gwenlake_hpc.launch.slurm.teardown_args`)."""
        return ["rc=$?",
                f"python3 {shlex.quote(str(self.teardown_script))} --rc \"$rc\" --max-retries {int(max_retries)} "
                f"--signal-delay {int(signal_delay_s)}" + (f" {more}" if more else ""),
                "exit $?"]


def is_remote_ref(image: str) -> bool:
    """A reference the runtime pulls (``docker://...``), not a file on the cluster."""
    return image.startswith(REMOTE_SCHEMES)


def runtime_of(cc: ContainerConfig, image_is_bundle: bool) -> str:
    """``launcher.container.runtime`` (checked by :class:`ContainerConfig`'s rules), or the one the image
    implies: ``oci`` for a bundle, else ``apptainer``."""
    if cc.runtime is None:
        return "oci" if image_is_bundle else "apptainer"
    return str(cc.runtime)


def parse_bind(text: str, cwd: Path) -> tuple[str, str, str]:
    """``SRC[:DST[:ro|rw]]`` -> ``(source, destination, mode)``, paths absolute (a relative source is taken from
    ``cwd``).

    Raises:
        ConfigError: an empty or relative destination, a mode other than ro/rw, a ``,`` in a path (Apptainer's
            separator), a source that does not exist.
    """
    rules.single_line("launcher.container.binds", str(text))
    parts = str(text).split(":")
    if not parts[0] or len(parts) > 3:
        raise ConfigError(f"launcher.container.binds: {text!r}: give SRC, SRC:DST or SRC:DST:ro|rw")
    src = str((cwd / Path(parts[0]).expanduser()).resolve())
    dst = parts[1] if len(parts) > 1 and parts[1] else src
    mode = parts[2] if len(parts) > 2 else "rw"
    if mode not in ("ro", "rw"):
        raise ConfigError(f"launcher.container.binds: {text!r}: the mode is ro or rw, not {mode!r}")
    if not dst.startswith("/"):
        raise ConfigError(f"launcher.container.binds: {text!r}: the destination must be an absolute path")
    if "," in src or "," in dst:
        raise ConfigError(f"launcher.container.binds: {text!r}: a path with ',' cannot be bound (Apptainer "
                          "separates binds with it); rename it or bind its parent")
    if not os.path.exists(src):
        raise ConfigError(f"launcher.container.binds: {src} does not exist on this host: create it or drop the bind")
    return src, dst, mode


def job_binds(paths: Mapping[str, Any], folder: Path, cwd: Path, target: str | None,
              extra: Iterable[str], more_paths: Sequence[str] = ()) -> list[tuple[str, str, str]]:
    """What the job needs inside: runs, data and model-repository roots, the job's folder, the submitting
    directory and the target's file, ``more_paths``, then ``extra``; read-write, at the same paths; nested ones
    dropped."""
    wanted = [paths.get("runs_root"), paths.get("data_root"), paths.get("model_repo"), str(folder), str(cwd),
              *more_paths]
    if target and target.rpartition(":")[0].endswith(".py"):
        wanted.append(str(Path(target.rpartition(":")[0]).parent))
    out: list[tuple[str, str, str]] = []
    for p in wanted:
        if p and os.path.isdir(p):
            if "," in str(p):
                raise ConfigError(f"launcher.container: {p} contains ',' and cannot be bound (Apptainer separates "
                                  "binds with it): use a path without ','")
            out.append((str(Path(p).resolve()), str(Path(p).resolve()), "rw"))
    out += [parse_bind(b, cwd) for b in extra]
    kept: list[tuple[str, str, str]] = []
    for b in sorted(set(out), key=lambda b: (len(b[1]), b)):
        if b[0] == b[1] and any(k[0] == k[1] and k[2] == b[2] and (b[1] + "/").startswith(k[1].rstrip("/") + "/")
                                for k in kept):
            continue  # inside a bind of the same path and mode already
        kept.append(b)
    return kept


def oci_conf_path(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The node's ``oci.conf`` as SLURM finds it (beside ``$SLURM_CONF``, or in :data:`OCI_CONF_DIRS`)."""
    dirs = [str(Path(environ["SLURM_CONF"]).parent)] if environ.get("SLURM_CONF") else []
    for d in [*dirs, *OCI_CONF_DIRS]:
        p = Path(d) / "oci.conf"
        if p.is_file():
            return p
    return None


def check_oci_conf(text: str, where: str) -> None:
    """Refuse an ``oci.conf`` without a way to run a container; warn when ``RunTimeRun`` is not ``exec``-ed.

    SLURM runs ``RunTimeRun`` through ``/bin/sh -c``: without ``exec`` the shell is the step's task, SLURM's
    time-limit signal (SIGUSR2) kills it, and the training never gets it (seen on SLURM 22.05 with runc).

    Raises:
        ConfigError: neither ``RunTimeRun`` nor ``RunTimeCreate`` is set.
    """
    keys = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "=" in line:
            k, v = line.split("=", 1)
            keys[k.strip().lower()] = v.strip().strip('"')
    if not keys.get("runtimerun") and not keys.get("runtimecreate"):
        raise ConfigError(f"launcher.container.runtime=oci: {where} sets neither RunTimeRun nor RunTimeCreate, so "
                          "SLURM cannot start a container; ask the cluster's admins, or use runtime=apptainer")
    run = keys.get("runtimerun")
    if run and not run.startswith("exec "):
        log.warning("%s: RunTimeRun does not start with `exec`: SLURM runs it through /bin/sh, and the time-limit "
                    "signal kills that shell instead of reaching the training (no final checkpoint). Ask the "
                    "admins for RunTimeRun=\"exec runc ...\"", where)


def _bundle_root(bundle: Path) -> tuple[dict[str, Any], Path]:
    """The bundle's spec and root file system, checked for the fields we read or extend.

    Raises:
        ConfigError: ``config.json`` unreadable, not an object, without a string ``root.path``, or with
            ``mounts``, ``process``, ``linux`` or ``hooks`` of the wrong JSON type; a root that is not a directory.
    """
    fix = "make it with `runc spec` / `crun spec` or your image tool"
    try:
        spec = json.loads((bundle / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"launcher.container.image={bundle}: config.json cannot be read as an OCI runtime spec "
                          f"({exc}); {fix}") from exc
    root = spec.get("root") if isinstance(spec, dict) else None
    if not isinstance(root, dict) or not isinstance(root.get("path"), str) or not root["path"]:
        raise ConfigError(f"launcher.container.image={bundle}: config.json has no root.path (a string); {fix}")
    shapes = {"mounts": list, "process": dict, "linux": dict, "hooks": dict}
    for key, kind in shapes.items():
        if key in spec and not isinstance(spec[key], kind):
            raise ConfigError(f"launcher.container.image={bundle}: config.json's {key} must be a JSON "
                              f"{'array' if kind is list else 'object'}; {fix}")
    if not all(isinstance(m, dict) for m in spec.get("mounts") or []) or \
            not all(isinstance(n, dict) for n in (spec.get("linux") or {}).get("namespaces") or []):
        raise ConfigError(f"launcher.container.image={bundle}: config.json's mounts and linux.namespaces must be "
                          f"arrays of objects; {fix}")
    rootfs = (bundle / root["path"]).resolve()
    if not rootfs.is_dir():
        raise ConfigError(f"launcher.container.image={bundle}: its root file system {rootfs} is not a directory")
    return spec, rootfs


def _mirror_rootfs(rootfs: Path, mirror: Path, covered: set[str], readonly: bool) -> list[dict[str, Any]]:
    """Make ``mirror`` a root file system made of binds of ``rootfs``'s top-level entries (links copied as
    links); returns the mounts. Entries that a mount of the spec covers (``/proc``, ``/dev``...) only get their
    mount point."""
    if mirror.is_symlink() or mirror.is_file():
        mirror.unlink()
    elif mirror.exists():
        shutil.rmtree(mirror)
    mirror.mkdir(parents=True)
    mounts = []
    for entry in sorted(os.scandir(rootfs), key=lambda e: e.name):
        dst, target = "/" + entry.name, mirror / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
            mounts.append({"destination": dst, "type": "link", "source": entry.name})  # dropped by the caller
            continue
        if entry.is_dir():
            target.mkdir()
        else:
            target.touch()
        if dst not in covered:
            mounts.append({"destination": dst, "type": "bind", "source": entry.path,
                           "options": ["rbind", "ro" if readonly else "rw"]})
    return mounts


def derived_bundle(bundle: Path, folder: Path, binds: Sequence[tuple[str, str, str]], gpu: bool,
                   hook: str | None, cwd: Path | None = None) -> tuple[Path, list[str]]:
    """Write ``<folder>/oci-bundle/``: the user's spec with the binds added as mounts, the working directory
    ``cwd`` (SLURM leaves the spec's, often ``/``) and, with ``gpu``, the NVIDIA hook; returns the new bundle
    directory (the user's bundle is not modified).

    SLURM 22.05 runs ``<bundle>/rootfs`` whatever the spec's ``root.path`` says, and runc refuses a root that is a
    symbolic link, so the new bundle's ``rootfs`` is a directory of mount points: each top-level entry of the
    user's root file system is bound there (read-only when the spec's root is), its links copied.
    """
    spec, rootfs = _bundle_root(bundle)
    # One bundle per submission: a later submission of the same run must not change what a requeue of this one
    # runs (its script names this folder).
    out = folder / f"oci-bundle-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    out.mkdir(parents=True)
    user_mounts = list(spec.get("mounts") or [])
    covered = {m.get("destination") for m in user_mounts}
    readonly = bool((spec.get("root") or {}).get("readonly"))
    mirror = _mirror_rootfs(rootfs, out / "rootfs", covered, readonly)
    entries = [m["destination"].lstrip("/") for m in mirror]  # what of the image the container sees
    mirror = [m for m in mirror if m["type"] != "link"]
    spec["root"] = {**spec["root"], "path": str((out / "rootfs").resolve())}
    ours = {d for _, d, _ in binds}
    mounts = mirror + [m for m in user_mounts if m.get("destination") not in ours]
    mounts += [{"destination": d, "type": "bind", "source": s, "options": ["rbind", mode]} for s, d, mode in binds]
    spec["mounts"] = mounts
    # HPC-style: the host's network (MLflow, torch.distributed) and processes (SLURM's signals reach the
    # training itself, not an init process that would ignore them)
    linux = spec.setdefault("linux", {})
    dropped = [n.get("type") for n in linux.get("namespaces") or [] if n.get("type") in ("network", "pid")]
    if dropped:
        linux["namespaces"] = [n for n in linux["namespaces"] if n.get("type") not in ("network", "pid")]
        log.info("launcher.container: the job shares the node's %s namespace(s) (dropped from the bundle's spec)",
                 " and ".join(dropped))
    if cwd is not None:
        spec.setdefault("process", {})["cwd"] = str(cwd)
    if gpu and hook:
        hooks = spec.setdefault("hooks", {})
        hooks.setdefault("prestart", []).append({"path": hook, "args": [NVIDIA_HOOK, "prestart"]})
    write_atomic(out / "config.json", json.dumps(spec, indent=2))  # the step's runtime reads it
    return out, entries


def identity_lines(runtime: str, image: str, folder: Path, pin: bool, rootfs: Path | None = None,
                   spec_file: Path | None = None, entries: Sequence[str] | None = None) -> list[str]:
    """Batch-script lines (host side, every start) that export the image's identity for the job.

    The digest is ``sha256:`` of the image file (cached by size, modification time and inode in
    ``<folder>/image-digest``, so a requeue does not read a large image again), of ``config.json`` and a listing
    (path, size, time, mode, link) of the root file system's files for a directory (``entries``: only these
    top-level entries, those an OCI container sees; directories and empty files, which runtimes create as mount
    points, are not listed), or the reference's own ``@sha256:`` digest (empty for an unpinned ``docker://``
    reference).
    """
    q = shlex.quote
    lines = [f"export {ENV_RUNTIME}={q(runtime)} {ENV_IMAGE}={q(image)} {ENV_PIN}={1 if pin else 0}",
             f'export {ENV_HOST_MNT_NS}="$(readlink /proc/self/ns/mnt)"']
    if runtime == "oci":
        lines.append(f'{ENV_RUNTIME_VERSION}="$(srun --version 2>&1 | head -n 1)"')
        # the runtime SLURM runs: the first word of RunTimeRun (or RunTimeCreate) in oci.conf, after `exec`
        lines.append('gwl_oci="$(dirname "${SLURM_CONF:-/etc/slurm/slurm.conf}")/oci.conf"; '
                     "gwl_rt=$(sed -n -E 's/^[[:space:]]*RunTime(Run|Create)[[:space:]]*=[[:space:]]*\"?(exec[[:space:]]+)?"
                     "([^[:space:]\"]+).*/\\3/Ip' \"$gwl_oci\" 2>/dev/null | head -n 1)")
        lines.append(f'[ -n "$gwl_rt" ] && {ENV_RUNTIME_VERSION}="${ENV_RUNTIME_VERSION}; $("$gwl_rt" --version 2>&1 '
                     '| head -n 1)"')
    else:
        lines.append(f'{ENV_RUNTIME_VERSION}="$({q(runtime)} --version 2>&1 | head -n 1)"')
    if is_remote_ref(image):
        digest = image.split("@", 1)[1] if "@sha256:" in image else ""
        lines.append(f"{ENV_DIGEST}={q(digest)}")
    elif rootfs is not None:
        spec = q(str(spec_file)) if spec_file else "/dev/null"
        where = " ".join(q("./" + e) for e in entries) if entries is not None else "."
        lines.append(f"{ENV_DIGEST}=sha256:$({{ cat {spec}; cd {q(str(rootfs))} && find {where} -xdev ! -type d "
                     "! -empty -printf '%p\\t%s\\t%T@\\t%m\\t%l\\n' 2>/dev/null | LC_ALL=C sort; } | sha256sum "
                     "| cut -d ' ' -f 1)")
    else:
        cache = q(str(folder / "image-digest"))
        lines += [f"gwl_img={q(image)}",
                  "gwl_key=\"$(stat -L -c '%s %Y %i' -- \"$gwl_img\" 2>/dev/null) $gwl_img\"",
                  f'if [ "$(sed -n 1p {cache} 2>/dev/null)" = "$gwl_key" ]; then {ENV_DIGEST}="$(sed -n 2p {cache})"; '
                  f'else {ENV_DIGEST}="sha256:$(sha256sum < "$gwl_img" | cut -d \' \' -f 1)"; '
                  f'printf \'%s\\n%s\\n\' "$gwl_key" "${ENV_DIGEST}" > {cache}; fi']
    lines.append(f"export {ENV_RUNTIME_VERSION} {ENV_DIGEST}")
    return lines


def prepare(lc: Any, paths: Mapping[str, Any], folder: Path, cwd: Path, target: str | None = None,
            gpus_requested: bool = False, which: Callable[[str], str | None] = shutil.which,
            environ: Mapping[str, str] = os.environ, write: bool = True,
            more_paths: Sequence[str] = ()) -> ContainerStep | None:
    """Check ``launcher.container`` and make what the step needs; None when no image is set.

    Args:
        lc: the launcher config (``lc.container``).
        paths: absolute ``runs_root``, ``data_root``, ``model_repo`` (bound into the container).
        folder: the job's log folder (``<run_dir>/slurm``): the derived bundle, the digest cache and the
            teardown's copy go there.
        cwd: the submitting directory (bound; relative binds start there).
        target: ``job.target`` (a ``FILE.py:fn`` target's folder is bound).
        gpus_requested: the job asks for GPUs (``gpu: null`` then means true).
        which: finds a program on this host (the runtime, the NVIDIA hook).
        write: False for a dry run (nothing is written; the bundle path is shown as it would be).
        more_paths: further folders to bind (the other tasks' roots and targets in a sweep: one image, one
            bundle for the whole array).

    Raises:
        ConfigError: unknown runtime, missing image or bundle, runtime not installed here, no ``oci.conf``,
            bad binds or environment names, each naming the setting and the fix.
    """
    cc = typed_launcher(lc).container  # a ContainerConfig: runtime, python, env and binds checked by its rules
    if not cc.image:
        return None
    image = str(cc.image)
    local = not is_remote_ref(image)
    image_path = (cwd / Path(image).expanduser()).resolve() if local else None
    runtime = _checked_runtime(cc, image, image_path, which, environ)
    gpu = gpus_requested if cc.gpu is None else bool(cc.gpu)
    binds = job_binds(paths, folder, cwd, target, cc.binds, more_paths)
    setup = [f"export {k}={shlex.quote(str(v))}" for k, v in dict(cc.env).items()]
    record = str(image_path) if local else image
    if runtime == "oci":
        command, srun_args = _oci_step(cc, image_path, record, folder, cwd, binds, gpu,  # type: ignore[arg-type]
                                       which, write, setup)
    else:
        words = [runtime, "exec", "--pwd", str(cwd)] + (["--nv"] if gpu else [])
        if binds:
            words += ["--bind", ",".join(f"{s}:{d}:{m}" for s, d, m in binds)]
        command = [*words, record, str(cc.python)]
        rootfs = image_path if (image_path and image_path.is_dir()) else None  # a sandbox directory
        setup += identity_lines(runtime, record, folder, cc.pin, rootfs=rootfs)
        srun_args = []
    teardown = folder / "gwenlake-requeue.py"
    if write:
        from . import requeue

        # the batch script's teardown runs this copy on the host, at every end of a step
        write_atomic(teardown, Path(requeue.__file__).read_bytes())
    return ContainerStep(runtime=runtime, image=record, command=command, srun_args=srun_args, setup=setup,
                         teardown_script=str(teardown), binds=binds)


def _checked_runtime(cc: ContainerConfig, image: str, image_path: Path | None, which: Callable[[str], str | None],
                     environ: Mapping[str, str]) -> str:
    """The runtime that runs ``image`` (``launcher.container.runtime``, else chosen from the image), checked
    on this host.

    Raises:
        ConfigError: a missing local image, ``oci`` without a bundle or without SLURM's ``oci.conf``, a
            runtime not installed here.
    """
    is_bundle = bool(image_path and image_path.is_dir() and (image_path / "config.json").is_file())
    runtime = runtime_of(cc, is_bundle)
    if image_path is not None and not image_path.exists():
        raise ConfigError(f"launcher.container.image={image}: {image_path} does not exist; build or copy the image "
                          "there (README: Containers), or fix the path")
    if runtime == "oci":
        if not is_bundle:
            raise ConfigError(f"launcher.container.image={image}: runtime=oci needs an OCI bundle directory (a "
                              "config.json and its root file system); for a .sif or docker:// image use "
                              "runtime=apptainer")
        conf = oci_conf_path(environ)
        if conf is None:
            raise ConfigError("launcher.container.runtime=oci: SLURM has no oci.conf on this host (looked beside "
                              f"$SLURM_CONF and in {', '.join(OCI_CONF_DIRS)}); without it SLURM runs the step "
                              "outside the container. Ask the cluster's admins to configure it, or use "
                              "runtime=apptainer with a .sif image")
        check_oci_conf(conf.read_text(), str(conf))
    elif which(runtime) is None:
        raise ConfigError(f"launcher.container.runtime={runtime}: `{runtime}` is not installed on this host (not "
                          "in PATH); load it in launcher.setup is not enough here: install it, or choose the runtime "
                          "the cluster has (apptainer, singularity, or oci for SLURM's --container)")
    return runtime


def _oci_step(cc: ContainerConfig, image_path: Path, record: str, folder: Path, cwd: Path,
              binds: list[tuple[str, str, str]], gpu: bool, which: Callable[[str], str | None], write: bool,
              setup: list[str]) -> tuple[list[str], list[str]]:
    """SLURM's ``--container`` step over a bundle derived from ``image_path`` (written unless ``write`` is
    False); appends the identity lines to ``setup``. Returns ``(command, srun arguments)``.

    Raises:
        ConfigError: ``launcher.container.gpu=true`` without the NVIDIA hook on this host.
    """
    hook = which(NVIDIA_HOOK) if gpu else None
    if gpu and hook is None:
        msg = (f"launcher.container.gpu: {NVIDIA_HOOK} (the NVIDIA container toolkit) is not installed here, "
               "so the OCI container would not see the GPUs")
        if cc.gpu is True:
            raise ConfigError(msg + ": install the toolkit on the nodes, or set launcher.container.gpu=false")
        log.warning("%s; set launcher.container.gpu=false to silence this", msg)
    spec, rootfs = _bundle_root(image_path)
    if write:
        bundle, entries = derived_bundle(image_path, folder, binds, gpu, hook, cwd)
    else:  # a dry run writes nothing: the folder's name and the entries are what a submission would make
        bundle, entries = folder / "oci-bundle-<submission>", sorted(e.name for e in os.scandir(rootfs))
    # the spec that runs (written at submission) and the image's files that the container sees (live binds)
    setup += identity_lines("oci", record, folder, cc.pin, rootfs=rootfs,
                            spec_file=bundle / "config.json", entries=entries)
    setup.insert(0, f"# launcher.container: oci {record} as {bundle}; binds "
                    + ", ".join(f"{s}:{d}:{m}" for s, d, m in binds))
    return [str(cc.python)], [f"--container={bundle}"]

