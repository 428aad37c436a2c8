"""Resources and job settings declared on ``@train(...)``: parsed and checked when the module is imported.

``@train(..., cpu="8", memory="32Gi", gpu="nvidia-a10g:1", env={...}, secrets=[...], metadata={...},
max_retries=3)``. They are defaults for the SLURM launcher (``--cpus-per-task``, ``--mem``, ``--gres``, the job's
environment, the 0600 secrets file, requeues); ``launcher.*`` in the job config or on the command line wins.
``metadata`` becomes tags of the MLflow run. The local launcher ignores the resources.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..base.errors import TrainDefinitionError

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT])(i?)$")
_GPU_TYPE = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]*$")  # a type starts with a letter: "1.5" is no type
_MIB = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
MEMORY_FORMS = '"500Mi", "32Gi", "2T" (K, M, G, T, with or without i: binary units, as SLURM counts them)'


@dataclass(frozen=True)
class Resources:
    """What a training declared for the cluster.

    Attributes:
        cpus: CPUs per task (``--cpus-per-task``), or None.
        mem_mib: memory per node in MiB (``--mem=<n>M``), or None.
        gpus: GPUs per node, or None; ``gpu_type`` the gres type (``nvidia-a10g``) or None.
        env: environment variables for the job (not secret: they appear in the script).
        secrets: names of environment variables passed through the 0600 secrets file at submission.
        metadata: tags of the MLflow run (str -> str).
        max_retries: requeues in a row, after a time limit or a killed job step, of starts that sealed no newer
            checkpoint (``launcher.max_retries``), or None (the launcher's default, 3).
        image: the container image (``launcher.container.image``): a ``.sif`` path, a ``docker://`` reference
            or an OCI bundle directory; None: no container.
    """

    cpus: int | None = None
    mem_mib: int | None = None
    gpus: int | None = None
    gpu_type: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)
    max_retries: int | None = None
    image: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (the remote plan sends it back to the workstation)."""
        return {"cpus": self.cpus, "mem_mib": self.mem_mib, "gpus": self.gpus, "gpu_type": self.gpu_type,
                "env": dict(self.env), "secrets": list(self.secrets), "metadata": dict(self.metadata),
                "max_retries": self.max_retries, "image": self.image}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Resources":
        """The inverse of :meth:`to_dict`."""
        return cls(cpus=data.get("cpus"), mem_mib=data.get("mem_mib"), gpus=data.get("gpus"),
                   gpu_type=data.get("gpu_type"), env=dict(data.get("env") or {}),
                   secrets=tuple(data.get("secrets") or ()), metadata=dict(data.get("metadata") or {}),
                   max_retries=data.get("max_retries"), image=data.get("image"))

    @property
    def gres(self) -> str | None:
        """``gpu[:type]:N`` for ``--gres``, or None."""
        if not self.gpus:
            return None
        return f"gpu:{self.gpu_type}:{self.gpus}" if self.gpu_type else f"gpu:{self.gpus}"


def parse_cpu(value: Any) -> int | None:
    """``8`` or ``"8"`` -> 8 CPUs per task.

    Raises:
        TrainDefinitionError: not a positive whole number (SLURM allocates whole CPUs).
    """
    if value is None:
        return None
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
        raise TrainDefinitionError(f"@train cpu={value!r}: give a whole number of CPUs per task, e.g. cpu=\"8\" "
                                   "(SLURM allocates whole CPUs; fractions such as \"500m\" are not accepted)")
    return int(text)


def parse_memory(value: Any) -> int | None:
    """``"32Gi"`` -> 32768, ``"500Mi"`` -> 500, ``"2T"`` -> 2097152 (MiB); a bare number is GiB (``memory=16``).

    Raises:
        TrainDefinitionError: any other form (``"32 GB"``, ``"lots"``, zero), naming the accepted forms.
    """
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        mib = float(value) * 1024
    else:
        m = _MEMORY.match(str(value).strip())
        if not m or (" " in str(value).strip()):
            raise TrainDefinitionError(f"@train memory={value!r}: use {MEMORY_FORMS}, or a number of GiB")
        mib = float(m.group(1)) * _MIB[m.group(2)]
    if not mib >= 1:
        raise TrainDefinitionError(f"@train memory={value!r}: at least 1 MiB ({MEMORY_FORMS})")
    return int(round(mib))


def parse_gpu(value: Any) -> tuple[int | None, str | None]:
    """``1``/``"1"`` -> (1, None); ``"nvidia-a10g:1"`` -> (1, "nvidia-a10g"); ``"a100"`` -> (1, "a100").

    Raises:
        TrainDefinitionError: a count that is not a positive whole number, or a type with characters SLURM's gres
            names do not have.
    """
    if value is None:
        return None, None
    text = str(value).strip()
    if isinstance(value, bool) or not text:
        raise TrainDefinitionError(f"@train gpu={value!r}: give a count (gpu=\"1\") or TYPE:COUNT "
                                   "(gpu=\"nvidia-a10g:1\")")
    kind, _, count = text.rpartition(":") if ":" in text else ("", "", text)
    if not kind and not count.isdigit():  # "a100": one GPU of that type
        kind, count = count, "1"
    if not count.isdigit() or int(count) < 1 or (kind and not _GPU_TYPE.match(kind)) or (":" in text and not kind):
        raise TrainDefinitionError(f"@train gpu={value!r}: give a count (gpu=\"1\") or TYPE:COUNT "
                                   "(gpu=\"nvidia-a10g:1\"), the count a positive whole number")
    return int(count), kind or None


def parse_resources(settings: Mapping[str, Any]) -> Resources:
    """The :class:`Resources` of a decorator's settings (``cpu``, ``memory``, ``gpu``, ``env``, ``secrets``,
    ``metadata``, ``max_retries``).

    Raises:
        TrainDefinitionError: naming the setting and the accepted form.
    """
    gpus, gpu_type = parse_gpu(settings.get("gpu"))
    env = settings.get("env") or {}
    if not isinstance(env, Mapping):
        raise TrainDefinitionError(f"@train env={env!r}: give a dict of variable name -> value")
    for k, v in env.items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise TrainDefinitionError(f"@train env: {k!r} is not an environment variable name")
        if not isinstance(v, (str, int, float)) or isinstance(v, bool) or any(ord(c) < 32 for c in str(v)):
            raise TrainDefinitionError(f"@train env.{k}={v!r}: give a single-line string")
    secrets = settings.get("secrets") or []
    if isinstance(secrets, str) or not all(isinstance(s, str) and _ENV_NAME.match(s) for s in secrets):
        raise TrainDefinitionError(f"@train secrets={secrets!r}: give a list of environment variable names "
                                   "(their values are read when the job is submitted)")
    overlap = sorted(set(secrets) & set(env))
    if overlap:
        raise TrainDefinitionError(f"@train: {', '.join(overlap)} is both in env (written in the script) and in "
                                   "secrets: keep it in secrets only")
    metadata = settings.get("metadata") or {}
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) and k.strip() and len(k) <= 250
                                                    for k in metadata):
        raise TrainDefinitionError(f"@train metadata={metadata!r}: give a dict of str keys (250 characters at "
                                   "most) -> values; they become MLflow run tags")
    retries = settings.get("max_retries")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        raise TrainDefinitionError(f"@train max_retries={retries!r}: give a whole number >= 0")
    image = settings.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip() or any(ord(c) < 32 for c in image)):
        raise TrainDefinitionError(f"@train image={image!r}: give the image as one line of text (a .sif path, a "
                                   "docker:// reference or an OCI bundle directory)")
    return Resources(cpus=parse_cpu(settings.get("cpu")), mem_mib=parse_memory(settings.get("memory")), gpus=gpus,
                     gpu_type=gpu_type, env={k: str(v) for k, v in env.items()}, secrets=tuple(secrets),
                     metadata={k: v if isinstance(v, str) else json.dumps(v, default=str) for k, v in metadata.items()},
                     max_retries=retries, image=image)


def launcher_defaults(resources: Resources) -> dict[str, Any]:
    """``launcher.*`` values the declared resources stand for (only those declared)."""
    out: dict[str, Any] = {}
    if resources.cpus is not None:
        out["cpus_per_task"] = resources.cpus
    if resources.mem_mib is not None:
        out["mem_gb"] = resources.mem_mib / 1024
    if resources.gres is not None:
        out["gres"] = resources.gres
    if resources.max_retries is not None:
        out["max_retries"] = resources.max_retries
    if resources.image is not None:
        out["container.image"] = resources.image
    return out
