"""Bad input through real processes: a project trained once (``trained``), snapshots of what a refused
command may not change, a user's cluster file."""

from __future__ import annotations

import hashlib

import pytest


def snapshot(root):
    """sha256 of every file under runs/ and the model branch: what must survive a bad command."""
    out = {}
    for p in sorted((root / "runs").rglob("*")):
        # run.json and the goodput ledger (ledger/start-*.jsonl) record each start, the lock, lease and fence
        # counter each start's hold of the run; checkpoints and outputs are what must not change
        if p.is_file() and p.name not in ("mlflow.db", "run.json", ".lock", ".fence", ".lease") \
                and p.parent.name != "ledger":
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def ledger_files(root):
    """The goodput ledger's files under runs/ (one per start)."""
    return sorted(str(p.relative_to(root)) for p in (root / "runs").rglob("ledger/start-*.jsonl"))


def train_t(project):
    project.run("+job=t", "job.tracking=false", check=0)
    (project.root / "afile").write_text("a plain file where a folder is expected\n")
    (project.root / "loop1").symlink_to("loop2")
    (project.root / "loop2").symlink_to("loop1")
    return project


@pytest.fixture
def trained(project):
    return train_t(project)


#: What a user writes from the README's list of keys: the connection keys, no defaults list naming the schema.
USER_CLUSTER_FILE = ("host: login.example.org\nport: 2222\nuser: me\nkey_file: ~/.ssh/id_ed25519\n"
                     "known_hosts: ~/.ssh/known_hosts\nremote_dir: /shared/me/project\npython: python3\n")
