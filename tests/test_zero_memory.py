"""Model states per rank at each ZeRO stage (autotune/model/zero_memory.py), pinned against the
installed DeepSpeed's own estimators, and the stage-fit arithmetic the stage sweep uses on a GPU."""

from __future__ import annotations

import pytest

from autotune.model.zero_memory import HEADROOM, model_states_bytes, stage_fit

PARAMS = (1_000_000, 234_048, 7_000_000_000, 13_015_864_320)
DP = (1, 2, 8, 64)


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("dp", DP)
def test_zero2_and_zero3_are_deepspeeds_own_estimates(params, dp):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    largest = params // 40
    for offload in (False, True):
        _, gpu2 = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=dp, cpu_offload=offload)
        assert model_states_bytes(params, 2, dp, offload_optimizer=offload) == gpu2
        _, gpu3, _ = estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=dp, cpu_offload=offload,
                                                            cpu_offload_params=False)
        assert model_states_bytes(params, 3, dp, largest_layer_params=largest, offload_optimizer=offload) == gpu3


@pytest.mark.parametrize("params", PARAMS)
def test_each_stage_partitions_more_and_all_agree_on_one_rank(params):
    one = {s: model_states_bytes(params, s, 1) for s in (0, 1, 2)}
    assert set(one.values()) == {20 * params}  # nothing to partition over one rank
    many = [model_states_bytes(params, s, 8, largest_layer_params=params // 40) for s in (0, 1, 2, 3)]
    assert many == sorted(many, reverse=True) and many[0] > many[-1]


def test_bad_arguments_are_refused():
    for args, kw in (((10, 4, 2), {}), ((10, 2, 0), {}), ((10, 0, 2), {"offload_optimizer": True})):
        with pytest.raises(ValueError):
            model_states_bytes(*args, **kw)


def test_a_stage_fits_when_the_measured_peak_moved_by_the_states_difference_fits():
    gib, params, dp = 2**30, 7_000_000_000, 8
    # measured at ZeRO-3 with 50 GiB on an 80 GiB device: ZeRO-2 adds the whole half-precision
    # weights (2 x 7e9 bytes) less the largest layer's gather: 12.4 GiB more, under the 72 GiB limit
    fit = stage_fit(2, measured_peak_bytes=50 * gib, measured_stage=3, capacity_bytes=80 * gib, params=params, dp=dp,
                    largest_layer_params=params // 40)
    expected = 50 * gib - model_states_bytes(params, 3, dp, largest_layer_params=params // 40) \
        + model_states_bytes(params, 2, dp)
    assert fit.predicted_peak_bytes == expected and fit.limit_bytes == 80 * gib * (1 - HEADROOM)
    assert fit.fits
    zero0 = stage_fit(0, measured_peak_bytes=50 * gib, measured_stage=3, capacity_bytes=80 * gib, params=params,
                      dp=dp, largest_layer_params=params // 40)
    assert not zero0.fits and "ZeRO-0" in zero0.why_not() and "GiB" in zero0.why_not()  # 20 bytes x 7e9: 130 GiB


def _baseline(**kw):
    from builders import healthy_summary

    base = dict(pipeline_stages=1, data_parallel_size=8, zero_stage=3, memory_peak_bytes=50 * 2**30,
                memory_capacity_bytes=80 * 2**30)
    return healthy_summary(**{**base, **kw})


def test_the_stage_sweep_skips_a_stage_predicted_not_to_fit_and_says_why(tmp_path):
    """The sweep's side (a GPU's numbers: a CPU has no device size, and nothing is skipped there)."""
    from builders import RecordingDisplay
    from step_driver import Driven

    from autotune.core.dsconfig import DsConfig
    from autotune.core.space import TrialConfig
    from autotune.engines.deepspeed_zero.engine import STAGE_KNOB, zero_sweep
    from autotune.tuning.proposers.base import Proposal

    notes = RecordingDisplay()
    cfg = DsConfig.from_dict({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
    sweep = Driven(zero_sweep(cfg, tmp_path, notes.note, parameters=7_000_000_000))
    base = Proposal(config=TrialConfig(micro_batch_size=1, gradient_accumulation_steps=8), source="baseline")
    sweep.after(0, base, True, 10.0, _baseline())
    queued = []
    while (p := sweep.next_proposal()) is not None:
        queued.append(p.source)
    assert queued == [f"knob:{STAGE_KNOB}=2"] + [q for q in queued if not q.startswith(f"knob:{STAGE_KNOB}=")]
    assert any("ZeRO-0" in n and "not tried" in n for n in notes.lines)  # 20 bytes x 7e9: never on 80 GiB
    assert any("ZeRO-1" in n and "not tried" in n for n in notes.lines)
    import json

    assert set(json.loads((tmp_path / "knobs.json").read_text())["not_tried"][STAGE_KNOB]) == {"0", "1"}


@pytest.mark.parametrize("why, kw, raw", [
    ("a CPU: no device size", {"memory_capacity_bytes": None}, {"bf16": {"enabled": True}}),
    ("fp32: not DeepSpeed's estimators' case", {}, {}),
])
def test_nothing_is_skipped_without_a_device_size_or_mixed_precision(tmp_path, why, kw, raw):
    from autotune.core.dsconfig import DsConfig, mixed_precision
    from autotune.engines.deepspeed_zero.engine import STAGE_KNOB, stage_too_big

    cfg = DsConfig.from_dict({"zero_optimization": {"stage": 3}, **raw})
    assert stage_too_big(STAGE_KNOB, "0", _baseline(**kw), parameters=7_000_000_000,
                         mixed=mixed_precision(cfg)) is None, why
