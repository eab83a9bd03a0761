"""ControllerExporter: trial-level metrics read back from a fresh registry."""

from __future__ import annotations

import pytest
from prom_helpers import scrape, synthetic_records
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from autotune.core.space import TrialConfig
from autotune.core.summary import summarize_trial
from exporters.prometheus_controller import ControllerExporter


def v(reg: CollectorRegistry, name: str, **labels) -> float | None:
    return reg.get_sample_value(name, {"job": "j", **labels})


def summary():
    recs = [r for s in range(4) for r in synthetic_records(step=s, trial=0)]
    return summarize_trial(recs)


def test_current_trial_and_config():
    reg = CollectorRegistry()
    ctl = ControllerExporter(job="j", registry=reg)
    ctl.trial_started(0, TrialConfig(micro_batch_size=4, gradient_accumulation_steps=8))
    ctl.trial_started(1, TrialConfig(micro_batch_size=8, gradient_accumulation_steps=4,
                                     reduce_bucket_size=100_000))
    assert v(reg, "autotune_current_trial") == 1
    assert v(reg, "autotune_current_micro_batch_size", trial="1") == 8
    assert v(reg, "autotune_current_gradient_accumulation_steps", trial="1") == 4
    assert v(reg, "autotune_current_reduce_bucket_size", trial="1") == 100_000
    assert v(reg, "autotune_trials_total") == 2


def test_bucket_absent_when_not_searched():
    reg = CollectorRegistry()
    ctl = ControllerExporter(job="j", registry=reg)
    ctl.trial_started(0, TrialConfig(micro_batch_size=4, gradient_accumulation_steps=8))
    assert v(reg, "autotune_current_reduce_bucket_size", trial="0") is None


def test_finished_trials_status_best_history_and_rules():
    reg = CollectorRegistry()
    ctl = ControllerExporter(job="j", registry=reg)
    cfg = [TrialConfig(micro_batch_size=m, gradient_accumulation_steps=4) for m in (1, 2, 4, 8)]
    results = [("ok", 10.0, ["bubble-above-ideal"]), ("ok", 25.0, []),
               ("failed", 0.0, []), ("ok", 20.0, ["bubble-above-ideal", "comm-compute-high"])]
    for t, (status, sps, rules) in enumerate(results):
        ctl.trial_started(t, cfg[t])
        ctl.trial_finished(t, cfg[t], status, sps, summary=None, rules_fired=rules)
    assert v(reg, "autotune_trials_finished_total", status="ok") == 3
    assert v(reg, "autotune_trials_finished_total", status="failed") == 1
    assert v(reg, "autotune_best_samples_per_second") == 25.0
    assert v(reg, "autotune_best_trial") == 1
    assert [v(reg, "autotune_trial_samples_per_second", trial=str(t)) for t in range(4)] == [10, 25, 0, 20]
    assert [v(reg, "autotune_trial_best_samples_per_second", trial=str(t)) for t in range(4)] == [10, 25, 25, 25]
    assert v(reg, "autotune_rules_fired_total", rule="bubble-above-ideal") == 2
    assert v(reg, "autotune_rules_fired_total", rule="comm-compute-high") == 1
    assert v(reg, "autotune_trial_config_info", trial="2", status="failed", micro_batch_size="4",
             gradient_accumulation_steps="4", reduce_bucket_size="") == 1


def test_failed_trial_never_becomes_best():
    reg = CollectorRegistry()
    ctl = ControllerExporter(job="j", registry=reg)
    c = TrialConfig(micro_batch_size=1, gradient_accumulation_steps=1)
    ctl.trial_finished(0, c, "failed", 99.0)
    assert v(reg, "autotune_best_samples_per_second") is None


def test_last_trial_signals_come_from_the_summary():
    reg = CollectorRegistry()
    ctl = ControllerExporter(job="j", registry=reg)
    s = summary()
    ctl.trial_finished(0, TrialConfig(micro_batch_size=8, gradient_accumulation_steps=4), "ok",
                       s.samples_per_second, summary=s)
    assert v(reg, "autotune_last_trial_comm_compute_ratio", trial="0") == pytest.approx(s.comm_compute_ratio)
    assert v(reg, "autotune_last_trial_bubble_ideal_ratio", trial="0") == pytest.approx(s.bubble_fraction_ideal)
    assert v(reg, "autotune_last_trial_stage_compute_imbalance", trial="0") == pytest.approx(
        s.stage_compute_imbalance)
    assert v(reg, "autotune_last_trial_memory_fragmentation_ratio", trial="0") == pytest.approx(0.1)


def test_serve_over_http(capsys):
    ctl = ControllerExporter(job="j")
    url = ctl.serve(port=0)
    try:
        assert url and f"controller metrics: {url}" in capsys.readouterr().out
        ctl.trial_started(0, TrialConfig(micro_batch_size=2, gradient_accumulation_steps=2))
        names = {f.name for f in text_string_to_metric_families(scrape(url))}
        assert {"autotune_current_trial", "autotune_trials"} <= names
    finally:
        ctl.close()
