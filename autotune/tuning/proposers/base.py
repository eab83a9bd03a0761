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
    source: str
    """Who proposed it: baseline, bayes, rule:<id>, random, grid, ... (the label the study stores)."""
    reason: str = ""

    @property
    def kind(self) -> TrialKind:
        """The typed kind of the trial (autotune/core/trial_kind.py)."""
        return TrialKind.of(self.source)


@runtime_checkable
class Proposer(Protocol):
    space: SearchSpace

    def ask(self) -> Proposal: ...

    def tell(self, config: TrialConfig, result: TrialResult) -> None: ...

    def converged(self) -> str | None: ...
