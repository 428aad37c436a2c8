"""The sbatch script of a job: our own template, line for line the one submitit writes for the same settings.

submitit renders the script of ``launcher=slurm`` itself when it submits (public API: the executor's
parameters). The dry run (``launcher.dry_run=true``) and the jobs submitted over SSH (``cluster=NAME``) need the
text without submitting; it is made here rather than with submitit's private ``_make_sbatch_string``, and
``tests/unit/test_sbatch_script.py`` checks that both agree.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Mapping, Sequence

#: The signal SLURM sends ``signal_delay_s`` before the time limit (``#SBATCH --signal=USR2@N``).
WARNING_SIGNAL = "USR2"
# Settings that shape the script but are not sbatch options.
_NOT_SBATCH = {"signal_delay_s", "additional_parameters"}


def _flag(key: str, value: Any) -> str:
    key = key.replace("_", "-")
    if value is True:
        return f"#SBATCH --{key}"
    return f"#SBATCH --{key}={shlex.quote(str(value))}"


def render_sbatch(command: str, folder: str | Path, params: Mapping[str, Any], *, setup: Sequence[str] = (),
                  teardown: Sequence[str] = (), wckey: str = "submitit", srun_args: Sequence[str] = ()) -> str:
    """The text of the sbatch script that runs ``command`` under ``srun``.

    Args:
        command: the job step's command line (already shell-quoted).
        folder: the log folder; ``%j`` in it is the job id. Logs are ``<folder>/%j_0_log.out`` and ``.err``.
        params: sbatch settings from :func:`gwenlake_hpc.launch.slurm.sbatch_parameters` (``job_name``,
            ``time`` in minutes, ``nodes``, ``ntasks_per_node``, ``signal_delay_s``, ``partition``...,
            ``additional_parameters``: extra ``--key=value`` options such as ``requeue``).
        setup: shell lines before the step; teardown: after it.
        wckey: the ``--wckey`` submitit sets (kept so that both scripts are the same).
        srun_args: more ``srun`` options (submitit's ``srun_args``), e.g. ``--container=BUNDLE``.
    """
    options = {k: v for k, v in params.items() if v is not None and k not in _NOT_SBATCH}
    options["wckey"] = wckey
    options["signal"] = f"{WARNING_SIGNAL}@{int(params.get('signal_delay_s', 90))}"
    stdout = str(Path(folder) / "%j_%t_log.out")
    stderr = str(Path(folder) / "%j_%t_log.err")
    options["output"] = stdout.replace("%t", "0")
    options["error"] = stderr.replace("%t", "0")
    options["open-mode"] = "append"
    options.update(params.get("additional_parameters") or {})
    lines = ["#!/bin/bash", "", "# Parameters", *(_flag(k, options[k]) for k in sorted(options))]
    if setup:
        lines += ["", "# setup", *setup]
    srun = " ".join(shlex.quote(a) for a in ["srun", "--unbuffered", "--output", stdout, "--error", stderr,
                                                 *srun_args])
    lines += ["", "# command", "export SUBMITIT_EXECUTOR=slurm", f"{srun} {command}", ""]
    if teardown:
        lines += ["", "# teardown", *teardown]
    return "\n".join(lines)
