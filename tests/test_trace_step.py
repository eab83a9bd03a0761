"""Which trials of a study record a trace (`--trace-steps`, autotune/tuning/trace_step.py):
the baseline, then the first re-measurement of the configuration that is the best then."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from autotune.core.space import TrialConfig
from autotune.trials.contract import TrialRequest
from autotune.tuning.proposers.base import Proposal
from autotune.tuning.steps import TrialEnd
from autotune.tuning.trace_step import TraceStep

A = TrialConfig(micro_batch_size=1, gradient_accumulation_steps=32)
B = TrialConfig(micro_batch_size=4, gradient_accumulation_steps=8)
C = TrialConfig(micro_batch_size=8, gradient_accumulation_steps=4)


def _request(n: int, cfg: TrialConfig, root: Path) -> TrialRequest:
    return TrialRequest(number=n, config=cfg, trial_dir=root / f"trial-{n:03d}", timeout=60.0)


def _run(step: TraceStep, root: Path, n: int, cfg: TrialConfig, source: str, speed: float | None) -> int:
    """One trial through the step: what it was asked to trace; a traced trial leaves traces/."""
    proposal = Proposal(config=cfg, source=source)
    req = _request(n, cfg, root)
    step.prepare(req, proposal.kind)
    if req.trace_steps:
        (req.trial_dir / "traces").mkdir(parents=True)
    step.after(TrialEnd(number=n, proposal=proposal, ok=speed is not None, samples_per_second=speed))
    return req.trace_steps


def test_the_baseline_and_the_first_rerun_of_the_best_are_traced_and_nothing_else(tmp_path):
    step = TraceStep(3, tmp_path)
    asked = [_run(step, tmp_path, 0, A, "baseline", 100.0),
             _run(step, tmp_path, 1, B, "bayes", 150.0),   # the new best: a first measurement, not traced
             _run(step, tmp_path, 2, C, "bayes", 120.0),
             _run(step, tmp_path, 3, B, "confirm", 149.0),  # the best run again: traced
             _run(step, tmp_path, 4, B, "confirm", 151.0)]  # once
    assert asked == [3, 0, 0, 3, 0]


def test_a_rerun_of_a_configuration_that_is_not_the_best_is_not_traced(tmp_path):
    step = TraceStep(2, tmp_path)
    asked = [_run(step, tmp_path, 0, A, "baseline", 100.0), _run(step, tmp_path, 1, B, "bayes", 150.0),
             _run(step, tmp_path, 2, A, "remeasure", 101.0), _run(step, tmp_path, 3, C, "bayes", None)]
    assert asked == [2, 0, 0, 0]


def test_a_resumed_study_does_not_trace_again_what_it_traced(tmp_path):
    for n in (0, 3):
        (tmp_path / f"trial-{n:03d}" / "traces").mkdir(parents=True)

    def row(n: int, cfg: TrialConfig, source: str, speed: float) -> SimpleNamespace:
        return SimpleNamespace(number=n, config=cfg, source=source, samples_per_second=speed)

    step = TraceStep(2, tmp_path)
    step.replay([row(0, A, "baseline", 100.0), row(1, B, "bayes", 150.0), row(3, B, "confirm", 149.0)], [], None)
    assert _run(step, tmp_path, 4, B, "confirm", 150.0) == 0
    fresh = TraceStep(2, tmp_path)  # a study whose best was never re-run: its re-run is traced
    fresh.replay([row(0, A, "baseline", 100.0), row(1, B, "bayes", 150.0)], [], None)
    assert _run(fresh, tmp_path, 5, B, "confirm", 150.0) == 2


def test_every_trial_is_traced_when_asked(tmp_path):
    step = TraceStep(2, tmp_path, every=True)
    asked = [_run(step, tmp_path, 0, A, "baseline", 100.0), _run(step, tmp_path, 1, B, "bayes", 150.0),
             _run(step, tmp_path, 2, C, "bayes", None)]
    assert asked == [2, 2, 2]
