"""Summaries against values computed by hand."""

import math

import pytest
from builders import SMALL_STEP, record

from autotune.core.summary import fluctuation, ideal_bubble_fraction, summarize, summarize_trial


def rec(**kw):
    return record(**{**SMALL_STEP, **kw})


def test_ideal_bubble_matches_1f1b_formula():
    assert ideal_bubble_fraction(2, 1) == pytest.approx(0.5)
    assert ideal_bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert ideal_bubble_fraction(8, 40) == pytest.approx(7 / 47)
    with pytest.raises(ValueError):
        ideal_bubble_fraction(0, 4)


def test_fluctuation_is_population_std_and_needs_two_samples():
    assert fluctuation([0.5]) is None
    assert fluctuation([0.4, 0.6]) == pytest.approx(0.1)
    assert fluctuation([0.2, 0.2, 0.2]) == 0.0


def two_rank_trial():
    # global batch = micro 2 x GAS 2 x dp 2 = 8 samples per step
    rows = [
        rec(rank=0, stage=0, step=0, warmup=1, step_seconds=9.0, compute_seconds=1.0),  # excluded
        rec(rank=1, stage=1, step=0, warmup=1, step_seconds=9.0, compute_seconds=1.0),  # excluded
        rec(rank=0, stage=0, step=1, step_seconds=1.0, compute_seconds=0.6, comm_seconds=0.1,
            wait_seconds=0.2, device_utilization=0.6, loss=None),
        rec(rank=1, stage=1, step=1, step_seconds=2.0, compute_seconds=1.2, comm_seconds=0.2,
            wait_seconds=0.4, device_utilization=0.6, loss=3.0),
        rec(rank=0, stage=0, step=2, step_seconds=0.5, compute_seconds=0.2, comm_seconds=0.1,
            wait_seconds=0.1, device_utilization=0.4, loss=None),
        rec(rank=1, stage=1, step=2, step_seconds=0.5, compute_seconds=0.4, comm_seconds=0.0,
            wait_seconds=0.0, device_utilization=0.8, loss=2.0),
    ]
    return summarize_trial(rows)


def test_throughput_uses_slowest_rank_per_step_and_skips_warmup():
    s = two_rank_trial()
    assert s.steps == 2 and s.warmup_steps == 1
    # step 1: slowest 2.0 s -> 4 samples/s; step 2: 0.5 s -> 16 samples/s; median 10
    assert s.samples_per_second == pytest.approx(10.0)
    assert s.tokens_per_second == pytest.approx(640.0)
    assert s.step_seconds == pytest.approx(1.25)
    assert s.step_time_jitter == pytest.approx(0.75 / 1.25)


def test_ratios_imbalance_bubble_by_hand():
    s = two_rank_trial()
    r0, r1 = s.ranks
    # transfer only: waiting for a peer is not communication (issue 24)
    assert r0.comm_compute_ratio == pytest.approx(0.2 / 0.8)
    assert r1.comm_compute_ratio == pytest.approx(0.2 / 1.6)
    assert s.comm_compute_ratio == pytest.approx(0.25)
    assert s.transfer_compute_ratio == pytest.approx(0.2 / 0.8)
    # waiting is its own signal: worst rank's wait / step, 0.3/1.5 and 0.4/2.5
    assert s.peer_wait_fraction == pytest.approx(0.2)
    assert s.metrics_schema == 2
    # stage means: stage0 0.4 s, stage1 0.8 s -> max/mean = 0.8/0.6
    assert s.stage_compute_imbalance == pytest.approx(0.8 / 0.6)
    assert s.slowest_stage == 1
    # idle share per rank: 1 - 0.8/1.5 and 1 - 1.6/2.5
    assert r0.bubble_fraction == pytest.approx(1 - 0.8 / 1.5)
    assert r1.bubble_fraction == pytest.approx(1 - 1.6 / 2.5)
    assert s.bubble_fraction_measured == pytest.approx(((1 - 0.8 / 1.5) + (1 - 1.6 / 2.5)) / 2)
    assert s.bubble_fraction_ideal == pytest.approx(1 / 3)


def test_utilization_fluctuation_per_rank_and_across():
    s = two_rank_trial()
    assert s.ranks[0].device_utilization_fluctuation == pytest.approx(0.1)
    assert s.ranks[1].device_utilization_fluctuation == pytest.approx(0.1)
    assert s.device_utilization_fluctuation == pytest.approx(0.1)
    assert s.cross_device_fluctuation == pytest.approx(0.1)  # std of the means 0.5 and 0.7


def test_fragmentation_not_available_on_cpu_is_none_not_zero():
    s = two_rank_trial()
    assert s.memory_fragmentation_ratio is None
    rows = [rec(step=1, memory_fragmentation_ratio=0.2), rec(step=2, memory_fragmentation_ratio=0.4)]
    assert summarize_trial(rows).memory_fragmentation_ratio == pytest.approx(0.3)


def test_host_bound_only_where_utilization_came_from_the_device():
    # rank 0 on a GPU with NVML: instructions span 0.9 and 0.8 of the steps (busy 0.85),
    # kernels ran 0.3 and 0.2 of the time (0.25): 1 - 0.25/0.85 of instruction time idle.
    rows = [rec(rank=0, step=1, compute_seconds=0.9, device_utilization=0.3, utilization_from_device=1),
            rec(rank=0, step=2, compute_seconds=0.8, device_utilization=0.2, utilization_from_device=1),
            rec(rank=1, stage=1, step=1, compute_seconds=0.5, device_utilization=0.5, utilization_from_device=0),
            rec(rank=1, stage=1, step=2, compute_seconds=0.5, device_utilization=0.5, utilization_from_device=0)]
    s = summarize_trial(rows)
    assert s.ranks[0].host_bound_fraction == pytest.approx(1 - 0.25 / 0.85)
    assert s.ranks[1].host_bound_fraction is None  # busy fraction: nothing to compare with
    assert s.host_bound_fraction == pytest.approx(1 - 0.25 / 0.85)
    assert two_rank_trial().host_bound_fraction is None  # CPU (and older CSVs): not available
    # kernels running the whole instruction time: not host-bound at all, never negative
    busy_gpu = [rec(step=1, compute_seconds=0.5, device_utilization=0.7, utilization_from_device=1)]
    assert summarize_trial(busy_gpu).host_bound_fraction == 0.0


def test_loss_first_last_only_from_ranks_that_have_it():
    s = two_rank_trial()
    assert (s.loss_first, s.loss_last) == (3.0, 2.0)


def test_summarize_groups_trials_and_drops_warmup_only_trials():
    rows = [rec(trial=0, step=1), rec(trial=1, step=0, warmup=1), rec(trial=2, step=1)]
    assert [s.trial for s in summarize(rows)] == [0, 2]


def test_roundtrip_dict():
    from autotune.core.summary import TrialSummary

    s = two_rank_trial()
    again = TrialSummary.from_dict(s.to_dict())
    assert again == s
    assert not math.isnan(again.samples_per_second)


def test_rows_without_a_schema_version_count_as_schema_1():
    """A cell left empty (a CSV edited by hand, or rows of two versions in one file) is an old row;
    the fuzz benchmark found the summary raising on it (int of NaN)."""
    rows = [rec(rank=r, stage=r, step=s, schema_version=None if s == 1 else 2) for r in (0, 1) for s in (1, 2)]
    assert summarize_trial(rows).metrics_schema == 1
    assert summarize_trial([rec(rank=r, stage=r, step=1) for r in (0, 1)]).metrics_schema == 2
