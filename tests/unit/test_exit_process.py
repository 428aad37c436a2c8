"""How a process ends (``exit_process``): through ``sys.exit`` normally; after a multi-task run's failure left its
process group undestroyed, with the exit handlers run and the streams flushed, then ``os._exit`` before the
interpreter's finalisation (where gloo's still-running threads would abort the process with SIGABRT)."""

import os
import subprocess
import sys
import textwrap

import pytest

from gwenlake_hpc.runtime import distributed


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_process_whose_group_was_abandoned_runs_its_exit_handlers_then_ends_with_its_status():
    done = _run("""
        import atexit, logging, sys
        from gwenlake_hpc.runtime import distributed as d
        logging.basicConfig(stream=sys.stderr)
        atexit.register(lambda: print("exit handler ran", flush=True))
        d._ABANDONED.append(True)  # what teardown(d, ok=False) records
        print("unflushed line", end="")  # no newline, no flush: exit_process flushes it
        logging.getLogger("x").error("logged before the exit")
        d.exit_process(3)
        print("never printed")
    """)
    assert done.returncode == 3, done
    assert done.stdout == "unflushed lineexit handler ran\n", done
    assert "logged before the exit" in done.stderr


def test_otherwise_it_is_sys_exit():
    assert not distributed._ABANDONED
    with pytest.raises(SystemExit) as info:
        distributed.exit_process(5)
    assert info.value.code == 5
