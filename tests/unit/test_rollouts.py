"""RL rollouts as MLflow traces: checked messages, one trace per episode linked to the job's run, exactly once."""

from __future__ import annotations

import pytest

from gwenlake_hpc.stores.tracking.rollouts import rollout_entry, validate_messages
from helpers.rollouts import CHAT


@pytest.mark.parametrize("messages, needle", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "bot", "content": "x"}], "messages[0]: role 'bot' is not one of"),
    ([{"role": "user"}], "messages[0]: content is missing"),
    ([{"role": "user", "content": 3}], "content must be a string"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "only an assistant message has tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]}], "messages[0].tool_calls[0]"),
    ([{"role": "tool", "tool_call_id": "zz", "content": "x"}], "needs the tool_call_id of an earlier"),
    ([{"role": "user", "content": "x", "extra": float("nan")}], "not JSON data"),
])
def test_bad_messages_are_refused_naming_the_message(messages, needle):
    with pytest.raises(ValueError) as err:
        validate_messages(messages)
    assert needle in str(err.value)


def test_bad_reward_metrics_and_ids_are_refused():
    for kwargs, needle in (({"reward": float("nan")}, "reward=nan is not finite"),
                           ({"metrics": {"m": "x"}}, "m='x' is not a number"),
                           ({"rollout_id": "XYZ"}, "32 lowercase hex")):
        args = {"reward": 1.0, "step": 1, "task_id": None, "metrics": None, "rollout_id": None, **kwargs}
        with pytest.raises(ValueError, match=needle):
            rollout_entry(CHAT, **args)
    entry = rollout_entry(CHAT, reward=1, step=3, task_id=7, metrics={"turns": 2}, rollout_id=None)["rollout"]
    assert len(entry["id"]) == 32 and entry["task_id"] == "7" and entry["reward"] == 1.0
