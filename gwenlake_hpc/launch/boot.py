"""The job step's first Python code: stop handlers before anything else loads, then submitit's job runner.

The sbatch script runs ``python -m gwenlake_hpc.launch.boot -u -m submitit.core._submit FOLDER`` (submitit's
``python`` setting). SLURM may send the time-limit warning (``--signal``, SIGUSR2) up to 60 s early; arriving
while the interpreter imports submitit, torch and the user's module, it used to kill the step with the default
action ("FAILED 12:0"), and the teardown spent a retry on it. Here the handlers record the signal and end the
start-up at once with exit 75 (nothing trained, the checkpoints kept: :meth:`StopRequest.arm`), and the
teardown reads it as the time-limit case.
"""

from __future__ import annotations

import runpy
import sys

from ..base.errors import EXIT_EVICTED
from ..runtime.signals import StopInterrupt, ignore_from_now_on, install_early


def keep_our_handlers() -> None:
    """Stop submitit from putting its own signal handlers over ours in this job step.

    submitit installs them (``JobEnvironment._handle_signals``) just before it calls the job, and the job
    (:class:`gwenlake_hpc.launch.slurm.SlurmEntry`) puts ours back first thing. A signal landing between the two
    went to submitit's handler, which ended the job as "timed-out too many times" (a burst of SIGUSR2 hit that
    gap in CI). Nothing here relies on submitit's handling: the loop stops at a step boundary and the batch
    script's teardown decides the requeue (:mod:`gwenlake_hpc.launch.requeue`).
    """
    from submitit.core import job_environment

    def keep(self: object, paths: object, submission: object) -> None:
        return None  # ours stay

    job_environment.JobEnvironment._handle_signals = keep  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    """Run ``[-u] -m MODULE ARGS...`` as ``python`` would, with the stop handlers already installed (and kept:
    :func:`keep_our_handlers` when MODULE is submitit's runner)."""
    install_early()
    args = list(argv)
    if args[:1] == ["-u"]:  # unbuffered output, as python -u
        args = args[1:]
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    if len(args) < 2 or args[0] != "-m":
        raise SystemExit(f"usage: python -m gwenlake_hpc.launch.boot [-u] -m MODULE [ARGS...], got {argv!r}")
    sys.argv = [args[1], *args[2:]]
    if args[1].startswith("submitit."):
        keep_our_handlers()  # imported while ours already record a stop signal
    try:
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    except StopInterrupt as exc:  # a stop signal while submitit and the job load: end now, as evicted
        print(f"stop requested ({exc}) during the start-up: this start ends now (exit {EXIT_EVICTED}), having "
              "trained nothing", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_EVICTED) from None
    finally:
        # Python puts back the default actions while it shuts down: a late SIGUSR2 (SLURM's warning, repeated)
        # would then end a finished step with "FAILED 12:0".
        ignore_from_now_on()


if __name__ == "__main__":
    main(sys.argv[1:])
