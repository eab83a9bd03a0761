"""torch.distributed.pipelining (`--engine torch`, issue 28): the built-in workload's decoder
laid out in `PipelineStage`s and run by one of torch's schedules, its ranks started by torchrun
(autotune/rank/torch_pp/, behind the engine face the probe reads). The study, the rules and the
outputs are the DeepSpeed engine's; what differs is here: its checks, its space (no ZeRO
bucket) and its setting step, the schedule sweep.

What it does not do yet, refused in one line rather than ignored: several nodes, the user's
own `--model`, partition methods, per-layer costs and the partition rounds, activation
checkpointing, profiler traces, fp16/bf16, and the performance model's tuner (it replays
DeepSpeed's TrainSchedule), and warm workers (each trial is a torchrun launch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.core import pp_schedules
from autotune.core.errors import UserError
from autotune.core.knob import Knob
from autotune.core.options import WorkloadOptions
from autotune.engines.base import require_stages
from autotune.rank.workload.presets import get_preset
from autotune.trials.launcher import TORCHRUN, TORCHRUN_STYLE, RankLaunch

if TYPE_CHECKING:
    from autotune.core.dsconfig import DsConfig
    from autotune.core.options import RunOptions
    from autotune.core.space import SearchSpace
    from autotune.trials.multinode import Cluster
    from autotune.tuning.knob_sweep import KnobSweep
    from autotune.tuning.steps import SettingStep

SCHEDULE_KNOB = "schedule"
"""The sweep's knob: the workload option it sets per trial (autotune/trials/builtin.py `workload_for`)."""
NOT_YET = "not available under --engine torch yet"
RANK_ENTRY = Path(__file__).resolve().parents[2] / "rank" / "torch_pp" / "train.py"
"""The built-in workload's rank under torch.distributed.pipelining, started by torchrun."""
TORCH_IS_FRESH = "the torch engine's trials run in fresh processes (torchrun per trial; no warm pool yet)"


class TorchPipelining:
    name = "torch"
    title = "torch.distributed.pipelining"
    launch = RankLaunch(launcher=TORCHRUN, script=RANK_ENTRY, style=TORCHRUN_STYLE, builds_ops=False,
                        warm_refusal=TORCH_IS_FRESH)
    workload_knobs = frozenset({SCHEDULE_KNOB})
    config_knobs: frozenset[str] = frozenset()
    step_model: str | None = None

    def validate(self, opts: RunOptions) -> None:
        """One line and exit 2 for an option this engine cannot honour, before any trial."""
        wl = opts.workload
        defaults = WorkloadOptions()
        require_stages(wl.pipeline_stages)
        refused = {
            "--model": wl.model is not None,
            "--hostfile/--include/--exclude/--num_nodes/--num_gpus/--master_addr (several nodes)":
                any((wl.hostfile, wl.include, wl.exclude, wl.num_nodes, wl.num_gpus, wl.master_addr)),
            "--partition-method (the torch engine lays the decoder layers out evenly, torchtitan's layers per stage)":
                wl.partition_method != defaults.partition_method,
            "--layer-costs": wl.layer_costs, "--balance-stages": wl.balance_stages,
            "--activation-checkpoint-interval": wl.activation_checkpoint_interval > 0,
            "--trace-steps": opts.trace_steps > 0,
            "--slow-stage/--slow-layer": wl.slow_stage is not None or wl.slow_layer is not None,
        }
        for what, given in refused.items():
            if given:
                raise UserError(f"{what}: {NOT_YET}")
        preset = get_preset(wl.preset)
        pp_schedules.check(wl.schedule, ranks=wl.pipeline_stages, layers=preset.num_layers,
                           virtual_stages=wl.virtual_stages, available=pp_schedules.installed())

    def check_config(self, opts: RunOptions, base: DsConfig) -> None:
        """What of the ds_config the torch engine cannot build (the same for every trial)."""
        from autotune.rank.torch_pp.engine import OPTIMIZERS

        base.check_pipeline()  # as under DeepSpeed's pipeline: the bucket and ZeRO stage it keeps are ZeRO-1's
        path = opts.config
        kind = str((base.raw.get("optimizer") or {}).get("type", "")).lower()
        if kind not in OPTIMIZERS:
            raise UserError(f"{path}: optimizer {kind!r}: the torch engine builds Adam, AdamW or SGD")
        wl = opts.workload
        m = _baseline_micro_batches(opts, base)
        why = pp_schedules.refuses(wl.schedule, ranks=wl.pipeline_stages, micro_batches=m,
                                   virtual_stages=wl.virtual_stages)
        if why:
            raise UserError(f"--schedule {wl.schedule}: {why} (the baseline's gradient_accumulation_steps, "
                            f"from {path})")
        for section in ("fp16", "bf16"):
            if (base.raw.get(section) or {}).get("enabled"):
                raise UserError(f"{path}: {section}: {NOT_YET} (its trials train in fp32)")

    def space(self, opts: RunOptions, base: DsConfig, space: SearchSpace) -> SearchSpace:
        """The DeepSpeed space without the bucket: the torch engine has no ZeRO bucket to size."""
        return dataclasses.replace(space, bucket_range=None, bucket_saturation=None,
                                   bucket_note="reduce_bucket_size not searched: the torch engine all-reduces "
                                               "each gradient whole (no ZeRO bucket)")

    def steps(self, opts: RunOptions, base: DsConfig, space: SearchSpace, *, root: Path,
              note: Callable[[str], None], noise: float, cluster: Cluster | None) -> list[SettingStep]:
        # the model settings the DeepSpeed engine steps through are PipelineModule's: none here
        return [schedule_sweep(opts.workload, _baseline_micro_batches(opts, base, space), root, note)]

    def describe(self, opts: RunOptions) -> str:
        return f"; engine: {self.title}, schedule {opts.workload.schedule}"


def _baseline_micro_batches(opts: RunOptions, base: DsConfig, space: SearchSpace | None = None) -> int:
    from autotune.tuning.starting_point import baseline_config, build_space

    return baseline_config(base, opts, space or build_space(opts, base)).gradient_accumulation_steps


def schedule_sweep(wl: WorkloadOptions, baseline_micro_batches: int, root: Path,
                   note: Callable[[str], None]) -> KnobSweep:
    """The schedule step: each installed schedule the layout fits, one trial each at the
    baseline's micro-batch and micro-batch count; the fastest kept for the search (the knob
    sweep's rule, autotune/tuning/knob_sweep.py). A schedule that refuses the baseline's count is
    not swept, and the run says why."""
    from autotune.tuning.knob_sweep import KnobSweep

    preset = get_preset(wl.preset)
    values = []
    for name in pp_schedules.fitting(ranks=wl.pipeline_stages, layers=preset.num_layers,
                                     virtual_stages=wl.virtual_stages, available=pp_schedules.installed()):
        why = pp_schedules.refuses(name, ranks=wl.pipeline_stages, micro_batches=baseline_micro_batches,
                                   virtual_stages=wl.virtual_stages)
        if why:
            note(f"      schedule {name} not swept: {why} (the baseline's count)")
        else:
            values.append(name)
    knob = Knob(name=SCHEDULE_KNOB, flag="--schedule", joined=False, values=tuple(values))
    return KnobSweep([knob], {SCHEDULE_KNOB: wl.schedule}, root, note)
