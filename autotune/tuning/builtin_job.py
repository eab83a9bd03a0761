"""The built-in workload as a tuning job (autotune/tuning/job.py): the preset model of
autotune/rank/workload/, its ranks started by autotune itself, fresh or warm (autotune/trials/builtin.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from autotune.core.dsconfig import DsConfig
from autotune.core.options import RunOptions
from autotune.core.space import SearchSpace
from autotune.study.store import Study
from autotune.trials.builtin import builtin_runner
from autotune.trials.contract import Runner
from autotune.trials.multinode import Cluster
from autotune.tuning.starting_point import baseline_config, build_space, require_optimizer
from autotune.tuning.steps import SettingStep
from autotune.tuning.torch_engine import (
    check_engine,
    check_torch_config,
    schedule_sweep,
    torch_space,
)
from autotune.tuning.validation import validate


class BuiltinJob:
    def validate(self, opts: RunOptions) -> None:
        if opts.knobs:
            from autotune.usercmd.knobs import refuse_for_built_in

            refuse_for_built_in(opts.knobs)  # always raises: one line naming the flag to use
        validate(opts, built_in=True)
        check_engine(opts)

    def check_config(self, opts: RunOptions, base: DsConfig) -> None:
        require_optimizer(base, opts.config)  # a config without one would fail every trial alike
        if opts.workload.engine == "torch":
            check_torch_config(opts, base, opts.config)

    def space(self, opts: RunOptions, base: DsConfig) -> SearchSpace:
        space = build_space(opts, base)
        return torch_space(space) if opts.workload.engine == "torch" else space

    def describe(self, opts: RunOptions) -> str:
        wl = opts.workload
        engine = (f"; engine: torch.distributed.pipelining, schedule {wl.schedule}" if wl.engine == "torch"
                  else "")
        return (f"workload: {wl.preset}, {wl.pipeline_stages} stages x {wl.data_parallel_size} dp = "
                f"{wl.world_size} ranks{engine}")

    def store(self, study: Study) -> None:
        """The study's settings hold the whole workload."""

    def runner(self, opts: RunOptions, base: DsConfig, *, note: Callable[[str], None],
               cluster: Cluster | None) -> Runner:
        return builtin_runner(opts.workload, base, note=note, cluster=cluster)

    def steps(self, opts: RunOptions, base: DsConfig, space: SearchSpace, *, root: Path,
              note: Callable[[str], None], noise: float, cluster: Cluster | None) -> list[SettingStep]:
        wl = opts.workload
        steps: list[SettingStep] = []
        if wl.engine == "torch":  # the schedule sweep; the model settings below are DeepSpeed's PipelineModule's
            steps.append(schedule_sweep(wl, baseline_config(base, opts, space).gradient_accumulation_steps, root, note))
            return steps
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
