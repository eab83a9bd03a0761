"""A real Prometheus scrapes real exporters; every dashboard query and rule must return data.

Feed: in-process exporters fed with synthetic StepRecords for two jobs, one shaped like
a GPU run (memory fields present) and one like a CPU run (memory "not available").
On the CPU job the memory panels and the fragmentation alert must return *no* data
(absent, never a made-up 0); everything else must return data with the expected labels.
The lead's DeepSpeed integration test can reuse `prom_helpers.prometheus_server` and
`check_dashboard_and_rules` with a real training job as the feed.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator

import pytest
import yaml
from prom_helpers import REPO, Prom, prometheus_server, synthetic_records

from autotune.space import TrialConfig
from autotune.summary import summarize_trial
from exporters.prometheus_controller import ControllerExporter
from exporters.prometheus_rank import LABEL_NAMES, RankExporter

pytestmark = pytest.mark.prometheus

DASH = REPO / "grafana" / "dashboards" / "autotune.json"
ALERTS = REPO / "rules" / "prometheus" / "alerts.yml"
ABSENT_ON_CPU = ("autotune_memory_allocated_bytes", "autotune_memory_reserved_bytes",
                 "autotune_memory_fragmentation_ratio", "autotune_last_trial_memory_fragmentation_ratio")
"""Metrics a CPU run must not export at all ("not available")."""
AGG_RE = re.compile(r"^\s*(?:histogram_quantile\([\d.]+,\s*)?\w+ by \(([^)]*)\)")
SELECTOR_RE = re.compile(r"^\s*(\w+)\{")


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every dashboard target."""
    dash = json.loads(DASH.read_text())
    return [(p["title"], t["refId"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def substitute(expr: str, job: str) -> str:
    return (expr.replace("$job", job).replace("$trial", ".*").replace("$stage", ".*")
            .replace("$rank", ".*").replace("$__rate_interval", "10s"))


def expected_labels(expr: str) -> tuple[set[str], bool]:
    """(labels, exact): an aggregation's `by` labels exactly, or a selector's labels at least."""
    if m := AGG_RE.match(expr):
        return {x.strip() for x in m.group(1).split(",")} - {"le"}, True
    metric = SELECTOR_RE.match(expr).group(1)
    if metric.startswith(("autotune_trial_", "autotune_last_trial_", "autotune_current_")) \
            and metric != "autotune_current_trial":
        return {"job", "trial"}, False
    if metric in ("autotune_current_trial", "autotune_best_samples_per_second", "autotune_best_trial"):
        return {"job"}, False
    return set(LABEL_NAMES), False


def check_result(prom: Prom, what: str, expr: str, job: str, expect_data: bool,
                 labels: set[str] | None, exact: bool) -> None:
    result = prom.query(expr)
    if not expect_data:
        assert result == [], f"{what}: expected no data on the CPU job, got {result}"
        return
    assert result, f"{what}: no data for {expr}"
    for series in result:
        got = set(series["metric"]) - {"__name__", "instance"}
        if exact:
            assert got == labels, f"{what}: labels {got} != {labels}"
        else:
            assert labels <= got, f"{what}: labels {got} lack {labels - got}"
        if "job" in got:
            assert series["metric"]["job"] == job, what


def check_dashboard_and_rules(prom: Prom, job: str, *, cpu: bool) -> None:
    """Every panel query, template variable and rule of the repo against `prom` for `job`."""
    for title, ref, raw in dashboard_queries():
        expr = substitute(raw, job)
        absent = cpu and any(m in expr for m in ABSENT_ON_CPU)
        labels, exact = expected_labels(expr)
        check_result(prom, f"panel {title!r} {ref}", expr, job, not absent, labels, exact)

    dash = json.loads(DASH.read_text())
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.match(r"label_values\((.*),\s*(\w+)\)$", var["definition"])
        values = prom.api(f"label/{m.group(2)}/values", **{"match[]": substitute(m.group(1), job)})
        assert values, f"variable {var['name']} has no values"

    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        name = rule.get("record") or rule["alert"]
        expr = rule["expr"]
        absent = cpu and "fragmentation" in expr
        if "record" in rule:
            expr = f'{name}{{job="{job}"}}'
            labels = set(re.match(r"(\w+):", name).group(1).split("_"))
            check_result(prom, f"record {name}", expr, job, True, labels, True)
            continue
        per_rank = "job_trial:" not in expr
        scoped = f'({expr}) and on (job) (autotune_steps_total{{job="{job}"}})'
        labels = set(LABEL_NAMES) if per_rank else {"job", "trial"}
        check_result(prom, f"alert {name}", scoped, job, not absent, labels, not per_rank)

    active = prom.api("alerts")["alerts"]
    states = {(a["labels"]["alertname"], a["labels"].get("job")) for a in active}
    for rule in (r for g in groups for r in g["rules"] if "alert" in r):
        if cpu and "fragmentation" in rule["expr"]:
            assert (rule["alert"], job) not in states
        else:
            assert (rule["alert"], job) in states, f"{rule['alert']} not pending/firing for {job}"


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


@pytest.fixture(scope="module")
def live() -> Iterator[Prom]:
    feed = Feed()
    try:
        with prometheus_server(feed.targets, rule_files=[ALERTS]) as prom:
            wait_for_history(prom, seconds=6)
            yield prom
    finally:
        feed.close()


def test_gpu_like_job_every_query_and_rule_returns_data(live: Prom):
    check_dashboard_and_rules(live, "live-gpu", cpu=False)


def test_cpu_like_job_memory_is_absent_everything_else_present(live: Prom):
    check_dashboard_and_rules(live, "live-cpu", cpu=True)


def test_stage_imbalance_recording_rule_value(live: Prom):
    """Synthetic stage 1 computes 0.2 s, stage 0 0.1 s: max/mean = 0.2/0.15."""
    got = live.query('job_trial:autotune_stage_compute_imbalance:ratio{job="live-gpu"}')
    assert float(got[0]["value"][1]) == pytest.approx(0.2 / 0.15)
