"""RL rollouts as MLflow traces: ``gwenlake_hpc.log_rollout(messages, reward=..., step=..., task_id=...)``.

One episode is one trace linked to the job's MLflow run. ``messages`` is the conversation in the OpenAI chat
format (``role``, ``content``, ``tool_calls``, ``tool_call_id``). The trace's root span ``rollout`` holds the
task and the prompt (the messages before the first assistant message) as inputs and the reward, the metrics and
the last message as outputs; each assistant message is a ``model turn N`` span (CHAT_MODEL: the messages since
the previous turn in, the assistant message out), followed by one span per environment response (a ``tool``
message: a TOOL span named after the function it answers; a ``user`` message: an ``environment`` span).

Durability: the training appends the rollout to the tracking spool like a metric point; the delivery process
creates the trace when MLflow answers (later, if it is down). Exactly once: the trace carries the tag
``gwenlake.rollout_id`` (32 hex, given or drawn) and the delivery first looks for a trace with that tag in the
experiment, so a rollout delivered before a kill is not created twice. MLflow 3 draws trace ids itself
(``tr-<32 hex>``), so the rollout id is that tag, not the trace id: search with
``filter_string="tag.`gwenlake.rollout_id` = '<id>'"``.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
ROLLOUT_TAG = "gwenlake.rollout_id"
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a conversation in the OpenAI chat format and return it as plain JSON data.

    Rules: a non-empty list of dicts; ``role`` one of :data:`ROLES`; ``content`` a string, a list of content
    parts (dicts with ``type``) or, for an assistant message with ``tool_calls``, None; ``tool_calls`` (assistant
    only) a list of ``{"id", "type": "function", "function": {"name", "arguments" (a JSON string)}}``; a ``tool``
    message has the ``tool_call_id`` of an earlier tool call.

    Raises:
        ValueError: naming the message's index and what is wrong.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("log_rollout: messages must be a non-empty list of chat messages "
                         "({'role': ..., 'content': ...})")
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        where = f"log_rollout: messages[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where}: a message is a dict with 'role' and 'content', not {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise ValueError(f"{where}: only an assistant message has tool_calls (this one is {role!r})")
        if content is None and not (role == "assistant" and calls):
            raise ValueError(f"{where}: content is missing (only an assistant message with tool_calls may omit it)")
        if content is not None and not isinstance(content, str):
            if not (isinstance(content, list) and all(isinstance(p, Mapping) and "type" in p for p in content)):
                raise ValueError(f"{where}: content must be a string or a list of parts with a 'type'")
        if calls is not None:
            if not isinstance(calls, list) or not calls:
                raise ValueError(f"{where}: tool_calls must be a non-empty list")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, Mapping) else None
                if not (isinstance(c, Mapping) and isinstance(c.get("id"), str) and c.get("type", "function") ==
                        "function" and isinstance(fn, Mapping) and isinstance(fn.get("name"), str)
                        and isinstance(fn.get("arguments", ""), str)):
                    raise ValueError(f"{where}.tool_calls[{j}]: give {{'id': str, 'type': 'function', 'function': "
                                     "{'name': str, 'arguments': JSON string}}")
                call_ids.add(c["id"])
        if role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or tid not in call_ids:
                raise ValueError(f"{where}: a tool message needs the tool_call_id of an earlier assistant tool call "
                                 f"(got {tid!r}; known: {', '.join(sorted(call_ids)) or 'none'})")
        try:
            out.append(json.loads(json.dumps(dict(m), allow_nan=False)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: not JSON data ({exc})") from None
    return out


def rollout_entry(messages: Any, *, reward: float | None, step: int, task_id: str | None,
                  metrics: Mapping[str, Any] | None, rollout_id: str | None) -> dict[str, Any]:
    """The spool entry ``{"rollout": {...}}`` of one episode (checked; see :func:`validate_messages`).

    Raises:
        ValueError: bad messages, a reward or metric that is not a finite number, a rollout id that is not 32
            lowercase hex characters.
    """
    rid = uuid.uuid4().hex if rollout_id is None else str(rollout_id)
    if not _HEX32.match(rid):
        raise ValueError(f"log_rollout: rollout_id={rollout_id!r}: give 32 lowercase hex characters "
                         "(uuid.uuid4().hex), or leave it out")
    values = {str(k): _finite(str(k), v) for k, v in dict(metrics or {}).items()}
    return {"rollout": {"id": rid, "messages": validate_messages(messages),
                        "reward": None if reward is None else _finite("reward", reward), "metrics": values,
                        "step": int(step), "task_id": None if task_id is None else str(task_id),
                        "time_ns": time.time_ns()}}


def _finite(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"log_rollout: {name}={value!r} is not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"log_rollout: {name}={value!r} is not finite")
    return number


def deliver_rollout(client: Any, uri: str, experiment_id: str, run_id: str, rollout: Mapping[str, Any]) -> bool:
    """Create the trace of one rollout entry in ``experiment_id``, linked to ``run_id``; False when a trace
    with its rollout id exists already (delivered before a kill). Raises what MLflow raises (an outage: the
    entry stays in the spool and is tried again)."""
    import mlflow

    rid = str(rollout["id"])
    existing = client.search_traces(locations=[experiment_id], filter_string=f"tag.`{ROLLOUT_TAG}` = '{rid}'",
                                    max_results=1)
    if existing:
        return False
    # The client's span calls export through the process-wide tracking URI, synchronously (this process is
    # the delivery process, or `tracking sync`: nothing else traces here).
    mlflow.set_tracking_uri(uri)
    os.environ["MLFLOW_ENABLE_ASYNC_TRACE_LOGGING"] = "false"
    messages = list(rollout["messages"])
    first_turn = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    t = int(rollout.get("time_ns") or time.time_ns())
    tags = {ROLLOUT_TAG: rid, "gwenlake.step": str(rollout.get("step"))}
    if rollout.get("task_id") is not None:
        tags["gwenlake.task_id"] = str(rollout["task_id"])
    if rollout.get("reward") is not None:
        tags["gwenlake.reward"] = repr(float(rollout["reward"]))
    root = client.start_trace("rollout", span_type="AGENT", experiment_id=experiment_id, tags=tags,
                              inputs={"task_id": rollout.get("task_id"), "messages": messages[:first_turn]},
                              attributes={"gwenlake.step": rollout.get("step"), "gwenlake.rollout_id": rid},
                              start_time_ns=t)
    tick = t
    turn = 0
    names = {c["id"]: c["function"]["name"] for m in messages for c in (m.get("tool_calls") or [])}
    since = first_turn
    for i in range(first_turn, len(messages)):
        m = messages[i]
        tick += 1000
        if m["role"] == "assistant":
            turn += 1
            span = client.start_span(f"model turn {turn}", trace_id=root.trace_id, parent_id=root.span_id,
                                     span_type="CHAT_MODEL", inputs={"messages": messages[since:i]},
                                     start_time_ns=tick)
            client.end_span(root.trace_id, span.span_id, outputs=m, end_time_ns=tick + 500)
            since = i + 1
        else:
            name = f"tool {names.get(m.get('tool_call_id'), '?')}" if m["role"] == "tool" else "environment"
            span = client.start_span(name, trace_id=root.trace_id, parent_id=root.span_id,
                                     span_type="TOOL" if m["role"] == "tool" else "UNKNOWN",
                                     inputs={"tool_call_id": m.get("tool_call_id")} if m["role"] == "tool" else None,
                                     start_time_ns=tick)
            client.end_span(root.trace_id, span.span_id, outputs=m, end_time_ns=tick + 500)
    client.end_trace(root.trace_id, outputs={"reward": rollout.get("reward"), "metrics": rollout.get("metrics"),
                                             "last_message": messages[-1]}, end_time_ns=tick + 1000)
    client.link_traces_to_run([root.trace_id], run_id)
    return True
