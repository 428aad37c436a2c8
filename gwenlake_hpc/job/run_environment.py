"""The container a start runs in, as the job's batch script reports it (the job side of ``launcher.container``).

The batch script runs on the host, outside the container, at every start (a requeue runs it again): it computes
the image's identity there, where the image file and the runtime are visible, and exports it in the variables
below; :func:`container_start` reads them inside the container. The launcher side is
:mod:`gwenlake_hpc.launch.container`.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Sequence

from ..base.errors import ConfigError

log = logging.getLogger("gwenlake_hpc.run_environment")

#: Variables the batch script exports for the step (the names are the interface between the two sides).
ENV_RUNTIME = "GWENLAKE_CONTAINER_RUNTIME"              # apptainer | singularity | oci
ENV_IMAGE = "GWENLAKE_CONTAINER_IMAGE"                  # the image as configured (path or reference)
ENV_DIGEST = "GWENLAKE_CONTAINER_DIGEST"                # "sha256:<hex>" of the image at this start
ENV_RUNTIME_VERSION = "GWENLAKE_CONTAINER_RUNTIME_VERSION"  # what the runtime printed of its version
ENV_PIN = "GWENLAKE_CONTAINER_PIN"                      # "1": a changed image is refused
ENV_HOST_MNT_NS = "GWENLAKE_CONTAINER_HOST_MNT_NS"      # the batch script's mount namespace (readlink)


def container_start(environ: Mapping[str, str] = os.environ, own_mnt_ns: str | None = None) -> dict[str, Any] | None:
    """The container of this start: ``{"runtime", "image", "digest", "runtime_version"}``, or None when the job
    was not submitted with ``launcher.container``.

    Args:
        environ: the process environment (the batch script's exports).
        own_mnt_ns: this process's mount namespace (``readlink /proc/self/ns/mnt``); read when None.

    Raises:
        ConfigError: the step runs in the batch script's own mount namespace, so not in the container (SLURM
            ignores ``--container`` on a node without ``oci.conf``, with only a line in slurmd's log).
    """
    runtime = environ.get(ENV_RUNTIME)
    if not runtime:
        return None
    host_ns = environ.get(ENV_HOST_MNT_NS)
    if own_mnt_ns is None:
        try:
            own_mnt_ns = os.readlink("/proc/self/ns/mnt")
        except OSError:
            own_mnt_ns = None
    if host_ns and own_mnt_ns and host_ns == own_mnt_ns:
        raise ConfigError(
            f"launcher.container: the job step is not running inside the container ({runtime}, "
            f"{environ.get(ENV_IMAGE)}): it shares the batch script's mount namespace. For runtime=oci the node "
            "needs SLURM's oci.conf (SLURM ignores --container without it); see the README's containers section")
    return {"runtime": runtime, "image": environ.get(ENV_IMAGE), "digest": environ.get(ENV_DIGEST) or None,
            "runtime_version": environ.get(ENV_RUNTIME_VERSION) or None}


def check_same_image(starts: Sequence[Mapping[str, Any]], current: Mapping[str, Any] | None,
                     environ: Mapping[str, str] = os.environ) -> None:
    """Compare this start's image with the previous start's (``run.json`` ``starts``): a different digest
    warns, or, with ``launcher.container.pin=true``, is refused.

    Raises:
        ConfigError: the image changed and the job is pinned (nothing is written; the checkpoints stay).
    """
    if not current:
        return
    previous = next((s["container"] for s in reversed(starts) if s.get("container")), None)
    if not previous or previous.get("digest") == current.get("digest"):
        return
    what = (f"the container image changed since the previous start of this run: {previous.get('image')} "
            f"{previous.get('digest')} then, {current.get('image')} {current.get('digest')} now")
    if environ.get(ENV_PIN) == "1":
        raise ConfigError(f"launcher.container.pin=true: {what}. Put the previous image back, or start a new run "
                          "(job.model=... or another run name), or set launcher.container.pin=false")
    log.warning("%s; the run continues in the new one (launcher.container.pin=true refuses this)", what)
