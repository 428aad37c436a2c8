"""Custom metrics to StatsD: a real UDP socket receives and parses what log_custom_metric sends."""

from __future__ import annotations

import logging
import socket

import pytest

from gwenlake_hpc.stores.tracking import custom_metrics
from gwenlake_hpc.stores.tracking.custom_metrics import log_custom_metric


@pytest.fixture
def listener(monkeypatch):
    """A UDP socket on 127.0.0.1 standing in for the StatsD agent; STATSD_HOST/PORT point at it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(30)
    monkeypatch.setenv("STATSD_HOST", "127.0.0.1")
    monkeypatch.setenv("STATSD_PORT", str(sock.getsockname()[1]))
    monkeypatch.delenv("STATSD_PREFIX", raising=False)
    custom_metrics.reset()
    yield sock
    custom_metrics.reset()
    sock.close()


def parse(datagram: bytes) -> list[tuple[str, float, str, dict[str, str]]]:
    """StatsD lines ``name:value|type|#k:v,...`` -> (name, value, type, tags)."""
    out = []
    for line in datagram.decode("ascii").split("\n"):
        head, *fields = line.split("|")
        name, value = head.rsplit(":", 1)
        tags = {}
        for f in fields[1:]:
            if f.startswith("#"):
                tags = dict(t.split(":", 1) for t in f[1:].split(","))
        out.append((name, float(value), fields[0], tags))
    return out


def test_gauge_with_tags_arrives_as_statsd_line(listener):
    assert log_custom_metric("queue_depth", 3, tags={"split": "val", "class": "a b|c"}) is True
    assert parse(listener.recv(4096)) == [
        ("gwenlake.custom_metrics.queue_depth", 3.0, "g", {"class": "a_b_c", "split": "val"})]
    assert log_custom_metric("lr", 0.000123) is True
    assert parse(listener.recv(4096)) == [("gwenlake.custom_metrics.lr", 0.000123, "g", {})]


def test_negative_gauge_is_set_not_decremented(listener):
    """A bare ``-2.5|g`` is a decrement in StatsD: 0 is sent first in the same datagram, as statsd's gauge does."""
    assert log_custom_metric("margin", -2.5, tags={"split": "test"}) is True
    lines = parse(listener.recv(4096))
    assert [(v, t) for _, v, t, _ in lines] == [(0.0, "g"), (-2.5, "g")]
    assert {tuple(sorted(tags.items())) for *_, tags in lines} == {(("split", "test"),)}


def test_prefix_from_the_environment(listener, monkeypatch):
    monkeypatch.setenv("STATSD_PREFIX", "team.a")
    custom_metrics.reset()
    assert log_custom_metric("x", 1.5)
    assert parse(listener.recv(4096))[0][0] == "team.a.custom_metrics.x"


def test_bad_values_and_names_are_dropped_with_one_warning_never_raised(listener, caplog):
    caplog.set_level(logging.WARNING, logger="gwenlake_hpc.custom_metrics")
    assert log_custom_metric("loss", float("nan")) is False
    assert log_custom_metric("loss", float("inf")) is False
    assert log_custom_metric("bad:name", 1.0) is False
    assert log_custom_metric("loss", "abc") is False
    assert log_custom_metric("loss", 2.0) is True  # the next datagram is this one: nothing was sent before it
    assert parse(listener.recv(4096)) == [("gwenlake.custom_metrics.loss", 2.0, "g", {})]
    texts = [r.getMessage() for r in caplog.records]
    assert sum("not finite" in t for t in texts) == 1  # once per name, not per call
    assert any("'bad:name' is not valid" in t for t in texts) and any("'abc' is not a number" in t for t in texts)


def test_off_without_a_host_is_a_no_op_with_one_notice(monkeypatch, caplog):
    monkeypatch.delenv("STATSD_HOST", raising=False)
    custom_metrics.reset()
    caplog.set_level(logging.INFO, logger="gwenlake_hpc.custom_metrics")
    assert log_custom_metric("x", 1.0) is False
    assert log_custom_metric("x", 2.0) is False
    assert sum("no StatsD sink configured" in r.getMessage() for r in caplog.records) == 1
    custom_metrics.reset()


def test_unresolvable_host_is_off_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("STATSD_HOST", "no-such-host.invalid")
    custom_metrics.reset()
    caplog.set_level(logging.WARNING, logger="gwenlake_hpc.custom_metrics")
    assert log_custom_metric("x", 1.0) is False
    assert any("cannot be used" in r.getMessage() for r in caplog.records)
    custom_metrics.reset()


@pytest.mark.slow
def test_a_job_sends_one_gauge_per_step_equal_to_the_tracked_loss(observed_job):
    """statsd.host/port in the job config; the training's values are the MLflow run's loss points."""
    from mlflow import MlflowClient

    project, proc = observed_job.project, observed_job.proc
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for d in observed_job.datagrams for line in parse(d)]
    assert {name for name, *_ in lines} == {"ci.custom_metrics.loss"}
    sent = {int(tags["step"]): value for _, value, _, tags in lines}
    assert sorted(sent) == list(range(1, 31)) and all(tags["split"] == "train" for *_, tags in lines)
    uri = f"sqlite:///{project.root / 'runs' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = (next((project.root / "runs" / "t.model").iterdir()) / "tracking" / "run_id").read_text().strip()
    tracked = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert sent == tracked
