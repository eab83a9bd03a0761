"""Interval timers for pipeline instructions: host clock on CPU, CUDA events on GPUs.

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


def make_timer(device_type: str) -> IntervalTimer:
    return CudaEventTimer() if device_type == "cuda" else HostTimer()
