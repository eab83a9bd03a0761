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
from typing import Any, Protocol


class IntervalTimer(Protocol):
    def begin(self) -> Any:
        """Mark the start of an interval; returns a token for `end`."""

    def end(self, token: Any, category: str) -> None:
        """Close the interval opened by `token`, adding it to `category`."""

    def collect(self) -> dict[str, float]:
        """Seconds per category since the last collect (called at step end)."""


class HostTimer:
    def __init__(self) -> None:
        self._acc: dict[str, float] = defaultdict(float)

    def begin(self) -> float:
        return time.perf_counter()

    def end(self, token: float, category: str) -> None:
        self._acc[category] += time.perf_counter() - token

    def collect(self) -> dict[str, float]:
        out, self._acc = dict(self._acc), defaultdict(float)
        return out


class CudaEventTimer:
    """Records a pair of CUDA events per interval; resolves them at collect().

    Events are reused from step to step (a step's events have all completed once
    collect() has synchronized on the last one), so the steady state creates none.
    """

    def __init__(self, *, torch: Any = None) -> None:
        if torch is None:
            import torch
        self._torch = torch  # injectable: tests pass a fake with cuda.Event
        self._pending: list[tuple[str, Any, Any]] = []
        self._free: list[Any] = []

    def begin(self) -> Any:
        ev = self._free.pop() if self._free else self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def end(self, token: Any, category: str) -> None:
        self._pending.append((category, token, self.begin()))

    def collect(self) -> dict[str, float]:
        acc: dict[str, float] = defaultdict(float)
        if self._pending:
            self._pending[-1][2].synchronize()
        for category, start, stop in self._pending:
            acc[category] += start.elapsed_time(stop) / 1000.0
            self._free += (start, stop)
        self._pending = []
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

    def end(self, token: tuple[float, float], category: str) -> None:  # type: ignore[override]
        self._acc[category] += time.perf_counter() - token[0]
        self._acc[category + CPU_SUFFIX] += time.thread_time() - token[1]


CPU_SUFFIX = ":cpu"


def work_view(parts: dict[str, float]) -> dict[str, float]:
    """Each category's work: its CPU seconds where the timer recorded them (CPU), else the
    parts as they are (CUDA events are already the device's own time)."""
    cpu = {k[: -len(CPU_SUFFIX)]: v for k, v in parts.items() if k.endswith(CPU_SUFFIX)}
    return cpu or parts


def make_timer(device_type: str) -> IntervalTimer:
    """CUDA events on a GPU; on a CPU the host clock with each interval's CPU time beside it."""
    return CudaEventTimer() if device_type == "cuda" else WallAndCpuTimer()
