"""A plain DeepSpeedEngine with ZeRO (`--engine zero`, issue 42): the built-in decoder as one
module, every rank a data-parallel replica (ranks = --dp, no stages), stepped by
autotune/rank/zero/engine.py under DeepSpeed's launcher, fresh per trial or in warm workers.

This is the engine HF Trainer and Lightning build, and the ground of DeepSpeed's own autotuner.
Its communication is ZeRO's collectives, timed per call (autotune/rank/collectives.py); the
bucket it searches is `reduce_bucket_size`, which buckets the reduction at ZeRO stages 1-3
(autotune/core/dsconfig.py `reduce_bucket_inert`, pipeline=False).

What it does not do yet, refused in one line rather than ignored: the pipeline-only options
(`--stages`, partitions, layer costs, activation checkpointing of a PipelineModule, the
slowdown hooks) and several nodes. Profiler traces (`--trace-steps`) label its phases and
collectives (autotune/core/trace_labels.py). The performance model's tuner (`--tuner
model`) runs on autotune/model/zero_step.py, the model of a plain engine's step by ZeRO stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.core.dsconfig import (
    ZERO_SETTINGS,
    ZERO_SIZES,
    ZERO_STAGE_KEY,
    effective_zero_settings,
    mixed_precision,
)
from autotune.core.errors import UserError
from autotune.core.knob import Knob
from autotune.core.options import WorkloadOptions
from autotune.trials.launcher import DEEPSPEED_LAUNCH

if TYPE_CHECKING:
    from autotune.core.dsconfig import DsConfig
    from autotune.core.options import RunOptions
    from autotune.core.space import SearchSpace
    from autotune.core.summary import TrialSummary
    from autotune.trials.multinode import Cluster
    from autotune.tuning.knob_sweep import KnobSweep
    from autotune.tuning.steps import SettingStep

NOT_YET = "not available under --engine zero yet"
NO_STAGES = "the ZeRO engine has no pipeline stages: its ranks are --dp replicas of the whole model"
STAGES = 1
"""The one "stage" of a plain engine: the whole model on every rank."""


STAGE_KNOB, ZERO_KNOBS = ZERO_STAGE_KEY, ZERO_SETTINGS
SWITCHES = ("zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients")
SIZE_VALUES = {"zero_optimization.allgather_bucket_size": ("50000000", "200000000", "500000000"),
               "zero_optimization.stage3_prefetch_bucket_size": ("50000000", "200000000"),
               "zero_optimization.stage3_param_persistence_threshold": ("100000", "1000000"),
               "zero_optimization.stage3_max_live_parameters": ("300000000", "1000000000")}
"""The sizes the sweep tries, DeepSpeed's default among them: the gather of the updated partitions
(ZeRO-1/2), and at ZeRO-3 the prefetch, the parameters kept whole, the parameters live at once."""
assert set(SIZE_VALUES) == set(ZERO_SIZES)
STAGE3_ONLY = tuple(k for k in SIZE_VALUES if ".stage3_" in k)


class DeepSpeedZero:
    name = "zero"
    title = "DeepSpeed ZeRO (a plain DeepSpeedEngine)"
    launch = DEEPSPEED_LAUNCH  # the same rank entry and warm worker: the rank builds by --engine
    workload_knobs: frozenset[str] = frozenset()
    config_knobs = frozenset(ZERO_KNOBS)
    step_model: str | None = "a plain engine's step by ZeRO stage (autotune/model/zero_step.py)"

    def validate(self, opts: RunOptions) -> None:
        wl, defaults = opts.workload, WorkloadOptions()
        if wl.pipeline_stages not in (defaults.pipeline_stages, STAGES):
            raise UserError(f"--stages {wl.pipeline_stages}: {NO_STAGES}")
        refused = {
            "--model (your own PipelineModule)": wl.model is not None,
            "--schedule/--virtual-stages (torch.distributed.pipelining's)":
                (wl.schedule, wl.virtual_stages) != (defaults.schedule, defaults.virtual_stages),
            "--partition-method": wl.partition_method != defaults.partition_method,
            "--layer-costs": wl.layer_costs, "--balance-stages": wl.balance_stages,
            "--activation-checkpoint-interval": wl.activation_checkpoint_interval > 0,
            "--slow-stage/--slow-layer": wl.slow_stage is not None or wl.slow_layer is not None,
            "--hostfile/--include/--exclude/--num_nodes/--num_gpus/--master_addr (several nodes)":
                any((wl.hostfile, wl.include, wl.exclude, wl.num_nodes, wl.num_gpus, wl.master_addr)),
        }
        for what, given in refused.items():
            if given:
                raise UserError(f"{what}: {NOT_YET}")
        # the run's shape from here on: one "stage", so ranks = dp (core/options.py world_size)
        wl.pipeline_stages = STAGES

    def check_config(self, opts: RunOptions, base: DsConfig) -> None:
        """DeepSpeed builds ZeRO stages 0-3 on a plain engine; the config's own checks ran already."""
        if base.activation_checkpoint_interval:
            raise UserError(f"{opts.config}: pipeline.activation_checkpoint_interval: a PipelineModule's "
                            "setting; the ZeRO engine's model is a plain module")

    def space(self, opts: RunOptions, base: DsConfig, space: SearchSpace) -> SearchSpace:
        """The bucket as a plain engine has it: it acts at ZeRO stages 1-3 with dp > 1."""
        from autotune.tuning.starting_point import build_space

        return dataclasses.replace(build_space(opts, base, pipeline=False), pipeline_stages=STAGES)

    def steps(self, opts: RunOptions, base: DsConfig, space: SearchSpace, *, root: Path,
              note: Callable[[str], None], noise: float, cluster: Cluster | None) -> list[SettingStep]:
        # the setting steps of the pipeline engines are PipelineModule's (checkpointing, partitions)
        return [zero_sweep(base, root, note, stages=zero_stages(opts.zero_stages), parameters=space.model_parameters)]

    def describe(self, opts: RunOptions) -> str:
        return f"; engine: {self.title}"


def zero_stages(text: str) -> tuple[str, ...]:
    """`--zero-stages 0,1,2,3`: the stages the sweep tries, as knob text; anything else is one line."""
    stages = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not stages or any(s not in ("0", "1", "2", "3") for s in stages):
        raise UserError(f"--zero-stages {text!r}: list ZeRO stages from 0 to 3, comma-separated (e.g. 0,1,2,3, "
                        "or the config's own stage alone to fix it)")
    return stages


def zero_sweep(base: DsConfig, root: Path, note: Callable[[str], None], *, then: Sequence[Knob] = (),
               then_own: Mapping[str, str | None] | None = None,
               stages: Sequence[str] = ("0", "1", "2", "3"), parameters: int | None = None) -> KnobSweep:
    """The ZeRO step: the stage (0-3), then `overlap_comm`, `contiguous_gradients` and the sizes
    (`allgather_bucket_size` at ZeRO-1/2; the prefetch bucket, persistence threshold and live
    parameters at ZeRO-3; each dropped where the stage kept or the model's size makes it inert)
    at the stage kept, one trial per value at the baseline's micro-batch and GAS; a value is kept when it beats
    the one in force by more than the noise between launches (autotune/tuning/knob_sweep.py). A
    value that runs out of memory is a failed trial of its own, and the sweep goes on. `then`: the
    user's own knobs (`--knob`, with their `then_own` values), swept after these in the same
    sweep (one `STUDY/knobs.json`). On a device whose size the baseline measured, with mixed
    precision and the model's `parameters` known, a stage predicted not to fit is not tried
    (`stage_too_big`)."""
    from autotune.tuning.knob_sweep import KnobSweep

    own = effective_zero_settings(base)  # what the baseline runs: the config's, else DeepSpeed's defaults
    knobs = [Knob(name=STAGE_KNOB, flag=STAGE_KNOB, joined=True, values=tuple(stages)),
             *(Knob(name=k, flag=k, joined=True, values=("false", "true")) for k in SWITCHES),
             *(Knob(name=k, flag=k, joined=True, values=v) for k, v in SIZE_VALUES.items()), *then]
    refuse = partial(stage_too_big, parameters=parameters, mixed=mixed_precision(base)) if parameters else None
    return KnobSweep(knobs, {**own, **(then_own or {})}, root, note, inert=partial(_inert, parameters=parameters),
                     again=STAGE_KNOB, refuse=refuse)


def stage_too_big(name: str, value: str, baseline: TrialSummary | None, *, parameters: int, mixed: bool) -> str | None:
    """Why a ZeRO stage is not tried: its predicted peak (the baseline's measured peak moved by the
    model states' difference, autotune/model/zero_memory.py) is over the device. Nothing is
    predicted without a device size (a CPU), a measured peak or mixed precision (the model is
    DeepSpeed's estimators', which assume fp16/bf16)."""
    from autotune.model.zero_memory import stage_fit

    if (name != STAGE_KNOB or baseline is None or not mixed or baseline.memory_capacity_bytes is None
            or baseline.memory_peak_bytes is None or baseline.zero_stage is None):
        return None
    fit = stage_fit(int(value), measured_peak_bytes=baseline.memory_peak_bytes, measured_stage=baseline.zero_stage,
                    capacity_bytes=baseline.memory_capacity_bytes, params=parameters,
                    dp=baseline.data_parallel_size)
    return None if fit.fits else fit.why_not()


def _inert(name: str, kept: Mapping[str, str | None], *, parameters: int | None = None) -> str | None:
    """Why a ZeRO setting cannot change the run the stage kept makes: ZeRO-0 has no ZeRO
    reducer or gatherer; `allgather_bucket_size` buckets the gather of ZeRO-1/2 only and the
    stage-3 settings act at ZeRO-3 only; a size at or above the whole model's parameters at every
    value tried makes the same single call (or keeps everything) at each."""
    stage = kept.get(STAGE_KNOB)
    if name in ZERO_KNOBS[1:] and stage == "0":
        return "ZeRO-0 kept, which has no ZeRO gradient reducer for it to change"
    if name in STAGE3_ONLY and stage != "3":
        return f"ZeRO-{stage} kept: the stage-3 settings act at ZeRO-3 only"
    if name == "zero_optimization.allgather_bucket_size" and stage == "3":
        return "ZeRO-3 kept: its gathers go by stage3_prefetch_bucket_size, not allgather_bucket_size"
    if name in SIZE_VALUES and parameters and parameters <= min(int(v) for v in SIZE_VALUES[name]):
        return (f"the model's {parameters:,} parameters are within every value tried, so each makes the same "
                "single call (or keeps every parameter)")
    return None

