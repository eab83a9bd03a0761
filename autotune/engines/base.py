"""The engine plug-in: what a run of the built-in workload asks of the engine its ranks build.

The built-in job (autotune/tuning/builtin_job.py) holds one `Engine` for the run, chosen once
by `--engine` (autotune/engines/registry.py), and asks it at each point where engines differ;
what they share (the preset, the data, the rules, the study, the outputs) is the job's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from autotune.core.dsconfig import DsConfig
    from autotune.core.options import RunOptions
    from autotune.core.space import SearchSpace
    from autotune.trials.launcher import RankLaunch
    from autotune.trials.multinode import Cluster
    from autotune.tuning.steps import SettingStep


class Engine(Protocol):
    name: str
    """The `--engine` value."""
    title: str
    """The engine in words (the run's header, the report)."""
    launch: RankLaunch
    """How its ranks start: the launcher, the rank entry, warm workers or not."""
    workload_knobs: frozenset[str]
    """The workload options its setting steps sweep as knobs (autotune/tuning/knob_sweep.py), set
    per trial by the built-in runner: the torch engine's `schedule`."""
    config_knobs: frozenset[str]
    """The ds_config settings its setting steps sweep as knobs, by dotted path, set per trial in
    the trial's ds_config.json by the built-in runner: the ZeRO engine's `zero_optimization.stage`."""
    step_model: str | None
    """What the performance model replays for it (autotune/model/, `--tuner model`); None: it
    has no model of this engine's step yet, and `--tuner model` is refused."""

    def validate(self, opts: RunOptions) -> None:
        """The options this engine cannot honour: one UserError line (exit 2) before any study."""
        ...

    def check_config(self, opts: RunOptions, base: DsConfig) -> None:
        """What of the starting ds_config this engine cannot build (the same for every trial)."""
        ...

    def space(self, opts: RunOptions, base: DsConfig, space: SearchSpace) -> SearchSpace:
        """The job's search space as this engine has it (a knob it lacks taken out, with why)."""
        ...

    def steps(self, opts: RunOptions, base: DsConfig, space: SearchSpace, *, root: Path,
              note: Callable[[str], None], noise: float, cluster: Cluster | None) -> list[SettingStep]:
        """This engine's setting steps (autotune/tuning/steps.py), in the order they propose."""
        ...

    def describe(self, opts: RunOptions) -> str:
        """This engine's part of the job in words: "" for the default engine, else "; engine: ..."."""
        ...


def require_stages(stages: int) -> None:
    """A pipeline engine's one line for `--stages 1` (a plain engine has no stages: `--engine zero`)."""
    from autotune.core.errors import UserError

    if stages < 2:
        raise UserError(f"--stages {stages}: a pipeline needs at least 2 stages; --engine zero trains the "
                        "whole model on every rank")
