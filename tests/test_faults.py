"""Trial faults, injected on purpose: each ends as a failed trial with a classified reason,
the run goes on to its budget, and no process is left behind."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from builders import run_trial
from robust_helpers import FAST, alive_under, rows, start_cli, write_config

from autotune.core.dsconfig import DsConfig
from autotune.core.options import WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.trials.builtin import builtin_runner
from autotune.trials.launcher import group_alive
from autotune.trials.precision import probe_devices

pytestmark = pytest.mark.slow

# The loss-scale collapse needs fp16 (only fp16 has a dynamic loss scale), and whether
# DeepSpeed's CPU accelerator runs fp16 depends on the CPU model. Where it cannot, the
# run goes without fp16 and without that one fault; every other fault is still checked.
CPU = probe_devices("cpu")
HAS_FP16 = CPU.supported["fp16"]
NO_FP16_REASON = f"{CPU.device} has no fp16 ({CPU.why_not.get('fp16')}): the loss scale cannot collapse here"
FAULTS = {1: ("oom", "oom"), 2: ("kill", "killed"), 3: ("nan", "nonfinite_loss"),
          4: ("nometrics", "no_metrics"), 5: ("nolauncher", "launcher_missing")}
OVERFLOW = {6: ("overflow", "loss_scale_collapse")}
if HAS_FP16:
    FAULTS.update(OVERFLOW)


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    # fp16 with the loss scale starting at its minimum: a healthy trial never overflows,
    # the `overflow` fault makes every gradient overflow, so the scale collapses for real.
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 0, "min_loss_scale": 1,
                     "hysteresis": 1, "loss_scale_window": 1000}} if HAS_FP16 else {}
    cfg = write_config(root, **fp16)
    assert alive_under(root) == []
    spec = ",".join(f"{kind}@{n}" for n, (kind, _) in FAULTS.items())
    proc = start_cli("run", "--budget", str(len(FAULTS) + 1), "--study", "st", "--config", str(cfg), "--fault", spec, *FAST,
                     cwd=root)
    out, _ = proc.communicate(timeout=900)
    return root / "st", proc.returncode, out, alive_under(root)


def test_run_reaches_its_budget_with_every_fault_classified(fault_run):
    study, rc, out, _ = fault_run
    assert rc == 0, out[-4000:]
    got = {n: (status, reason) for n, status, reason, _ in rows(study)}
    assert got[0] == ("ok", None)
    for n, (_, reason) in FAULTS.items():
        assert got[n] == ("failed", reason), (n, got[n], out[-3000:])
    assert len(got) == len(FAULTS) + 1


@pytest.mark.skipif(not HAS_FP16, reason=NO_FP16_REASON)
def test_fp16_overflow_fault_is_part_of_the_run(fault_run):
    study, _, out, _ = fault_run
    got = {n: (status, reason) for n, status, reason, _ in rows(study)}
    assert got[6] == ("failed", "loss_scale_collapse"), out[-3000:]


def test_no_process_left_behind(fault_run):
    study, _, _, left = fault_run
    assert left == []
    for _, _, _, pgid in rows(study):
        assert pgid is None or not group_alive(pgid)


def test_reasons_reach_display_summary_report_and_logs_are_kept(fault_run):
    study, _, out, _ = fault_run
    summary = json.loads((study / "summary.json").read_text())
    by_trial = {t["trial"]: t for t in summary["trials"]}
    report = (study / "report.md").read_text()
    for n, (_, reason) in FAULTS.items():
        assert by_trial[n]["status"] == "failed" and by_trial[n]["failure_reason"] == reason
        assert by_trial[n]["failure_detail"]
        assert f"failed ({reason})" in report
        assert f"failed: {reason}" in out  # the live row
        assert (study / f"trial-{n:03d}" / "launcher.log").stat().st_size > 0
    assert summary["counted_trials"] == len(FAULTS) + 1 and summary["failed_trials"] == len(FAULTS)
    assert summary["best"]["status"] == "ok"
    assert (study / "best_ds_config.json").exists()


def test_the_proposer_learns_from_failures(fault_run):
    study, _, _, _ = fault_run
    db = sqlite3.connect(study / "study.db")
    sources = [r[0] for r in db.execute("SELECT source FROM trials ORDER BY number")]
    db.close()
    assert sources[0] == "baseline" and len(sources) == len(FAULTS) + 1  # every failure was told, ask() went on


def test_hung_rank_is_stopped_by_the_timeout(tmp_path):
    wl = WorkloadOptions(data_parallel_size=1, steps=2, warmup_steps=1, faults="hang@0")
    base = DsConfig.from_dict(json.loads(write_config(tmp_path).read_text()))
    seen = {}
    outcome = run_trial(builtin_runner(wl, base), 0, TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4), tmp_path / "t0", timeout=30,
        on_start=lambda p: seen.setdefault("pgid", p.pgid))
    assert outcome.result.failure_reason == "timeout"
    assert "every rank was stopped" in outcome.failure_detail
    assert not group_alive(seen["pgid"])
    assert alive_under(tmp_path) == []
    assert Path(tmp_path / "t0" / "launcher.log").exists()
