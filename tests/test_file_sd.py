"""The Prometheus file_sd targets file: rank records in, a valid targets document out (exporters/file_sd.py),
and the watch's findings metric (exporters/prometheus_watch.py)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from prom_helpers import require_binary
from prometheus_client import CollectorRegistry, generate_latest

from exporters.file_sd import (
    LiveTargets,
    ScrapeTarget,
    read_rank_endpoints,
    read_targets,
    scrape_config,
    target_host,
    write_rank_endpoint,
    write_targets,
)
from exporters.prometheus_watch import WatchExporter

LABELS = {"job": "j", "trial": "3", "rank": "1", "stage": "1", "device": "cpu", "host": "node7"}


def test_targets_carry_their_own_host_and_labels(tmp_path):
    path = write_targets(tmp_path / "t.json", [
        ScrapeTarget(host="10.0.0.5", port=9711, labels={"job": "j", "trial": "3", "rank": "1", "stage": "1"}),
        ScrapeTarget(host="::1", port=9700, labels={"job": "j"}),
    ])
    doc = json.loads(path.read_text())
    assert {"targets": ["10.0.0.5:9711"], "labels": {"job": "j", "trial": "3", "rank": "1", "stage": "1"}} in doc
    assert {"targets": ["[::1]:9700"], "labels": {"job": "j"}} in doc
    assert sorted(t.port for t in read_targets(path)) == [9700, 9711]
    assert not list(tmp_path.glob(".t.json.*"))  # the atomic writer's temporary file is gone


def test_a_wildcard_bind_is_listed_under_the_machines_name():
    assert target_host("0.0.0.0", "node7") == "node7"
    assert target_host("127.0.0.1", "node7") == "127.0.0.1"


def test_rank_records_become_targets_with_the_port_bound_and_stale_ones_are_ignored(tmp_path):
    old = write_rank_endpoint(tmp_path / "endpoint-rank0.json", url="http://127.0.0.1:9710/metrics", labels=LABELS)
    os.utime(old, (time.time() - 60, time.time() - 60))  # an interrupted earlier attempt's
    write_rank_endpoint(tmp_path / "endpoint-rank1.json", url="http://0.0.0.0:9713/metrics", labels=LABELS)
    got = read_rank_endpoints(tmp_path, since=time.time() - 5)
    assert got == [ScrapeTarget(host="node7", port=9713, labels={"job": "j", "trial": "3", "rank": "1", "stage": "1"})]
    (tmp_path / "endpoint-rank2.json").write_text("{half")  # being written by someone: skipped, no error
    assert len(read_rank_endpoints(tmp_path)) == 2


def test_live_targets_follow_the_watched_folders_and_end_empty(tmp_path):
    ctl = ScrapeTarget(host="127.0.0.1", port=9700, labels={"job": "j"})
    live = LiveTargets(tmp_path / "prometheus_targets.json", [ctl])
    try:
        assert read_targets(live.path) == [ctl]
        trial = tmp_path / "trial-003"
        trial.mkdir()
        live.watch(trial)
        write_rank_endpoint(trial / "endpoint-rank1.json", url="http://127.0.0.1:9715/metrics", labels=LABELS)
        deadline = time.monotonic() + 10
        while len(read_targets(live.path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {t.port for t in read_targets(live.path)} == {9700, 9715}  # found by the poller, no call
        live.unwatch(trial)
        assert read_targets(live.path) == [ctl]
    finally:
        live.close()
    assert read_targets(live.path) == []


@pytest.mark.prometheus
def test_the_printed_scrape_config_is_a_valid_prometheus_config(tmp_path):
    promtool = require_binary("promtool")
    targets = write_targets(tmp_path / "prometheus_targets.json", [ScrapeTarget(host="127.0.0.1", port=9700)])
    (tmp_path / "prometheus.yml").write_text(scrape_config([targets]))
    proc = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "does not exist" not in proc.stdout + proc.stderr  # the absolute path it names is the file


@pytest.mark.prometheus
def test_watch_findings_metric_passes_promtool_and_follows_the_findings():
    promtool = require_binary("promtool")
    reg = CollectorRegistry()
    ctl = WatchExporter(job="j", registry=reg)
    ctl.set_findings([("bubble-above-ideal", "warning"), ("comm-compute-high", "warning")])
    ctl.set_findings([("bubble-above-ideal", "warning")])
    text = generate_latest(reg).decode()
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert reg.get_sample_value("autotune_watch_finding",
                                {"job": "j", "rule": "bubble-above-ideal", "severity": "warning"}) == 1
    assert reg.get_sample_value("autotune_watch_finding",
                                {"job": "j", "rule": "comm-compute-high", "severity": "warning"}) is None
    assert reg.get_sample_value("autotune_watch_evaluations_total", {"job": "j"}) == 2


def test_under_deepspeeds_launcher_a_taken_port_falls_back_by_the_local_world_size(monkeypatch):
    """DeepSpeed's launcher sets LOCAL_SIZE, not torchrun's LOCAL_WORLD_SIZE: rank 0's fallback must
    still skip rank 1's port (found by the run's targets file listing rank 1 on rank 0's fallback)."""
    import warnings

    from prom_helpers import taken_port

    from exporters.endpoint import MetricsEndpointWarning
    from exporters.prometheus_rank import RankExporter

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "2")
    with taken_port() as taken:
        exp = RankExporter(labels={"job": "t"})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MetricsEndpointWarning)
            exp.serve(port=taken)
        try:
            assert exp.endpoint is not None and exp.endpoint.port == taken + 2
        finally:
            exp.close()
