"""Interval timers for pipeline instructions: host clock on CPU, CUDA events on GPUs.

On a CPU every interval is also timed in the calling thread's CPU seconds (its work,
without the wait for a core: see WallAndCpuTimer).

On a GPU, kernels run asynchronously: a host clock around an instruction
measures launch time, not execution. CUDA events record on the stream and are
read once per step, after the step's final synchronize.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Protocol


class IntervalTimer(Protocol):
    def begin(self) -> Any:
        """Mark the start of an interval; returns a token for `end`."""

    def end(self, token: Any, category: str, also: str | None = None) -> None:
        """Close the interval opened by `token`, adding it to `category` (and to `also`, where
        given: a collective's time inside the compute that encloses it, autotune/rank/instrument.py)."""

    def collect(self) -> dict[str, float]:
        """Seconds per category since the last collect (called at step end)."""

    def intervals(self) -> dict[str, list[float]]:
        """The seconds of each interval of the categories that start with a prefix in `each`, in
        the step the last `collect` closed (point-to-point instructions and collectives:
        autotune/rank/p2p_split.py)."""


class _Intervals:
    """Each interval of the categories that start with a prefix in `each`, kept apart for the
    step (a few per micro-batch)."""

    def __init__(self, each: Iterable[str] = ()) -> None:
        self.each = tuple(each)
        self._open: dict[str, list[float]] = defaultdict(list)
        self._closed: dict[str, list[float]] = {}

    def add(self, category: str, seconds: float) -> None:
        if self.each and category.startswith(self.each):
            self._open[category].append(seconds)

    def close_step(self) -> None:
        self._closed, self._open = dict(self._open), defaultdict(list)

    def intervals(self) -> dict[str, list[float]]:
        return self._closed


class HostTimer(_Intervals):
    def __init__(self, each: Iterable[str] = ()) -> None:
        super().__init__(each)
        self._acc: dict[str, float] = defaultdict(float)

    def begin(self) -> float:
        return time.perf_counter()

    def end(self, token: float, category: str, also: str | None = None) -> None:
        seconds = time.perf_counter() - token
        self._acc[category] += seconds
        if also is not None:
            self._acc[also] += seconds
        self.add(category, seconds)

    def collect(self) -> dict[str, float]:
        out, self._acc = dict(self._acc), defaultdict(float)
        self.close_step()
        return out


class CudaEventTimer(_Intervals):
    """Records a pair of CUDA events per interval; resolves them at collect().

    Events are reused from step to step (a step's events have all completed once
    collect() has synchronized on the last one), so the steady state creates none.
    """

    def __init__(self, *, torch: Any = None, each: Iterable[str] = ()) -> None:
        super().__init__(each)
        if torch is None:
            import torch
        self._torch = torch  # injectable: tests pass a fake with cuda.Event
        self._pending: list[tuple[str, Any, Any, str | None]] = []
        self._free: list[Any] = []

    def begin(self) -> Any:
        ev = self._free.pop() if self._free else self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def end(self, token: Any, category: str, also: str | None = None) -> None:
        self._pending.append((category, token, self.begin(), also))

    def collect(self) -> dict[str, float]:
        acc: dict[str, float] = defaultdict(float)
        if self._pending:
            self._pending[-1][2].synchronize()
        for category, start, stop, also in self._pending:
            seconds = start.elapsed_time(stop) / 1000.0
            acc[category] += seconds
            if also is not None:
                acc[also] += seconds
            self.add(category, seconds)
            self._free += (start, stop)
        self._pending = []
        self.close_step()
        return dict(acc)


class WallAndCpuTimer(HostTimer):
    """The host clock, plus each interval's thread CPU time under `<category>:cpu`.

    The CPU time is the work an interval did, not its wall time. On a CPU with fewer cores
    than ranks (the 4-rank demo on 2 cores) an interval's wall time includes waiting for a
    core, and that wait depends on what the other ranks do at that moment, not on the
    interval's own work (identical decoder layers read 40-90 ms of wall time in one trial,
    38-47 ms of thread CPU time). Torch runs a rank's kernels on the calling thread with one
    intra-op thread (the workload's default), so this is the rank's compute. On a GPU the
    CUDA events already measure the device's own time.
    """

    def begin(self) -> tuple[float, float]:  # type: ignore[override]
        return time.perf_counter(), time.thread_time()

    def end(self, token: tuple[float, float], category: str,  # type: ignore[override]
            also: str | None = None) -> None:
        seconds, work = time.perf_counter() - token[0], time.thread_time() - token[1]
        for name in (category, also) if also is not None else (category,):
            self._acc[name] += seconds
            self._acc[name + CPU_SUFFIX] += work
        self.add(category, seconds)


CPU_SUFFIX = ":cpu"


def work_view(parts: dict[str, float]) -> dict[str, float]:
    """Each category's work: its CPU seconds where the timer recorded them (CPU), else the
    parts as they are (CUDA events are already the device's own time)."""
    cpu = {k[: -len(CPU_SUFFIX)]: v for k, v in parts.items() if k.endswith(CPU_SUFFIX)}
    return cpu or parts


def make_timer(device_type: str, each: Iterable[str] = ()) -> IntervalTimer:
    """CUDA events on a GPU; on a CPU the host clock with each interval's CPU time beside it.
    `each`: the prefixes of the categories whose intervals are also kept one by one for the step."""
    return CudaEventTimer(each=each) if device_type == "cuda" else WallAndCpuTimer(each)
