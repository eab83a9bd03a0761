"""A plain engine's communication: the collectives of DeepSpeed's communication backend, one
instruction each (issue 42).

A plain `DeepSpeedEngine` has no pipeline instructions to time; its communication is the ZeRO
reducer's and gatherer's collectives (all-reduce, reduce-scatter, all-gather, ...), called from
inside the engine's backward and step. Every one of them reaches the process's one backend
object, `deepspeed.comm.comm.cdb` (a `TorchBackend`, deepspeed/comm/torch.py), whatever wrapper
of `deepspeed.comm` the caller used (`allgather_fn`, `reduce_scatter_fn`, the coalesced
collectives). So the collectives are wrapped there, as instance attributes of that object: one
place, no collective counted twice, no DeepSpeed class patched, undone when the trial ends.

DeepSpeed's own `comms_logger` (`"comms_logger": {"enabled": true}`) times the same calls, but it
synchronizes the device before and after every collective (`timed_op`, deepspeed/comm/comm.py),
which removes the very overlap `overlap_comm` buys, and it keeps a running log per message size
rather than per step; the probe's timer (CUDA events on a GPU, the host clock on a CPU) times
each call in place instead (docs/zero-facts.md).

Each call is its own kind, `collective:<op>:<elements>`, so the probe's split
(autotune/rank/p2p_split.py `TransferSplit`) can tell a collective's transfer (its fastest
instance) from the wait for a slower rank (the rest). A collective started with `async_op=True`
returns a handle; the time its `wait()` blocks is counted as communication too, since that is
the part of the transfer the rank waited for (an all-gather's apart as well, in the CSV's
`gather_seconds`: ZeRO-3 starts its parameter gathers async, autotune/rank/instrument.py).
The step's calls and its all-gathers' share are columns of their own (docs/metrics.md).

Rank-side: DeepSpeed is imported only when a table is wrapped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

COLLECTIVE_PREFIX = "collective:"
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "broadcast",
               "all_to_all_single", "all_to_all")
"""The backend's collectives (deepspeed/comm/torch.py `TorchBackend`); point-to-point and barriers
are not the ZeRO reducer's and stay untimed."""


GATHERS = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_coalesced"})
"""The all-gathers: ZeRO-3 gathers its parameters with them, ZeRO-1/2 the updated parameters."""


def collective_calls(intervals: dict[str, list[float]]) -> int:
    """The collective calls of one step's intervals (each `collective:` instance once)."""
    return sum(len(v) for k, v in intervals.items() if k.startswith(COLLECTIVE_PREFIX))


def gathers(intervals: dict[str, list[float]]) -> dict[str, list[float]]:
    """The all-gather kinds of one step's intervals."""
    return {k: v for k, v in intervals.items()
            if k.startswith(COLLECTIVE_PREFIX) and k[len(COLLECTIVE_PREFIX):].partition(":")[0] in GATHERS}


def collective_kind(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """`collective:<op>:<elements>`: one kind per collective and message size."""
    return f"{COLLECTIVE_PREFIX}{op}:{_elements(args, kwargs)}"


def _elements(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Elements of the tensors a collective is handed (the first tensor or list of tensors)."""
    for value in (*args, *kwargs.values()):
        if hasattr(value, "numel"):
            return int(value.numel())
        if isinstance(value, (list, tuple)) and value and all(hasattr(v, "numel") for v in value):
            return int(sum(v.numel() for v in value))
    return 0


def backend() -> object | None:
    """The process's DeepSpeed communication backend, or None before `init_distributed`."""
    from deepspeed.comm import comm

    return getattr(comm, "cdb", None)


class TimedWork:
    """An async collective's handle whose `wait()` is timed (`on_wait(seconds_fn)`); the rest
    is the handle's own."""

    def __init__(self, work: Any, timed_wait: Callable[[Callable[[], Any]], Any]) -> None:
        self._work, self._timed_wait = work, timed_wait

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed_wait(lambda: self._work.wait(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
