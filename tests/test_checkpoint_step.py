"""The checkpoint step (autotune/tuning/checkpoint_step.py): a micro-batch that ran out of memory is
run again with activation checkpointing, kept when it is the fastest, climbed while it wins.

The tuning loop, the study (SQLite), the step and the hybrid proposer are the real ones; the
trials are answered at once by a runner with an injected memory cliff (the ground truth): a
micro-batch above `FITS` runs out of memory without checkpointing, one above `FITS_CKPT` with
it, and checkpointing costs `RECOMPUTE` of the throughput. The real ranks are in
tests/test_checkpoint_ranks.py.
"""

from __future__ import annotations

import json

from builders import RecordingDisplay, ScriptedRunner, healthy_summary

from autotune.core.dsconfig import DsConfig
from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_result import STATUS_OK, TrialResult
from autotune.study.store import Study
from autotune.trials.judge import TrialOutcome, failed
from autotune.tuning.checkpoint_step import MAX_TRIALS, SOURCE, CheckpointStep
from autotune.tuning.proposers.base import Proposal
from autotune.tuning.proposers.hybrid import HybridProposer
from autotune.tuning.tuner import Tuner

FITS, FITS_CKPT, RECOMPUTE = 4, 8, 0.8
BASE = TrialConfig(micro_batch_size=1, gradient_accumulation_steps=32)


def _space() -> SearchSpace:
    return SearchSpace.build(pipeline_stages=2, data_parallel_size=1, zero_stage=0, global_batch=32, micro_max=32)


def throughput(cfg: TrialConfig) -> float | None:
    """The ground truth: samples/s grow with the micro-batch; None: out of memory."""
    limit = FITS_CKPT if cfg.activation_checkpoint_interval else FITS
    if cfg.micro_batch_size > limit:
        return None
    return 10.0 * cfg.micro_batch_size * (RECOMPUTE if cfg.activation_checkpoint_interval else 1.0)


class CliffRunner(ScriptedRunner):
    def __init__(self) -> None:
        self.base = DsConfig.from_dict({"train_micro_batch_size_per_gpu": 1})
        self.ran: list[TrialConfig] = []

    def answer(self, request) -> TrialOutcome:
        config = request.config
        self.ran.append(config)
        sps = throughput(config)
        if sps is None:
            return failed("oom", "CUDA out of memory (injected cliff)", 0.1)
        return TrialOutcome(result=TrialResult(status=STATUS_OK, samples_per_second=sps),
                            summary=healthy_summary(samples_per_second=sps), failure_detail=None, wall_seconds=0.1)

    def ds_config_for(self, config: TrialConfig) -> dict:
        return self.base.with_trial(micro_batch_size=config.micro_batch_size,
                                    gradient_accumulation_steps=config.gradient_accumulation_steps,
                                    data_parallel_size=1, reduce_bucket_size=None,
                                    activation_checkpoint_interval=config.activation_checkpoint_interval).to_dict()


class Climbing(HybridProposer):
    """The hybrid proposer, asked to climb the micro-batch (1, 2, 4, 8, ...) so the cliff comes early."""

    def __init__(self, space: SearchSpace) -> None:
        super().__init__(space, seed=0, moves=None, budget=12)
        self.told: list[TrialConfig] = []

    def tell(self, config, result) -> None:
        self.told.append(config)
        super().tell(config, result)

    def ask(self):
        tried = {c.micro_batch_size for c in self.told}
        for m in self.space.micro_batch_sizes:
            if m not in tried:
                cfg = TrialConfig(micro_batch_size=m, gradient_accumulation_steps=self.space.gas_for(m))
                self.history.pending.add(cfg.key())
                return Proposal(config=cfg, source="explore", reason="climb")
        return super().ask()


def _tune(root, budget: int, step: bool = True):
    space = _space()
    study = Study.open(root, create=True)
    runner, proposer = CliffRunner(), Climbing(space)
    notes: list[str] = []
    quiet = RecordingDisplay()
    quiet.note = notes.append
    tuner = Tuner(study=study, runner=runner, space=space, proposer=proposer, baseline=BASE, note=quiet.note,
                  budget=budget, steps=[CheckpointStep(space, notes.append)] if step else [],
                  stop_early=False)
    tuner.run()
    return study, runner, proposer, notes


def test_an_out_of_memory_micro_batch_is_run_again_with_checkpointing_and_climbed_while_it_wins(tmp_path):
    study, runner, proposer, notes = _tune(tmp_path / "st", budget=8)
    trials = {t.number: t for t in study.counted()}
    # 0: micro 1, 1: 2, 2: 4, 3: 8 (out of memory), then the step: 8 with checkpointing (the fastest),
    # so 16 with it (out of memory too), and the proposer goes on
    assert [c.micro_batch_size for c in runner.ran[:4]] == [1, 2, 4, 8]
    assert trials[3].status == "failed" and trials[3].failure_reason == "oom"
    assert trials[4].source == SOURCE and trials[4].config == TrialConfig(
        micro_batch_size=8, gradient_accumulation_steps=4, activation_checkpoint_interval=1)
    assert "trial 3 ran out of memory at micro-batch 8" in trials[4].reason
    assert trials[4].status == "ok" and trials[4].samples_per_second == throughput(trials[4].config)
    assert trials[5].source == SOURCE and trials[5].config.micro_batch_size == 16
    assert trials[5].config.gradient_accumulation_steps == 2  # the fixed global batch's GAS
    assert trials[5].status == "failed"
    assert all(trials[n].source != SOURCE for n in (6, 7))  # the ladder ended where checkpointing ran out too
    assert any("ran out of memory too" in n for n in notes)
    # the ground truth's best: micro 8 with checkpointing (64 samples/s against micro 4's 40)
    best = study.best()
    assert best.number == 4 and best.config.activation_checkpoint_interval == 1
    written = json.loads((tmp_path / "st" / "best_ds_config.json").read_text())
    assert written["pipeline"] == {"activation_checkpoint_interval": 1}
    assert written["train_micro_batch_size_per_gpu"] == 8
    # the proposers' encoding has no interval: checkpointed trials are never told
    assert all(c.activation_checkpoint_interval == 0 for c in proposer.told)
    assert TrialConfig(micro_batch_size=8, gradient_accumulation_steps=4) in proposer.told  # the failure is
    summary = json.loads((tmp_path / "st" / "summary.json").read_text())
    assert summary["best"]["activation_checkpoint_interval"] == 1
    report = (tmp_path / "st" / "report.md").read_text()
    assert "pipeline.activation_checkpoint_interval 1" in report and "| 8 (ckpt 1) |" in report
    study.close()


def test_a_checkpointed_trial_that_is_not_the_fastest_is_not_kept_or_climbed(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "RECOMPUTE", 0.3)  # micro 8 checkpointed: 24 < micro 4's 40
    study, _, _, notes = _tune(tmp_path / "st", budget=6)
    checkpointed = [t for t in study.counted() if t.source == SOURCE]
    assert len(checkpointed) == 1 and checkpointed[0].config.micro_batch_size == 8
    assert study.best().config.activation_checkpoint_interval == 0
    assert "activation_checkpoint_interval" not in (tmp_path / "st" / "best_ds_config.json").read_text()
    assert any("not faster than the best trial" in n for n in notes)
    study.close()


def test_without_the_step_nothing_is_checkpointed(tmp_path):
    study, _, _, _ = _tune(tmp_path / "st", budget=6, step=False)
    assert all(t.config.activation_checkpoint_interval == 0 for t in study.counted())
    study.close()


def test_a_resumed_study_plans_as_the_uninterrupted_one_did(tmp_path):
    """Replay: the same finished rows give the same next checkpointed trial, never one twice."""
    study, _, _, _ = _tune(tmp_path / "st", budget=5)  # stops right after the first checkpointed trial
    finished = study.counted()
    assert finished[-1].source == SOURCE and finished[-1].status == "ok"
    replayed = CheckpointStep(_space(), lambda _t: None)
    replayed.replay(finished, [])
    nxt = replayed.next_proposal()
    assert nxt is not None and nxt.source == SOURCE and nxt.config.micro_batch_size == 16
    assert nxt.config.activation_checkpoint_interval == 1
    interrupted = CheckpointStep(_space(), lambda _t: None)
    interrupted.replay(finished[:-1], [finished[-1]])  # the checkpointed trial runs again as itself
    assert interrupted.next_proposal() is None
    study.close()


def test_only_out_of_memory_calls_for_it_and_no_configuration_twice_nor_more_than_the_cap():
    step = CheckpointStep(_space(), lambda _t: None)
    cfg = TrialConfig(micro_batch_size=8, gradient_accumulation_steps=4)
    step._after(1, cfg, "explore", False, "timeout", None, 10.0)
    assert step.next_proposal() is None
    step._after(1, cfg, "explore", False, "oom", None, 10.0)
    assert step.next_proposal().config.activation_checkpoint_interval == 1
    step._after(2, cfg, "explore", False, "oom", None, 10.0)  # the same micro-batch again
    assert step.next_proposal() is None
    assert MAX_TRIALS == 3
    for m, n, expected in ((16, 3, True), (32, 4, True), (2, 5, False)):  # the 4th is over the cap
        step._after(n, TrialConfig(micro_batch_size=m, gradient_accumulation_steps=32 // m), "explore", False,
                   "oom", None, 10.0)
        planned = step.next_proposal()
        assert (planned is not None) == expected, (m, planned)
    assert len(step.tried) == MAX_TRIALS


def test_the_interval_is_stored_read_back_and_added_to_an_older_study(tmp_path):
    import sqlite3

    from autotune.study import store as study_mod

    old = tmp_path / "old"
    old.mkdir()
    db = sqlite3.connect(old / study_mod.DB_NAME)
    db.executescript(study_mod._SCHEMA.replace("    activation_checkpoint_interval INTEGER NOT NULL DEFAULT 0,\n", ""))
    db.execute("INSERT INTO meta VALUES ('format', ?)", (str(study_mod.STUDY_FORMAT),))
    db.execute("INSERT INTO trials(number, status, source, micro_batch_size, gradient_accumulation_steps, started)"
               " VALUES (0, 'ok', 'baseline', 2, 4, 0)")
    db.commit()
    db.close()
    s = Study.open(old, create=False)
    assert s.trials()[0].config == TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4)
    s.start_trial(1, TrialConfig(micro_batch_size=8, gradient_accumulation_steps=1, activation_checkpoint_interval=1),
                  SOURCE, "")
    assert s.trials()[1].config.activation_checkpoint_interval == 1
    assert s.trials()[1].config.key() != TrialConfig(micro_batch_size=8, gradient_accumulation_steps=1).key()
    assert "ckpt=1" in s.trials()[1].config.describe()
    s.close()
