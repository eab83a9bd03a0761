"""How long a trial measures: until the median step time is known well enough, or a cap.

The rule, one module for both its users: the ranks of a trial decide with it when to
stop stepping (autotune/rank/workload/train.py, autotune/rank/hook.py), and the trial's
summary (autotune/core/summary.py) computes the same interval from the metrics CSV rows.

The interval: a distribution-free confidence interval of the MEDIAN step time from order
statistics. For n sorted step times x(1) <= ... <= x(n), the number of them below the
true median is Binomial(n, 1/2), so [x(k), x(n+1-k)] covers the median with probability
1 - 2 P(B <= k-1) whatever the distribution of step times (continuous); k is the
largest rank that keeps that at or above the confidence. Exact binomial sums up to
n = 1000, the normal approximation with continuity correction above. At 95 % no such
interval exists below 6 steps (6 steps: [min, max], 96.9 %). Step times are skewed and
have outliers (a descheduled rank, a page fault), which is why the median and not a
mean +- t-interval.

What it is not: the spread between launches of the same configuration. On the CPU demo
that spread is larger than the within-trial interval (docs/trial-length.md,
benchmarks/launch_noise.py), so this interval says how well THIS trial measured its
median, not how well a re-run would agree; the tuner's final choice keeps its own
between-launch noise margin (autotune/core/noise.py).

A step of the trial's time is the slowest rank's (the summary's definition): the ranks
MAX-reduce their step times, so every rank decides on the same numbers with the same
rule, and every rank runs the same number of `train_batch` calls (a pipeline whose ranks
disagree hangs). Pure Python and numpy; torch only inside `torch_reduce_max`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from autotune.core.noise import NOISE_MARGIN, tie_floor

CONFIDENCE = 0.95
DEFAULT_PRECISION = 0.03
"""Relative half-width of the median's interval at which a trial stops: +-3 %."""
CAP_FACTOR = 2
"""The step cap by default: this many times the minimum (--steps). Two, not more: on the shared
2-core machines a trial's steps spread +-14-17 % (docs/trial-length.md), so +-3 % is rarely reached
and the cap decides; between-launch spread is larger still, so longer trials buy little there."""
EXACT_UP_TO = 1000
"""Exact binomial sums up to this many steps; the normal approximation above."""
RECORD_NAME = "step-budget.json"
"""What global rank 0 writes in the trial folder: how many steps ran and why they ended."""

FIXED, PRECISION, CAP, HOPELESS = "fixed", "precision", "cap", "hopeless"
"""Why a trial's steps ended: the fixed count ran, the interval is narrow enough, the cap,
or the trial cannot plausibly beat the incumbent (stopped early)."""


@dataclass(frozen=True, slots=True)
class MedianInterval:
    """The median of n values and its distribution-free confidence interval."""

    median: float
    low: float
    high: float
    n: int
    confidence: float

    @property
    def relative_half_width(self) -> float:
        """(high - low) / 2 / median: 0.03 reads "+-3 %" (the interval may be asymmetric)."""
        return (self.high - self.low) / 2 / self.median if self.median > 0 else math.inf


def _order_rank(n: int, confidence: float) -> int:
    """The largest k >= 1 with 2 P(Bin(n, 1/2) <= k-1) <= 1 - confidence, or 0 if none."""
    alpha = 1.0 - confidence
    if n <= EXACT_UP_TO:
        total, cum, k = 2 ** n, 0, 0
        while k < (n + 1) // 2:
            cum += math.comb(n, k)  # P(B <= k) * 2^n
            if 2 * cum > alpha * total:
                return k  # k+1 would exceed: x(k) (1-based) is the last that keeps coverage
            k += 1
        return k
    z = _normal_quantile(1 - alpha / 2)
    # P(B <= k-1) ~ Phi((k - 1/2 - n/2) / (sqrt(n)/2)) <= alpha/2  <=>  k <= (n + 1 - z sqrt(n)) / 2
    return min((n + 1) // 2, max(0, math.floor((n + 1 - z * math.sqrt(n)) / 2)))


def _normal_quantile(p: float) -> float:
    """The standard normal quantile, by bisection on erf (no scipy)."""
    if not 0 < p < 1:
        raise ValueError("p must be in (0, 1)")
    lo, hi = -10.0, 10.0
    for _ in range(100):  # bisection on erf: exact enough and short
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> MedianInterval | None:
    """The median and its order-statistic interval; None when too few values for `confidence`."""
    xs = sorted(float(v) for v in values)
    n = len(xs)
    if n == 0:
        return None
    k = _order_rank(n, confidence)
    if k < 1:
        return None
    mid = n // 2
    median = xs[mid] if n % 2 else (xs[mid - 1] + xs[mid]) / 2
    return MedianInterval(median=median, low=xs[k - 1], high=xs[n - k], n=n, confidence=confidence)


def hopeless_step_seconds(incumbent_samples_per_second: float, noise: float, global_batch: int) -> float:
    """The step time above which a trial cannot plausibly beat the incumbent.

    samples/s = global batch / step time, so a trial whose FASTEST plausible step (its
    interval's low end) still gives less than the incumbent's tie floor (core/noise.py) in samples/s is
    hopeless: its samples/s interval lies entirely below the incumbent by more than the
    noise margin."""
    if incumbent_samples_per_second <= 0 or not 0 <= noise < 1:
        raise ValueError("the incumbent's samples/s must be > 0 and the noise in [0, 1)")
    return global_batch / tie_floor(incumbent_samples_per_second, noise)


@dataclass(kw_only=True, slots=True)
class StepRule:
    """When a trial's measured steps end (warm-up steps excluded)."""

    min_steps: int
    """Never stop before this many measured steps (the fixed count when not adaptive)."""
    max_steps: int
    """Never run more measured steps than this (adaptive only)."""
    adaptive: bool = True
    precision: float = DEFAULT_PRECISION
    confidence: float = CONFIDENCE
    hopeless_above: float | None = None
    """Step seconds (slowest rank) above which the trial is hopeless (`hopeless_step_seconds`);
    None: never stopped early (the baseline, a re-measurement, no incumbent yet)."""

    def __post_init__(self) -> None:
        if self.min_steps < 1 or self.max_steps < self.min_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if not 0 < self.precision < 1:
            raise ValueError(f"precision must be in (0, 1), got {self.precision}")

    @property
    def cap(self) -> int:
        return self.max_steps if self.adaptive else self.min_steps

    def decide(self, step_seconds: Sequence[float]) -> str | None:
        """None: measure another step; else why the steps end (FIXED, PRECISION, CAP, HOPELESS)."""
        n = len(step_seconds)
        if not self.adaptive:
            return FIXED if n >= self.min_steps else None
        if n < self.min_steps:
            return None
        iv = median_interval(step_seconds, self.confidence)
        if iv is not None and self.hopeless_above is not None and iv.low > self.hopeless_above:
            return HOPELESS
        if iv is not None and iv.relative_half_width <= self.precision:
            return PRECISION
        return CAP if n >= self.max_steps else None


def stop_step(rule: StepRule, step_seconds: Sequence[float]) -> tuple[int, str | None]:
    """Replay the rule over a series: (measured steps it would run, why it stops; None: the
    series ran out first)."""
    for n in range(1, len(step_seconds) + 1):
        why = rule.decide(step_seconds[:n])
        if why is not None:
            return n, why
    return len(step_seconds), None


ReduceMax = Callable[[list[float]], list[float]]
"""Element-wise maximum over every rank of the job (identity in one process)."""


@dataclass(kw_only=True, slots=True)
class StepBudget:
    """One rank's side of the rule: feed it every step's time, ask it after every step.

    Until the minimum number of measured steps it runs without communication (every rank
    counts the same steps). From then on, after each step, the step times not yet shared
    are MAX-reduced over all ranks (one tiny all_reduce: the slowest rank's step times,
    identical on every rank), and the rule decides on them: every rank reaches the same
    decision at the same step."""

    rule: StepRule
    warmup_steps: int
    reduce_max: ReduceMax = field(default=lambda xs: list(xs))
    calls: int = 0
    own: list[float] = field(default_factory=list)
    """This rank's measured step times (from the probe, as its CSV has them)."""
    shared: list[float] = field(default_factory=list)
    """The slowest rank's measured step times, as far as reduced."""
    reason: str | None = None

    def observe(self, step_seconds: float, warmup: bool) -> None:
        """The probe's record of one step (`PipelineProbe.on_step`)."""
        if not warmup:
            self.own.append(float(step_seconds))

    def go_on(self) -> bool:
        """After each train_batch call: run another? Collective from the minimum on (adaptive)."""
        self.calls += 1
        measured = self.calls - self.warmup_steps
        if measured < self.rule.min_steps:
            return True
        if measured >= self.rule.cap and not self.rule.adaptive:
            self.reason = FIXED
            return False
        if len(self.own) < measured:  # no probe record for a step: time it as unknown (never narrows)
            self.own.extend([math.inf] * (measured - len(self.own)))
        pending = self.own[len(self.shared):measured]
        if pending:
            self.shared.extend(self.reduce_max(pending))
        self.reason = self.rule.decide(self.shared)
        if self.reason is None and measured >= self.rule.cap:
            self.reason = CAP  # a guard: the cap holds whatever the series says
        return self.reason is None

    @property
    def stopped_early(self) -> bool:
        return self.reason == HOPELESS

    def record(self) -> dict:
        """What rank 0 writes as RECORD_NAME (read back by `read_record`)."""
        iv = median_interval(self.shared, self.rule.confidence) if self.shared else None
        return {"measured_steps": self.calls - self.warmup_steps, "reason": self.reason,
                "stopped_early": self.stopped_early, "adaptive": self.rule.adaptive,
                "min_steps": self.rule.min_steps, "max_steps": self.rule.cap,
                "precision": self.rule.precision, "hopeless_above_seconds": self.rule.hopeless_above,
                "median_seconds": iv.median if iv else None,
                "relative_half_width": iv.relative_half_width if iv else None}


def rank_budget(*, steps: int, warmup_steps: int, adaptive: bool, precision: float, cap: int,
                global_batch: int, incumbent_samples_per_second: float | None = None, noise: float = NOISE_MARGIN,
                reduce_max: ReduceMax | None = None) -> StepBudget:
    """A rank's budget from its trial's rank plan (autotune/core/rank_plan.py, wired by
    autotune/rank/wiring.py); the reduce is the default process group's unless given."""
    hopeless = (hopeless_step_seconds(incumbent_samples_per_second, noise, global_batch)
                if adaptive and incumbent_samples_per_second else None)
    rule = StepRule(min_steps=steps, max_steps=max(cap, steps), adaptive=adaptive, precision=precision,
                    hopeless_above=hopeless)
    return StepBudget(rule=rule, warmup_steps=warmup_steps, reduce_max=reduce_max or torch_reduce_max)


def follow_probe(probe: object, budget: StepBudget) -> None:
    """Feed `budget` every step the probe records (autotune/rank/instrument.py `on_step`), keeping
    a callback already there."""
    before = getattr(probe, "on_step", None)

    def on_step(record: object) -> None:
        budget.observe(record.step_seconds, bool(record.warmup))  # type: ignore[attr-defined]
        if before is not None:
            before(record)

    probe.on_step = on_step  # type: ignore[attr-defined]


def torch_reduce_max(values: list[float]) -> list[float]:
    """The element-wise max of `values` over the default process group (gloo or NCCL)."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return list(values)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.cpu().tolist()]


def write_record(budget: StepBudget, trial_dir: str) -> None:
    """Rank 0: how the steps ended, beside the metrics CSVs (atomic: never half a file)."""
    import json
    import os

    path = os.path.join(trial_dir, RECORD_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(budget.record(), fh)
        fh.write("\n")
    os.replace(tmp, path)


def read_record(trial_dir: str | object) -> dict | None:
    """The record rank 0 wrote, or None (a fixed-length run of an older version, a user job)."""
    import json
    import os

    path = os.path.join(str(trial_dir), RECORD_NAME)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
