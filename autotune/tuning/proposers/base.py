"""The proposer contract. Every proposer (Bayesian, rules, hybrid, random, grid)
implements it; the tuning loop and the benchmark only talk to this interface.

- `ask()` returns the next configuration to run, with who proposed it and why.
- `tell(config, result)` reports any finished trial, whoever proposed it
  (including the baseline and trials told back after a resume).
- `converged()` says why the search may stop before its budget (the budget is a
  cap, not a quota), or None; asked before each `ask()`. Proposers without a
  model of what is left to gain return None and run the whole budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_kind import TrialKind
from autotune.core.trial_result import TrialResult


@dataclass(kw_only=True, slots=True)
class Proposal:
    config: TrialConfig
    source: TrialKind
    """Who proposed it: baseline, bayes, rule:<id>, random, grid, ... (autotune/core/trial_kind.py;
    the label the study stores). A label given as text is made the kind."""
    reason: str = ""

    def __post_init__(self) -> None:
        self.source = TrialKind.of(self.source)

    @property
    def kind(self) -> TrialKind:
        """The typed kind of the trial (its `source`)."""
        return self.source


@runtime_checkable
class Proposer(Protocol):
    space: SearchSpace

    def ask(self) -> Proposal: ...

    def tell(self, config: TrialConfig, result: TrialResult) -> None: ...

    def converged(self) -> str | None: ...
