"""The simulated study (benchmarks/sim_study.py) that scores `--tuner model` on the tuner
benchmark's landscapes (issue 44): its observations are what the model would read from a real
study of the scenario, so the model calibrated on them predicts the scenario's own step, and the
model tuner runs on it through the same `ModelGuidedProposer` `autotune run` builds."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.core.space import TrialConfig
from autotune.model.step_model import Layout, predict
from autotune.tuning.proposers.model_guided import ModelGuidedProposer
from benchmarks.sim_landscape import SimRun, scenarios
from benchmarks.sim_study import SimStudy


def _noise_free(name: str):
    sc = next(s for s in scenarios() if s.name == name)
    return dataclasses.replace(sc, noise=0.0, straggler_rate=0.0, mem_jitter=1e-6)


@pytest.mark.parametrize("name", ["cpu-tiny-2x2", "gpt-4x1-imbalanced"])
def test_the_model_of_a_noise_free_simulated_study_predicts_the_scenarios_step(name):
    sc = _noise_free(name)
    sim, study = SimRun(sc, 0), SimStudy(sc)
    tried = [sc.baseline, TrialConfig(micro_batch_size=1, gradient_accumulation_steps=sc.baseline.gradient_accumulation_steps * 4,
                                      reduce_bucket_size=sc.baseline.reduce_bucket_size),
             TrialConfig(micro_batch_size=16, gradient_accumulation_steps=2, reduce_bucket_size=sc.baseline.reduce_bucket_size)]
    for t, cfg in enumerate(tried):
        study.record(t, cfg, sim(cfg, t))
    model = study.model()
    assert model.observations[0].layer_costs is not None and model.calibration.layers is not None
    unseen = TrialConfig(micro_batch_size=8, gradient_accumulation_steps=4, reduce_bucket_size=sc.baseline.reduce_bucket_size)
    p = predict(model.calibration, Layout(micro_batch_size=8, gradient_accumulation_steps=4,
                                          stages=sc.space.pipeline_stages, data_parallel_size=sc.space.data_parallel_size,
                                          reduce_bucket_size=unseen.reduce_bucket_size))
    assert p.step_seconds == pytest.approx(sc.breakdown(unseen)["step"], rel=0.10)


def test_the_model_tuner_runs_on_a_simulated_study():
    sc = _noise_free("cpu-tiny-2x2")
    sim, study = SimRun(sc, 1), SimStudy(sc)
    prop = ModelGuidedProposer(sc.space, models=study.model)
    sources = []
    for t in range(4):
        if t == 0:
            cfg, reason = sc.baseline, "baseline"
        else:
            proposal = prop.ask()
            cfg, reason = proposal.config, proposal.reason
        result = sim(cfg, t)
        study.record(t, cfg, result)
        prop.tell(cfg, result)
        sources.append(reason)
    assert "second micro-batch size" in sources[1]  # one size measured: the farthest next
    assert any("the model predicts" in r or "bucket count only" in r for r in sources[2:]), sources


def test_the_model_tuner_explores_the_farthest_micro_batch_that_its_memory_model_says_fits():
    """A 7B pipeline on 80 GB GPUs, baseline micro 1: the largest micro-batch does not fit. From the
    baseline's layer costs (each layer's activations per sample) and the device's capacity, the
    second trial is the largest micro-batch predicted to fit, not the first out-of-memory trial."""
    sc = _noise_free("llama7b-8x4-gb1024")
    sim, study = SimRun(sc, 2), SimStudy(sc)
    prop = ModelGuidedProposer(sc.space, models=study.model)
    first = sim(sc.baseline, 0)
    study.record(0, sc.baseline, first)
    prop.tell(sc.baseline, first)
    second = prop.ask().config
    fits = [m for m in sc.space.micro_batch_sizes if sc.p_ok(TrialConfig(
        micro_batch_size=m, gradient_accumulation_steps=max(1, 1024 // (m * sc.space.data_parallel_size)),
        reduce_bucket_size=sc.baseline.reduce_bucket_size)) > 0.5]
    assert max(sc.space.micro_batch_sizes) not in fits  # the scenario has a cliff to fall off
    assert sc.p_ok(second) > 0.5 and second.micro_batch_size >= max(fits) // 2, second
