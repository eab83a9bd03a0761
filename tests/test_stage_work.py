"""Stage work on a CPU: thread CPU time beside the wall clock (autotune/rank/timing.py), and the
stage work imbalance the partition step decides on (autotune/core/summary.py, autotune/tuning/balance.py).

On a machine with fewer cores than ranks, an interval's wall time also holds the wait for a
core; the CPU-time view must leave that wait out and keep the work.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from builders import healthy_summary, record

from autotune.core.summary import summarize_trial
from autotune.rank.timing import CPU_SUFFIX, WallAndCpuTimer, make_timer, work_view
from autotune.tuning.balance import work_imbalance


def _spin(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_a_wait_counts_in_wall_time_only_and_work_in_both():
    t = WallAndCpuTimer()
    tok = t.begin()
    time.sleep(0.05)  # waiting, as a rank waits for a core
    t.end(tok, "compute")
    tok = t.begin()
    _spin(0.05)
    t.end(tok, "work")
    parts = t.collect()
    assert parts["compute"] >= 0.05 and parts["compute" + CPU_SUFFIX] < 0.02
    assert parts["work"] >= 0.05 and parts["work" + CPU_SUFFIX] >= 0.045
    view = work_view(parts)
    assert set(view) == {"compute", "work"} and view["compute"] < 0.02
    assert t.collect() == {}


def test_work_view_keeps_event_times_as_they_are():
    assert work_view({"fwd:0": 0.25, "bwd:0": 0.5}) == {"fwd:0": 0.25, "bwd:0": 0.5}
    assert isinstance(make_timer("cpu"), WallAndCpuTimer)


def _stage_rows(stage: int, wall: float, work: float | None, steps: int = 4) -> list:
    return [record(rank=stage, stage=stage, step=s, compute_seconds=wall, optimizer_seconds=0.0,
                   compute_cpu_seconds=work, data_parallel_size=1) for s in range(steps)]


def test_work_imbalance_follows_cpu_time_not_the_wait_for_a_core():
    # Stage 1 waited for a core (wall 0.9 s) but did the same work as stage 0.
    s = summarize_trial(_stage_rows(0, 0.5, 0.4) + _stage_rows(1, 0.9, 0.4))
    assert s.stage_compute_imbalance == pytest.approx(0.9 / 0.7)
    assert s.stage_work_seconds == pytest.approx([0.4, 0.4])
    assert s.stage_work_imbalance == pytest.approx(1.0)
    assert work_imbalance(s) == pytest.approx(1.0)
    # Stage 0 does twice the work: the imbalance is 2 / 1.5 whatever the wall clock says.
    s = summarize_trial(_stage_rows(0, 0.5, 0.8) + _stage_rows(1, 0.5, 0.4))
    assert s.stage_work_imbalance == pytest.approx(0.8 / 0.6)
    assert s.stage_compute_imbalance == pytest.approx(1.0)


def test_without_the_column_a_cpu_trial_has_no_work_figure_and_a_gpu_trial_uses_its_events():
    cpu = summarize_trial(_stage_rows(0, 0.5, None) + _stage_rows(1, 0.9, None))
    assert cpu.stage_work_imbalance is None and cpu.stage_work_seconds is None
    assert work_imbalance(cpu) == pytest.approx(cpu.stage_compute_imbalance)
    gpu = summarize_trial([dataclasses.replace(r, memory_reserved_bytes=1e9)  # the CUDA allocator's
                           for r in _stage_rows(0, 0.5, None) + _stage_rows(1, 0.9, None)])
    assert gpu.stage_work_imbalance == pytest.approx(gpu.stage_compute_imbalance)
    assert work_imbalance(healthy_summary()) == pytest.approx(1.02)  # a summary stored before the field
