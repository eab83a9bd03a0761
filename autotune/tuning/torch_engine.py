"""What `--engine torch` changes in a run of the built-in workload (issue 28): its checks, its
search space and its schedule sweep. The trials themselves run through the built-in runner
(autotune/trials/builtin.py, torchrun and autotune/rank/torch_pp/), so the study, the rules and
the outputs are the DeepSpeed engine's.

What it does not do yet, refused in one line rather than ignored: several nodes, the user's
own `--model`, partition methods, per-layer costs and the partition rounds, activation
checkpointing, profiler traces, fp16/bf16, and the performance model's tuner (it follows
DeepSpeed's TrainSchedule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.core import pp_schedules
from autotune.core.dsconfig import DsConfig
from autotune.core.errors import UserError
from autotune.core.options import RunOptions, WorkloadOptions
from autotune.core.space import SearchSpace
from autotune.rank.workload.presets import get_preset

if TYPE_CHECKING:
    from autotune.usercmd.knobs import KnobSweep

ENGINES = ("deepspeed", "torch")
SCHEDULE_KNOB = "schedule"
NOT_YET = "not available under --engine torch yet"


def check_engine(opts: RunOptions) -> None:
    """One line and exit 2 for an engine option this run cannot honour, before any trial."""
    wl = opts.workload
    if wl.engine not in ENGINES:
        raise UserError(f"--engine {wl.engine!r}: use {' or '.join(ENGINES)}")
    defaults = WorkloadOptions()
    if wl.engine == "deepspeed":
        if (wl.schedule, wl.virtual_stages) != (defaults.schedule, defaults.virtual_stages):
            raise UserError("--schedule and --virtual-stages choose a torch.distributed.pipelining schedule: "
                            "add --engine torch (DeepSpeed's engine runs its own 1F1B)")
        return
    refused = {
        "--model": wl.model is not None,
        "--hostfile/--include/--exclude/--num_nodes/--num_gpus/--master_addr (several nodes)":
            any((wl.hostfile, wl.include, wl.exclude, wl.num_nodes, wl.num_gpus, wl.master_addr)),
        "--partition-method (the torch engine lays the decoder layers out evenly, torchtitan's layers per stage)":
            wl.partition_method != defaults.partition_method,
        "--layer-costs": wl.layer_costs, "--balance-stages": wl.balance_stages,
        "--activation-checkpoint-interval": wl.activation_checkpoint_interval > 0,
        "--trace-steps": opts.trace_steps > 0,
        "--tuner model (the performance model follows DeepSpeed's TrainSchedule)": opts.tuner == "model",
        "--slow-stage/--slow-layer": wl.slow_stage is not None or wl.slow_layer is not None,
    }
    for what, given in refused.items():
        if given:
            raise UserError(f"{what}: {NOT_YET}")
    preset = get_preset(wl.preset)
    pp_schedules.check(wl.schedule, ranks=wl.pipeline_stages, layers=preset.num_layers,
                       virtual_stages=wl.virtual_stages, available=pp_schedules.installed())


def check_torch_config(opts: RunOptions, base: DsConfig, path: object) -> None:
    """What of the ds_config the torch engine cannot build (the same for every trial)."""
    from autotune.rank.torch_pp.engine import OPTIMIZERS

    kind = str((base.raw.get("optimizer") or {}).get("type", "")).lower()
    if kind not in OPTIMIZERS:
        raise UserError(f"{path}: optimizer {kind!r}: the torch engine builds Adam, AdamW or SGD")
    wl = opts.workload
    from autotune.tuning.starting_point import baseline_config, build_space

    m = baseline_config(base, opts, build_space(opts, base)).gradient_accumulation_steps
    why = pp_schedules.refuses(wl.schedule, ranks=wl.pipeline_stages, micro_batches=m,
                               virtual_stages=wl.virtual_stages)
    if why:
        raise UserError(f"--schedule {wl.schedule}: {why} (the baseline's gradient_accumulation_steps, from {path})")
    for section in ("fp16", "bf16"):
        if (base.raw.get(section) or {}).get("enabled"):
            raise UserError(f"{path}: {section}: {NOT_YET} (its trials train in fp32)")


def torch_space(space: SearchSpace) -> SearchSpace:
    """The DeepSpeed space without the bucket: the torch engine has no ZeRO bucket to size."""
    return dataclasses.replace(space, bucket_range=None, bucket_saturation=None,
                               bucket_note="reduce_bucket_size not searched: the torch engine all-reduces "
                                           "each gradient whole (no ZeRO bucket)")


def schedule_sweep(wl: WorkloadOptions, baseline_micro_batches: int, root: Path,
                   note: Callable[[str], None]) -> KnobSweep:
    """The schedule step: each installed schedule the layout fits, one trial each at the
    baseline's micro-batch and micro-batch count; the fastest kept for the search (the knob
    sweep's rule, autotune/usercmd/knobs.py). A schedule that refuses the baseline's count is
    not swept, and the run says why."""
    from autotune.usercmd.knobs import Knob, KnobSweep

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
    return KnobSweep([knob], ("--schedule", wl.schedule), root, note)
