"""Prometheus file-based service discovery: where every endpoint of a run actually serves.

A rank's endpoint may not serve on the port it asked for (the fallback in
exporters/endpoint.py), and the ranks of each trial come and go. So each rank
writes the endpoint it bound to a small JSON record beside its metrics CSV
(`endpoint-rankR.json`, `write_rank_endpoint`), and the controller keeps one
Prometheus `file_sd` targets file current from those records (`LiveTargets`):

    [{"targets": ["127.0.0.1:9710"], "labels": {"job": "autotune", "trial": "3", "rank": "0", "stage": "0"}},
     {"targets": ["127.0.0.1:9700"], "labels": {"job": "autotune"}}]

Prometheus re-reads the file when it changes (file_sd_configs); it is always
replaced whole (autotune.core.fileio.write_atomic), never seen half-written. Targets
carry their own host: records from ranks on other machines (issue 12) list
those machines, not this one.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from autotune.core.fileio import write_atomic

TARGETS_FILE = "prometheus_targets.json"
RANK_ENDPOINT = "endpoint-rank{rank}.json"
RANK_LABELS = ("job", "trial", "rank", "stage")
"""Labels a rank target carries in the targets file (the series carry more, see docs/metrics.md)."""
_WILDCARD = ("0.0.0.0", "::", "")
POLL_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """One endpoint: where to scrape it and the labels its target group carries."""

    host: str
    port: int
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def group(self) -> dict:
        return {"targets": [self.address], "labels": {k: str(v) for k, v in self.labels.items()}}


def target_host(addr: str, hostname: str | None = None) -> str:
    """The host a scraper should use for an endpoint bound to `addr`.

    A wildcard bind (0.0.0.0, ::) serves every interface: name the machine instead.
    """
    return (hostname or socket.gethostname()) if addr in _WILDCARD else addr


def targets_json(targets: Iterable[ScrapeTarget]) -> str:
    """The file_sd document: one target group per endpoint, in a stable order."""
    ordered = sorted(targets, key=lambda t: (t.labels.get("trial", ""), _num(t.labels.get("rank")),
                                             t.host, t.port))
    return json.dumps([t.group() for t in ordered], indent=2) + "\n"


def write_targets(path: Path, targets: Iterable[ScrapeTarget]) -> Path:
    """Replace the targets file at `path` with `targets` (atomically)."""
    return write_atomic(Path(path), targets_json(targets))


def read_targets(path: Path) -> list[ScrapeTarget]:
    """The targets a file_sd document lists (what a test or a second tool reads back)."""
    out = []
    for group in json.loads(Path(path).read_text(encoding="utf-8")):
        for address in group["targets"]:
            host, _, port = address.rpartition(":")
            out.append(ScrapeTarget(host=host.strip("[]"), port=int(port), labels=dict(group.get("labels", {}))))
    return out


def scrape_config(targets_files: Sequence[str | Path], *, job_name: str = "autotune") -> str:
    """A ready `scrape_configs` entry for prometheus.yml that reads the targets file(s)."""
    files = ", ".join(json.dumps(str(Path(p).resolve())) for p in targets_files)
    return ("scrape_configs:\n"
            f"  - job_name: {job_name}\n"
            "    honor_labels: true      # keep the exporters' own job label\n"
            "    file_sd_configs:\n"
            f"      - files: [{files}]\n"
            "        refresh_interval: 5s\n")


# --- the rank's side -------------------------------------------------------------------------

def write_rank_endpoint(path: str | Path, *, url: str, labels: Mapping[str, object]) -> Path:
    """Record the endpoint this rank serves (`url` as the exporter printed it), atomically.

    `labels`: the rank's job, trial, rank and stage (and host, the machine's name).
    """
    parts = urlsplit(url)
    addr = parts.hostname or ""
    record = {"addr": addr, "port": parts.port, "url": url, "pid": os.getpid(),
              "hostname": str(labels.get("host") or socket.gethostname()),
              "labels": {k: str(labels[k]) for k in RANK_LABELS if k in labels}}
    return write_atomic(Path(path), json.dumps(record) + "\n")


def read_rank_endpoints(folder: Path, *, since: float = 0.0) -> list[ScrapeTarget]:
    """The rank endpoints recorded in `folder` (records older than `since`, Unix time, ignored:
    an interrupted earlier attempt's)."""
    out = []
    for p in sorted(Path(folder).glob(RANK_ENDPOINT.replace("{rank}", "*"))):
        try:
            if p.stat().st_mtime < since:
                continue
            rec = json.loads(p.read_text(encoding="utf-8"))
            out.append(ScrapeTarget(host=target_host(rec["addr"], rec.get("hostname")), port=int(rec["port"]),
                                    labels=dict(rec.get("labels", {}))))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced, or not ours: the next poll reads it
    return out


# --- the controller's side -------------------------------------------------------------------

class LiveTargets:
    """Keeps the targets file current: fixed targets (the controller) plus the rank records
    of the folders being watched, polled from a daemon thread every POLL_SECONDS."""

    def __init__(self, path: Path, fixed: Sequence[ScrapeTarget] = ()) -> None:
        self.path = Path(path)
        self.fixed = list(fixed)
        self._folders: dict[Path, float] = {}
        self._extra: list[ScrapeTarget] = []
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()
        self._written: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh()

    def watch(self, folder: Path, *, since: float | None = None) -> None:
        """List the rank endpoints recorded in `folder` from now on (records older than `since`
        are stale)."""
        with self._lock:
            self._folders[Path(folder)] = time.time() - 1.0 if since is None else since
        self.refresh()
        self._ensure_thread()

    def unwatch(self, folder: Path) -> None:
        """The folder's ranks are gone: drop their targets."""
        with self._lock:
            self._folders.pop(Path(folder), None)
        self.refresh()

    def add(self, targets: Iterable[ScrapeTarget]) -> None:
        """Targets known by other means (issue 12: ranks on other hosts)."""
        with self._lock:
            self._extra.extend(targets)
        self.refresh()

    def current(self) -> list[ScrapeTarget]:
        with self._lock:
            folders = dict(self._folders)
            extra = list(self._extra)
        ranks = [t for folder, since in folders.items() for t in read_rank_endpoints(folder, since=since)]
        return [*self.fixed, *extra, *ranks]

    def refresh(self) -> None:
        """Rewrite the file when what it should list changed; a failed write is retried next poll.

        One refresh at a time, from reading to writing: the poller's refresh must not write
        what it read before an `unwatch` after the unwatch has written its own."""
        with self._refreshing:
            text = targets_json(self.current())
            if text == self._written:
                return
            try:
                write_atomic(self.path, text)
            except OSError:
                return
            self._written = text

    def close(self) -> None:
        """Stop polling and empty the file: nothing it listed serves any more."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self._folders.clear()
            self._extra.clear()
            self.fixed = []
        self.refresh()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, daemon=True, name="file_sd")
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self.refresh()


def _num(v: object) -> int:
    try:
        return int(str(v))
    except ValueError:
        return -1
