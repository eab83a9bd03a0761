"""propose_moves (what the hybrid proposer calls) and patch_config (--write-config)."""

from __future__ import annotations

import pytest
from builders import healthy_summary

from autotune.advisor import check_config, evaluate, patch_config
from autotune.core.dsconfig import DsConfig
from autotune.core.space import SearchSpace, TrialConfig
from autotune.tuning.proposers.rule_moves import propose_moves


def _space(**kw):
    args = dict(pipeline_stages=2, data_parallel_size=2, zero_stage=1)
    args.update(kw)
    return SearchSpace.build(**args)


def test_proposals_are_in_space_and_labelled():
    space = _space()
    cur = TrialConfig(micro_batch_size=4, gradient_accumulation_steps=8, reduce_bucket_size=100_000)
    props = propose_moves(healthy_summary(comm_compute_ratio=0.5, device_utilization_fluctuation=0.2), cur, space)
    assert props
    for p in props:
        assert space.contains(p.config) and p.config != cur
        assert p.source.startswith("rule:") and "\n" not in p.reason and "->" in p.reason
    comm = [p for p in props if p.source == "rule:comm-compute-high"]
    # no model size in this space: no bucket move (never a smaller one), GAS x2 (free batch)
    assert [(p.config.reduce_bucket_size, p.config.gradient_accumulation_steps) for p in comm] == [(100_000, 16)]


def test_no_proposals_on_healthy_trial():
    cur = TrialConfig(micro_batch_size=4, gradient_accumulation_steps=8, reduce_bucket_size=100_000)
    assert propose_moves(healthy_summary(), cur, _space()) == []


def test_fixed_global_batch_keeps_batch():
    space = _space(global_batch=64, zero_stage=0)
    cur = TrialConfig(micro_batch_size=16, gradient_accumulation_steps=2)
    props = propose_moves(healthy_summary(micro_batch_size=16, gradient_accumulation_steps=2,
                                          reduce_bucket_size=None), cur, space)
    bubble = [p for p in props if p.source == "rule:bubble-ideal-above-target"]
    assert bubble and bubble[0].config.gradient_accumulation_steps >= 4
    for p in props:
        assert p.config.micro_batch_size * p.config.gradient_accumulation_steps * 2 == 64


def test_bucket_moves_dropped_when_knob_cannot_act():
    space = _space(zero_stage=0)
    cur = TrialConfig(micro_batch_size=4, gradient_accumulation_steps=8)
    props = propose_moves(healthy_summary(comm_compute_ratio=0.5, reduce_bucket_size=None), cur, space)
    assert all(p.config.reduce_bucket_size is None for p in props)
    assert props and props[0].config.gradient_accumulation_steps == 16


BASE = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 500000000},
        "pipeline": {"stages": 2, "activation_checkpoint_interval": 0}, "wall_clock_breakdown": True,
        "optimizer": {"type": "Adam"}}


def test_patch_config_applies_and_stays_consistent():
    cfg = DsConfig.from_dict(BASE)
    findings = evaluate([healthy_summary(comm_compute_ratio=0.5, gradient_accumulation_steps=2)], ds_config=cfg)
    out = patch_config(cfg, findings)
    assert out["zero_optimization"]["stage"] == 1
    assert out["wall_clock_breakdown"] is False
    assert "stages" not in out["pipeline"] and out["optimizer"] == {"type": "Adam"}
    assert out["train_batch_size"] == (out["train_micro_batch_size_per_gpu"]
                                       * out["gradient_accumulation_steps"] * 2)
    patched = DsConfig.from_dict(out)
    patched.check_pipeline()
    patched.resolve_batch(2)


def test_patch_config_from_check_without_dp_derives_it():
    cfg = DsConfig.from_dict({**BASE, "gradient_accumulation_steps": 2, "train_batch_size": 16})
    out = patch_config(cfg, check_config(cfg, stages=2, world_size=4))
    assert out["gradient_accumulation_steps"] == 4 and out["train_batch_size"] == 4 * 4 * 2


def test_patch_config_ignores_insufficient_and_advice():
    cfg = DsConfig.from_dict({**BASE, "zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000_000},
                              "wall_clock_breakdown": False, "pipeline": {}})
    out = patch_config(cfg, evaluate([healthy_summary(stage_compute_imbalance=2.0,
                                                      memory_fragmentation_ratio=None)], ds_config=cfg))
    assert out == cfg.to_dict()


@pytest.mark.parametrize("gas", [3, 5])
def test_not_multiple_of_stages_rounds_up(gas):
    f = [x for x in evaluate([healthy_summary(gradient_accumulation_steps=gas, pipeline_stages=2)])
         if x.rule_id == "micro-batches-not-multiple-of-stages"][0]
    assert f.fired and f.changes[0].new == gas + 1


def test_comm_rules_grow_gas_only_when_the_global_batch_may_grow():
    """At a fixed global batch more GAS only shrinks the micro-batch: no amortization, no move."""
    summary = healthy_summary(comm_compute_ratio=0.9, micro_batch_size=2, gradient_accumulation_steps=16,
                              reduce_bucket_size=250_000_000)
    cur = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=16, reduce_bucket_size=250_000_000)
    fixed = propose_moves(summary, cur, _space(global_batch=64))
    free = propose_moves(summary, cur, _space())
    comm = ("rule:comm-compute-high", "rule:comm-compute-above-target")
    assert not [p for p in fixed if p.source in comm and p.config.gradient_accumulation_steps != 16]
    assert not [p for p in fixed if p.source in comm and p.config.reduce_bucket_size != 250_000_000]
    assert [p for p in free if p.source in comm and p.config.gradient_accumulation_steps == 32]
