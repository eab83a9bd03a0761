"""A live demo feed: in-process exporters fed pipeline-shaped records, scraped by a real Prometheus.

`render_preview.py --demo` draws the dashboard from it, and the live tests evaluate every
dashboard query and alert against it. Standard library plus autotune's own exporters;
the real `prometheus` binary is the point (Debian: apt-get install prometheus).

- `synthetic_records(...)`: StepRecords shaped like a p-stage pipeline's.
- `Feed()`: rank exporters (2 stages x 2 dp) and a controller for a GPU-like and a CPU-like job.
- `prometheus_server(targets, rule_files=...)`: a real Prometheus in a temp dir scraping them.
- `wait_for_history(prom, seconds)`: until every series has history worth drawing.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from autotune.core.schema import StepRecord
from autotune.core.space import TrialConfig
from autotune.core.summary import summarize_trial
from exporters.prometheus_controller import ControllerExporter
from exporters.prometheus_rank import RankExporter

REPO = Path(__file__).resolve().parent.parent
ALERTS = REPO / "rules" / "prometheus" / "alerts.yml"


def find_binary(name: str) -> str:
    """Path of `name`; FileNotFoundError naming the Debian package when it is missing."""
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"{name} binary not found on PATH (Debian: apt-get install prometheus)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        comm, wait = 0.04, 0.15 + 0.05 * (stages - 1 - stage)  # transfer only: 0.4 of stage 0's compute
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
    honor_labels: bool = True, file_sd: Sequence[Path] = (),
) -> Iterator[Prom]:
    """Start a real Prometheus scraping `targets` ("127.0.0.1:PORT"); stop it on exit.

    `file_sd`: targets files (autotune's prometheus_targets.json) read instead of `targets`.

    `rule_files` are copied into the temp dir and evaluated every second. Waits until
    the HTTP API answers (not until targets are scraped: use `wait_until`).
    """
    binary = find_binary("prometheus")
    work = Path(tempfile.mkdtemp(prefix="autotune-prom-"))
    rules = []
    for i, rf in enumerate(rule_files):
        dst = work / f"rules{i}.yml"
        shutil.copy(rf, dst)
        rules.append(str(dst))
    targets_json = json.dumps(list(targets))
    discovery = (f"    file_sd_configs:\n      - files: {json.dumps([str(p) for p in file_sd])}\n"
                 "        refresh_interval: 1s\n" if file_sd else
                 f"    static_configs:\n      - targets: {targets_json}\n")
    config = (
        f"global:\n  scrape_interval: {scrape_interval}\n  evaluation_interval: 1s\n"
        f"rule_files: {json.dumps(rules)}\n"
        "scrape_configs:\n  - job_name: autotune-test\n"
        f"    honor_labels: {str(honor_labels).lower()}\n" + discovery
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


class Feed:
    """Rank exporters (2 stages x 2 dp) and a controller per job, fed from a thread."""

    def __init__(self) -> None:
        self.ranks: dict[str, list[RankExporter]] = {}
        self.controllers: list[ControllerExporter] = []
        self.stop = threading.Event()
        self.targets: list[str] = []
        for job in ("live-gpu", "live-cpu"):
            self.ranks[job] = [RankExporter(labels={"job": job}) for _ in range(4)]
            ctl = ControllerExporter(job=job)
            self.controllers.append(ctl)
            for e in [*self.ranks[job], ctl]:
                e.serve(port=0)
                self.targets.append(f"127.0.0.1:{e.endpoint.port}")
            self._history(ctl, gpu=job == "live-gpu")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @staticmethod
    def _history(ctl: ControllerExporter, gpu: bool) -> None:
        for t, (micro, sps) in enumerate([(2, 10.0), (4, 18.0), (8, 15.0)]):
            cfg = TrialConfig(micro_batch_size=micro, gradient_accumulation_steps=4,
                              reduce_bucket_size=10**6)
            ctl.trial_started(t, cfg)
            recs = [r for s in range(4) for r in synthetic_records(step=s, trial=t, dp=2, gpu=gpu)]
            ctl.trial_finished(t, cfg, "ok", sps, summary=summarize_trial(recs),
                               rules_fired=["bubble-above-ideal"])
        ctl.trial_started(3, TrialConfig(micro_batch_size=8, gradient_accumulation_steps=8,
                                         reduce_bucket_size=10**6))

    def _run(self) -> None:
        step = 0
        while not self.stop.is_set():
            for job, exps in self.ranks.items():
                for exp, rec in zip(exps, synthetic_records(step=step, trial=3, dp=2, gpu=job == "live-gpu"),
                                    strict=True):
                    exp.write(rec)
            step += 1
            self.stop.wait(0.2)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for e in [*(x for v in self.ranks.values() for x in v), *self.controllers]:
            e.close()


def wait_for_history(prom: Prom, seconds: float) -> None:
    """Every target scraped and every rank series present, then `seconds` more of history
    (rate() windows, a few rule evaluations): a slow start-up never shortens the history."""
    prom.wait_until(prom.targets_up, what="all targets up")
    prom.wait_until(lambda: len(prom.query("autotune_steps_total")) == 8, what="8 rank series")
    time.sleep(seconds)
    prom.wait_until(lambda: (got := prom.query("min(count_over_time(autotune_steps_total[1m]))"))
                    and float(got[0]["value"][1]) >= 3, what="3 scrapes of every rank")
