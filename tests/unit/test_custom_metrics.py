"""Custom metrics to StatsD: a real UDP socket receives and parses what log_custom_metric sends."""

from __future__ import annotations

import logging
import socket

import pytest

from gwenlake_hpc.stores.tracking import custom_metrics
from gwenlake_hpc.stores.tracking.custom_metrics import log_custom_metric
from helpers.custom_metrics import parse


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


