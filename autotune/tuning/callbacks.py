"""The tuning loop's callbacks (autotune/tuning/steps.py `TunerCallback`): the progress display,
the live metrics endpoints, and the study's output files."""

from __future__ import annotations

import json
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Protocol

from autotune.core.space import TrialConfig
from autotune.core.summary import TrialSummary
from autotune.study.outputs import write_outputs
from autotune.study.results import StudyResults, read_results
from autotune.study.store import Study, TrialRow
from autotune.trials.contract import Runner
from autotune.trials.judge import TrialOutcome
from autotune.tuning.display import ProgressDisplay
from autotune.tuning.proposers.base import Proposal
from autotune.tuning.steps import TrialEnd


class ProgressCallback:
    """A spinner while a trial runs; its row and its notes when it ends."""

    def __init__(self, display: ProgressDisplay, study: Study) -> None:
        self.display, self.study = display, study
        self._running: AbstractContextManager | None = None

    def trial_started(self, number: int, proposal: Proposal) -> None:
        self._running = self.display.running(number, proposal.config, proposal.source)
        self._running.__enter__()

    def _stop_spinner(self) -> None:
        if self._running is not None:
            running, self._running = self._running, None
            running.__exit__(None, None, None)

    def trial_finished(self, end: TrialEnd, outcome: TrialOutcome, rules_fired: list[str]) -> None:
        self._stop_spinner()
        number, proposal = end.number, end.proposal
        result = outcome.result
        self.display.trial_row(number, proposal.config, proposal.source, result.status, outcome.summary,
                               None if result.ok else result.failure_reason, end.is_best)
        best = end.incumbent
        if outcome.summary is not None and outcome.summary.stopped_early and best is not None:
            self.display.note(f"      stopped early: after {outcome.summary.steps} measured steps its median "
                              f"step's interval lies below the best trial's {best.samples_per_second:.1f} "
                              f"samples/s by more than the {best.noise:.0%} noise margin")
        if not result.ok:
            log = self.study.trial_dir(number) / "launcher.log"
            self.display.note(f"      failed ({result.failure_reason}): "
                              f"{outcome.failure_detail or 'no detail'}; log kept in {log}")
        if proposal.reason and not proposal.kind.is_baseline:
            self.display.note(f"      why: {proposal.reason}")

    def run_ended(self) -> None:
        self._stop_spinner()


class LiveEndpoints(Protocol):
    """What the loop tells the run's live metrics (exporters/run_endpoints.py `RunEndpoints`)."""

    def trial_started(self, trial: int, config: TrialConfig) -> None: ...

    def trial_finished(self, trial: int, config: TrialConfig, status: str, samples_per_second: float,
                       summary: TrialSummary | None = None, rules_fired: Iterable[str] = ()) -> None: ...


class LiveMetricsCallback:
    """The run's live metrics (exporters/run_endpoints.py): which trial runs, how each ended."""

    def __init__(self, endpoints: LiveEndpoints) -> None:
        self.endpoints = endpoints

    def trial_started(self, number: int, proposal: Proposal) -> None:
        self.endpoints.trial_started(number, proposal.config)

    def trial_finished(self, end: TrialEnd, outcome: TrialOutcome, rules_fired: list[str]) -> None:
        self.endpoints.trial_finished(end.number, end.proposal.config, outcome.result.status,
                                      outcome.result.samples_per_second, outcome.summary, rules_fired)

    def run_ended(self) -> None:
        """The endpoints outlive the loop: the session closes them."""


class StudyOutputs:
    """summary.json, best_ds_config.json and report.md (autotune/study/outputs.py), written after
    every trial, so that a killed run leaves its best configuration so far. Not a callback: the
    tuner writes them after the steps and the proposer have learnt from the trial, and once more
    at the end, where its result carries them."""

    def __init__(self, study: Study, runner: Runner) -> None:
        self.study, self.runner = study, runner

    def write(self) -> StudyResults:
        results = read_results(self.study)  # one snapshot: summary.json's best is best_ds_config.json's
        result_file = getattr(self.runner, "result_file", None)  # a job with no ds_config (torch_job.py)
        if result_file is not None:
            write_outputs(self.study, results, None, result_file(self.study, results.best) if results.best else None)
            return results
        best_cfg = self._ran_with(results.best) if results.best else None
        write_outputs(self.study, results, best_cfg)
        return results

    def _ran_with(self, best: TrialRow) -> dict[str, object]:
        """The ds_config the best trial ran: its own ds_config.json, which holds what a setting
        step set in it besides the batch and bucket (the ZeRO engine's stage); the runner's
        config for its batch where that file is gone."""
        try:
            ran = json.loads((self.study.trial_dir(best.number) / "ds_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            ran = None
        return ran if isinstance(ran, dict) else self.runner.ds_config_for(best.config)
