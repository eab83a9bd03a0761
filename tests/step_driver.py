"""A setting step driven one trial at a time, as the tuner drives it (autotune/tuning/steps.py).

`before(number, proposal)` fills a trial request through the step's `prepare` and returns
it; `after(...)` hands the step a TrialEnd built from the old positional arguments. Every
other attribute is the step's own (`pending`, `kept`, `next_proposal`, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.trials.contract import TrialRequest
from autotune.tuning.steps import TrialEnd


class Driven:
    def __init__(self, step: Any) -> None:
        self.step = step
        self.request: TrialRequest | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.step, name)

    def before(self, number: int, proposal: Any) -> TrialRequest:
        self.request = TrialRequest(number=number, config=proposal.config, trial_dir=Path("unused"), timeout=60.0)
        self.step.prepare(self.request, proposal.kind)
        return self.request

    def after(self, number: int, proposal: Any, ok: bool, samples_per_second: float | None, summary: Any = None,
              *, is_best: bool = False, room: int | None = None, failure_reason: str | None = None,
              earlier_best: float | None = None) -> None:
        self.step.after(TrialEnd(number=number, proposal=proposal, ok=ok, samples_per_second=samples_per_second,
                                 failure_reason=failure_reason, summary=summary, is_best=is_best, room=room,
                                 earlier_best=earlier_best))
