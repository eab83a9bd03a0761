"""Helpers for tests that need real Prometheus parts.

The feed, the server and the record generator live in `grafana/live_demo.py`, which the
dashboard preview uses too; this module adds what only tests want: a skip (not an error)
when the binary is missing, one-GET scrapes and a port that is taken.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from grafana.live_demo import (
    ALERTS,
    REPO,
    Feed,
    Prom,
    free_port,
    synthetic_records,
    wait_for_history,
)
from grafana.live_demo import prometheus_server as _prometheus_server

__all__ = ["ALERTS", "REPO", "Feed", "Prom", "free_port", "prometheus_server", "require_binary", "scrape",
           "synthetic_records", "taken_port", "wait_for_history"]


def require_binary(name: str) -> str:
    """Path of `name`, or skip the test naming the missing binary."""
    import pytest

    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} binary not found on PATH (Debian: apt-get install prometheus)")
    return path


def prometheus_server(targets: Sequence[str], *, rule_files: Sequence[Path] = (), **kw):
    """`live_demo.prometheus_server`, skipping the test where prometheus is not installed."""
    require_binary("prometheus")
    return _prometheus_server(targets, rule_files=rule_files, **kw)


def scrape(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A 127.0.0.1 port another socket is listening on, for as long as the block runs."""
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        yield blocker.getsockname()[1]
