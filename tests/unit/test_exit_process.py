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


def test_a_rank_whose_peer_is_known_gone_ends_without_the_final_barrier():
    """The adversary's input: under torchrun, rank 1 SIGKILLed during a checkpoint; the agent's SIGTERM made rank
    0 end as evicted after naming rank 1, then its teardown tried the final barrier and logged a second line,
    "a collective failed at the job's end ... what rank 0 committed stays" (nothing was committed). A rank whose
    peer is known gone (``Dist.lost_peer`` gave a verdict) abandons the group: no collective at the end."""
    done = _run("""
        import os, socket, subprocess
        import torch.distributed as dist
        from gwenlake_hpc.runtime import distributed as d
        from gwenlake_hpc.runtime.peers import Peer

        gone = subprocess.Popen(["true"]); gone.wait()  # a pid that is no process any more: rank 1, SIGKILLed
        host = socket.gethostname()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        me = d.Dist(rank=0, world_size=2, peers=[Peer(0, host, os.getpid()), Peer(1, host, gone.pid)])
        print("rank 1 pid", gone.pid)
        def no_collective(*a, **k):
            raise AssertionError("a collective at the end")
        me.where_all = no_collective
        me.barrier = no_collective
        print("verdict:", me.lost_peer(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), "at step 6"))
        print("peer_lost:", me.peer_lost, "teardown:", d.teardown(me, ok=True), "abandoned:", d._ABANDONED)
    """)
    assert done.returncode == 0, done.stderr
    import re
    import socket

    pid = re.search(r"rank 1 pid (\d+)", done.stdout).group(1)
    assert f"verdict: rank 1 (pid {pid} on {socket.gethostname()}) is gone: a collective failed at step 6" \
        in done.stdout, done.stdout
    assert "peer_lost: True teardown: True abandoned: [True]" in done.stdout, done.stdout


@pytest.mark.parametrize("torchrun_status,recorded,failed,expected", [
    (1, {0: 75, 1: 75}, {0: 75}, 75),       # SLURM's SIGTERM: every rank evicted
    (1, {0: 75}, {}, 75),                   # SIGTERM to torchrun's agent itself (no failures listed)
    (1, {0: 75}, {1: -9}, 1),               # rank 1 SIGKILLed (OOM), the agent's SIGTERM ended rank 0 as evicted
    (1, {0: 75}, {1: 1}, 1),                # rank 1 raised
    (1, {0: 1, 1: 75}, {0: 1}, 1),
    (0, {0: 0, 1: 0}, {}, 0),
    (1, {}, {0: 75}, 1),                    # no rank recorded (not our job)
])
def test_the_torchrun_wrapper_says_evicted_only_where_no_rank_failed(torchrun_status, recorded, failed, expected):
    from gwenlake_hpc.launch.torchrun import verdict

    assert verdict(torchrun_status, recorded, failed) == expected
