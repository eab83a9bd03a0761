"""Adaptive trial length with real ranks (autotune/core/step_budget.py in autotune/rank/workload/train.py):
every rank runs the same number of steps, the interval is stored, a hopeless trial stops early."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import run_trial
from robust_helpers import FAST_CONFIG

from autotune.core.dsconfig import DsConfig
from autotune.core.options import WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.core.step_budget import HOPELESS, RECORD_NAME
from autotune.trials.builtin import builtin_runner

pytestmark = pytest.mark.slow

CFG = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4)
MIN, CAP = 6, 12


def csv_rows(trial_dir: Path) -> dict[str, int]:
    return {p.name: len(p.read_text().splitlines()) - 1 for p in sorted(trial_dir.glob("metrics-rank*.csv"))}


@pytest.fixture(scope="module")
def two_trials(tmp_path_factory):
    """One warm pool, 2 stages x 1 dp: an adaptive trial, then one told of an unbeatable incumbent."""
    root = tmp_path_factory.mktemp("length")
    wl = WorkloadOptions(data_parallel_size=1, steps=MIN, warmup_steps=1, adaptive_steps=True, max_steps=CAP,
                         step_precision=0.03)
    runner = builtin_runner(wl, DsConfig.from_dict(FAST_CONFIG))
    try:
        plain = run_trial(runner, 0, CFG, root / "t0", timeout=600)
        hopeless = run_trial(runner, 1, CFG, root / "t1", timeout=600, incumbent=(1e6, 0.10))
    finally:
        runner.close()
    return root, plain, hopeless


def test_an_adaptive_trial_stores_its_interval_and_every_rank_ran_the_same_steps(two_trials):
    root, plain, _ = two_trials
    assert plain.result.ok, plain.failure_detail
    s = plain.summary
    assert MIN <= s.steps <= CAP
    assert s.step_seconds_low <= s.step_seconds <= s.step_seconds_high
    assert s.step_seconds_rel_half_width == pytest.approx(
        (s.step_seconds_high - s.step_seconds_low) / 2 / s.step_seconds)
    assert not s.stopped_early and s.steps_ended_by in ("precision", "cap")
    if s.steps_ended_by == "precision":
        assert s.step_seconds_rel_half_width <= 0.03
    else:
        assert s.steps == CAP
    rows = csv_rows(root / "t0")
    assert len(rows) == 2 and set(rows.values()) == {1 + s.steps}, rows  # warm-up + measured, on both ranks
    record = json.loads((root / "t0" / RECORD_NAME).read_text())
    assert record["measured_steps"] == s.steps and record["max_steps"] == CAP


def test_a_trial_that_cannot_beat_the_incumbent_stops_early_and_is_kept(two_trials):
    root, _, hopeless = two_trials
    assert hopeless.result.ok, hopeless.failure_detail
    s = hopeless.summary
    assert s.stopped_early and s.steps_ended_by == HOPELESS
    assert s.steps == MIN < CAP  # at the first step the interval exists
    assert hopeless.result.samples_per_second == s.samples_per_second > 0  # the optimizer is told this
    assert set(csv_rows(root / "t1").values()) == {1 + MIN}


def test_fixed_steps_run_exactly_the_count_with_an_incumbent(tmp_path):
    """--fixed-steps: no collective decision, no early stop, exactly --steps."""
    wl = WorkloadOptions(data_parallel_size=1, steps=3, warmup_steps=1, workers="fresh")
    out = run_trial(builtin_runner(wl, DsConfig.from_dict(FAST_CONFIG)), 0, CFG, tmp_path / "t", timeout=600,
                                                                 incumbent=(1e6, 0.10))
    assert out.result.ok and out.summary.steps == 3 and not out.summary.stopped_early
    assert out.summary.steps_ended_by == "fixed" and out.summary.step_seconds_low is None  # < 6 steps
    assert set(csv_rows(tmp_path / "t").values()) == {4}


def test_a_users_script_stops_at_the_same_step_on_every_rank_when_hopeless(tmp_path, monkeypatch):
    """The bootstrap hook (autotune/rank/hook.py) applies the same rule to the user's own loop."""
    import os
    import sys

    from autotune.trials.user_command import UserCommandRunner
    from autotune.usercmd.command import parse_command

    repo = Path(__file__).resolve().parent.parent
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    config = repo / "examples" / "ds_config.json"
    command = parse_command(["deepspeed", "--num_gpus", "2", str(repo / "examples" / "pipeline_train.py"),
                             "--deepspeed_config", str(config), "--steps", "100000", "--save-dir", "ckpt"],
                            cwd=tmp_path)
    runner = UserCommandRunner(command, DsConfig.from_dict(json.loads(config.read_text())), cwd=tmp_path,
                               data_parallel_size=1, steps=MIN, warmup_steps=1)
    runner.step_length = (True, 0.03, CAP)
    out = run_trial(runner, 0, TrialConfig(micro_batch_size=2, gradient_accumulation_steps=8), tmp_path / "t",
                     timeout=600, incumbent=(1e6, 0.10))
    assert out.result.ok, out.failure_detail
    assert out.summary.stopped_early and out.summary.steps == MIN
    assert set(csv_rows(tmp_path / "t").values()) == {1 + MIN}
    done = [json.loads(p.read_text()) for p in sorted((tmp_path / "t").glob("done-rank*.json"))]
    assert [d["train_batch_calls"] for d in done] == [1 + MIN, 1 + MIN]
