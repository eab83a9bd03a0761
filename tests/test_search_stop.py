"""The budget as a cap: the hybrid says when its search has converged, the tuning loop stops
there, says why once, stores it (summary.json `stopped`), a resumed stopped study runs no more
trials, and `--full-budget` runs them all (autotune/tuning/proposers/convergence.py,
autotune/tuning/search_stop.py)."""

from __future__ import annotations

import json
import math

import pytest
from builders import RecordingDisplay, ScriptedRunner
from click.testing import CliRunner

from autotune.cli.main import cli
from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_result import STATUS_OK, TrialResult
from autotune.study.store import Study
from autotune.trials.judge import TrialOutcome
from autotune.tuning.proposers.convergence import expected_improvement, noise_estimate
from autotune.tuning.proposers.history import History
from autotune.tuning.proposers.hybrid import HybridProposer
from autotune.tuning.proposers.registry import make_proposer, names
from autotune.tuning.tuner import Tuner


def space() -> SearchSpace:
    return SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1, global_batch=64)


def flat(cfg: TrialConfig) -> float:
    """A landscape with nothing left to find once micro >= 8: 1 % at most between buckets."""
    micro = 100.0 * (1 - math.exp(-cfg.micro_batch_size / 2))
    return micro * (1 - 0.005 * abs(math.log10(cfg.reduce_bucket_size or 1e6) - 6) / 2)


def ok(cfg: TrialConfig) -> TrialResult:
    return TrialResult(status=STATUS_OK, samples_per_second=flat(cfg))


def drive(p: HybridProposer, n: int) -> list[tuple[str | None, str]]:
    """Ask `converged` before each trial as the tuner does; (verdict, source) per step."""
    out = []
    for _ in range(n):
        why = p.converged()
        if why:
            out.append((why, "stop"))
            break
        prop = p.ask()
        p.tell(prop.config, ok(prop.config))
        out.append((None, prop.source))
    return out


def test_the_hybrid_stops_a_flat_search_after_its_floor_and_says_why():
    p = HybridProposer(space(), seed=0, moves=None, budget=20)
    steps = drive(p, 20)
    assert steps[-1][1] == "stop", steps
    told = len(p.history.observations)
    assert p.min_trials <= told < 20
    assert "expected improvement" in steps[-1][0] and "noise" in steps[-1][0]


def test_never_before_the_floor_or_during_the_rule_phase():
    p = HybridProposer(space(), seed=0, moves=None, budget=30, min_trials=12)
    verdicts = [v for v, _ in drive(p, 30)]
    told_at_stop = len(p.history.observations)
    assert verdicts[-1] is not None and told_at_stop >= 12
    p = HybridProposer(space(), seed=0, moves=None, budget=24, rule_phase=15)
    verdicts = [v for v, _ in drive(p, 24)]
    assert len(p.history.ok) >= 15 and all(v is None for v in verdicts[:14])


def test_a_close_runner_up_is_remeasured_before_the_stop():
    p = HybridProposer(space(), seed=0, moves=None, budget=20)
    sources = [s for _, s in drive(p, 20)]
    # On this landscape the top two are within the 10 % noise: the best is measured twice.
    assert "remeasure" in sources and sources[-1] == "stop"
    assert sources.index("remeasure") == len(sources) - 2
    assert p.history.ranked()[0][2] >= 2


def test_the_full_budget_is_unchanged_without_asking():
    """A run that never asks `converged` proposes what it proposed before the cap existed."""
    a = HybridProposer(space(), seed=3, moves=None, budget=12)
    b = HybridProposer(space(), seed=3, moves=None, budget=12)
    keys_a, keys_b = [], []
    for p, keys, ask in ((a, keys_a, False), (b, keys_b, True)):
        for _ in range(11):
            if ask:
                p.stop_verdict()  # the check itself draws nothing from the search's random stream
            prop = p.ask()
            p.tell(prop.config, ok(prop.config))
            keys.append(prop.config.key())
    assert keys_a == keys_b


@pytest.mark.parametrize("name", [n for n in names() if n != "hybrid"])
def test_other_proposers_run_the_whole_budget(name):
    assert make_proposer(name, space(), seed=0).converged() is None


def test_noise_is_measured_only_with_enough_repeats():
    h = History(space())
    c = TrialConfig(micro_batch_size=8, gradient_accumulation_steps=4, reduce_bucket_size=1_000_000)
    h.record(c, TrialResult(status=STATUS_OK, samples_per_second=100.0))
    h.record(c, TrialResult(status=STATUS_OK, samples_per_second=104.0))
    assert noise_estimate(h, 0.10) == (0.10, "assumed")  # one degree of freedom is not enough
    for v in (96.0, 101.0):
        h.record(c, TrialResult(status=STATUS_OK, samples_per_second=v))
    noise, source = noise_estimate(h, 0.10)
    assert source.startswith("measured over 3") and 0.02 <= noise < 0.05


def test_expected_improvement_is_exact_without_uncertainty():
    import numpy as np

    ei = expected_improvement(np.array([1.0, 0.5]), np.array([0.0, 0.0]), 0.8)
    assert ei[0] == pytest.approx(0.2) and ei[1] == 0.0


# ---- the tuning loop ------------------------------------------------------------------------

class FlatRunner(ScriptedRunner):
    """Trials answered by `flat` at once (the loop's logic, not DeepSpeed, is under test)."""

    def __init__(self) -> None:
        self.ran: list[TrialConfig] = []

    def answer(self, request) -> TrialOutcome:
        config = request.config
        self.ran.append(config)
        return TrialOutcome(result=ok(config), summary=None, failure_detail=None, wall_seconds=0.1)

    def ds_config_for(self, config: TrialConfig) -> dict:
        return {"train_micro_batch_size_per_gpu": config.micro_batch_size}


def tune(root, *, budget: int, stop_early: bool = True) -> tuple[dict, FlatRunner, RecordingDisplay]:
    study = Study.open(root, create=not (root / "study.db").exists())
    runner, notes = FlatRunner(), RecordingDisplay()
    sp = space()
    base = TrialConfig(micro_batch_size=1, gradient_accumulation_steps=32, reduce_bucket_size=500_000_000)
    try:
        result = Tuner(study=study, runner=runner, space=sp, note=notes.note, budget=budget, baseline=base,
                       proposer=HybridProposer(sp, seed=0, moves=None, budget=budget),
                       stop_early=stop_early).run()
    finally:
        study.close()
    return result.results.to_dict(), runner, notes  # summary.json's content


def test_the_loop_stops_says_why_once_and_records_it(tmp_path):
    summary, runner, notes = tune(tmp_path / "st", budget=20)
    stopped = summary["stopped"]
    assert stopped["budget"] == 20 and stopped["trials"] == summary["counted_trials"] == len(runner.ran) < 20
    said = [line for line in notes.lines if line.startswith("stopped after")]
    assert len(said) == 1 and f"stopped after {stopped['trials']} of 20 trials: " in said[0]
    assert "--full-budget" in said[0]
    on_disk = json.loads((tmp_path / "st" / "summary.json").read_text())
    assert on_disk["stopped"] == stopped
    assert "Stopped after" in (tmp_path / "st" / "report.md").read_text()


def test_a_resumed_stopped_study_runs_no_more_trials_and_full_budget_runs_on(tmp_path):
    first, _, _ = tune(tmp_path / "st", budget=20)
    assert first["stopped"] is not None
    again, runner, notes = tune(tmp_path / "st", budget=20)
    assert runner.ran == [] and again["counted_trials"] == first["counted_trials"]
    assert any(line.startswith("stopped earlier after") for line in notes.lines)
    full, runner, _ = tune(tmp_path / "st", budget=20, stop_early=False)
    assert full["counted_trials"] == 20 and full["stopped"] is None


def test_full_budget_from_the_start_runs_every_trial(tmp_path):
    summary, runner, _ = tune(tmp_path / "st", budget=13, stop_early=False)
    assert summary["counted_trials"] == 13 and summary["stopped"] is None


def test_the_flag_is_in_run_help():
    out = CliRunner().invoke(cli, ["run", "--help"]).output
    assert "--full-budget" in out
