"""The plain-engine (ZeRO) step model (autotune/model/zero_step.py, zero_plan.py; issue 42):
`autotune predict` and `autotune plan` on a study of a plain DeepSpeedEngine.

The terms' arithmetic is checked on observations written from known terms (they must come back
exactly); the CLI on the shared ZeRO study (tests/shared_studies.py `zero_study`: ZeRO-2 on 2
data-parallel ranks, the stage sweep among its trials), which no test here re-runs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from launch_helpers import autotune_cli

from autotune.model.hardware import load_hardware
from autotune.model.observations import Observation, StageMeasure
from autotune.model.step_model import Layout, calibrate, predict
from autotune.model.zero_memory import model_states_bytes

PARAMS = 1_000_000
WORK = {0: 1.0, 1: 1.0, 2: 1.5, 3: 3.0}
"""Each stage's work factor (ZeRO-2's hooks, ZeRO-3's gathers inside the forward and backward)."""
COMM_MICRO = {0: 0.0, 1: 0.0, 2: 0.004, 3: 0.010}
COMM_STEP = {0: 0.006, 1: 0.005, 2: 0.002, 3: 0.0}
ENGINE_MICRO = {0: 0.001, 1: 0.001, 2: 0.003, 3: 0.005}
OPT_ALL = 0.008


def _work(b: int) -> float:
    return 0.002 + 0.01 * b


def _truth(z: int, b: int, m: int, dp: int = 2) -> tuple[float, float, float, float]:
    """(step, work, comm, optimizer) seconds of a layout on 2 ranks with a core each."""
    work = m * WORK[z] * _work(b)
    comm = m * COMM_MICRO[z] + COMM_STEP[z]
    opt = OPT_ALL / (dp if z else 1)
    return work + comm + opt + m * ENGINE_MICRO[z], work, comm, opt


def _obs(trial: int, z: int, b: int, m: int, gather: float | None = None) -> Observation:
    step, work, comm, opt = _truth(z, b, m)
    gather = COMM_STEP[z] if z == 2 and gather is None else (gather or 0.0)
    st = StageMeasure(work_seconds=work, wall_compute_seconds=work, optimizer_seconds=opt, reduce_seconds=comm,
                      transfer_seconds=None, data_seconds=0.0, wait_seconds=0.0, step_seconds=step,
                      peak_memory_bytes=None, gather_seconds=gather)
    return Observation(trial=trial, micro_batch_size=b, gradient_accumulation_steps=m, reduce_bucket_size=int(5e8),
                       checkpoint_interval=0, stages=1, data_parallel_size=2, step_seconds=step,
                       samples_per_second=b * m * 2 / step, device="cpu", stage=[st], zero_stage=z,
                       plain_engine=True, mixed_precision=False)


def _study() -> list[Observation]:
    """A ZeRO sweep at micro 2 x GAS 8, then the kept stage (ZeRO-1) at three other micro-batches."""
    obs = [_obs(i, z, 2, 8) for i, z in enumerate((2, 0, 1, 3))]
    return obs + [_obs(4 + i, 1, b, 16 // b) for i, b in enumerate((1, 4, 8))]


def test_the_terms_come_back_and_predict_an_unseen_layout_at_every_stage():
    cal = calibrate(_study(), cores=2.0, model_parameters=PARAMS)
    assert cal.zero is not None and cal.zero.reference_stage == 1
    for z in range(4):
        for b, m in ((16, 1), (4, 4), (2, 8)):
            p = predict(cal, Layout(micro_batch_size=b, gradient_accumulation_steps=m, stages=1, data_parallel_size=2,
                                    reduce_bucket_size=int(5e8), zero_stage=z))
            assert p.step_seconds == pytest.approx(_truth(z, b, m)[0], rel=1e-6), (z, b, m)
            assert p.bubble_fraction is None  # not a pipeline job: no bubble, not a bubble of 0
            assert sum(p.terms.values()) == pytest.approx(p.step_seconds, rel=1e-9)


def test_ring_scaling_and_the_partitioned_optimizer_to_another_dp():
    cal = calibrate(_study(), cores=None, model_parameters=PARAMS)
    two = predict(cal, Layout(2, 8, 1, 2, int(5e8), zero_stage=1))
    eight = predict(cal, Layout(2, 2, 1, 8, int(5e8), zero_stage=1))
    assert eight.terms["reduce"] == pytest.approx(two.terms["reduce"] * (7 / 8) / (1 / 2), rel=1e-9)
    assert eight.terms["optimizer"] == pytest.approx(OPT_ALL / 8, rel=1e-9)
    assert any("dp 8 (calibrated at 2)" in e for e in eight.extrapolated)


def test_a_stage_the_study_never_ran_is_predicted_from_the_volume_rule_and_says_so():
    obs = [o for o in _study() if o.zero_stage != 3]
    cal = calibrate(obs, cores=2.0, model_parameters=PARAMS)
    p = predict(cal, Layout(2, 8, 1, 2, int(5e8), zero_stage=3))
    assert any("ZeRO-3 never ran in the study" in e for e in p.extrapolated)
    per_volume = cal.zero.seconds_per_volume
    assert per_volume > 0 and p.terms["reduce"] == pytest.approx(per_volume * 3 * 8, rel=1e-9)


def test_a_second_bucket_count_measures_the_cost_per_reduction_call():
    obs = _study()
    # ZeRO-2 again with a bucket of 1e5: 10 reduction calls per micro-batch, 2 ms more each micro-batch
    extra = dataclasses.replace(_obs(9, 2, 2, 8), reduce_bucket_size=100_000)
    st = extra.stage[0]
    extra = dataclasses.replace(extra, stage=[dataclasses.replace(st, reduce_seconds=st.reduce_seconds + 8 * 0.002)],
                                step_seconds=extra.step_seconds + 8 * 0.002)
    cal = calibrate([*obs, extra], cores=2.0, model_parameters=PARAMS)
    assert cal.zero.reduce_per_bucket == pytest.approx(0.002 / 9, rel=1e-6)
    small = predict(cal, Layout(2, 8, 1, 2, 100_000, zero_stage=2))
    big = predict(cal, Layout(2, 8, 1, 2, int(5e8), zero_stage=2))
    assert small.terms["reduce"] - big.terms["reduce"] == pytest.approx(8 * 0.002, rel=1e-6)


def test_memory_on_a_gpu_is_the_model_states_plus_what_the_peaks_hold_beyond_them():
    fixed, per_sample = 3e8, 2e7

    def on_gpu(o: Observation) -> Observation:
        z = int(o.zero_stage or 0)
        peak = model_states_bytes(PARAMS, z, 2) + fixed + per_sample * o.micro_batch_size
        return dataclasses.replace(o, device="cuda", mixed_precision=True, peak_memory_kind="cuda_max_allocated",
                                   stage=[dataclasses.replace(o.stage[0], peak_memory_bytes=peak)])

    cal = calibrate([on_gpu(o) for o in _study()], model_parameters=PARAMS)
    p = predict(cal, Layout(32, 1, 1, 8, int(5e8), zero_stage=3))
    assert p.stage_memory_bytes == [pytest.approx(model_states_bytes(PARAMS, 3, 8) + fixed + per_sample * 32, rel=1e-6)]
    cpu = predict(calibrate(_study(), cores=2.0, model_parameters=PARAMS), Layout(2, 8, 1, 2, zero_stage=3))
    assert cpu.stage_memory_bytes is None and any("not modelled on a CPU" in n for n in cpu.notes)


def test_plan_onto_a_preset_has_the_out_of_memory_cliff_along_the_stages(zero_study):
    """A 7B model on 16 H100s: ZeRO-0's 20 bytes per parameter do not fit 80 GB, ZeRO-3's do."""
    from autotune.model.plan import Cluster, plan
    from autotune.model.study_model import model_of_study

    model = model_of_study(zero_study.study)
    cal = model.calibration
    assert cal.zero is not None
    big = dataclasses.replace(model, workload={"preset": "llama-7b"},
                              calibration=dataclasses.replace(cal, zero=dataclasses.replace(cal.zero, parameters=6_738_000_000)))
    result = plan(big, Cluster(gpus=16, gpus_per_node=8, hardware=load_hardware("h100"), global_batch=256))
    assert {x.layout.zero_stage for x in result.too_big} == {0}
    assert 3 in {x.layout.zero_stage for x in result.ranked}
    for x in result.too_big:
        assert x.stage_memory_bytes[0] >= model_states_bytes(6_738_000_000, 0, 16) and x.overflow[1] > 0
    assert all(x.layout.data_parallel_size == 16 and x.layout.stages == 1 for x in result.ranked)


def _cli(*args: str, cwd):
    return autotune_cli(*args, cwd=cwd)


def test_predict_and_plan_on_the_shared_zero_study(zero_study, tmp_path):
    study = zero_study.study
    stages = sorted({json.loads((t / "ds_config.json").read_text())["zero_optimization"]["stage"]
                     for t in study.glob("trial-*") if (t / "metrics-rank0.csv").is_file()})
    assert len(stages) >= 3  # the stage sweep ran
    for z in stages:
        proc = _cli("predict", str(study), "--zero-stage", str(z), "--format", "json", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["layout"]["zero_stage"] == z and out["calibration"]["job"] == "plain engine"
        assert out["bubble_fraction"] is None and out["bubble_missing"] == "not a pipeline job"
        assert sum(out["terms_seconds"].values()) == pytest.approx(out["step_seconds"], rel=1e-6)
        if out["measured"] is not None:  # the study ran this very layout at this stage
            assert abs(out["samples_per_second"] / out["measured"]["samples_per_second"] - 1) < 0.25
    text = _cli("predict", str(study), "--zero-stage", str(stages[-1]), cwd=tmp_path).stdout
    assert "bubble      not a pipeline job" in text and f"ZeRO-{stages[-1]}, 2 dp" in text
    plan = _cli("plan", str(study), "--gpus", "16", "--hardware", "h100", "--format", "json", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    ranked = json.loads(plan.stdout)["ranked"]
    assert {x["layout"]["zero_stage"] for x in ranked} == {0, 1, 2, 3}
    assert all(x["bubble_fraction"] is None for x in ranked)
    for args, words in ((("predict", "--stages", "2"), "plain DeepSpeedEngine"),
                        (("predict", "--checkpoint-interval", "1"), "plain DeepSpeedEngine"),
                        (("plan", "--gpus", "16", "--stages", "2", "--hardware", "h100"), "no pipeline"),
                        (("plan", "--gpus", "16", "--dp", "8", "--hardware", "h100"), "dp = --gpus 16")):
        proc = _cli(args[0], str(study), *args[1:], cwd=tmp_path)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_a_knob_trial_of_other_zero_settings_is_not_calibrated_on_and_said(tmp_path):
    """The sweep's overlap_comm trial ran another step than the rest, which the terms do not
    model: the study's model leaves it out, and says which trial and which setting."""
    from autotune.model.zero_step import same_settings

    usual = (("zero_optimization.overlap_comm", "false"),)
    obs = [dataclasses.replace(o, zero_settings=usual) for o in _study()]
    knob = dataclasses.replace(_obs(9, 1, 2, 8), zero_settings=(("zero_optimization.overlap_comm", "true"),),
                               step_seconds=1.0)
    kept, note = same_settings([*obs, knob])
    assert kept == obs and note is not None and "trial(s) 9" in note and "overlap_comm" in note
    assert same_settings(obs) == (obs, None)
