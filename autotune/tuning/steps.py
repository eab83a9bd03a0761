"""The tuner's pluggable parts: the setting steps around the search, and the callbacks.

A setting step decides a model setting the Bayesian space has no dimension for: the
partition rounds (autotune/tuning/balance.py), the checkpoint step (autotune/tuning/checkpoint_step.py)
and the knob sweep (autotune/tuning/knob_sweep.py). Each puts its trials into the one queue
(`next_proposal`, as Optuna's `enqueue_trial` does), says what a trial runs with
(`prepare`), and learns from each ending (`after`). The tuner runs a list of them, in
order, so that any of them can run together in one study.

A callback watches the loop without steering it (Ray Tune's `Callback`, Optuna's
`callbacks=`): the progress display, the live metrics endpoint, the study's output files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from autotune.core.trial_kind import TrialKind
from autotune.tuning.proposers.base import Proposal

if TYPE_CHECKING:
    from autotune.core.summary import TrialSummary
    from autotune.study.store import TrialRow
    from autotune.trials.contract import Incumbent, TrialRequest
    from autotune.trials.judge import TrialOutcome


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialEnd:
    """How trial `number` ended, as the steps and callbacks see it."""

    number: int
    proposal: Proposal
    ok: bool
    samples_per_second: float | None
    failure_reason: str | None = None
    summary: TrialSummary | None = None
    is_best: bool = False
    """It made its configuration the study's best so far."""
    room: int | None = None
    """Trials the budget has left after it (None: no limit, as in a replay without a budget)."""
    earlier_best: float | None = None
    """samples/s of the fastest successful trial before it (None: none)."""
    incumbent: Incumbent | None = None
    """The best trial it was measured against (None: measured in full)."""

    @property
    def kind(self) -> TrialKind:
        return self.proposal.kind


class SettingStep(Protocol):
    """A model-setting step around the search (see the module docstring)."""

    @property
    def deciding(self) -> bool:
        """Its trials are queued or running: the configuration they re-run has no final
        measurement yet, so the tuner holds what it tells the proposer (autotune/core/measurements.py)."""
        ...

    def replay(self, finished: Sequence[TrialRow], redo: Sequence[TrialRow], budget: int | None) -> None:
        """Rebuild the step from a resumed study's finished trials; a trial of its own in `redo`
        (interrupted) runs again as itself, not a second time."""
        ...

    def next_proposal(self) -> Proposal | None:
        """Its next trial, if the trial just finished calls for one."""
        ...

    def before_end(self, best: TrialRow | None, room: int) -> Proposal | None:
        """A trial it wants before the search ends (the tuner asks when the budget has `room` for
        no more than the last trials, or the search has converged): the knob sweep's ZeRO stage
        tried again at the best's layout. `best`: the study's best so far."""
        ...

    def prepare(self, request: TrialRequest, kind: TrialKind) -> None:
        """Fill in this step's part of a trial's request (parts, layer-cost hooks, knob values)."""
        ...

    def after(self, end: TrialEnd) -> None:
        """Learn from a trial's end, whichever step proposed it."""
        ...


class TunerCallback(Protocol):
    """Watches the tuning loop (see the module docstring); every method may do nothing."""

    def trial_started(self, number: int, proposal: Proposal) -> None: ...

    def trial_finished(self, end: TrialEnd, outcome: TrialOutcome, rules_fired: list[str]) -> None:
        """After the study stored the trial, before the steps learn from it."""
        ...

    def run_ended(self) -> None:
        """The loop is over (its budget, convergence, an interrupt or a stop)."""
        ...
