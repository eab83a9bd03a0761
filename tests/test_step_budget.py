"""The trial-length rule (autotune/core/step_budget.py): the median's interval, when steps stop."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from autotune.core.step_budget import (
    CAP,
    FIXED,
    HOPELESS,
    PRECISION,
    StepBudget,
    StepRule,
    _order_rank,
    hopeless_step_seconds,
    median_interval,
    stop_step,
)

times = st.lists(st.floats(min_value=0.01, max_value=10.0, allow_nan=False), min_size=1, max_size=60)


@pytest.mark.parametrize("n,k", [(5, 0), (6, 1), (9, 2), (10, 2), (12, 3), (17, 5), (30, 10), (100, 40)])
def test_order_ranks_match_the_binomial_table(n, k):
    """The published ranks of the 95 % median interval (e.g. Conover, table A3)."""
    assert _order_rank(n, 0.95) == k


def test_the_normal_approximation_joins_the_exact_sums():
    assert abs(_order_rank(1001, 0.95) - _order_rank(1000, 0.95)) <= 1


@pytest.mark.parametrize("dist", ["lognormal", "exponential", "uniform"])
@pytest.mark.parametrize("n", [6, 11, 25])
def test_interval_covers_the_true_median_at_least_95_percent(dist, n):
    """Coverage on synthetic skewed and flat step times: distribution-free, never below 95 %
    beyond the sampling error of 4,000 draws (3 standard errors of a 95 % proportion: 1 %)."""
    rng = np.random.default_rng(n)
    draw, true_median = {
        "lognormal": (lambda: rng.lognormal(0.0, 0.5, n), 1.0),
        "exponential": (lambda: rng.exponential(1.0, n), math.log(2)),
        "uniform": (lambda: rng.uniform(2.0, 3.0, n), 2.5),
    }[dist]
    hits = 0
    for _ in range(4000):
        iv = median_interval(draw())
        hits += iv.low <= true_median <= iv.high
    assert hits / 4000 >= 0.94


@given(times)
def test_interval_brackets_the_median(xs):
    iv = median_interval(xs)
    if len(xs) < 6:
        assert iv is None  # no distribution-free 95 % interval exists below 6 values
        return
    assert min(xs) <= iv.low <= iv.median <= iv.high <= max(xs)
    assert iv.median == pytest.approx(float(np.median(xs)))


@given(times)
def test_a_higher_confidence_never_narrows_the_interval(xs):
    lo, hi = median_interval(xs, 0.90), median_interval(xs, 0.99)
    if hi is not None:
        assert lo is not None and lo.low >= hi.low and lo.high <= hi.high


@given(times, st.integers(1, 20), st.integers(0, 40))
def test_never_stops_before_the_minimum_and_always_by_the_cap(xs, lo, extra):
    rule = StepRule(min_steps=lo, max_steps=lo + extra, precision=0.03)
    n, why = stop_step(rule, xs)
    if why is not None:
        assert lo <= n <= lo + extra
    else:
        assert n == len(xs) < lo + extra  # ran out of steps first, never past the cap
    if len(xs) >= lo + extra:
        assert why is not None and n <= lo + extra


@given(times, st.floats(0.005, 0.5), st.floats(0.005, 0.5))
def test_a_tighter_precision_never_stops_sooner(xs, p1, p2):
    tight, loose = sorted((p1, p2))
    n_tight, _ = stop_step(StepRule(min_steps=6, max_steps=40, precision=tight), xs)
    n_loose, _ = stop_step(StepRule(min_steps=6, max_steps=40, precision=loose), xs)
    assert n_loose <= n_tight


@given(times, st.floats(0.01, 10.0), st.floats(0.01, 10.0))
def test_a_lower_incumbent_bar_never_stops_sooner(xs, a, b):
    """A larger hopeless step time (a weaker incumbent) can only let a trial run longer."""
    strict, lenient = sorted((a, b))
    n_strict, _ = stop_step(StepRule(min_steps=6, max_steps=40, precision=0.001, hopeless_above=strict), xs)
    n_lenient, _ = stop_step(StepRule(min_steps=6, max_steps=40, precision=0.001, hopeless_above=lenient), xs)
    assert n_strict <= n_lenient


def test_steady_steps_stop_at_the_precision_noisy_ones_at_the_cap():
    rng = np.random.default_rng(0)
    steady = list(1.0 + rng.normal(0, 0.005, 40))
    noisy = list(rng.lognormal(0, 0.6, 40))
    rule = StepRule(min_steps=6, max_steps=18, precision=0.03)
    assert stop_step(rule, steady) == (6, PRECISION)
    assert stop_step(rule, noisy) == (18, CAP)


def test_fixed_steps_run_exactly_the_count():
    assert stop_step(StepRule(min_steps=4, max_steps=4, adaptive=False), [1.0] * 10) == (4, FIXED)


def test_a_hopeless_trial_stops_at_the_minimum():
    rule = StepRule(min_steps=6, max_steps=18, precision=0.001,
                    hopeless_above=hopeless_step_seconds(100.0, 0.10, global_batch=16))  # 0.178 s
    slow = [0.30, 0.31, 0.29, 0.35, 0.30, 0.32, 0.31]
    assert stop_step(rule, slow) == (6, HOPELESS)
    near = [0.17, 0.19, 0.18, 0.20, 0.18, 0.17] * 3  # the interval reaches below the bar: not hopeless
    assert stop_step(rule, near)[1] != HOPELESS


def test_bad_rules_are_refused():
    with pytest.raises(ValueError):
        StepRule(min_steps=5, max_steps=4)
    with pytest.raises(ValueError):
        StepRule(min_steps=5, max_steps=9, precision=0.0)
    with pytest.raises(ValueError):
        hopeless_step_seconds(0.0, 0.1, 8)


class _Ranks:
    """Several ranks' budgets, their reduce a real element-wise max over the others' values."""

    def __init__(self, rule: StepRule, n: int, warmup: int) -> None:
        self.pending: dict[int, list[float]] = {}
        self.budgets = [StepBudget(rule=rule, warmup_steps=warmup, reduce_max=self._reducer(r)) for r in range(n)]

    def _reducer(self, r: int):
        def reduce_max(xs: list[float]) -> list[float]:
            self.pending[r] = list(xs)
            return [max(v) for v in zip(*self.pending.values(), strict=True)]
        return reduce_max


@given(st.lists(st.lists(st.floats(0.05, 5.0), min_size=40, max_size=40), min_size=2, max_size=4),
       st.integers(0, 3))
def test_every_rank_decides_the_same_step(series, warmup):
    """Ranks with different step times, reduced to the slowest: all stop after the same call."""
    rule = StepRule(min_steps=6, max_steps=18, precision=0.05)
    ranks = _Ranks(rule, len(series), warmup)
    stopped_at = {}
    for call in range(warmup + 30):
        ranks.pending.clear()
        for r, b in enumerate(ranks.budgets):
            if r in stopped_at:
                continue
            b.observe(series[r][call - warmup] if call >= warmup else 9.9, warmup=call < warmup)
        # the collective: every rank's pending values first (as all_reduce waits for all)
        for r, b in enumerate(ranks.budgets):
            if r not in stopped_at:
                measured = b.calls + 1 - warmup
                if measured >= rule.min_steps:
                    ranks.pending[r] = b.own[len(b.shared):measured]
        for r, b in enumerate(ranks.budgets):
            if r not in stopped_at and not b.go_on():
                stopped_at[r] = b.calls
    assert len(set(stopped_at.values())) == 1 and len(stopped_at) == len(series)
    n = next(iter(stopped_at.values())) - warmup
    assert 6 <= n <= 18
    slowest = [max(s[i] for s in series) for i in range(n)]
    assert ranks.budgets[0].shared == slowest


def test_the_summary_holds_the_interval_of_the_slowest_ranks_step_times():
    from builders import grid_records

    from autotune.core.summary import summarize_trial

    s = summarize_trial(grid_records(steps=13))  # 1 warm-up + 12 measured steps, 4 ranks
    slowest = [max(1.0 + 0.01 * ((st * 7 + r) % 5) for r in range(4)) for st in range(1, 13)]
    iv = median_interval(slowest)
    assert (s.step_seconds_low, s.step_seconds_high) == (iv.low, iv.high)
    assert s.step_seconds_rel_half_width == pytest.approx(iv.relative_half_width)
    assert not s.stopped_early and s.steps_ended_by is None  # the ranks' record is the judge's to add
    few = summarize_trial(grid_records(steps=4))
    assert few.step_seconds_low is None and few.step_seconds_rel_half_width is None


def test_the_progress_row_shows_the_interval_and_an_early_stop():
    from builders import healthy_summary
    from rich.console import Console

    from autotune.core.space import TrialConfig
    from autotune.tuning.display import ProgressDisplay

    console = Console(record=True, width=200)
    d = ProgressDisplay(console=console, budget=3)
    cfg = TrialConfig(micro_batch_size=4, gradient_accumulation_steps=8)
    d.trial_row(1, cfg, "bayes", "ok", healthy_summary(step_seconds_rel_half_width=0.021, stopped_early=True),
                None, False)
    d.trial_row(2, cfg, "bayes", "ok", healthy_summary(), None, False)
    rows = console.export_text().splitlines()
    assert "±95%" in rows[0]
    assert "±2.1%" in rows[1] and "ok (stopped early)" in rows[1]
    assert "n/a" in rows[2] and "stopped early" not in rows[2]


@pytest.mark.parametrize("source,measured_before,expect", [
    ("bayes", False, True), ("baseline", False, False), ("remeasure", False, False),
    ("confirm", False, False), ("recheck", False, False), ("bayes", True, False),
])
def test_the_tuner_passes_the_incumbent_only_to_new_configurations(tmp_path, source, measured_before, expect):
    from builders import ScriptedRunner

    from autotune.core.space import TrialConfig
    from autotune.study.store import Study
    from autotune.trials.contract import Incumbent
    from autotune.tuning.proposers.base import Proposal
    from autotune.tuning.tuner import Tuner

    study = Study.open(tmp_path / "st", create=True, meta={})
    try:
        best = TrialConfig(micro_batch_size=4, gradient_accumulation_steps=8)
        tid = study.start_trial(0, best, "baseline", "")
        study.finish_trial(tid, status="ok", samples_per_second=120.0, failure_reason=None, failure_detail=None,
                           summary=None, rules_fired=[], wall_seconds=1.0)
        tuner = Tuner(study=study, runner=ScriptedRunner(), space=None, proposer=object(), baseline=best,
                      note=print, budget=5)
        new = best if measured_before else TrialConfig(micro_batch_size=8, gradient_accumulation_steps=4)
        got = tuner._incumbent(Proposal(config=new, source=source, reason=""))
        assert got == (Incumbent(120.0, 0.10) if expect else None)
    finally:
        study.close()
