"""The budget as a cap, not a quota: the tuning loop's side of stopping a converged search.

The proposer says when the search has converged (`Proposer.converged`, the hybrid's
rule in autotune/tuning/proposers/convergence.py). This module asks it before each proposed
trial, remembers the decision in the study (meta key `stopped`: reason, trials,
budget), so a resumed study that had stopped runs no more trials and summary.json
says why, and words the one line the run prints. `--full-budget` turns it off; a
study resumed with it runs on, and the stored stop is dropped once it does.
"""

from __future__ import annotations

from typing import Any

from autotune.study.store import Study
from autotune.tuning.proposers.base import Proposer

META_KEY = "stopped"


def check(study: Study, proposer: Proposer, budget: int, *, enabled: bool) -> dict[str, Any] | None:
    """The stop record when the search stops now, else None (and no stale record is left)."""
    stored = study.get_meta_json(META_KEY)
    trials = len(study.counted())
    if not enabled:
        if stored is not None:
            study.set_meta_json({META_KEY: None})  # the run goes on: it did not stop here
        return None
    if stored is not None and stored.get("trials") == trials:
        return {**stored, "resumed": True}  # stopped before the controller ended: still stopped
    why = proposer.converged()
    if why is None:
        if stored is not None:
            study.set_meta_json({META_KEY: None})
        return None
    record = {"reason": why, "trials": trials, "budget": budget}
    study.set_meta_json({META_KEY: record})
    return record


def describe(record: dict[str, Any]) -> str:
    head = "stopped earlier" if record.get("resumed") else "stopped"
    return (f"{head} after {record['trials']} of {record['budget']} trials: {record['reason']} "
            "(--full-budget runs every trial of the budget)")
