"""The ZeRO stage tried again at the best trial's layout before the search ends
(autotune/tuning/knob_sweep.py `before_end`, the tuner's `ENDING_ROOM`, core/measurements.py).

The stage sweep decides at the baseline's micro-batch; which stage wins changes with it (on the
side-by-side's job ZeRO-0 wins at micro 2 and ZeRO-1 at micro 16: docs/zero-facts.md). A
scripted landscape with that shape drives a real Tuner, its study and the sweep, without
processes (the loop's logic is under test; the real engine's stage trials are the zero study's).
"""

from __future__ import annotations

import json

from builders import RecordingDisplay, ScriptedRunner

from autotune.core.dsconfig import DsConfig
from autotune.core.measurements import best_of, superseded
from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_result import STATUS_FAILED, STATUS_OK, TrialResult
from autotune.engines.deepspeed_zero.engine import STAGE_KNOB, zero_sweep
from autotune.study.store import Study, TrialRow
from autotune.trials.judge import TrialOutcome
from autotune.tuning.proposers.hybrid import HybridProposer
from autotune.tuning.tuner import Tuner

BASE = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=8)


def landscape(micro: int, stage: str) -> float | None:
    """samples/s: ZeRO-0 pays the full all-reduce per micro-batch, ZeRO-1 a smaller optimizer;
    the first wins at small micro-batches, the second at large ones; ZeRO-2/3 lose; ZeRO-0 runs
    out of memory above micro 16."""
    if stage == "0":
        return None if micro > 16 else 100.0 + 5.0 * micro
    return {"1": 60.0 + 12.0 * micro, "2": 40.0 + 4.0 * micro, "3": 20.0 + 2.0 * micro}[stage]


class StageRunner(ScriptedRunner):
    def __init__(self) -> None:
        self.ran: list[tuple[int, str, str]] = []

    def answer(self, request) -> TrialOutcome:
        stage = request.knob_values[STAGE_KNOB]
        self.ran.append((request.config.micro_batch_size, stage, request.number))
        sps = landscape(request.config.micro_batch_size, stage)
        result = (TrialResult(status=STATUS_OK, samples_per_second=sps) if sps is not None
                  else TrialResult(status=STATUS_FAILED, failure_reason="oom"))
        return TrialOutcome(result=result, summary=None, failure_detail=None, wall_seconds=0.1)


def tune(root, *, budget: int, stop_early: bool = False):
    study = Study.open(root, create=not (root / "study.db").exists())
    runner, notes = StageRunner(), RecordingDisplay()
    sp = SearchSpace.build(pipeline_stages=1, data_parallel_size=2, zero_stage=0, micro_max=32, gas_max=8,
                           pipeline=False)
    sweep = zero_sweep(DsConfig.from_dict({"zero_optimization": {"stage": 0}}), root, notes.note)
    try:
        Tuner(study=study, runner=runner, space=sp, note=notes.note, budget=budget, baseline=BASE,
              proposer=HybridProposer(sp, seed=0, moves=None, budget=budget), steps=[sweep],
              stop_early=stop_early).run()
        rows = study.counted()
    finally:
        study.close()
    return rows, runner, notes, sweep


def test_the_runner_up_stage_is_tried_at_the_best_layout_and_kept_when_it_wins(tmp_path):
    rows, runner, notes, sweep = tune(tmp_path, budget=10)
    again = [t for t in rows if t.source.startswith("knob-at-best:")]
    assert [t.source for t in again] == [f"knob-at-best:{STAGE_KNOB}=1"]  # once, the runner-up at micro 2
    t = again[0]
    assert t.config.micro_batch_size > BASE.micro_batch_size  # at the best's layout, not the baseline's
    before = best_of([r for r in rows if r.number < t.number])
    assert t.config.key() == before.config.key()
    assert runner.ran[t.number][1] == "1"
    assert sweep.kept[STAGE_KNOB] == "1"  # ZeRO-1 wins at the large micro-batch (the landscape)
    best = best_of(rows)
    assert best.number == t.number and best.repeats == 1  # the ZeRO-0 runs of that layout no longer hold
    assert {r.number for r in rows if r.config.key() == t.config.key() and r.number < t.number} <= superseded(rows)
    assert all(stage == "1" for _, stage, n in runner.ran if n > t.number)  # later trials run the kept stage
    assert "kept at the best's layout" in "\n".join(notes.lines)
    info = json.loads((tmp_path / "knobs.json").read_text())
    assert info["at_best"]["knob"] == STAGE_KNOB and info["at_best"]["measured"] == {"1": t.samples_per_second}
    assert info["kept"][STAGE_KNOB] == "1"


def test_a_slower_runner_up_at_the_best_is_not_kept_and_its_run_does_not_count():
    rows = [_row(0, "baseline", 2, 110.0), _row(1, f"knob:{STAGE_KNOB}=1", 2, 84.0),
            _row(2, "bayes", 8, 140.0), _row(3, f"knob-at-best:{STAGE_KNOB}=1", 8, 145.0)]
    assert superseded(rows) == {1, 3}  # within the noise of the runs it would replace: a tie
    assert best_of(rows).number == 2
    rows[3] = _row(3, f"knob-at-best:{STAGE_KNOB}=1", 8, 200.0)
    assert superseded(rows) == {1, 2} and best_of(rows).number == 3


def test_not_at_the_baseline_layout_not_twice_and_resumed_as_it_was(tmp_path):
    sweep = zero_sweep(DsConfig.from_dict({"zero_optimization": {"stage": 0}}), tmp_path, lambda s: None)
    finished = [_row(0, "baseline", 2, 110.0), *(_row(n, f"knob:{STAGE_KNOB}={s}", 2, v)
                                                 for n, s, v in ((1, "1", 84.0), (2, "2", 48.0), (3, "3", 24.0)))]
    sweep.replay(finished, [])
    assert sweep.before_end(best_of(finished), room=2) is None  # the best is the baseline's layout
    finished.append(_row(4, "bayes", 16, 180.0))
    p = sweep.before_end(best_of(finished), room=2)
    assert p is not None and p.source == f"knob-at-best:{STAGE_KNOB}=1" and p.config.micro_batch_size == 16
    assert sweep.before_end(best_of(finished), room=2) is None  # once a study
    resumed = zero_sweep(DsConfig.from_dict({"zero_optimization": {"stage": 0}}), tmp_path, lambda s: None)
    resumed.replay([*finished, _row(5, p.source, 16, 252.0)], [])
    assert resumed.kept[STAGE_KNOB] == "1" and resumed.before_end(best_of(finished), room=2) is None


def test_a_converged_search_still_tries_the_stage_before_it_stops(tmp_path):
    rows, _, notes, _ = tune(tmp_path, budget=40, stop_early=True)
    assert len(rows) < 40, "the scripted search should converge before its budget"
    assert any(t.source.startswith("knob-at-best:") for t in rows)
    assert "stopped after" in "\n".join(notes.lines)


def _row(number: int, source: str, micro: int, sps: float | None) -> TrialRow:
    return TrialRow(id=number, number=number, status="ok" if sps else "failed", source=source, reason="",
                    config=TrialConfig(micro_batch_size=micro, gradient_accumulation_steps=8),
                    samples_per_second=sps, failure_reason=None if sps else "oom", failure_detail=None,
                    summary=None, rules_fired=[], started=0.0, finished=1.0, wall_seconds=1.0, pgid=None)


def test_the_baseline_stage_is_a_runner_up_with_the_baselines_measurement(tmp_path):
    """The side-by-side's case: the config's ZeRO-1 is the baseline, ZeRO-0 wins at its micro-batch."""
    sweep = zero_sweep(DsConfig.from_dict({"zero_optimization": {"stage": 1}}), tmp_path, lambda s: None)
    finished = [_row(0, "baseline", 2, 84.0), *(_row(n, f"knob:{STAGE_KNOB}={s}", 2, v)
                                                for n, s, v in ((1, "0", 110.0), (2, "2", 48.0), (3, "3", 24.0)))]
    sweep.replay(finished, [])
    assert sweep.kept[STAGE_KNOB] == "0"
    finished.append(_row(4, "bayes", 16, 180.0))
    p = sweep.before_end(best_of(finished), room=2)
    assert p is not None and p.source == f"knob-at-best:{STAGE_KNOB}=1"
