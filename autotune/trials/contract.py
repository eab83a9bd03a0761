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
