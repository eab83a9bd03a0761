"""Activation checkpointing with real ranks (autotune/tuning/checkpoint_step.py): a checkpointed trial
trains the same model to the same losses, and `autotune run` runs one after an out-of-memory
trial. The step's decisions against an injected memory cliff are in tests/test_checkpoint_step.py."""

from __future__ import annotations

import json

import pytest
from builders import run_trial
from robust_helpers import FAST_CONFIG
from test_warm_workers import losses

from autotune.core.dsconfig import DsConfig
from autotune.core.options import WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.study.store import Study
from autotune.trials.builtin import builtin_runner

pytestmark = pytest.mark.slow

A = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4)


def test_a_checkpointed_trial_trains_to_the_same_losses_in_fresh_processes(tmp_path):
    """Checkpointing recomputes, it does not change the arithmetic: every step's loss is the
    plain trial's. The embedding is not checkpointed (model.py): with DeepSpeed's default rule,
    which checkpoints it too, this trial crashed."""
    notes: list[str] = []
    runner = builtin_runner(WorkloadOptions(data_parallel_size=1, steps=4, warmup_steps=1),
                         DsConfig.from_dict(FAST_CONFIG), note=notes.append)
    try:
        plain = run_trial(runner, 0, A, tmp_path / "plain", timeout=900)
        ckpt_cfg = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4, activation_checkpoint_interval=1)
        ckpt = run_trial(runner, 1, ckpt_cfg, tmp_path / "ckpt", timeout=900)
    finally:
        runner.close()
    assert plain.result.ok and ckpt.result.ok, (plain.failure_detail, ckpt.failure_detail)
    written = json.loads((tmp_path / "ckpt" / "ds_config.json").read_text())
    assert written["pipeline"]["activation_checkpoint_interval"] == 1
    assert "pipeline" not in json.loads((tmp_path / "plain" / "ds_config.json").read_text())
    assert any("the checkpoint step's trials run in fresh processes" in n for n in notes), notes
    got, want = losses(tmp_path / "ckpt"), losses(tmp_path / "plain")
    assert len(want) == 5 and want[-1] < want[0]
    assert got == pytest.approx(want, rel=1e-5)


def test_autotune_run_checkpoints_the_micro_batch_that_ran_out_of_memory(fault_study):
    """The session's fault study (tests/shared_studies.py): trial 1 runs out of memory, trial 2
    is the checkpoint step's rerun of its micro-batch."""
    assert fault_study.returncode == 0, fault_study.output[-4000:]
    out = fault_study.output
    study = Study.open(fault_study.study, create=False)
    try:
        trials = {t.number: t for t in study.counted()}
    finally:
        study.close()
    assert trials[1].status == "failed" and trials[1].failure_reason == "oom"
    assert trials[2].source == "checkpoint" and trials[2].status == "ok", out[-3000:]
    assert trials[2].config.activation_checkpoint_interval == 1
    assert trials[2].config.key()[:3] == trials[1].config.key()[:3]  # the same micro-batch, GAS, bucket
    assert "trial 1 ran out of memory" in trials[2].reason
    assert "checkpoint: micro-batch" in out  # the decision, said
    best = json.loads((fault_study.study / "summary.json").read_text())["best"]
    written = json.loads((fault_study.study / "best_ds_config.json").read_text())
    assert (written.get("pipeline", {}).get("activation_checkpoint_interval", 0)
            == best["activation_checkpoint_interval"])
    assert fault_study.alive_after == []
