"""Alert rules vs the advisor's rule data, and promtool on rules and real scrapes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from prom_helpers import REPO, require_binary, scrape, synthetic_records

from autotune.core.space import TrialConfig
from autotune.core.summary import summarize_trial
from exporters import alerts_gen
from exporters.prometheus_controller import ControllerExporter
from exporters.prometheus_rank import RankExporter

RULES = REPO / "rules" / "prometheus"
CONTRACT_TOML = """
[[rule]]
id = "utilization-fluctuation"
threshold = 0.15
[[rule]]
id = "comm-compute-high"
threshold = 0.25
[[rule]]
id = "fragmentation-high"
threshold = 0.05
[[rule]]
id = "bubble-above-ideal"
threshold = 0.10
"""


def test_committed_rules_match_builtin_toml():
    toml = REPO / "rules" / "builtin.toml"
    thresholds = alerts_gen.load_thresholds(toml)
    assert (RULES / "alerts.yml").read_text() == alerts_gen.render_rules(thresholds), \
        "alerts.yml is stale: run python -m exporters.alerts_gen"
    assert (RULES / "alerts_test.yml").read_text() == alerts_gen.render_tests(thresholds)


@pytest.mark.parametrize("layout", ["array", "table"])
def test_thresholds_read_from_either_toml_layout(tmp_path: Path, layout: str):
    text = CONTRACT_TOML if layout == "array" else "\n".join(
        f'[rules.{rid}]\nthreshold = {t}\nsummary = "x"' for rid, t in
        [("utilization-fluctuation", 0.2), ("comm-compute-high", 0.3),
         ("fragmentation-high", 0.07), ("bubble-above-ideal", 0.12)])
    (tmp_path / "b.toml").write_text(text)
    got = alerts_gen.load_thresholds(tmp_path / "b.toml")
    want = ({"utilization-fluctuation": 0.15, "comm-compute-high": 0.25, "fragmentation-high": 0.05,
             "bubble-above-ideal": 0.10} if layout == "array" else
            {"utilization-fluctuation": 0.2, "comm-compute-high": 0.3, "fragmentation-high": 0.07,
             "bubble-above-ideal": 0.12})
    assert got == want
    rules = alerts_gen.render_rules(got)
    for a in alerts_gen.ALERTS:
        assert f"> {alerts_gen._num(got[a.rule_id])}" in rules
        assert f'rule_id: "{a.rule_id}"' in rules


def test_missing_rule_is_a_clear_error(tmp_path: Path):
    (tmp_path / "b.toml").write_text('[[rule]]\nid = "comm-compute-high"\nthreshold = 0.25\n')
    with pytest.raises(ValueError, match="utilization-fluctuation"):
        alerts_gen.load_thresholds(tmp_path / "b.toml")


def test_check_mode_detects_stale_files(tmp_path: Path):
    (tmp_path / "b.toml").write_text(CONTRACT_TOML)
    args = ["--toml", str(tmp_path / "b.toml"), "--out", str(tmp_path / "a.yml"),
            "--tests-out", str(tmp_path / "t.yml")]
    assert alerts_gen.main([*args, "--check"]) == 1
    assert alerts_gen.main(args) == 0
    assert alerts_gen.main([*args, "--check"]) == 0


@pytest.mark.prometheus
def test_promtool_check_rules():
    promtool = require_binary("promtool")
    out = subprocess.run([promtool, "check", "rules", str(RULES / "alerts.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 9 rules found" in out.stdout


@pytest.mark.prometheus
def test_promtool_unit_tests_cover_every_alert():
    promtool = require_binary("promtool")
    tests_text = (RULES / "alerts_test.yml").read_text()
    for a in alerts_gen.ALERTS:
        assert f"alertname: {a.alert}" in tests_text
    out = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=RULES,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.prometheus
def test_promtool_test_rules_fails_on_a_wrong_threshold(tmp_path: Path):
    """The unit tests have teeth: a drifted threshold makes promtool fail."""
    promtool = require_binary("promtool")
    wrong = {a.rule_id: 0.15 for a in alerts_gen.ALERTS}
    wrong["utilization-fluctuation"] = 0.9
    (tmp_path / "alerts.yml").write_text(alerts_gen.render_rules(wrong))
    (tmp_path / "alerts_test.yml").write_text((RULES / "alerts_test.yml").read_text())
    out = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "AutotuneUtilizationFluctuationHigh" in out.stdout + out.stderr


def _check_metrics(text: str) -> subprocess.CompletedProcess:
    promtool = require_binary("promtool")
    return subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)


@pytest.mark.prometheus
@pytest.mark.parametrize("gpu", [True, False], ids=["gpu-record", "cpu-record"])
def test_promtool_check_metrics_on_rank_scrape(gpu: bool):
    exp = RankExporter(labels={"job": "j"})
    url = exp.serve(port=0)
    try:
        for step in range(3):
            exp.write(synthetic_records(step=step, gpu=gpu)[1])
        text = scrape(url)
    finally:
        exp.close()
    assert "autotune_step_seconds_bucket" in text
    out = _check_metrics(text)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.prometheus
def test_promtool_check_metrics_on_controller_scrape():
    ctl = ControllerExporter(job="j")
    url = ctl.serve(port=0)
    try:
        recs = [r for s in range(3) for r in synthetic_records(step=s, trial=0)]
        cfg = TrialConfig(micro_batch_size=8, gradient_accumulation_steps=4, reduce_bucket_size=10**5)
        ctl.trial_started(0, cfg)
        ctl.trial_finished(0, cfg, "ok", 12.5, summary=summarize_trial(recs), rules_fired=["comm-compute-high"])
        text = scrape(url)
    finally:
        ctl.close()
    assert "autotune_trial_config_info" in text
    out = _check_metrics(text)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_rule_that_changes_meaning_is_refused(tmp_path: Path):
    text = CONTRACT_TOML.replace('id = "comm-compute-high"\nthreshold = 0.25',
                                 'id = "comm-compute-high"\nsignal = "transfer_compute_ratio"\nthreshold = 0.25')
    (tmp_path / "b.toml").write_text(text)
    with pytest.raises(ValueError, match="mirrors comm_compute_ratio"):
        alerts_gen.load_thresholds(tmp_path / "b.toml")
