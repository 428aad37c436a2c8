"""The hang watchdog's rule, its setting and its reading of a faulthandler dump (the processes themselves are
tested in tests/integration/test_hang.py)."""

import json

import pytest

from gwenlake_hpc.base.errors import ConfigError
from gwenlake_hpc.job.hang_report import activity, joint_verdict, publish_verdict, where
from gwenlake_hpc.job.watchdog import AUTO_FLOOR_S, AUTO_LONG_S, AUTO_STARTUP_S, HangRule, hang_rule
from gwenlake_hpc.runtime import heartbeat as hb


def _beat(phase=hb.STEP, at_eval=False, first=False):
    return hb.Beat(pid=1, thread_id=0x1234, step=7, phase=phase, at_eval=at_eval, beat_ns=0, count=3, first=first)


def test_auto_never_goes_below_its_floor_and_follows_the_run_s_own_steps():
    rule = hang_rule("auto")
    assert rule.enabled and rule.timeout_s is None
    assert rule.limit(_beat(), recent_step_s=0.01) == AUTO_FLOOR_S
    assert rule.limit(_beat(), recent_step_s=120.0) == 1200.0  # 10 x the longest recent step
    assert rule.limit(_beat(hb.CHECKPOINT), recent_step_s=0.01) == AUTO_LONG_S
    assert rule.limit(_beat(at_eval=True), recent_step_s=300.0) == 3000.0
    assert rule.limit(_beat(hb.STARTING), recent_step_s=0.0) == AUTO_STARTUP_S == 3600.0


def test_a_number_sets_the_step_bound_and_three_times_it_for_the_long_phases():
    rule = hang_rule(4)
    assert rule.limit(_beat(), 100.0) == 4.0
    assert rule.limit(_beat(first=True), 100.0) == 12.0  # the first step of a start: compiling, warming up
    assert hang_rule("auto").limit(_beat(first=True), 0.01) == AUTO_LONG_S
    assert rule.limit(_beat(hb.CHECKPOINT), 100.0) == rule.limit(_beat(at_eval=True), 0.0) == 12.0
    assert not hang_rule(0).enabled and not hang_rule("0").enabled
    assert hang_rule(None) == HangRule(None) and hang_rule(" AUTO ") == HangRule(None)


@pytest.mark.parametrize("bad", [-1, "soon", True, float("nan"), float("inf"), [3]])
def test_a_bad_setting_names_it_and_the_choices(bad):
    with pytest.raises(ConfigError, match=r"job.hang_timeout_s=.*use auto .* a number of seconds, or 0"):
        hang_rule(bad)


def test_a_limit_under_the_watchdog_s_one_second_polling_is_refused():
    """The adversarial pass's job.hang_timeout_s=1e-9: it was accepted and killed the run at its first poll."""
    with pytest.raises(ConfigError, match=r"job.hang_timeout_s=1e-09: give at least 1 s"):
        hang_rule(1e-9)
    assert hang_rule(1).timeout_s == 1.0


DUMP = '''Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/work/x/.venv/lib/python3.11/site-packages/torch/utils/data/loader.py", line 99 in _loop

Current thread 0x0000000000001234 (most recent call first):
  File "/work/x/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/home/u/proj/train.py", line 42 in step_fn
  File "/home/u/proj/train.py", line 80 in fit
  File "/work/x/gwenlake_hpc/job/execute.py", line 330 in _train
'''


def test_the_verdict_reads_the_main_thread_and_the_innermost_frame_of_the_user_s_code():
    main, user = where(DUMP, 0x1234)
    assert main == "/work/x/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:2501 in all_reduce"
    assert user == "/home/u/proj/train.py:42 in step_fn"
    assert where("", 0x1234) == (None, None)
    frozen = DUMP.replace('/home/u/proj/train.py", line 42', '<frozen runpy>", line 88')
    assert where(frozen, 0x1234)[1] == "/home/u/proj/train.py:80 in fit"  # <frozen ...> is no one's code


def test_a_heartbeat_written_here_is_read_back(tmp_path):
    beat = hb.Heartbeat(tmp_path / "hb")
    first = hb.read(tmp_path / "hb")
    assert first.phase == hb.STARTING and first.count == 0
    beat.beat(11, at_eval=False, first=True)
    assert (hb.read(tmp_path / "hb").first, hb.read(tmp_path / "hb").at_eval) == (True, False)
    beat.beat(12, at_eval=True)
    beat.phase(hb.CHECKPOINT)
    now = hb.read(tmp_path / "hb")
    assert (now.step, now.phase, now.at_eval, now.first, now.count) == (12, hb.CHECKPOINT, True, False, 3)
    assert now.beat_ns >= first.beat_ns and now.pid == first.pid
    beat.close()
    assert hb.read(tmp_path / "hb").phase == hb.DONE
    (tmp_path / "junk").write_bytes(b"x" * 80)
    assert hb.read(tmp_path / "junk") is None and hb.read(tmp_path / "missing") is None


def _record(rank, step, activity, silent=9.0, host="node-a"):
    return {"rank": rank, "host": host, "pid": 100 + rank, "step": step, "phase": "step", "silent_s": silent,
            "limit_s": 8.0, "activity": activity, "main_thread_at": f"/x/f{rank}.py:1 in g",
            "user_code_at": f"/u/train.py:{10 + rank} in fit"}


def test_what_a_rank_does_is_read_from_its_main_thread():
    assert activity(DUMP, 0x1234) == "collective"  # inside torch.distributed: waiting for the others
    user = DUMP.replace("torch/distributed/distributed_c10d.py", "numpy/core/x.py").replace(
        '/work/x/.venv/lib/python3.11/site-packages/numpy/core/x.py", line 2501 in all_reduce\n', "")
    assert activity(user, 0x1234) == "your code"
    loader = DUMP.replace("torch/distributed/distributed_c10d.py", "torch/utils/data/dataloader.py")
    assert activity(loader, 0x1234) == "data loading"
    lib = DUMP.replace("torch/distributed/distributed_c10d.py", "numpy/core/x.py")
    assert activity(lib, 0x1234) == "a library"
    assert activity("", 0x1234) == "unknown"


def test_the_rank_that_stopped_first_is_the_one_not_waiting_in_a_collective(tmp_path):
    records = [_record(0, 25, "collective", silent=9.4), _record(1, 25, "your code", silent=9.1, host="node-b"),
               _record(2, 26, "collective", silent=8.2)]
    v = joint_verdict(records, tmp_path)
    assert v["first"] == [1] and v["waiting"] == [0, 2] and v["step"] == 25
    assert v["line"].startswith("gwenlake_hpc: hang: rank 1 on node-b made no progress for 9 s in step 25 (step; "
                                "the limit is 8 s, job.hang_timeout_s) (it stopped first): its main thread is at "
                                "/x/f1.py:1 in g (in your code: /u/train.py:11 in fit); the others wait: rank 0 on "
                                "node-a in step 25, collective at /x/f0.py:1 in g; rank 2"), v["line"]
    assert v["stacks"] == [str(tmp_path / f"rank{r}.txt") for r in (0, 1, 2)]


def test_when_every_rank_waits_in_a_collective_the_lowest_step_stopped_first(tmp_path):
    v = joint_verdict([_record(0, 31, "collective"), _record(1, 30, "collective"), _record(2, 30, "collective")],
                      tmp_path)
    assert v["first"] == [1, 2] and v["step"] == 30 and "(they stopped first)" in v["line"]
    one = joint_verdict([_record(0, 7, "your code")], tmp_path)
    assert one["first"] == [0] and "stopped first" not in one["line"] and "the others" not in one["line"]
    assert f"all threads' stacks: {tmp_path / 'rank0.txt'}; ending it" in one["line"]


def test_one_watchdog_publishes_the_verdict(tmp_path):
    v = joint_verdict([_record(0, 7, "your code")], tmp_path)
    assert publish_verdict(tmp_path, v) is True
    assert publish_verdict(tmp_path, {**v, "line": "another"}) is False
    assert json.loads((tmp_path / "verdict.json").read_text())["line"] == v["line"]


JOINED = '''Thread 0x0000000000000abc (most recent call first):
  File "/work/x/store.py", line 115 in _fsync_file
  File "/work/x/writer.py", line 45 in target
  File "/usr/lib/python3.11/threading.py", line 975 in run

Current thread 0x0000000000001234 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 1139 in _wait_for_tstate_lock
  File "/usr/lib/python3.11/threading.py", line 1119 in join
  File "/u/train.py", line 57 in fit
'''


def test_a_main_thread_waiting_for_one_of_our_threads_names_it_and_where_it_blocks(tmp_path):
    import threading

    from gwenlake_hpc.base.waits import snapshot, waiting_for
    from gwenlake_hpc.job.hang_report import main_thread_text, waited_thread

    threads = {"names": {str(0xabc): "gwenlake-checkpoint-writer", str(0x1234): "MainThread"},
               "waits": {str(0x1234): str(0xabc)}}
    waits = waited_thread(JOINED, 0x1234, threads)
    assert waits == {"name": "gwenlake-checkpoint-writer", "at": "/work/x/store.py:115 in _fsync_file"}
    assert waited_thread(JOINED, 0x1234, {**threads, "waits": {}}) is None  # no wait recorded: nothing guessed
    assert waited_thread(JOINED, 0x1234, {**threads, "waits": {str(0x1234): "99"}}) is None  # not in the dump
    main, user = where(JOINED, 0x1234)
    record = {**_record(0, 30, "a library"), "main_thread_at": main, "user_code_at": user, "waits_for": waits}
    assert main_thread_text(record) == (
        "its main thread waits for thread gwenlake-checkpoint-writer, blocked at /work/x/store.py:115 in "
        "_fsync_file (the main thread is at /usr/lib/python3.11/threading.py:1139 in _wait_for_tstate_lock) "
        "(in your code: /u/train.py:57 in fit)")
    assert main_thread_text(record) in joint_verdict([record], tmp_path)["line"]

    # the registry itself: a wait is recorded while it lasts, by the waiter's ident
    gate = threading.Event()
    worker = threading.Thread(target=gate.wait, name="gwenlake-test-worker")
    worker.start()
    with waiting_for(worker):
        now = snapshot()
    gate.set()
    worker.join()
    assert now["waits"] == {str(threading.get_ident()): str(worker.ident)}
    assert now["names"][str(worker.ident)] == "gwenlake-test-worker"
    assert snapshot()["waits"] == {}
