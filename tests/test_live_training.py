"""Live metrics from a real training job: `autotune run` (controller + 4 DeepSpeed ranks on CPU)
scraped by a real Prometheus that finds them through the run's targets file; every dashboard
query and rule evaluated against it, and the file checked against where the ranks bound."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from dashboard_checks import (
    ABSENT_ON_CPU,
    ALERTS,
    DASH,
    check_result,
    dashboard_queries,
    expected_labels,
    substitute,
)
from prom_helpers import free_port, prometheus_server, require_binary, taken_port

from exporters.file_sd import read_targets
from exporters.prometheus_rank import LABEL_NAMES

pytestmark = [pytest.mark.slow, pytest.mark.prometheus]
JOB = "autotune"


@dataclass
class LiveJob:
    prom: object
    proc: subprocess.Popen
    work: Path
    taken: int
    """The port given as --rank-metrics-port, held by another socket: rank 0 falls back."""
    listed: dict = field(default_factory=dict)
    """(trial, rank) -> the target the run's targets file listed while that trial ran."""

    @property
    def targets_file(self) -> Path:
        return self.work / "st" / "prometheus_targets.json"

    def read_listed(self) -> None:
        try:
            for t in read_targets(self.targets_file):
                self.listed[(t.labels.get("trial"), t.labels.get("rank", "controller"))] = t
        except (OSError, ValueError):
            pass  # not written yet, or replaced between the check and the read


@pytest.fixture(scope="module")
def live_job(tmp_path_factory):
    """`autotune run` as a user runs it live: Prometheus finds every endpoint through the run's own
    targets file (file_sd), and the rank base port is taken by another socket, so rank 0 binds
    its fallback and only the file can say where."""
    require_binary("prometheus")  # before the run: a missing binary skips without paying for it
    work = tmp_path_factory.mktemp("live")
    with taken_port() as taken:
        ctl = free_port()
        while taken <= ctl < taken + 8:
            ctl = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "autotune", "run", "--budget", "2", "--steps", "60", "--warmup-steps", "1",
             "--fixed-steps", "--study", str(work / "st"), "--metrics-port", str(ctl),
             "--rank-metrics-port", str(taken)],
            stdout=open(work / "run.log", "w"), stderr=subprocess.STDOUT)
        job = LiveJob(prom=None, proc=proc, work=work, taken=taken)
        try:
            with prometheus_server([], file_sd=[job.targets_file], rule_files=[ALERTS]) as prom:
                job.prom = prom

                def trial1_running() -> bool:
                    assert proc.poll() is None, (work / "run.log").read_text()[-3000:]
                    job.read_listed()
                    ranks = prom.query(f'autotune_steps_total{{job="{JOB}",trial="1"}}')
                    history = prom.query(f'autotune_trial_samples_per_second{{job="{JOB}"}}')
                    return len(ranks) == 4 and len(history) >= 1

                prom.wait_until(trial1_running, timeout=600, what="trial 1 running with 4 rank series")

                def trial1_history() -> bool:
                    job.read_listed()
                    got = prom.query(f'min(count_over_time(autotune_steps_total{{job="{JOB}",trial="1"}}[1m]))')
                    return bool(got) and float(got[0]["value"][1]) >= 4

                prom.wait_until(trial1_history, timeout=120, what="4 scrapes of every rank in trial 1")
                time.sleep(2)  # rule evaluations over that history
                yield job
        finally:
            proc.wait(timeout=600)


def test_every_panel_and_variable_returns_data_from_the_real_job(live_job):
    prom = live_job.prom
    for title, ref, raw in dashboard_queries():
        expr = substitute(raw, JOB)
        absent = any(m in expr for m in ABSENT_ON_CPU)  # CPU: memory series must not exist
        labels, exact = expected_labels(expr)
        check_result(prom, f"panel {title!r} {ref}", expr, JOB, not absent, labels, exact)
    dash = json.loads(DASH.read_text())
    for var in (v for v in dash["templating"]["list"] if v["type"] == "query"):
        m = re.match(r"label_values\((.*),\s*(\w+)\)$", var["definition"])
        assert prom.api(f"label/{m.group(2)}/values", **{"match[]": substitute(m.group(1), JOB)})


def test_every_rule_expression_evaluates_on_the_real_job(live_job):
    prom = live_job.prom
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        if "record" in rule:
            labels = set(re.match(r"(\w+):", rule["record"]).group(1).split("_"))
            check_result(prom, rule["record"], f'{rule["record"]}{{job="{JOB}"}}', JOB, True, labels, True)
            continue
        signal = rule["expr"].rsplit(" > ", 1)[0]  # the measured side, without the threshold
        absent = "fragmentation" in signal
        per_rank = "job_trial:" not in signal
        labels = set(LABEL_NAMES) if per_rank else {"job", "trial"}
        check_result(prom, rule["alert"], f"({signal}) and on (job) (autotune_steps_total{{job=\"{JOB}\"}})",
                     JOB, not absent, labels, not per_rank)


DECIDED = 0.02
"""A signal this close to its threshold may have crossed it between the rule's evaluation and the
query; such an alert is not compared."""


def test_alert_fires_where_the_real_signal_crosses_its_threshold(live_job):
    """Each alert is active exactly where its real signal is above its threshold, at the rule's
    own last evaluation: the signal is read at that evaluation's timestamp, from the same
    response that lists the rule's alerts (a reading taken later can differ by a step, and
    comm/compute moves that much between steps). Since comm/compute counts transfer only
    (issue 24) it may sit near its 0.25 on 4 CPU ranks, so an alert whose values lie within
    DECIDED of the threshold is left out; the bubble on 4 ranks sharing 2 cores is far above the
    ideal (oversubscription), so at least one alert is always compared."""
    prom = live_job.prom
    signals = {"AutotuneCommComputeHigh": (f'autotune_comm_compute_ratio{{job="{JOB}"}}', 0.25),
               "AutotuneBubbleAboveIdeal": (f'job_trial:autotune_bubble_measured_ratio:avg{{job="{JOB}"}} - on (job, '
                                            f'trial) job_trial:autotune_bubble_ideal_ratio:max{{job="{JOB}"}}', 0.1)}
    rules = {r["name"]: r for g in prom.api("rules", type="alert")["groups"] for r in g["rules"]}
    compared = []
    for alert, (expr, threshold) in signals.items():
        rule = rules[alert]
        seen = prom.api("query", query=expr, time=rule["lastEvaluation"])["result"]
        values = [float(s["value"][1]) for s in seen]
        if not values or any(abs(v - threshold) < DECIDED for v in values):
            continue
        compared.append(alert)
        assert bool(rule["alerts"]) == any(v > threshold for v in values), (alert, values, rule["alerts"])
    assert compared, "every alert's signal sat at its threshold"
    assert not rules["AutotuneMemoryFragmentationHigh"]["alerts"]  # not available on CPU


def test_prometheus_found_every_endpoint_through_the_targets_file(live_job):
    """Every rank's endpoint is listed with the port it really bound (rank 0: its fallback, base +
    local world size), with its trial and stage, and Prometheus scraped each through the file."""
    ranks = {r: t for (trial, r), t in live_job.listed.items() if trial == "1" and r != "controller"}
    assert set(ranks) == {"0", "1", "2", "3"}, live_job.listed
    assert ranks["0"].port == live_job.taken + 4  # base + k * local world size, k = 1
    assert {r: t.labels["stage"] for r, t in ranks.items()} == {"0": "0", "1": "0", "2": "1", "3": "1"}
    trial = live_job.work / "st" / "trial-001"
    for r, t in ranks.items():
        assert json.loads((trial / f"endpoint-rank{r}.json").read_text())["port"] == t.port
    # every listed endpoint answered Prometheus (over the run so far: trial 1's ranks may be gone)
    up = {s["metric"]["instance"]: s["value"][1] for s in live_job.prom.query(f'max_over_time(up{{job="{JOB}"}}[10m])')}
    for t in [*ranks.values(), live_job.listed[(None, "controller")]]:
        assert up.get(t.address) == "1", (t.address, up)
    assert live_job.prom.query(f'autotune_trials_total{{job="{JOB}"}}')  # the controller's own series


def test_run_finished_and_controller_counted_both_trials(live_job):
    proc, work = live_job.proc, live_job.work
    assert proc.wait(timeout=600) == 0
    summary = json.loads((work / "st" / "summary.json").read_text())
    assert summary["counted_trials"] == 2
    log = (work / "run.log").read_text()
    assert "controller metrics: http://127.0.0.1:" in log and "rank metrics: http://127.0.0.1:" in log
    assert read_targets(live_job.targets_file) == []  # the run ended: nothing listed serves any more
    assert "file_sd_configs" in log and str(live_job.targets_file) in log  # the printed config names the file
