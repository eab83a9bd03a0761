"""The Grafana dashboard JSON and provisioning files are well formed and self-consistent."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from prom_helpers import REPO

DASH = REPO / "grafana" / "dashboards" / "autotune.json"
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__all", "__interval_ms",
                    "__range_s", "__range_ms", "__from", "__to", "__dashboard", "__name"}
VAR_RE = re.compile(r"\$\{?(\w+)")


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(DASH.read_text())


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows
    return out


def test_current_schema_and_identity(dash):
    assert dash["schemaVersion"] >= 36
    assert dash["uid"] and dash["title"]


def test_panel_ids_unique_and_layout_sane(dash):
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels(dash):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]


def test_every_panel_has_targets_with_expressions(dash):
    for p in panels(dash):
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), p["title"]


def test_datasource_references_point_at_the_datasource_variable(dash):
    var_names = {v["name"] for v in dash["templating"]["list"]}
    ds_vars = {v["name"] for v in dash["templating"]["list"] if v["type"] == "datasource"}
    assert ds_vars == {"datasource"}
    refs = [p["datasource"] for p in panels(dash)] + [t["datasource"] for p in panels(dash)
                                                      for t in p["targets"]]
    refs += [v["datasource"] for v in dash["templating"]["list"] if v["type"] == "query"]
    for ref in refs:
        assert ref["type"] == "prometheus"
        assert ref["uid"].strip("${}") in var_names


def test_every_variable_used_is_defined(dash):
    defined = {v["name"] for v in dash["templating"]["list"]}
    text = json.dumps([p["targets"] for p in panels(dash)] + [
        v.get("definition", "") for v in dash["templating"]["list"]])
    used = set(VAR_RE.findall(text)) - GRAFANA_BUILTINS
    assert used, "expected panels to use template variables"
    assert used <= defined, used - defined
    assert {"job", "trial", "rank", "stage"} <= defined


def test_required_panels_exist(dash):
    exprs = " ".join(t["expr"] for p in panels(dash) for t in p["targets"])
    for metric in ("autotune_samples_per_second", "autotune_device_utilization_ratio",
                   "autotune_device_utilization_fluctuation_ratio", "autotune_comm_compute_ratio",
                   "autotune_memory_fragmentation_ratio", "autotune_memory_reserved_bytes",
                   "autotune_bubble_measured_ratio", "autotune_bubble_ideal_ratio",
                   "autotune_step_compute_seconds", "autotune_loss",
                   "autotune_trial_samples_per_second", "autotune_trial_best_samples_per_second",
                   "autotune_trial_config_info"):
        assert metric in exprs, metric


def test_provisioning_files():
    ds = yaml.safe_load((REPO / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["apiVersion"] == 1 and ds["datasources"][0]["type"] == "prometheus"
    prov = yaml.safe_load((REPO / "grafana/provisioning/dashboards/autotune.yml").read_text())
    assert prov["providers"][0]["type"] == "file" and prov["providers"][0]["options"]["path"]
    prom = yaml.safe_load((REPO / "grafana/prometheus.yml").read_text())
    jobs = {c["job_name"] for c in prom["scrape_configs"]}
    assert jobs == {"autotune-controller", "autotune-ranks"}
    assert all(c["honor_labels"] for c in prom["scrape_configs"])  # keep the exporter's job label
