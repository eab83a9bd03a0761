"""Trial faults, injected on purpose: each ends as a failed trial with a classified reason,
the run goes on to its budget, and no process is left behind."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from builders import run_trial
from robust_helpers import alive_under, rows, write_config
from shared_studies import FAULT_BUDGET, FAULTS, HAS_FP16, NO_FP16_REASON

from autotune.core.dsconfig import DsConfig
from autotune.core.options import WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.trials.builtin import builtin_runner
from autotune.trials.launcher import group_alive

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fault_run(fault_study):
    """The session's fault study (tests/shared_studies.py): a fault in every trial of FAULTS."""
    return fault_study.study, fault_study.returncode, fault_study.output, fault_study.alive_after


def test_run_reaches_its_budget_with_every_fault_classified(fault_run):
    study, rc, out, _ = fault_run
    assert rc == 0, out[-4000:]
    got = {n: (status, reason) for n, status, reason, _ in rows(study)}
    assert got[0] == ("ok", None)
    for n, (_, reason) in FAULTS.items():
        assert got[n] == ("failed", reason), (n, got[n], out[-3000:])
    assert len(got) == FAULT_BUDGET
    healthy = set(got) - set(FAULTS)
    assert healthy == {0, 2} and got[2] == ("ok", None)  # the baseline, and the checkpoint step's rerun


@pytest.mark.skipif(not HAS_FP16, reason=NO_FP16_REASON)
def test_fp16_overflow_fault_is_part_of_the_run(fault_run):
    study, _, out, _ = fault_run
    got = {n: (status, reason) for n, status, reason, _ in rows(study)}
    assert got[7] == ("failed", "loss_scale_collapse"), out[-3000:]


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
    assert summary["counted_trials"] == FAULT_BUDGET and summary["failed_trials"] == len(FAULTS)
    assert summary["best"]["status"] == "ok"
    assert (study / "best_ds_config.json").exists()


def test_the_proposer_learns_from_failures(fault_run):
    study, _, _, _ = fault_run
    db = sqlite3.connect(study / "study.db")
    sources = [r[0] for r in db.execute("SELECT source FROM trials ORDER BY number")]
    db.close()
    assert sources[0] == "baseline" and len(sources) == FAULT_BUDGET  # every failure was told, ask() went on


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


@pytest.mark.parametrize("lines, reason", [
    # the killed rank leaves nothing; the peer that lost it exited 1 first, and the launcher said so
    (["[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:29334: Connection reset "
      "by peer. This is typically caused by a remote worker hanging", "exits with return code = 1"], "killed"),
    # a rank's own error beside its peer's lost connection: that error is the cause
    (["[rank1]: ValueError: bad shape", "[rank0]: RuntimeError: Connection closed by peer",
      "exits with return code = 1"], "crash"),
])
def test_a_rank_that_vanished_is_killed_not_its_peers_crash(tmp_path, lines, reason):
    """The fresh-kill contract case, seen once in a fresh-clone suite run (2026-12-07): DeepSpeed's
    launcher reported the peer's exit 1 before the SIGKILLed rank's -9."""
    from autotune.trials.judge import judge
    from autotune.trials.launcher import LaunchOutcome

    log = tmp_path / "launcher.log"
    log.write_text("\n".join(lines) + "\n")
    outcome = judge(LaunchOutcome(returncode=1, timed_out=False, wall_seconds=1.0, log_path=log), tmp_path, 60)
    assert outcome.result.failure_reason == reason, outcome.failure_detail
