"""DeepSpeed's PipelineEngine (`--engine deepspeed`, the default): the built-in workload's
PipelineModule under DeepSpeed's launcher, fresh per trial or in warm workers.

Its setting steps are the model's own settings a PipelineModule takes: the activation
checkpoint step after an out-of-memory trial (autotune/tuning/checkpoint_step.py) and the
partition rounds (autotune/tuning/balance.py). The performance model replays its
TrainSchedule (autotune/model/schedule.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.core.errors import UserError
from autotune.core.options import WorkloadOptions
from autotune.engines.base import require_stages
from autotune.trials.launcher import DEEPSPEED_LAUNCH

if TYPE_CHECKING:
    from autotune.core.dsconfig import DsConfig
    from autotune.core.options import RunOptions
    from autotune.core.space import SearchSpace
    from autotune.trials.multinode import Cluster
    from autotune.tuning.steps import SettingStep


class DeepSpeedPipeline:
    name = "deepspeed"
    title = "DeepSpeed PipelineEngine"
    launch = DEEPSPEED_LAUNCH
    workload_knobs: frozenset[str] = frozenset()
    config_knobs: frozenset[str] = frozenset()
    step_model: str | None = "DeepSpeed's TrainSchedule (autotune/model/schedule.py)"

    def validate(self, opts: RunOptions) -> None:
        wl, defaults = opts.workload, WorkloadOptions()
        require_stages(wl.pipeline_stages)
        if (wl.schedule, wl.virtual_stages) != (defaults.schedule, defaults.virtual_stages):
            raise UserError("--schedule and --virtual-stages choose a torch.distributed.pipelining schedule: "
                            "add --engine torch (DeepSpeed's engine runs its own 1F1B)")

    def check_config(self, opts: RunOptions, base: DsConfig) -> None:
        """What DeepSpeed refuses under a pipeline (ZeRO 2 and 3); the rest the job's checks let through."""
        base.check_pipeline()

    def space(self, opts: RunOptions, base: DsConfig, space: SearchSpace) -> SearchSpace:
        return space

    def steps(self, opts: RunOptions, base: DsConfig, space: SearchSpace, *, root: Path,
              note: Callable[[str], None], noise: float, cluster: Cluster | None) -> list[SettingStep]:
        wl = opts.workload
        from autotune.tuning.layer_cost_step import layer_cost_steps

        steps: list[SettingStep] = layer_cost_steps(wl)  # the baseline's layer costs (plan from any study)
        # the checkpoint step where the model allows it: the built-in model, not yet checkpointing
        if (opts.checkpoint_on_oom and wl.model is None and not wl.activation_checkpoint_interval
                and not base.activation_checkpoint_interval):
            from autotune.tuning.checkpoint_step import CheckpointStep

            steps.append(CheckpointStep(space, note))
        if wl.balance_stages:  # the partition step (autotune/tuning/balance.py)
            from autotune.tuning.balance import StageBalancer

            steps.append(StageBalancer(root, note, method=wl.partition_method, noise=noise,
                                       multi_node=cluster is not None and cluster.multi_node))
        return steps

    def describe(self, opts: RunOptions) -> str:
        return ""
