"""A plain DeepSpeedEngine's optimizer steps, as events (issue 42: the user's own ZeRO script).

A pipeline engine's step is one call, `train_batch()`, which the probe, the watchdog and the
bootstrap's step budget wrap. A plain engine has no such call: the script's own loop calls
`engine(x)`, `engine.backward(loss)` and `engine.step()` once per micro-batch, and the optimizer
steps in the `step()` at the accumulation boundary (deepspeed/runtime/engine.py
`is_gradient_accumulation_boundary`, asked before the call: the call advances the count). So
one optimizer step begins at the first `forward` after a boundary and ends when the boundary's
`step()` returns; its loss is the mean of the losses handed to `backward` in between.

`plain_steps(engine)` installs the three wrappers once per engine (instance attributes, over any
already there: the probe's timed phases stay inside) and hands every listener the same events,
so the probe, the watchdog and the budget agree on where a step is. The built-in workload's
ZeRO engine (autotune/rank/zero/engine.py) has its own `train_batch` and does not need this.

Rank-side: no torch at import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ATTRIBUTE = "_autotune_plain_steps"


class PlainSteps:
    """The step events of one plain engine: `on_begin()` and `on_end(loss)` listeners, in the
    order they were added (the probe first: its record is made before the budget decides)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.begun: list[Callable[[], None]] = []
        self.ended: list[Callable[[Any], None]] = []
        self.in_step = False
        self.losses: list[Any] = []
        self._wrap()

    def _wrap(self) -> None:
        engine = self.engine
        forward, backward, step = engine.forward, engine.backward, engine.step

        def forward_(*args: Any, **kwargs: Any) -> Any:
            if not self.in_step:
                self.in_step = True
                for fn in list(self.begun):
                    fn()
            return forward(*args, **kwargs)

        def backward_(loss: Any, *args: Any, **kwargs: Any) -> Any:
            if hasattr(loss, "detach"):
                self.losses.append(loss.detach())  # a tensor, no device sync per micro-batch
            return backward(loss, *args, **kwargs)

        def step_(*args: Any, **kwargs: Any) -> Any:
            boundary = bool(engine.is_gradient_accumulation_boundary())  # before: step() advances it
            out = step(*args, **kwargs)
            if boundary:
                self._end()
            return out

        for name, fn in (("forward", forward_), ("backward", backward_), ("step", step_)):
            object.__setattr__(engine, name, fn)

    def _end(self) -> None:
        loss = _mean(self.losses)
        self.losses, self.in_step = [], False
        for fn in list(self.ended):
            fn(loss)


def plain_steps(engine: Any) -> PlainSteps:
    """The engine's step events, installed on first use."""
    steps = engine.__dict__.get(ATTRIBUTE)
    if steps is None:
        steps = PlainSteps(engine)
        object.__setattr__(engine, ATTRIBUTE, steps)
    return steps


def has_train_batch(engine: Any) -> bool:
    """A pipeline engine (or the built-in ZeRO stepper): its step is one `train_batch()` call."""
    return callable(getattr(engine, "train_batch", None))


def _mean(losses: list[Any]) -> Any:
    if not losses:
        return None
    import torch

    return torch.stack([t.float().mean() for t in losses]).mean()
