"""What a hang looked like: each rank's record, the job's verdict (which ranks stopped first), and its MLflow tag.

Responsibilities:

- reading a faulthandler dump (:func:`where`, :func:`activity`, :func:`waited_thread`): where the main thread is,
  the innermost frame of the user's code, what the rank is doing there (waiting in a collective, in a DataLoader,
  in the user's code or in a library), and, when the main thread waits for one of our threads (the checkpoint
  writer's ``join``...), that thread's name and where it blocks;
- each rank's record, ``<run_dir>/hangs/<start>/verdict-rank<r>.json`` (written by that rank's watchdog,
  :mod:`gwenlake_hpc.job.watchdog`), and the gathering of all ranks' records (:func:`gather`);
- the job's verdict (:func:`joint_verdict`): the ranks that stopped first are those not waiting in a collective,
  at the lowest step (a rank whose peer stopped waits for it in the next collective; its heartbeat shows the same
  step or a later one). It is written once, ``hangs/<start>/verdict.json``, by one watchdog (an exclusive create),
  printed as one line starting ``gwenlake_hpc: hang:``, and queued for the job's MLflow run
  (:func:`queue_for_tracking`: the tag ``gwenlake.hang`` and the stack files as artifacts under
  ``hangs/<start>/``), which the run's delivery process, the next start or ``tracking sync`` delivers.

The teardown of a SLURM job (:mod:`gwenlake_hpc.launch.requeue`) reads ``verdict.json`` to tell a hang from
another kill (it reads the file itself: it runs with the standard library only).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..base.fsutil import write_json_atomic

#: The job's verdict in ``hangs/<start>/`` (read by the SLURM teardown too: keep the name in step with it).
VERDICT_NAME = "verdict.json"
#: The longest tag value MLflow accepts in every version we support (characters).
MAX_TAG = 5000

_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')
_LIBRARIES = ("site-packages", "dist-packages", "/lib/python", "gwenlake_hpc/")
#: What a rank does, by the frames of its main thread (checked in this order).
ACTIVITIES = (("collective", ("torch/distributed/", "torch/nn/parallel/distributed.py")),
              ("data loading", ("torch/utils/data/",)))


def _main_frames(stacks: str, thread_id: int, first: bool = True) -> list[tuple[str, str, str]]:
    """A thread's frames of a faulthandler dump, innermost first: ``(file, line, function)``. The thread is
    ``thread_id`` (its ident, the main thread's for the callers here); when it is not found, the first thread of
    the dump (``first``) or none."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks)
    wanted = f"0x{thread_id:016x}"
    block = next((b for b in blocks if b.strip() and wanted in b.splitlines()[0]), blocks[0] if first else "")
    return [(m["file"], m["line"], m["fn"]) for m in (_FRAME.match(line) for line in block.splitlines()) if m]


def waited_thread(stacks: str, thread_id: int, threads: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The thread the main thread (``thread_id``) waits for, when our code said so
    (:func:`gwenlake_hpc.base.waits.waiting_for`, published by the watchdog's training side as ``threads``:
    ``{"names": {ident: name}, "waits": {ident: ident}}``), and it is in the dump: ``{"name": its name,
    "at": its innermost frame, file:line in function}``; None otherwise (no wait recorded, the thread gone)."""
    if not isinstance(threads, Mapping):
        return None
    waited = (threads.get("waits") or {}).get(str(thread_id))
    if not waited or not str(waited).isdigit():
        return None
    frames = _main_frames(stacks, int(waited), first=False)
    if not frames:
        return None
    name = (threads.get("names") or {}).get(str(waited)) or f"0x{int(waited):016x}"
    file, line, fn = frames[0]
    return {"name": str(name), "at": f"{file}:{line} in {fn}"}


def main_thread_text(record: Mapping[str, Any]) -> str:
    """Where a rank's main thread stands, in words: ``its main thread waits for thread NAME, blocked at
    file:line in function (the main thread is at ...)`` when it waits for one of our threads, else ``its main
    thread is at ...``; the innermost frame of the user's code after it when that is another frame."""
    main, waits = record.get("main_thread_at"), record.get("waits_for")
    if isinstance(waits, Mapping) and waits.get("name"):
        at = f"its main thread waits for thread {waits['name']}, blocked at {waits.get('at')}" + (
            f" (the main thread is at {main})" if main else "")
    else:
        at = f"its main thread is at {main}" if main else "its stacks could not be read"
    if record.get("user_code_at") and record.get("user_code_at") != main:
        at += f" (in your code: {record['user_code_at']})"
    return at


def where(stacks: str, thread_id: int) -> tuple[str | None, str | None]:
    """``(innermost frame of the main thread, innermost frame outside the libraries)`` of a faulthandler dump
    (``file:line in function``), None where not found. ``<frozen ...>`` frames are no one's code."""
    frames = _main_frames(stacks, thread_id)
    text = [f"{f}:{n} in {fn}" for f, n, fn in frames]
    user = next((t for t, (f, _, _) in zip(text, frames)
                 if not f.startswith("<") and not any(s in f for s in _LIBRARIES)), None)
    return (text[0] if text else None), user


def activity(stacks: str, thread_id: int) -> str:
    """What the main thread does: ``collective`` (inside ``torch.distributed`` or DDP: waiting for other
    ranks), ``data loading`` (a DataLoader), ``your code`` (the innermost frame is the user's), ``a library``,
    or ``unknown`` (no stacks)."""
    frames = _main_frames(stacks, thread_id)
    if not frames:
        return "unknown"
    for name, markers in ACTIVITIES:
        if any(m in f for f, _, _ in frames for m in markers):
            return name
    innermost = frames[0][0]
    return "a library" if innermost.startswith("<") or any(s in innermost for s in _LIBRARIES) else "your code"


def write_record(folder: Path, record: Mapping[str, Any]) -> Path:
    """``folder/verdict-rank<r>.json``, written durably (:func:`~gwenlake_hpc.base.fsutil.write_json_atomic`: a
    reader never sees half of it)."""
    return write_json_atomic(folder / f"verdict-rank{int(record['rank'])}.json", dict(record))


def read_records(folder: Path) -> list[dict[str, Any]]:
    """Every rank's record in ``folder`` (unreadable ones skipped), by rank."""
    out = []
    for path in folder.glob("verdict-rank*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("rank"), int):
            out.append(data)
    return sorted(out, key=lambda r: r["rank"])


def gather(folder: Path, world_size: int, window_s: float) -> list[dict[str, Any]]:
    """The ranks' records once all ``world_size`` are in ``folder``, or what is there after ``window_s``
    seconds (a rank whose watchdog is gone, a node lost)."""
    deadline = time.monotonic() + window_s
    while True:
        records = read_records(folder)
        if len(records) >= world_size or time.monotonic() >= deadline:
            return records
        time.sleep(0.25)


def joint_verdict(records: Sequence[Mapping[str, Any]], folder: Path) -> dict[str, Any]:
    """The job's verdict from the ranks' records (at least one).

    Returns:
        ``{"first": [ranks that stopped first], "step": their lowest step, "waiting": [other ranks],
        "line": the one-line verdict, "stacks": [stack files], "records": the records, "time": Unix s}``.
        The ranks that stopped first: those not waiting in a collective (all of them when every rank waits)
        at the lowest step among them.
    """
    working = [r for r in records if r.get("activity") != "collective"] or list(records)
    step = min(int(r["step"]) for r in working)
    first = [r for r in working if int(r["step"]) == step]
    others = [r for r in records if r not in first]
    lead = first[0]
    at = main_thread_text(lead)
    names = ", ".join(f"rank {r['rank']} on {r['host']}" for r in first[:8]) + (
        f" and {len(first) - 8} more" if len(first) > 8 else "")
    stopped = " (it stopped first)" if len(records) > 1 and len(first) == 1 else \
        " (they stopped first)" if len(first) > 1 else ""
    line = (f"gwenlake_hpc: hang: {names} made no progress for {lead['silent_s']:.0f} s in step {lead['step']} "
            f"({lead['phase']}; the limit is {lead['limit_s']:.0f} s, job.hang_timeout_s){stopped}: {at}")
    if others:
        waits = "; ".join(f"rank {r['rank']} on {r['host']} in step {r['step']}, {r.get('activity', 'unknown')}"
                          + (f" at {r['main_thread_at']}" if r.get("main_thread_at") else "") for r in others[:4])
        line += f"; the others wait: {waits}" + (f" and {len(others) - 4} more" if len(others) > 4 else "")
    stacks = [str(folder / f"rank{r['rank']}.txt") for r in records]
    line += (f"; all threads' stacks: {stacks[0] if len(stacks) == 1 else str(folder) + '/rank*.txt'}; ending "
             "it (the job step fails killed, a SLURM job is requeued and resumes from its newest checkpoint)")
    return {"first": [r["rank"] for r in first], "step": step, "waiting": [r["rank"] for r in others],
            "line": line, "stacks": stacks, "records": list(records), "time": time.time()}


def publish_verdict(folder: Path, verdict: Mapping[str, Any]) -> bool:
    """Write ``folder/verdict.json`` unless it exists (an exclusive create: one watchdog reports; not the
    atomic replace of :mod:`gwenlake_hpc.base.fsutil`, whose rename would let a second writer replace the
    first); True when this call wrote it."""
    try:
        fd = os.open(folder / VERDICT_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(dict(verdict), indent=1) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return True


def queue_for_tracking(state_dir: Path, folder: Path, verdict: Mapping[str, Any]) -> None:
    """Queue the verdict for the job's MLflow run: tags ``gwenlake.hang`` (the line), ``gwenlake.hang.step``,
    ``gwenlake.hang.first_ranks``, and every stack file plus ``verdict.json`` as artifacts under
    ``hangs/<start>/``, in a spool segment of this process's own (:mod:`gwenlake_hpc.stores.tracking.delivery
    .spool`), made durable before it returns.

    Raises:
        OSError: the state folder cannot be written.
    """
    from ..stores.tracking.delivery.spool import SpoolWriter, encode, stage_artifact

    tags = {"gwenlake.hang": str(verdict["line"])[:MAX_TAG], "gwenlake.hang.step": str(verdict["step"]),
            "gwenlake.hang.first_ranks": ",".join(map(str, verdict["first"]))}
    entries: list[Any] = [{"tags": tags}]
    for path in [*map(Path, verdict["stacks"]), folder / VERDICT_NAME]:
        if path.is_file():
            entries.append(stage_artifact(state_dir, path, f"hangs/{folder.name}"))
    writer = SpoolWriter(state_dir)
    try:
        writer.append(encode(entries))
    finally:
        writer.close()
