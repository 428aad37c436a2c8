"""Named checkpoints: a store per model shared by its runs, a `latest` entry, `checkpoints list`."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import gwenlake_hpc
from gwenlake_hpc import load_state
from gwenlake_hpc.stores.checkpoints.named import latest_path, list_named, save_named
from gwenlake_hpc.base.errors import ConfigError, GwenlakeError


def test_save_replace_latest_and_list(tmp_path):
    root = tmp_path / "runs" / "crm.churn"
    a = nn.Linear(3, 2)
    extra = tmp_path / "tokenizer.json"
    extra.write_text('{"vocab": 3}')
    first = save_named(root, "exp-one", a, run_key="k1", step=10, metadata={"lr": 0.01},
                       additional_files=[extra])
    assert first == root / "named" / "exp-one" and (first / "tokenizer.json").read_text() == '{"vocab": 3}'
    b = nn.Linear(3, 2)
    load_state(first / "model.safetensors", model=b)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert latest_path(root) == first

    second = save_named(root, "exp-two", {"w": torch.arange(4.0)}, run_key="k2", step=5)  # a plain state_dict
    assert latest_path(root) == second
    c = nn.Linear(3, 2)
    save_named(root, "exp-one", c, run_key="k3", step=20)  # replaced whole, and now the latest
    info = json.loads((first / "checkpoint.json").read_text())
    assert (info["run_key"], info["step"], info["metadata"]) == ("k3", 20, {})
    assert not (first / "tokenizer.json").exists()  # nothing of the old one is left in it
    assert latest_path(root) == first
    listed = list_named(root)
    assert [(i["name"], i["run_key"], i["latest"]) for i in listed] == [("exp-two", "k2", False),
                                                                       ("exp-one", "k3", True)]
    assert listed[1]["size"] == sum((first / f).stat().st_size for f in ("model.safetensors",))
    assert not [p for p in (root / "named").iterdir() if p.name.startswith((".tmp", ".old"))]


@pytest.mark.parametrize("name", ["../escape", "a/b", "latest", ".hidden", "", "x" * 200])
def test_names_that_would_leave_the_store_are_refused(tmp_path, name):
    with pytest.raises(ConfigError, match="checkpoint path="):
        save_named(tmp_path / "m", name, nn.Linear(1, 1), run_key="k", step=1)
    assert not (tmp_path / "escape").exists()


def test_bad_metadata_and_files_are_refused_and_leave_nothing(tmp_path):
    with pytest.raises(ConfigError, match="metadata"):
        save_named(tmp_path / "m", "x", nn.Linear(1, 1), run_key="k", step=1, metadata={"f": float("nan")})
    with pytest.raises(ConfigError, match="is not a file"):
        save_named(tmp_path / "m", "x", nn.Linear(1, 1), run_key="k", step=1, additional_files=[tmp_path / "no"])
    assert list_named(tmp_path / "m") == [] and latest_path(tmp_path / "m") is None


def test_outside_a_run_both_functions_say_so():
    with pytest.raises(GwenlakeError, match="no training runs in this process"):
        gwenlake_hpc.checkpoint(nn.Linear(1, 1), path="x")
    with pytest.raises(GwenlakeError, match="no training runs in this process"):
        gwenlake_hpc.last_checkpoint_path()


def test_a_reader_never_sees_a_replaced_checkpoint_missing(tmp_path):
    """Replacing a name swaps the folders in one step: latest_path() and the folder are there throughout."""
    import threading

    root = tmp_path / "m"
    save_named(root, "shared", nn.Linear(2, 2), run_key="k", step=0)
    done = threading.Event()
    missing = []

    def read():
        while not done.is_set():
            if latest_path(root) is None or not (root / "named" / "shared" / "checkpoint.json").is_file():
                missing.append(1)

    t = threading.Thread(target=read)
    t.start()
    try:
        for step in range(1, 40):
            save_named(root, "shared", nn.Linear(2, 2), run_key="k", step=step, additional_files=str(tmp_path / "f")
                       if (tmp_path / "f").write_text("x") else ())
    finally:
        done.set()
        t.join(30)
    assert missing == [] and json.loads((root / "named" / "shared" / "checkpoint.json").read_text())["step"] == 39
    assert (root / "named" / "shared" / "f").read_text() == "x"  # a str is one file, not its characters
    assert not [p for p in (root / "named").iterdir() if p.name.startswith((".tmp", ".old"))]
