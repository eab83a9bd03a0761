"""Interval timers: the host clock, and the CUDA-event path against a fake torch.cuda.Event."""

import time

import pytest

from autotune.rank.engine_face import DEEPSPEED_CATEGORY as INSTRUCTION_CATEGORY
from autotune.rank.timing import CudaEventTimer, HostTimer, make_timer


def test_host_timer_accumulates_per_category_and_resets():
    t = HostTimer()
    tok = t.begin()
    time.sleep(0.02)
    t.end(tok, "compute")
    tok = t.begin()
    t.end(tok, "comm")
    got = t.collect()
    assert got["compute"] >= 0.02 and got["comm"] < got["compute"]
    assert t.collect() == {}


class FakeEvent:
    """Stands in for torch.cuda.Event: a timestamp set by record(), read by elapsed_time (ms)."""

    clock = 0.0
    synced = 0
    created = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t = None
        FakeEvent.created += 1

    def record(self) -> None:
        self.t = FakeEvent.clock

    def synchronize(self) -> None:
        FakeEvent.synced += 1

    def elapsed_time(self, other: "FakeEvent") -> float:
        return (other.t - self.t) * 1000.0


class FakeTorch:
    class cuda:  # noqa: N801 - mirrors torch.cuda
        Event = FakeEvent


def test_cuda_event_timer_reads_event_pairs_once_per_step():
    t = CudaEventTimer(torch=FakeTorch)
    FakeEvent.clock, FakeEvent.synced, FakeEvent.created = 1.0, 0, 0
    a = t.begin()
    FakeEvent.clock = 1.25
    t.end(a, "compute")
    b = t.begin()
    FakeEvent.clock = 1.5
    t.end(b, "wait")
    got = t.collect()
    assert got == pytest.approx({"compute": 0.25, "wait": 0.25})
    assert FakeEvent.synced == 1  # one synchronize per step, not per instruction
    assert t.collect() == {}


def test_cuda_event_timer_keeps_the_asked_categories_intervals_one_by_one():
    """The point-to-point split (autotune/rank/p2p_split.py) needs each send's and receive's time, on a
    GPU from the events as well."""
    t = CudaEventTimer(torch=FakeTorch, each=frozenset({"p2p:SendGrad"}))
    FakeEvent.clock = 0.0
    for width, cat in ((0.5, "p2p:SendGrad"), (0.25, "p2p:SendGrad"), (1.0, "compute")):
        a = t.begin()
        FakeEvent.clock += width
        t.end(a, cat)
    assert t.collect() == pytest.approx({"p2p:SendGrad": 0.75, "compute": 1.0})
    assert t.intervals() == {"p2p:SendGrad": pytest.approx([0.5, 0.25])}


def test_cuda_event_timer_reuses_a_steps_events():
    t = CudaEventTimer(torch=FakeTorch)
    FakeEvent.clock, FakeEvent.created = 0.0, 0
    for step in range(3):
        for width in (0.5, 0.25):
            a = t.begin()
            FakeEvent.clock += width
            t.end(a, "compute")
        assert t.collect() == pytest.approx({"compute": 0.75}), step
    assert FakeEvent.created == 4  # the first step's two pairs, re-recorded after


def test_make_timer_by_device():
    assert isinstance(make_timer("cpu"), HostTimer)


def test_every_deepspeed_instruction_has_a_category():
    """Pins what we rely on in DeepSpeed 0.19.8: the instruction set of the pipeline engine."""
    engine = pytest.importorskip("deepspeed.runtime.pipe.engine", reason="deepspeed not installed")
    names = {cls.__name__ for cls in engine.PipelineEngine._INSTRUCTION_MAP}
    assert names == set(INSTRUCTION_CATEGORY)
