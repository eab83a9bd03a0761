"""RankExporter: values read back from a fresh registry, scrape over HTTP, port conflicts."""

from __future__ import annotations

import dataclasses
import threading
import warnings

import pytest
from prom_helpers import scrape, synthetic_records, taken_port
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from autotune.core.summary import fluctuation, ideal_bubble_fraction
from exporters.endpoint import MetricsEndpointWarning
from exporters.prometheus_rank import RankExporter

LABELS = {"job": "t", "trial": "1", "rank": "0", "stage": "0", "device": "cpu", "host": "testhost"}


def cpu_record(step: int = 0, **over):
    r = synthetic_records(step=step, stages=2, gpu=False)[0]
    return dataclasses.replace(r, **over)


def value(reg: CollectorRegistry, name: str, **labels) -> float | None:
    return reg.get_sample_value(name, {**LABELS, **labels})


def test_no_metrics_before_first_step():
    reg = CollectorRegistry()
    RankExporter(labels={"job": "t"}, registry=reg)
    assert list(reg.collect()) == []


def test_gauges_follow_the_signal_definitions():
    reg = CollectorRegistry()
    exp = RankExporter(labels={"job": "t"}, registry=reg)
    r = cpu_record(loss=1.25, stage=1, rank=0)
    exp.write(r)
    lab = {"stage": "1"}
    assert value(reg, "autotune_device_utilization_ratio", **lab) == pytest.approx(r.device_utilization)
    assert value(reg, "autotune_comm_compute_ratio", **lab) == pytest.approx(r.comm_seconds / r.compute_seconds)
    assert value(reg, "autotune_peer_wait_ratio", **lab) == pytest.approx(r.wait_seconds / r.step_seconds)
    assert value(reg, "autotune_bubble_measured_ratio", **lab) == pytest.approx(1 - r.compute_seconds / r.step_seconds)
    assert value(reg, "autotune_bubble_ideal_ratio", **lab) == pytest.approx(ideal_bubble_fraction(2, 4))
    assert value(reg, "autotune_step_compute_seconds", **lab) == pytest.approx(r.compute_seconds)
    assert value(reg, "autotune_step_wait_seconds", **lab) == pytest.approx(r.wait_seconds)
    assert value(reg, "autotune_samples_per_second", **lab) == pytest.approx(r.samples_per_second)
    assert value(reg, "autotune_tokens_per_second", **lab) == pytest.approx(r.tokens_per_second)
    assert value(reg, "autotune_loss", **lab) == 1.25
    assert value(reg, "autotune_steps_total", **lab) == 1


def test_not_available_on_cpu_means_absent_not_zero():
    reg = CollectorRegistry()
    exp = RankExporter(labels={"job": "t"}, registry=reg)
    exp.write(cpu_record())
    for name in ("autotune_memory_fragmentation_ratio", "autotune_memory_allocated_bytes",
                 "autotune_memory_reserved_bytes", "autotune_loss"):
        assert value(reg, name) is None, name
    # One step is not enough for a spread: fluctuation is absent too.
    assert value(reg, "autotune_device_utilization_fluctuation_ratio") is None


def test_gpu_memory_fields_are_exported():
    reg = CollectorRegistry()
    exp = RankExporter(labels={"job": "t"}, registry=reg)
    r = synthetic_records(step=0, gpu=True)[0]
    exp.write(r)
    lab = {"device": "cuda:0"}
    assert value(reg, "autotune_memory_fragmentation_ratio", **lab) == pytest.approx(0.1)
    assert value(reg, "autotune_memory_reserved_bytes", **lab) == r.memory_reserved_bytes
    assert value(reg, "autotune_memory_allocated_bytes", **lab) == r.memory_allocated_bytes


def test_fluctuation_over_sliding_window_excludes_warmup():
    reg = CollectorRegistry()
    exp = RankExporter(labels={"job": "t"}, registry=reg, window=3)
    exp.write(cpu_record(step=0, warmup=1, device_utilization=0.0))
    utils = [0.9, 0.1, 0.5, 0.7]
    for i, u in enumerate(utils, start=1):
        exp.write(cpu_record(step=i, device_utilization=u))
    assert value(reg, "autotune_device_utilization_fluctuation_ratio") == pytest.approx(
        fluctuation(utils[-3:]))
    assert value(reg, "autotune_steps_total") == 5  # warm-up counted as a step


def test_step_histogram_buckets_and_sum():
    reg = CollectorRegistry()
    exp = RankExporter(labels={"job": "t"}, registry=reg, buckets=(0.1, 1.0))
    exp.write(cpu_record(step=0, warmup=1, step_seconds=50.0))  # not in the histogram
    for i, secs in enumerate((0.05, 0.5, 0.7, 3.0), start=1):
        exp.write(cpu_record(step=i, step_seconds=secs))
    assert value(reg, "autotune_step_seconds_bucket", le="0.1") == 1
    assert value(reg, "autotune_step_seconds_bucket", le="1.0") == 3
    assert value(reg, "autotune_step_seconds_bucket", le="+Inf") == 4
    assert value(reg, "autotune_step_seconds_count") == 4
    assert value(reg, "autotune_step_seconds_sum") == pytest.approx(4.25)


def test_new_trial_starts_fresh_series():
    reg = CollectorRegistry()
    exp = RankExporter(labels={"job": "t"}, registry=reg)
    for i in range(3):
        exp.write(cpu_record(step=i))
    exp.write(cpu_record(step=0, trial=2))
    assert value(reg, "autotune_steps_total", trial="2") == 1
    assert value(reg, "autotune_steps_total", trial="1") is None


def test_record_labels_win_and_unknown_labels_are_refused():
    reg = CollectorRegistry()
    exp = RankExporter(labels={"job": "t", "host": "fallback"}, registry=reg)
    exp.write(cpu_record(host=""))
    assert value(reg, "autotune_steps_total", host="fallback") == 1
    with pytest.raises(ValueError, match="unknown labels"):
        RankExporter(labels={"job": "t", "colour": "red"}, registry=CollectorRegistry())


def test_concurrent_writes_and_scrapes_stay_consistent():
    reg = CollectorRegistry()
    exp = RankExporter(labels={"job": "t"}, registry=reg)
    errors: list[BaseException] = []

    def writer():
        for i in range(2000):
            exp.write(cpu_record(step=i))

    def reader():
        try:
            for _ in range(200):
                fams = {f.name: f for f in reg.collect()}
                if "autotune_step_seconds" in fams:
                    s = {x.name + x.labels.get("le", ""): x.value for x in fams["autotune_step_seconds"].samples}
                    assert s["autotune_step_seconds_bucket+Inf"] == s["autotune_step_seconds_count"]
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert value(reg, "autotune_steps_total") == 2000


def test_serve_prints_url_and_serves_parseable_text(capsys):
    exp = RankExporter(labels={"job": "t"})
    url = exp.serve(port=0)
    try:
        assert url is not None and url.startswith("http://127.0.0.1:")
        assert f"metrics: {url}" in capsys.readouterr().out
        exp.write(cpu_record())
        names = {f.name for f in text_string_to_metric_families(scrape(url))}
        assert {"autotune_device_utilization_ratio", "autotune_steps", "autotune_step_seconds"} <= names
    finally:
        exp.close()


def test_port_in_use_falls_back_with_a_warning(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with taken_port() as taken:
        exp = RankExporter(labels={"job": "t"})
        with pytest.warns(MetricsEndpointWarning, match=f"port {taken} .* in use"):
            url = exp.serve(port=taken)
        try:
            # Fallback steps by the local world size so it never takes the next rank's port.
            assert url is not None and exp.endpoint.port == taken + 2
        finally:
            exp.close()


def test_no_free_port_disables_endpoint_without_raising():
    with taken_port() as taken:
        exp = RankExporter(labels={"job": "t"})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # even -W error must not crash training
            assert exp.serve(port=taken, tries=1) is None
        assert exp.endpoint is None
        exp.write(cpu_record())  # the sink keeps working


def test_non_loopback_bind_warns():
    exp = RankExporter(labels={"job": "t"})
    with pytest.warns(MetricsEndpointWarning, match="anyone who can reach"):
        url = exp.serve(addr="0.0.0.0", port=0)
    exp.close()
    assert url is not None


def test_start_rank_exporter_serves_or_returns_none():
    from exporters.prometheus_rank import start_rank_exporter

    exp = start_rank_exporter(port=0, labels={"job": "t", "rank": "3"})
    try:
        assert exp is not None and exp.endpoint is not None
    finally:
        exp.close()
    with taken_port() as taken:
        with pytest.warns(MetricsEndpointWarning, match="in use"):
            exp = start_rank_exporter(port=taken, labels={"job": "t"})
        try:  # a taken port falls back instead of failing the rank
            assert exp is not None and exp.endpoint.port != taken
        finally:
            exp.close()
