"""Custom metrics to a StatsD sink: ``gwenlake_hpc.log_custom_metric(name, value, tags={...})``.

Each call sends one gauge ``<prefix>.custom_metrics.<name>`` over UDP with the well-kept ``statsd`` client,
tags in the DogStatsD form (``|#key:value,...``, read by Datadog's agent, Telegraf and statsd_exporter; a plain
StatsD server ignores them). Where it goes, first found wins:

- ``host``: the job config's ``statsd.host``, else ``$STATSD_HOST``; neither: off (one notice, then no-ops);
- ``port``: ``statsd.port``, else ``$STATSD_PORT``, else 8125;
- ``prefix``: ``statsd.prefix``, else ``$STATSD_PREFIX``, else ``gwenlake``.

A job exports its ``statsd.*`` settings as those variables, so DataLoader workers and other processes of the
training send to the same place. It never blocks on the network and never raises in the loop: UDP is
fire-and-forget, the host name is resolved once (at the job's start, or at the first call elsewhere), and an
unresolvable host, a bad name or a non-finite value is one warning and the value is dropped.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("gwenlake_hpc.custom_metrics")

DEFAULT_PORT = 8125
DEFAULT_PREFIX = "gwenlake"
#: Metric names: StatsD's wire format reserves ``:``, ``|``, ``@``, ``#`` and newlines.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-/]*$")
#: Characters DogStatsD allows in a tag; anything else becomes ``_``.
_TAG_BAD = re.compile(r"[^A-Za-z0-9_.\-/:]")

_lock = threading.Lock()
_sink: "_Sink | None" = None
_warned: set[str] = set()


def configure(host: str | None = None, port: int | None = None, prefix: str | None = None) -> None:
    """Set where :func:`log_custom_metric` sends (called by the job with its ``statsd.*`` settings).

    Values given are exported as ``STATSD_HOST``/``STATSD_PORT``/``STATSD_PREFIX`` for the processes the
    training starts; None keeps the environment's. The host is resolved now, so the loop never waits on DNS.
    """
    global _sink
    check_settings(host, port, prefix)
    for name, value in (("STATSD_HOST", host), ("STATSD_PORT", port), ("STATSD_PREFIX", prefix)):
        if value is not None and str(value) != "":
            os.environ[name] = str(value)
    with _lock:
        if _sink is not None:
            _sink.close()
        # Not configured: no notice yet (only a training that calls log_custom_metric gets one).
        _sink = _Sink.from_environment() if os.environ.get("STATSD_HOST", "").strip() else None


def check_settings(host: Any, port: Any, prefix: Any) -> None:
    """Refuse bad ``statsd.*`` settings before any work.

    Raises:
        ConfigError: naming the setting and the accepted form.
    """
    from ...base.errors import ConfigError

    if host is not None and (not str(host).strip() or any(c.isspace() or ord(c) < 32 for c in str(host))):
        raise ConfigError(f"statsd.host={host!r} is not a host name or address: give e.g. statsd.host=localhost, "
                          "or leave it out ($STATSD_HOST, else custom metrics are off)")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise ConfigError(f"statsd.port={port!r} is not a UDP port: give a number from 1 to 65535 (StatsD's is 8125)")
    if prefix is not None and not _NAME.match(str(prefix)):
        raise ConfigError(f"statsd.prefix={prefix!r}: use letters, digits, _ . - / (e.g. statsd.prefix=myteam)")


def reset() -> None:
    """Forget the sink (tests; a process that changed ``STATSD_*``): the next call reads the environment."""
    global _sink
    with _lock:
        if _sink is not None:
            _sink.close()
        _sink = None
        _warned.clear()


def log_custom_metric(name: str, value: float, tags: Mapping[str, Any] | None = None) -> bool:
    """Send ``value`` as the gauge ``<prefix>.custom_metrics.<name>`` to the StatsD sink.

    Args:
        name: letters, digits, ``_``, ``.``, ``-``, ``/`` (e.g. ``"queue_depth"``, ``"gpu/util"``).
        value: a finite number (int, float, or a 0-d tensor/array: anything ``float()`` takes); units are the
            caller's (put them in the name, e.g. ``"batch_ms"``).
        tags: ``{key: value}`` sent as DogStatsD tags ``key:value``; characters outside ``[A-Za-z0-9_.-/:]``
            become ``_``.

    Returns:
        True when the datagram was handed to the socket; False when the sink is off or the value was dropped
        (a warning says why, once per reason).

    Never raises and never blocks on the network (see the module's docstring).
    """
    try:
        if not isinstance(name, str) or not _NAME.match(name):
            _warn_once(f"name:{name!r}", "custom metric name %r is not valid (letters, digits, _ . - /): dropped",
                       name)
            return False
        try:
            number = float(value)
        except (TypeError, ValueError):
            _warn_once(f"value:{name}", "custom metric %s: %r is not a number: dropped", name, value)
            return False
        if not math.isfinite(number):
            _warn_once(f"finite:{name}", "custom metric %s: %s is not finite: dropped (said once for this name)", name,
                       number)
            return False
        sink = _current()
        if sink is None:
            return False
        return sink.gauge(name, number, tags or {})
    except Exception as exc:  # noqa: BLE001 - a metrics sink must never end a training
        _warn_once(f"error:{type(exc).__name__}", "custom metric %s not sent: %s: %s", name, type(exc).__name__,
                   exc)
        return False


def _current() -> "_Sink | None":
    global _sink
    with _lock:
        if _sink is None:
            _sink = _Sink.from_environment()
        return _sink if _sink.client is not None else None


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def tag_suffix(tags: Mapping[str, Any]) -> str:
    """DogStatsD tags ``|#k:v,...`` for ``tags`` (sorted by key; unsafe characters replaced by ``_``)."""
    if not tags:
        return ""
    parts = []
    for key in sorted(tags, key=str):
        k = _TAG_BAD.sub("_", str(key))
        v = _TAG_BAD.sub("_", str(tags[key]))
        parts.append(f"{k}:{v}" if v else k)
    return "|#" + ",".join(parts)


class _Sink:
    """One ``statsd.StatsClient`` (UDP), or none when StatsD is not configured or cannot be resolved."""

    def __init__(self, client: Any, where: str) -> None:
        self.client = client
        self.where = where

    @classmethod
    def from_environment(cls) -> "_Sink":
        host = os.environ.get("STATSD_HOST", "").strip()
        if not host:
            log.info("custom metrics: no StatsD sink configured (statsd.host or $STATSD_HOST): "
                     "log_custom_metric does nothing")
            return cls(None, "")
        port_text = os.environ.get("STATSD_PORT", "").strip() or str(DEFAULT_PORT)
        prefix = os.environ.get("STATSD_PREFIX", "").strip() or DEFAULT_PREFIX
        try:
            port = int(port_text)
            if not 0 < port < 65536:
                raise ValueError(port_text)
        except ValueError:
            log.warning("custom metrics: STATSD_PORT=%r is not a port number (1-65535): off", port_text)
            return cls(None, "")
        try:
            import statsd

            client = statsd.StatsClient(host, port, prefix=f"{prefix}.custom_metrics", ipv6=":" in host)
        except Exception as exc:  # noqa: BLE001 - unresolvable host, no statsd package: off, said once
            log.warning("custom metrics: StatsD at %s:%d cannot be used (%s: %s): off", host, port,
                        type(exc).__name__, exc)
            return cls(None, "")
        log.info("custom metrics: sending to StatsD at %s:%d as %s.custom_metrics.*", host, port, prefix)
        return cls(client, f"{host}:{port}")

    def gauge(self, name: str, value: float, tags: Mapping[str, Any]) -> bool:
        suffix = tag_suffix(tags)
        text = str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
        # statsd's own gauge() has no tags: the same wire lines through its pipeline (one datagram).
        pipe = self.client.pipeline()
        if value < 0:  # a plain negative gauge is a decrement in StatsD: set 0 first, as statsd's gauge() does
            pipe._send_stat(name, f"0|g{suffix}", 1)
        pipe._send_stat(name, f"{text}|g{suffix}", 1)
        pipe.send()
        return True

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass
