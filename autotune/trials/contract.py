"""The trial contract: what the tuner asks of any way of running a trial, and what it gets back.

Three runners implement it: fresh processes and warm workers for the built-in workload
(autotune/trials/builtin.py) and the user's own command (autotune/trials/user_command.py). Where the
ranks run (one machine or several nodes) is a property of the launch, not a fourth runner.
`tests/test_runner_contract.py` runs every implementation through the same cases.

A setting step (the partition rounds, the knob sweep) says what a trial runs with by filling
in its part of the request (`parts`, `layer_costs`, `knob_values`), never by reaching into a
runner: the request is the whole of what a trial is told.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from autotune.core.dsconfig import DEEPSPEED_DEFAULT_BUCKET, DsConfig
from autotune.core.rank_plan import RankPlan, RankSettings
from autotune.core.space import TrialConfig
from autotune.rank.watchdog import StallLimits

if TYPE_CHECKING:  # the contract names these types; importing them here would pull the runners in
    from autotune.trials.judge import TrialOutcome
    from autotune.trials.launcher import TrialProcess
    from autotune.trials.multinode import Cluster


@dataclass(frozen=True, slots=True)
class Incumbent:
    """The best trial so far: a trial that cannot plausibly beat it may stop early
    (autotune/core/step_budget.py)."""

    samples_per_second: float
    noise: float
    """The margin within which two runs of one configuration may differ."""


@dataclass(kw_only=True, slots=True)
class TrialRequest:
    """One trial, as the tuner asks for it."""

    number: int
    config: TrialConfig
    trial_dir: Path
    timeout: float
    """Seconds for the whole trial (autotune/trials/limits.py)."""
    stall: StallLimits | None = None
    """Each rank's start-up and step limits (autotune/rank/watchdog.py); None: no watchdog."""
    incumbent: Incumbent | None = None
    """None: measured in full (the baseline, a re-measurement)."""
    on_start: Callable[[TrialProcess], None] | None = None
    """Receives the launched process group (the study records its group id and port)."""
    parts: list[int] | None = None
    """Stage boundaries the pipeline is built with (the partition step); None: the job's own method."""
    layer_costs: bool | None = None
    """Time every layer (the partition step's measuring trials); None: as the study was started."""
    trace_steps: int = 0
    """Steps to record a torch.profiler trace of on every rank (the trace step); 0: none."""
    knob_values: dict[str, str] = field(default_factory=dict)
    """The user's model settings for this trial (the knob sweep, autotune/tuning/knob_sweep.py)."""


def plan_for(request: TrialRequest, trial_dir: Path, settings: RankSettings) -> RankPlan:
    """What the trial's ranks are told: the runner's own settings with the request's part (its
    number, the incumbent to beat, the watchdog's limits, the setting steps' asks). The one
    request-to-plan mapping of every runner."""
    incumbent = request.incumbent
    return settings.plan(trial_dir=str(trial_dir), trial=request.number,
                         incumbent=(incumbent.samples_per_second, incumbent.noise) if incumbent else None,
                         limits=request.stall.to_dict() if request.stall is not None else None,
                         trace_steps=request.trace_steps, layer_costs=request.layer_costs, parts=request.parts)


@runtime_checkable
class Runner(Protocol):
    """Runs trials of one job. Every ending, failures included, is a TrialOutcome: a trial never
    raises into the tuner (an interrupt aside, which stops the trial's processes on its way out)."""

    cluster: Cluster | None
    """The nodes the ranks run on (autotune/trials/multinode.py); None: this machine."""

    def ds_config_for(self, config: TrialConfig) -> dict[str, object]:
        """The ds_config.json a trial of `config` runs with (also the study's best config file)."""
        ...

    def run(self, request: TrialRequest) -> TrialOutcome:
        """Run one trial in `request.trial_dir` and judge how it ended (autotune/trials/judge.py)."""
        ...

    def begin_close(self) -> None:
        """No trial follows: processes kept between trials may start exiting now."""
        ...

    def close(self) -> None:
        """The end of the run: nothing of the runner is left running."""
        ...


def trial_ds_config(base: DsConfig, config: TrialConfig, data_parallel_size: int, *,
                    own_when_unchanged: bool = False) -> dict[str, object]:
    """The ds_config.json a trial of `config` runs with, for every runner (`Runner.ds_config_for`):
    the base config with the trial's micro-batch, GAS, train_batch_size, bucket and
    `pipeline.activation_checkpoint_interval` (DeepSpeed's PipelineEngine sets it on the module
    when > 0, deepspeed-facts.md, so a user's script runs it too).

    `own_when_unchanged`: where the base would run exactly this trial, the base itself, as the
    user wrote it (the user's command: its own config stays byte for byte its own)."""
    if own_when_unchanged:
        layout = base.resolve_batch(data_parallel_size)
        own_bucket = base.reduce_bucket_size or DEEPSPEED_DEFAULT_BUCKET
        if (config.micro_batch_size == layout.micro_batch_size
                and config.gradient_accumulation_steps == layout.gradient_accumulation_steps
                and config.reduce_bucket_size in (None, own_bucket)
                and config.activation_checkpoint_interval in (0, base.activation_checkpoint_interval)):
            return dict(base.to_dict())
    return dict(base.with_trial(
        micro_batch_size=config.micro_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        data_parallel_size=data_parallel_size,
        reduce_bucket_size=config.reduce_bucket_size,
        activation_checkpoint_interval=config.activation_checkpoint_interval,
    ).to_dict())

