"""Tracking URIs: checking them, the default SQLite store's URI, and keeping credentials out of logs and files."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from ...base.errors import ConfigError
from .sqlite import sqlite_path, sqlite_uri

_ACCEPTED_SCHEMES = ("sqlite", "postgresql", "mysql", "http", "https", "databricks")


def default_uri(runs_root: str | os.PathLike[str]) -> str:
    """Return the default tracking URI, a SQLite store next to the runs.

    Args:
        runs_root: folder holding the runs (the project's runs root); made absolute, so the URI
            does not depend on the working directory of the job.

    Returns:
        ``"sqlite:///<absolute runs_root>/mlflow.db"`` (four slashes for an absolute path), the path
        percent-encoded, so the store lands inside ``runs_root`` whatever characters it holds.
    """
    return sqlite_uri(Path(runs_root) / "mlflow.db")


def validate_uri(uri: str) -> str:
    """Check a tracking URI (config key ``tracking.uri``) and return it stripped.

    Accepted: ``sqlite:``, ``postgresql:``, ``mysql:`` (with an optional ``+driver``),
    ``http:``, ``https:`` and ``databricks``.

    Raises:
        ConfigError: for an empty value, a ``file:`` URI or a plain path (MLflow 3 refuses the
            filesystem store, "in maintenance mode"), or an unknown scheme. The message names
            ``tracking.uri`` and suggests ``sqlite:///<path>/mlflow.db`` or ``http://host:port``.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(
            "tracking.uri is empty: set it to sqlite:///<path>/mlflow.db or http://host:port"
        )
    uri = uri.strip()
    if uri == "databricks":
        if not _importable("databricks.sdk"):
            raise ConfigError("tracking.uri=databricks needs the Python package databricks-sdk, which is not "
                              "installed here (pip install databricks-sdk), and its credentials")
        return uri
    scheme = urlsplit(uri).scheme.lower()
    # A Windows drive letter parses as a one-letter scheme: it is a plain path too.
    if not scheme or len(scheme) == 1:
        path = Path(uri).expanduser().absolute()
        suggestion = f"sqlite:///{path}" if path.suffix == ".db" else f"sqlite:///{path}/mlflow.db"
        raise ConfigError(
            f"tracking.uri={uri!r} is a plain path; MLflow 3 no longer accepts the filesystem "
            f"tracking backend (it is in maintenance mode). Use {suggestion} or http://host:port"
        )
    if scheme == "file":
        path = Path(urlsplit(uri).path or ".").absolute()
        raise ConfigError(
            f"tracking.uri={redact_uri(uri)!r}: MLflow 3 no longer accepts the filesystem "
            f"tracking backend ('file:' URIs, in maintenance mode). Use "
            f"sqlite:///{path}/mlflow.db or http://host:port"
        )
    base = scheme.split("+", 1)[0]
    if base not in _ACCEPTED_SCHEMES:
        raise ConfigError(
            f"tracking.uri={redact_uri(uri)!r} has an unsupported scheme {scheme!r}; use "
            f"sqlite:///<path>/mlflow.db, http://host:port, or one of: "
            f"{', '.join(_ACCEPTED_SCHEMES)}"
        )
    if _CONTROL.search(uri):
        raise ConfigError(f"tracking.uri={redact_uri(uri)!r} holds control characters (a newline?): remove them")
    parts = urlsplit(uri)
    if base == "sqlite":
        path = sqlite_path(uri)
        if path is None:
            raise ConfigError(f"tracking.uri={uri!r} is an in-memory SQLite store: every run and point would be "
                              "lost at the end of the process; use sqlite:///<path>/mlflow.db")
        # Absolute, so that the delivery process, `tracking sync` from another folder and the next start all
        # open the same file.
        return sqlite_uri(path.expanduser().absolute())
    if base in ("http", "https"):
        try:
            parts.port
        except ValueError:
            raise ConfigError(f"tracking.uri={redact_uri(uri)!r}: the port is not a number from 0 to 65535; use "
                              f"{base}://host:5000") from None
        if not parts.hostname:
            raise ConfigError(f"tracking.uri={redact_uri(uri)!r} names no host; use {base}://host:5000")
    driver = scheme.split("+", 1)[1] if "+" in scheme else None
    modules = {"postgresql": {None: ("psycopg2", "psycopg"), "psycopg2": ("psycopg2",), "psycopg": ("psycopg",),
                              "pg8000": ("pg8000",)},
               "mysql": {None: ("MySQLdb",), "mysqldb": ("MySQLdb",), "pymysql": ("pymysql",),
                         "mysqlconnector": ("mysql.connector",)},
               "databricks": {None: ("databricks.sdk",)}}.get(base, {})
    wanted = modules.get(driver)
    if wanted and not any(_importable(m) for m in wanted):
        raise ConfigError(f"tracking.uri={redact_uri(uri)!r} needs the Python package {' or '.join(wanted)}, which "
                          "is not installed here (pip install it, e.g. psycopg2-binary for PostgreSQL, "
                          "mysqlclient for MySQL, databricks-sdk for Databricks)")
    return uri


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package
        return False


def is_sqlite(uri: str) -> bool:
    """Tell whether ``uri`` is a SQLite store (``sqlite:`` or ``sqlite+driver:``)."""
    return urlsplit(str(uri)).scheme.lower().split("+", 1)[0] == "sqlite"


def redact_uri(uri: str, keep_user: bool = False) -> str:
    """Return ``uri`` without its password (and without its user unless ``keep_user``)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = userinfo.split(":", 1)[0]
    netloc = f"{user}@{host}" if keep_user and user else host
    return urlunsplit(parts._replace(netloc=netloc))


def scrub(text: object, uri: str, limit: int = 300) -> str:
    """Return ``str(text)`` shortened, with the credentials of ``uri`` cut out.

    MLflow error messages repeat the URL they called, credentials included. A long message
    keeps its head and its tail: the cause ("Connection refused") comes last.
    """
    out = str(text)
    netloc = urlsplit(uri).netloc
    if "@" in netloc:
        userinfo = netloc.rsplit("@", 1)[0]
        out = out.replace(userinfo + "@", "")
        password = userinfo.split(":", 1)[1] if ":" in userinfo else ""
        if password:
            out = out.replace(password, "***")
    if len(out) <= limit:
        return out
    half = (limit - 5) // 2
    return f"{out[:half]} ... {out[-half:]}"
