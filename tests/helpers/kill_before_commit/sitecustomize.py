"""Put on ``PYTHONPATH`` with ``GWL_TEST_SIGKILL_BEFORE_COMMIT=1``: a job SIGKILLs itself once the training
function has returned and its last checkpoint is sealed, before the commit (the end a node failure or a
``scancel --signal=KILL`` can give any training, the examples and the docs' snippets included, without a hook in
their code). Its rerun has no step left to train. :data:`DIR` is this folder (tests/helpers/killing.py)."""

import os

if os.environ.get("GWL_TEST_SIGKILL_BEFORE_COMMIT") == "1":
    import signal

    from gwenlake_hpc.job import execute

    _finish = execute.finish

    def _killed_before_commit(p, run, result, start):
        if run.is_main and not run.evicted:
            run.wait_for_checkpoint()
            os.kill(os.getpid(), signal.SIGKILL)
        return _finish(p, run, result, start)

    execute.finish = _killed_before_commit
