"""The trace step (`autotune run --trace-steps N`): which trials record a torch.profiler trace.

A trace costs the profiler's overhead and N + 1 extra steps of the trial that records it, so a
study records two, not one per trial: the baseline (the job as the user set it up), and the
first re-measurement of the configuration that is the best at that moment (a proposer's
confirm, a partition round's re-run of the best): the best as the study found it, with no
trial added for it. A study whose best is never run again has the baseline's trace only, and
`autotune report` says so; `--trace-every-trial` traces them all. The traced steps are unmeasured (autotune/rank/trace_recorder.py),
so a traced trial's figures stand beside the others'.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from autotune.core.trial_kind import TrialKind
from autotune.rank.trace_recorder import traces_dir
from autotune.study.store import TrialRow
from autotune.trials.contract import TrialRequest
from autotune.tuning.proposers.base import Proposal
from autotune.tuning.steps import TrialEnd


class TraceStep:
    def __init__(self, steps: int, root: Path, *, every: bool = False) -> None:
        self.steps = steps
        self.root = root
        self.every = every
        self.baseline_traced = False
        self.best_traced = False
        self.best_key: tuple | None = None
        self.best_speed = 0.0

    @property
    def deciding(self) -> bool:
        return False

    def replay(self, finished: Sequence[TrialRow], redo: Sequence[TrialRow], budget: int | None) -> None:
        for row in finished:
            traced = traces_dir(self.root / f"trial-{row.number:03d}").is_dir()
            if TrialKind.of(row.source).is_baseline:
                self.baseline_traced = self.baseline_traced or traced
            elif traced:
                self.best_traced = True
            if row.samples_per_second and row.samples_per_second > self.best_speed:
                self.best_speed, self.best_key = row.samples_per_second, row.config.key()

    def before_end(self, best: TrialRow | None, room: int) -> Proposal | None:
        return None

    def next_proposal(self) -> Proposal | None:
        return None

    def prepare(self, request: TrialRequest, kind: TrialKind) -> None:
        if self.every:
            request.trace_steps = self.steps
        elif kind.is_baseline and not self.baseline_traced:
            request.trace_steps = self.steps
        elif (not kind.is_baseline and not self.best_traced and self.best_key is not None
              and request.config.key() == self.best_key):
            request.trace_steps = self.steps

    def after(self, end: TrialEnd) -> None:
        traced = traces_dir(self.root / f"trial-{end.number:03d}").is_dir()
        if end.kind.is_baseline:
            self.baseline_traced = True  # once, whether or not it got that far
        elif traced:
            self.best_traced = True
        if end.ok and end.samples_per_second and end.samples_per_second > self.best_speed:
            self.best_speed, self.best_key = end.samples_per_second, end.proposal.config.key()
