"""How long a trial may take, from the job's own measured start-ups and steps.

- Start-up: 2x the slowest start-up a finished trial of this study measured (each rank's
  process start to its first step: autotune/rank/watchdog.py), 120 s before one is measured.
  `--startup-timeout` overrides it (a job that loads a large checkpoint).
- A step: the slowest step this configuration is expected to take, from the slowest
  per-sample time measured so far scaled to this configuration's batch; each rank stops
  at 10x that (at least 60 s), and at 10x its own slowest step of the trial.
- The whole trial: 4x the slowest finished trial's start-up plus steps, its steps scaled
  to this configuration's batch, at least 120 s; 900 s while nothing is measured (its
  start-up is still bounded by the 120 s watchdog). `--trial-timeout` overrides it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from autotune.core.space import TrialConfig
from autotune.rank.watchdog import StallLimits
from autotune.study.store import STATUS_OK, TrialRow

FIRST_TIMEOUT = 900.0
"""Seconds for a trial before one has finished (its start-up has its own 120 s limit)."""
MIN_TIMEOUT = 120.0
TIMEOUT_FACTOR = 4.0
STARTUP_BEFORE_MEASURED = 120.0
STARTUP_FACTOR = 2.0


@dataclass(kw_only=True, slots=True)
class TrialLimits:
    timeout: float
    """The controller's limit for the whole trial."""
    stall: StallLimits
    """Each rank's own limits (start-up, a step), written into the rank plan."""


def _batch(config: TrialConfig) -> int:
    return max(1, config.micro_batch_size * config.gradient_accumulation_steps)


def measured_startup(trials: Iterable[TrialRow]) -> float | None:
    """The slowest start-up of the finished trials, or None when none recorded one."""
    values = [float(t.summary["startup_seconds"]) for t in trials
              if t.status == STATUS_OK and t.summary and t.summary.get("startup_seconds")]
    return max(values) if values else None


def limits_for(config: TrialConfig, trials: list[TrialRow], *, trial_timeout: float | None = None,
               startup_timeout: float | None = None) -> TrialLimits:
    ok = [t for t in trials if t.status == STATUS_OK and t.wall_seconds]
    startup = measured_startup(ok)
    if startup_timeout is not None:
        startup_limit = startup_timeout
    elif startup is not None:
        startup_limit = STARTUP_FACTOR * startup
    else:
        startup_limit = STARTUP_BEFORE_MEASURED
    step = None
    speeds = [t.samples_per_second for t in ok if t.samples_per_second]
    dp = next((int(t.summary.get("data_parallel_size") or 1) for t in ok if t.summary), 1)
    if speeds:
        step = _batch(config) * dp / min(speeds)
    if trial_timeout is not None:
        timeout = trial_timeout
    elif not ok:
        timeout = FIRST_TIMEOUT
    else:
        expected = 0.0
        for t in ok:
            own_startup = float((t.summary or {}).get("startup_seconds") or 0.0)
            steps_part = max(0.0, float(t.wall_seconds or 0.0) - own_startup)
            scale = max(1.0, _batch(config) / _batch(t.config))
            expected = max(expected, own_startup + steps_part * scale)
        timeout = max(MIN_TIMEOUT, TIMEOUT_FACTOR * expected, startup_limit + MIN_TIMEOUT)
    return TrialLimits(timeout=timeout, stall=StallLimits(startup_seconds=startup_limit, step_seconds=step))
