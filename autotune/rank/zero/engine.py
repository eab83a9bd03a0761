"""The built-in workload's plain DeepSpeedEngine (`--engine zero`, issue 42), behind the engine face.

`deepspeed.initialize(model=nn.Module)` returns a plain `DeepSpeedEngine` (ZeRO stage 0-3, every
rank a data-parallel replica). It has no `train_batch`: a script calls `engine(x)`,
`engine.backward(loss)` and `engine.step()` per micro-batch, and the optimizer steps at the
accumulation boundary. `ZeroEngine` is that loop as one `train_batch(data_iter)` (one optimizer
step, `gradient_accumulation_steps` micro-batches), so the built-in rank's loop, the probe, the
step budget and the watchdog see the step they see on every other engine; its phases and the
ZeRO collectives inside them are the plain engine's instruction table
(autotune/rank/engine_face.py `PlainEngineInstructions`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from autotune.rank.engine_face import (
    EngineLayout,
    InstructionTable,
    PlainEngineInstructions,
    layout_of,
)


class ZeroEngine:
    """A plain DeepSpeedEngine and its loss, stepped one optimizer step per `train_batch`."""

    def __init__(self, engine: Any, loss_fn: Callable[[Any, Any], Any]) -> None:
        self.engine, self.loss_fn = engine, loss_fn
        self.device = engine.device

    def train_batch(self, data_iter: Iterator[tuple[Any, Any]] | None = None) -> Any:
        """One optimizer step: forward, backward and step for each micro-batch of it; the mean loss."""
        import torch

        if data_iter is None:
            raise ValueError("ZeroEngine.train_batch needs data_iter")
        engine, losses = self.engine, []
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, labels = next(data_iter)
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            loss = self.loss_fn(engine(inputs), labels)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        return torch.stack(losses).mean()

    # -- what the rank side reads (autotune/rank/engine_face.py, autotune/rank/instrument.py) ----
    def autotune_layout(self) -> EngineLayout:
        return layout_of(self.engine)

    def autotune_instructions(self) -> InstructionTable:
        return PlainEngineInstructions(self.engine)

    def is_last_stage(self) -> bool:
        return True  # every replica computes the loss

    def destroy(self) -> None:
        self.engine.destroy()

    def __getattr__(self, name: str) -> Any:
        # the engine's own accessors: fp16_enabled, optimizer, zero_optimization_stage, skipped_steps...
        return getattr(self.__dict__["engine"], name)
