"""How far a prediction can be off: an interval from the study's own held-out errors (issue 44).

Each trial of the study is predicted by the model calibrated on the others (leave-one-out,
autotune/model/validation.py); the error of each is the log of predicted over measured step
time. A new layout's measurement lies within the prediction times e^{+-q}, where q is the
ceil((n + 1) x level)-th smallest of the n absolute errors: the jackknife's conformal rule,
which covers a new held-out measurement at least `level` of the time when the trials are
exchangeable. Its errors hold the launch-to-launch noise of the trials (10-30 % on these shared
cores), so the interval is for one measured launch, not for the mean of many.

Too few held-out trials for the level (n < level / (1 - level), four for 80 %) give no interval,
and the output says so, never a made-up width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autotune.model.validation import HeldOut

LEVEL = 0.8
"""The stated coverage of `autotune predict`'s interval."""


@dataclass(frozen=True, slots=True)
class Interval:
    level: float
    low: float
    high: float
    """samples/s: a new launch of the layout reads between these, `level` of the time."""
    from_trials: int
    half_width_log: float
    """q: the interval is the prediction times e^-q .. e^q."""


def log_errors(points: list[HeldOut]) -> list[float]:
    return [math.log(p.predicted_step_seconds / p.measured_step_seconds) for p in points
            if p.predicted_step_seconds > 0 and p.measured_step_seconds > 0]


def needed(level: float = LEVEL) -> int:
    """Held-out trials the level needs: the smallest n with ceil((n + 1) level) <= n."""
    n = 1
    while math.ceil((n + 1) * level - 1e-9) > n:
        n += 1
    return n


def interval(samples_per_second: float, points: list[HeldOut], level: float = LEVEL) -> Interval | None:
    """The interval around a predicted samples/s from the held-out errors; None when too few."""
    errors = sorted(abs(e) for e in log_errors(points))
    n = len(errors)
    if n < needed(level):
        return None
    q = errors[math.ceil((n + 1) * level - 1e-9) - 1]
    return Interval(level=level, low=samples_per_second * math.exp(-q), high=samples_per_second * math.exp(q),
                    from_trials=n, half_width_log=q)


def why_none(trials: int, held: int, level: float = LEVEL) -> str:
    if trials <= 1:
        return "one trial gives no interval (nothing to hold out)"
    return (f"no {level:.0%} interval: {held} held-out trial(s), {needed(level)} needed "
            "(a study of more trials gives one)")
