"""Exceptions that carry an exit status, so every entry point maps them the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

#: Exit status of a usage or configuration error (bad override, unknown job, missing dataset).
EXIT_USAGE = 2
#: Exit status of an evicted training (SIGTERM, SIGUSR2, Ctrl-C): not a success, retry later.
#: 75 is EX_TEMPFAIL from sysexits.h: "temporary failure, the user is invited to retry".
EXIT_EVICTED = 75
#: Exit status of a training that raised.
EXIT_FAILED = 1


class GwenlakeError(Exception):
    """Base class of the errors gwenlake_hpc raises on purpose."""

    exit_code = EXIT_FAILED


class ConfigError(GwenlakeError, ValueError):
    """Bad input from the user: a config key, an override, a binding or a name.

    The message names the field and says how to fix it. Entry points exit with status 2.
    """

    exit_code = EXIT_USAGE


#: Functions that recognise a framework's own exception as bad input (see :func:`as_config_error`).
_TRANSLATORS: list[Callable[[BaseException], "ConfigError | None"]] = []


def recognise_config_errors(translate: Callable[[BaseException], "ConfigError | None"]) -> None:
    """Register ``translate``: given an exception a training function raised, it returns the
    :class:`ConfigError` it stands for (a framework's refusal of a setting, raised before any training), or
    None. An integration registers one when imported (``gwenlake_hpc.integrations.transformers``); a function
    registered twice is kept once."""
    if translate not in _TRANSLATORS:
        _TRANSLATORS.append(translate)


def as_config_error(exc: BaseException) -> "ConfigError | None":
    """The :class:`ConfigError` a registered translator sees in ``exc`` (the job then exits 2 with its message
    instead of a traceback), else None. A translator that raises is ignored."""
    for translate in _TRANSLATORS:
        try:
            found = translate(exc)
        except Exception:
            continue
        if found is not None:
            return found
    return None


class TrainDefinitionError(ConfigError, TypeError):
    """``@train`` misused (a parameter missing for a binding or for ``run``, not one ``Output``): a TypeError
    as a wrong call is, and a usage error (exit 2) when a job imports the function."""


class DataError(ConfigError):
    """A dataset is missing or malformed (missing column, ragged column lengths, bad name)."""


class CheckpointError(GwenlakeError):
    """A checkpoint could not be written or read."""


class DamagedFileError(CheckpointError):
    """A file's bytes do not match the digest its checkpoint manifest recorded, or it is truncated.

    Attributes:
        path: the file.
        checkpoint: the checkpoint directory holding it, or None outside a checkpoint.
    """

    def __init__(self, message: str, path: Path, checkpoint: Path | None = None):
        super().__init__(message)
        self.path = path
        self.checkpoint = checkpoint

    def __reduce__(self):
        # Pickled with its path and checkpoint: torch.distributed.checkpoint sends a rank's read error to the
        # other ranks, which rebuild it (the default reduce would call __init__ with the message alone).
        return (type(self), (str(self), self.path, self.checkpoint))


class CheckpointExistsError(CheckpointError, ConfigError):
    """A checkpoint of the step being sealed exists already on the shared filesystem (kept as it is): this start
    resumed from an older checkpoint than the run's newest (a listing its node had cached; the run's pointer
    deleted) or another start trains the run. Exit 2, not requeued: the next start resumes from the newest."""

    exit_code = EXIT_USAGE


class CheckpointNotVisibleError(CheckpointError, ConfigError):
    """The run's newest sealed checkpoint (named by its pointer) cannot be seen from this node within
    ``checkpoint.visible_wait_s``. No longer raised (kept for code that catches it): a pointer whose checkpoint the
    server still lacks after the wait is damaged, set aside, and the start resumes from the newest intact
    checkpoint (:mod:`gwenlake_hpc.stores.checkpoints.pointer`)."""

    exit_code = EXIT_USAGE


class StartLimitError(GwenlakeError):
    """This start of a SLURM job is past ``launcher.max_starts`` (``GWENLAKE_MAX_STARTS`` against
    ``SLURM_RESTART_COUNT`` + 1): SLURM requeued it (a preemption, a lost node) after the last start the budget
    allows. The job exits 1 before any work; its teardown ends it FAILED, naming the rule."""


class RendezvousError(GwenlakeError):
    """The job's process group did not form: a rank of ``WORLD_SIZE`` never joined within the collectives'
    timeout (``GWENLAKE_DIST_TIMEOUT_S``), it died in its start-up, or ``MASTER_ADDR``/``MASTER_PORT`` lead
    nowhere. Exit 1 before any work (nothing is written); the message names what joined."""


class NonFiniteError(GwenlakeError):
    """A loss became NaN or infinite (``job.on_nonfinite=stop``, the default): the run ends with exit 1."""


class StateMismatchError(CheckpointError, ConfigError):
    """A saved training state does not fit the objects it is loaded into (a tensor's shape differs, or the
    layout cannot be converted): the message names the tensor and both shapes. A usage error (exit 2): the
    model was built differently from the one that was saved; nothing is deleted."""

    exit_code = EXIT_USAGE


class CheckpointFormatError(ConfigError):
    """A checkpoint manifest or state file was written by a newer gwenlake_hpc, in a format (or with a digest
    algorithm) this version cannot read.

    A requeued job pinned to an older commit can meet a checkpoint written by a newer one; it stops with exit
    2 and names the writer instead of loading it wrongly.
    """
