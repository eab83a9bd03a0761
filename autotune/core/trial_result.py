"""What a finished trial tells the search: ok or failed, its throughput, why it failed.

The trial side (trials/judge.py) makes it and the tuning side (the proposers' `tell`, the
tuner) reads it, so it lives in the data model, below both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STATUS_OK = "ok"
STATUS_FAILED = "failed"


@dataclass(kw_only=True, slots=True)
class TrialResult:
    status: str
    """"ok" or "failed"."""
    samples_per_second: float = 0.0
    """Median throughput; 0 for failed trials."""
    failure_reason: str | None = None
    """Classified reason for a failed trial: oom, timeout, crash, nan, no_metrics, ..."""
    summary: object | None = None
    """The trial's TrialSummary when available (rules read it)."""
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK
