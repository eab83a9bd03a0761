"""Helpers for tests that need real Prometheus parts (reusable by the DeepSpeed integration test).

- `synthetic_records(...)`: StepRecords shaped like a p-stage pipeline's, for in-process feeds.
- `prometheus_server(targets, rule_files=...)`: a real `prometheus` process in a temp dir,
  scraping loopback targets every second; yields a `Prom` with `query()` helpers.
- `scrape(url)`: one GET of a /metrics endpoint.

Only the standard library: the real binaries are the point.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from autotune.schema import StepRecord

REPO = Path(__file__).resolve().parent.parent


def require_binary(name: str) -> str:
    """Path of `name`, or skip the test naming the missing binary."""
    import pytest

    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} binary not found on PATH (Debian: apt-get install prometheus)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def synthetic_records(
    *, step: int, trial: int = 1, stages: int = 2, dp: int = 1, gas: int = 4, micro: int = 8,
    gpu: bool = True, seed: float = 0.0,
) -> list[StepRecord]:
    """One step's records for every rank: stage s+1 computes more, utilization oscillates.

    With gpu=True the memory fields are filled (as on CUDA); with gpu=False they are None.
    Values are chosen so that every advisor alert condition holds (fluctuation,
    comm/compute, fragmentation, bubble far above ideal), making alert expressions
    return data.
    """
    out = []
    for rank in range(stages * dp):
        stage = rank % stages
        compute = 0.10 * (1 + stage)
        comm, wait = 0.02, 0.15 + 0.05 * (stages - 1 - stage)
        step_s = compute + comm + wait + 0.01
        util = 0.5 + 0.35 * math.sin(step + rank + seed)
        sps = micro * gas * dp / step_s
        reserved = 4e9 + rank * 1e8
        out.append(StepRecord(
            time=time.time(), trial=trial, rank=rank, stage=stage, step=step, warmup=0,
            step_seconds=step_s, samples_per_second=sps, tokens_per_second=sps * 128,
            compute_seconds=compute, comm_seconds=comm, wait_seconds=wait, data_seconds=0.01,
            device_utilization=util,
            memory_allocated_bytes=reserved * 0.9 if gpu else None,
            memory_reserved_bytes=reserved if gpu else None,
            memory_fragmentation_ratio=0.1 if gpu else None,
            memory_inactive_split_bytes=reserved * 0.05 if gpu else None,
            memory_peak_bytes=reserved * 0.95 if gpu else 1e9,
            loss=2.0 / (1 + 0.1 * step) if stage == stages - 1 else None,
            micro_batch_size=micro, gradient_accumulation_steps=gas, reduce_bucket_size=500_000,
            pipeline_stages=stages, data_parallel_size=dp, seq_length=128,
            device=f"cuda:{rank}" if gpu else "cpu", host="testhost",
        ))
    return out


@dataclass
class Prom:
    """A running Prometheus: base URL plus thin HTTP API helpers."""

    url: str
    workdir: Path
    process: subprocess.Popen

    def api(self, path: str, **params: str) -> dict:
        q = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=10) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; the result vector (or matrix) as a list of {metric, value}."""
        return self.api("query", query=expr)["result"]

    def wait_until(self, predicate, timeout: float = 30.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    def targets_up(self) -> bool:
        active = self.api("targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)


@contextlib.contextmanager
def prometheus_server(
    targets: Sequence[str], *, rule_files: Sequence[Path] = (), scrape_interval: str = "1s",
    honor_labels: bool = True,
) -> Iterator[Prom]:
    """Start a real Prometheus scraping `targets` ("127.0.0.1:PORT"); stop it on exit.

    `rule_files` are copied into the temp dir and evaluated every second. Waits until
    the HTTP API answers (not until targets are scraped: use `wait_until`).
    """
    binary = require_binary("prometheus")
    work = Path(tempfile.mkdtemp(prefix="autotune-prom-"))
    rules = []
    for i, rf in enumerate(rule_files):
        dst = work / f"rules{i}.yml"
        shutil.copy(rf, dst)
        rules.append(str(dst))
    targets_json = json.dumps(list(targets))
    config = (
        f"global:\n  scrape_interval: {scrape_interval}\n  evaluation_interval: 1s\n"
        f"rule_files: {json.dumps(rules)}\n"
        "scrape_configs:\n  - job_name: autotune-test\n"
        f"    honor_labels: {str(honor_labels).lower()}\n"
        f"    static_configs:\n      - targets: {targets_json}\n"
    )
    (work / "prometheus.yml").write_text(config)
    port = free_port()
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT)
    prom = Prom(url=f"http://127.0.0.1:{port}", workdir=work, process=proc)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {(work / 'prometheus.log').read_text()}")
            try:
                urllib.request.urlopen(f"{prom.url}/-/ready", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A 127.0.0.1 port another socket is listening on, for as long as the block runs."""
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        yield blocker.getsockname()[1]
