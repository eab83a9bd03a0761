"""Every dashboard query and alert evaluated against a live Prometheus: the shared checks of
the live tests (the synthetic feed and the real training job)."""

from __future__ import annotations

import json
import re

import yaml
from prom_helpers import ALERTS, REPO, Prom

from exporters.prometheus_rank import LABEL_NAMES

DASH = REPO / "grafana" / "dashboards" / "autotune.json"
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
