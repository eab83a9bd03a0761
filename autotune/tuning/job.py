"""The workload contract: what a tuning run needs of the job it tunes.

Two jobs implement it: the built-in workload (autotune/tuning/builtin_job.py) and the user's own
command (autotune/usercmd/job.py). Each offers its checks, its search space, its runner (the
trial contract, autotune/trials/contract.py), its setting steps (autotune/tuning/steps.py) and
its description, so the run's assembly (autotune/tuning/session.py) has no branch on which one it
holds. An engine is not a job: the built-in job runs under any engine of autotune/engines/
(the plug-in that owns the engine's launch, space, checks and setting steps), and a user's job
under the engine its script builds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from autotune.core.dsconfig import DsConfig
    from autotune.core.options import RunOptions
    from autotune.core.space import SearchSpace
    from autotune.study.store import Study
    from autotune.trials.contract import Runner
    from autotune.trials.multinode import Cluster
    from autotune.tuning.steps import SettingStep


class TuningJob(Protocol):
    def validate(self, opts: RunOptions) -> None:
        """The options checked for this job (one line and exit 2 on bad input), before any study."""
        ...

    def base_config(self, opts: RunOptions) -> DsConfig:
        """The starting ds_config: the run's file (`--config`, the command's), or the one the
        user's script builds in code (read by its start-up check)."""
        ...

    def check_config(self, opts: RunOptions, base: DsConfig) -> None:
        """What would fail every trial alike, checked once before a study is touched."""
        ...

    def space(self, opts: RunOptions, base: DsConfig) -> SearchSpace: ...

    def describe(self, opts: RunOptions) -> str:
        """The job in words, for the run's header and every report."""
        ...

    def store(self, study: Study) -> None:
        """What a resume needs of the job, written into a new study."""
        ...

    def runner(self, opts: RunOptions, base: DsConfig, *, note: Callable[[str], None],
               cluster: Cluster | None) -> Runner: ...

    def steps(self, opts: RunOptions, base: DsConfig, space: SearchSpace, *, root: Path,
              note: Callable[[str], None], noise: float, cluster: Cluster | None) -> list[SettingStep]:
        """The setting steps this job's study runs, in the order they propose."""
        ...
