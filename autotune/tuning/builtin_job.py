"""The built-in workload as a tuning job (autotune/tuning/job.py): the preset model of
autotune/rank/workload/, its ranks started by autotune itself, fresh or warm (autotune/trials/builtin.py),
under the engine `--engine` names (autotune/engines/). What engines share is here; what differs,
the job asks its engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from autotune.core.dsconfig import DsConfig, check_known_zero_keys
from autotune.core.errors import UserError
from autotune.core.options import RunOptions
from autotune.core.space import SearchSpace
from autotune.engines.base import Engine
from autotune.engines.registry import ENGINES, engine_named
from autotune.study.store import Study
from autotune.trials.builtin import builtin_runner
from autotune.trials.contract import Runner
from autotune.trials.multinode import Cluster
from autotune.tuning.starting_point import build_space, load_base_config, require_optimizer
from autotune.tuning.steps import SettingStep
from autotune.tuning.validation import validate


class BuiltinJob:
    def validate(self, opts: RunOptions) -> None:
        if opts.knobs:
            from autotune.usercmd.knobs import refuse_for_built_in

            refuse_for_built_in(opts.knobs)  # always raises: one line naming the flag to use
        validate(opts, built_in=True)
        engine = self.engine(opts)
        if opts.tuner == "model" and engine.step_model is None:
            modelled = ", ".join(f"{e.name} ({e.step_model})" for e in ENGINES.values() if e.step_model)
            raise UserError(f"--tuner model: not available under --engine {engine.name} yet (the performance "
                            f"model replays the step of --engine {modelled})")
        engine.validate(opts)

    @staticmethod
    def engine(opts: RunOptions) -> Engine:
        return engine_named(opts.workload.engine)

    def base_config(self, opts: RunOptions) -> DsConfig:
        return load_base_config(opts)

    def check_config(self, opts: RunOptions, base: DsConfig) -> None:
        self.engine(opts).check_config(opts, base)  # what the engine cannot build at all, first
        require_optimizer(base, opts.config)  # a config without one would fail every trial alike
        check_known_zero_keys(base, opts.config or "the config")  # nor one DeepSpeed's ZeRO section refuses

    def space(self, opts: RunOptions, base: DsConfig) -> SearchSpace:
        return self.engine(opts).space(opts, base, build_space(opts, base))

    def describe(self, opts: RunOptions) -> str:
        wl = opts.workload
        shape = (f"{wl.pipeline_stages} stages x {wl.data_parallel_size} dp = {wl.world_size} ranks"
                 if wl.pipeline_stages > 1 else f"{wl.world_size} data-parallel ranks")
        return f"workload: {wl.preset}, {shape}{self.engine(opts).describe(opts)}"

    def store(self, study: Study) -> None:
        """The study's settings hold the whole workload."""

    def runner(self, opts: RunOptions, base: DsConfig, *, note: Callable[[str], None],
               cluster: Cluster | None) -> Runner:
        engine = self.engine(opts)
        return builtin_runner(opts.workload, base, note=note, cluster=cluster, launch=engine.launch,
                              workload_knobs=engine.workload_knobs, config_knobs=engine.config_knobs)

    def steps(self, opts: RunOptions, base: DsConfig, space: SearchSpace, *, root: Path,
              note: Callable[[str], None], noise: float, cluster: Cluster | None) -> list[SettingStep]:
        return self.engine(opts).steps(opts, base, space, root=root, note=note, noise=noise, cluster=cluster)
