"""The partition solver (autotune/core/partition.py) against brute force over every contiguous partition."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.core.errors import UserError
from autotune.core.partition import (
    LayerMove,
    MemoryModel,
    balanced_parts,
    check_parts,
    describe_moves,
    imbalance,
    in_flight,
    moves,
    parse_parts,
    stage_memory,
    stage_times,
)

SETTINGS = settings(max_examples=200, deadline=None)


def all_parts(n: int, stages: int):
    for cuts in itertools.combinations(range(1, n), stages - 1):
        yield [0, *cuts, n]


def brute_best(costs, stages, memory=None, fixed=None):
    best = None
    for parts in all_parts(len(costs), stages):
        if memory is not None and max(m - memory.limit_bytes for m in stage_memory(parts, memory)) > 0:
            continue
        worst = max(stage_times(costs, parts, fixed))
        best = worst if best is None else min(best, worst)
    return best


costs_st = st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=9)


@SETTINGS
@given(costs=costs_st, stages=st.integers(1, 5))
def test_solver_matches_brute_force(costs, stages):
    if len(costs) < stages:
        with pytest.raises(UserError, match="cannot fill"):
            balanced_parts(costs, stages)
        return
    parts = balanced_parts(costs, stages)
    assert check_parts(parts, len(costs), stages) == parts  # valid, every stage non-empty
    assert max(stage_times(costs, parts)) == pytest.approx(brute_best(costs, stages), rel=1e-9, abs=1e-9)


@SETTINGS
@given(costs=costs_st, stages=st.integers(1, 4), fixed=st.lists(st.floats(0, 50, allow_nan=False), min_size=4,
                                                                  max_size=4))
def test_fixed_stage_costs_match_brute_force(costs, stages, fixed):
    if len(costs) < stages:
        return
    parts = balanced_parts(costs, stages, stage_fixed=fixed[:stages])
    assert max(stage_times(costs, parts, fixed[:stages])) == pytest.approx(
        brute_best(costs, stages, fixed=fixed[:stages]), rel=1e-9, abs=1e-9)


@SETTINGS
@given(costs=st.lists(st.floats(0, 100, allow_nan=False), min_size=2, max_size=8), stages=st.integers(2, 4),
       params=st.lists(st.integers(0, 50), min_size=8, max_size=8),
       acts=st.lists(st.integers(0, 20), min_size=8, max_size=8),
       limit=st.integers(10, 300), micro=st.integers(1, 6))
def test_memory_constraint_matches_brute_force(costs, stages, params, acts, limit, micro):
    n = len(costs)
    if n < stages:
        return
    memory = MemoryModel(limit_bytes=limit, parameter_bytes=params[:n], activation_bytes=acts[:n],
                         micro_batches=micro)
    expected = brute_best(costs, stages, memory)
    if expected is None:
        with pytest.raises(UserError, match="fits"):
            balanced_parts(costs, stages, memory=memory)
        return
    parts = balanced_parts(costs, stages, memory=memory)
    assert max(stage_memory(parts, memory)) <= limit
    assert max(stage_times(costs, parts)) == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_heavy_head_moves_layers_off_the_last_stage():
    # embedding, 6 equal decoder layers, an LM head as heavy as three of them
    costs = [0.2] + [1.0] * 6 + [3.0]
    uniform = [0, 4, 8]
    parts = balanced_parts(costs, 2)
    assert parts == [0, 5, 8]
    assert imbalance(stage_times(costs, uniform)) > imbalance(stage_times(costs, parts))
    assert moves(uniform, parts) == [LayerMove(layer=4, from_stage=1, to_stage=0)]
    names = ["EmbeddingPipe"] + ["DecoderLayerPipe"] * 6 + ["LMHeadPipe"]
    assert describe_moves(uniform, parts, names) == "layer 4 (DecoderLayerPipe): stage 1 -> 0"
    assert describe_moves(parts, parts) == ""


def test_first_stage_holds_the_most_activations():
    assert [in_flight(4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(4, 0, 2) == 2
    memory = MemoryModel(limit_bytes=1e9, parameter_bytes=[0, 0], activation_bytes=[10, 10], micro_batches=8)
    assert stage_memory([0, 1, 2], memory) == [20, 10]


@pytest.mark.parametrize("bad, message", [
    ([0, 4], "boundaries for 2 stages"),
    ([1, 4, 8], "must start at 0"),
    ([0, 4, 7], "must start at 0"),
    ([0, 4, 4, 8], "must increase"),
    (["a", 4, 8], "integers"),
])
def test_bad_parts_are_said(bad, message):
    stages = 3 if len(bad) == 4 else 2
    with pytest.raises(UserError, match=message):
        check_parts(bad, 8, stages)


def test_parse_parts():
    assert parse_parts("0,5,8") == [0, 5, 8]
    assert parse_parts("[0, 5, 8]") == [0, 5, 8]
    with pytest.raises(UserError, match="comma-separated"):
        parse_parts("0;5")


@pytest.mark.parametrize("method, message", [
    ("parts:0,3", "2 boundaries for 2 stages"),
    ("parts:0,3,7", "layer count 6"),
    ("parts:0,x,6", "comma-separated"),
    ("profile", "parts:B0,B1"),
])
def test_a_bad_partition_method_is_one_clear_error(method, message):
    from autotune.core.options import RunOptions, WorkloadOptions
    from autotune.tuning.validation import validate

    opts = RunOptions(workload=WorkloadOptions(preset="tiny", pipeline_stages=2, partition_method=method))
    with pytest.raises(UserError, match=message):
        validate(opts)


def test_explicit_parts_are_a_valid_method():
    from autotune.core.options import RunOptions, WorkloadOptions
    from autotune.tuning.validation import validate

    validate(RunOptions(workload=WorkloadOptions(preset="tiny", pipeline_stages=2, partition_method="parts:0,2,6")))
