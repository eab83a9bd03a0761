"""The prediction interval from held-out errors (autotune/model/interval.py): the conformal
rule's arithmetic, its coverage on exchangeable errors, and what `predict` says without one."""

from __future__ import annotations

import json
import math
import random

import pytest
from launch_helpers import autotune_cli

from autotune.model.interval import LEVEL, interval, needed, why_none
from autotune.model.validation import HeldOut


def _points(errors: list[float]) -> list[HeldOut]:
    """Held-out trials whose predicted step is e^error times the measured one."""
    return [HeldOut(trial=i, measured_samples_per_second=100.0, predicted_samples_per_second=100.0 / math.exp(e),
                    measured_step_seconds=1.0, predicted_step_seconds=math.exp(e)) for i, e in enumerate(errors)]


def test_the_quantile_is_the_conformal_rank_of_the_absolute_errors():
    assert needed(0.8) == 4 and needed(0.9) == 9
    assert interval(100.0, _points([0.1, -0.2, 0.05])) is None  # three held out: (3 + 1) x 0.8 > 3
    iv = interval(100.0, _points([0.1, -0.2, 0.05, 0.3]))  # rank ceil(5 x 0.8) = 4 of |e|: 0.3
    assert iv is not None and iv.from_trials == 4 and iv.half_width_log == pytest.approx(0.3)
    assert iv.low == pytest.approx(100 * math.exp(-0.3)) and iv.high == pytest.approx(100 * math.exp(0.3))
    iv = interval(100.0, _points([0.01 * k for k in range(1, 11)]))  # rank ceil(11 x 0.8) = 9: 0.09
    assert iv.half_width_log == pytest.approx(0.09)


def test_it_covers_a_new_measurement_at_least_as_often_as_it_says():
    """Exchangeable errors (launch noise of 15 % and a model bias): over many draws of a small
    study (6 held-out trials) and one new launch, the 80 % interval holds it >= 80 % of the time."""
    rng = random.Random(7)
    hits = total = 0
    for _ in range(4000):
        bias = rng.gauss(0, 0.05)
        errors = [bias + rng.gauss(0, 0.15) for _ in range(7)]
        iv = interval(100.0, _points(errors[:6]))
        new = 100.0 / math.exp(errors[6])  # the new launch's samples/s, the prediction being 100
        hits += iv.low <= new <= iv.high
        total += 1
    assert hits / total >= LEVEL, hits / total


def test_without_enough_trials_it_says_why_never_a_width():
    assert why_none(1, 0) == "one trial gives no interval (nothing to hold out)"
    assert "3 held-out trial(s), 4 needed" in why_none(3, 3)


def test_predict_says_why_a_small_study_has_no_interval(builtin_study, tmp_path):
    out = json.loads(autotune_cli("predict", str(builtin_study.study), "--format", "json", cwd=tmp_path,
                                  timeout=300).stdout)
    assert out["samples_per_second_interval"] is None  # a budget-3 study: too few held out
    assert "needed" in out["interval_missing"] or "one trial" in out["interval_missing"]
    text = autotune_cli("predict", str(builtin_study.study), cwd=tmp_path, timeout=300).stdout
    assert out["interval_missing"] in text


def test_no_interval_is_stated_for_another_stage_count_or_dp():
    """The study's held-out trials all ran its own stages x dp: for another layout the interval is
    withheld, and the reason names both layouts (a 2-rank study's interval had held 4 of 13 4-rank
    layouts: benchmarks/model_accuracy.py)."""
    from autotune.model.render import LeaveOneOut
    from autotune.model.step_model import Layout

    loo = LeaveOneOut(points=_points([0.1, -0.2, 0.05, 0.3]), trials=5, shape=(2, 1))
    same = Layout(micro_batch_size=4, gradient_accumulation_steps=8, stages=2, data_parallel_size=1)
    other = Layout(micro_batch_size=4, gradient_accumulation_steps=4, stages=2, data_parallel_size=2)
    assert loo.interval(100.0, same) is not None and loo.interval(100.0) is not None
    assert loo.interval(100.0, other) is None
    why = loo.why_no_interval(other)
    assert "2 stages x 2 dp" in why and "ran 2 x 1" in why
    assert "held-out trial(s)" in loo.why_no_interval(same)  # the other reason, where it is the one
