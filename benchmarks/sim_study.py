"""A simulated study for the performance model: what `autotune run` would have written for each
trial of a `sim_landscape.Scenario`, as the model's own observations (issue 44, the simulator gap).

A real study holds each trial's metrics CSVs, and its baseline each layer's cost; the model
(autotune/model/) reads them as `Observation`s. Here each successful simulated trial becomes
that observation directly, from the scenario's noise-free breakdown times the trial's noise
factor (the same factor its samples/s carries): per stage the forward+backward work of the
step, the data-parallel reduction, the optimizer step and the peak memory; the baseline (trial
0) also carries layer costs, `LAYERS_PER_STAGE` equal layers per stage, a third of each
layer's work forward, as a pipeline study's baseline measures them by default. So
`--tuner model` is scored on the landscapes the other tuners are, with the same noise.
"""

from __future__ import annotations

from pathlib import Path

from autotune.core.space import TrialConfig
from autotune.core.trial_result import TrialResult
from autotune.model.observations import Observation, StageMeasure
from autotune.model.step_model import calibrate
from autotune.model.study_model import StudyModel
from autotune.rank.layer_costs import LayerCosts
from benchmarks.sim_landscape import Scenario

LAYERS_PER_STAGE = 4
FORWARD_SHARE = 1 / 3


class SimStudy:
    """The observations of one simulated run so far; `model()` is what `autotune run` would calibrate."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.observations: list[Observation] = []

    def record(self, trial: int, cfg: TrialConfig, result: TrialResult) -> None:
        if not result.ok or result.summary is None or not result.samples_per_second:
            return
        sc, summary = self.scenario, result.summary
        bd = sc.breakdown(cfg)
        factor = bd["step"] / summary.step_seconds  # the trial's noise, as its samples/s carries it
        p, m = sc.space.pipeline_stages, cfg.gradient_accumulation_steps
        peak = summary.memory_peak_bytes
        stages = [StageMeasure(work_seconds=m * bd["per_micro"][s] / factor,
                               wall_compute_seconds=m * bd["per_micro"][s] / factor,
                               optimizer_seconds=sc.optimizer_seconds / factor,
                               reduce_seconds=bd["reduce"] / factor, transfer_seconds=None, data_seconds=0.0,
                               wait_seconds=0.0, step_seconds=summary.step_seconds, peak_memory_bytes=peak)
                  for s in range(p)]
        self.observations.append(Observation(
            trial=trial, micro_batch_size=cfg.micro_batch_size, gradient_accumulation_steps=m,
            reduce_bucket_size=cfg.reduce_bucket_size, checkpoint_interval=0, stages=p,
            data_parallel_size=sc.space.data_parallel_size, step_seconds=summary.step_seconds,
            samples_per_second=result.samples_per_second, device="cuda", stage=stages,
            layer_costs=self._layer_costs(cfg, factor) if trial == 0 else None,
            peak_memory_kind="cuda_max_allocated", parts=self._parts() if trial == 0 else None,
            seq_length=sc.seq_length, zero_stage=sc.zero_stage))

    def _parts(self) -> list[int]:
        return [s * LAYERS_PER_STAGE for s in range(self.scenario.space.pipeline_stages + 1)]

    def _layer_costs(self, cfg: TrialConfig, factor: float) -> LayerCosts:
        sc = self.scenario
        p, m, mb = sc.space.pipeline_stages, cfg.gradient_accumulation_steps, cfg.micro_batch_size
        per_layer = [m * sc._micro_seconds(s, mb) / factor / LAYERS_PER_STAGE
                     for s in range(p) for _ in range(LAYERS_PER_STAGE)]
        n = len(per_layer)
        return LayerCosts(
            names=[f"layer{i}" for i in range(n)], forward_seconds=[c * FORWARD_SHARE for c in per_layer],
            backward_seconds=[c * (1 - FORWARD_SHARE) for c in per_layer],
            parameters=[int(sc.params_per_stage / LAYERS_PER_STAGE)] * n,
            activation_bytes=[int(sc.mem_activation_bytes_per_sample * mb / LAYERS_PER_STAGE)] * n,
            parts=self._parts(), stage_overhead_seconds=[0.0] * p,
            stage_peak_memory_bytes=[sc.memory_bytes(cfg)] * p, peak_memory_kind="cuda_max_allocated",
            micro_batch_size=mb, gradient_accumulation_steps=m)

    def model(self) -> StudyModel:
        """The study's model, calibrated on every observation so far (a UserError before any)."""
        params = int(self.scenario.params_per_stage * self.scenario.space.pipeline_stages)
        cal = calibrate(self.observations, cores=None, model_parameters=params)
        return StudyModel(root=Path(f"simulated:{self.scenario.name}"), calibration=cal,
                          observations=list(self.observations), workload=None)
