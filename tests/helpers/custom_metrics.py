"""Parsing StatsD datagrams (``name:value|type|#tags``) as the custom-metric tests receive them."""

from __future__ import annotations


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
