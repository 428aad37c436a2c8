"""The job step's first Python code: stop handlers before anything else loads, then submitit's job runner.

The sbatch script runs ``python -m gwenlake_hpc.launch.boot -u -m submitit.core._submit FOLDER`` (submitit's
``python`` setting). SLURM may send the time-limit warning (``--signal``, SIGUSR2) up to 60 s early; arriving
while the interpreter imports submitit, torch and the user's module, it used to kill the step with the default
action ("FAILED 12:0"), and the teardown spent a retry on it. Here the handlers only record the signal, the
training then stops after its first step with a checkpoint, and the teardown reads it as the time-limit case.
"""

from __future__ import annotations

import runpy
import sys

from ..signals import ignore_from_now_on, install_early


def main(argv: list[str]) -> None:
    """Run ``[-u] -m MODULE ARGS...`` as ``python`` would, with the stop handlers already installed."""
    install_early()
    args = list(argv)
    if args[:1] == ["-u"]:  # unbuffered output, as python -u
        args = args[1:]
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    if len(args) < 2 or args[0] != "-m":
        raise SystemExit(f"usage: python -m gwenlake_hpc.launch.boot [-u] -m MODULE [ARGS...], got {argv!r}")
    sys.argv = [args[1], *args[2:]]
    try:
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    finally:
        # Python puts back the default actions while it shuts down: a late SIGUSR2 (SLURM's warning, repeated)
        # would then end a finished step with "FAILED 12:0".
        ignore_from_now_on()


if __name__ == "__main__":
    main(sys.argv[1:])
