"""An RL chat with a tool call, logged as a rollout by the rollout tests (unit/ and integration/)."""

from __future__ import annotations

CHAT = [{"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": "2+2"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
        {"role": "assistant", "content": "4"}]
