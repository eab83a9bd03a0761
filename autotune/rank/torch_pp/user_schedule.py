"""A user's own torch.distributed.pipelining schedule behind the engine face (issue 43).

The script builds its `PipelineStage`s and one `Schedule*` object and calls `schedule.step(...)`
in its own loop, its optimizer step between the calls. `UserSchedule` wraps that object as the
built-in torch engine's `TorchPipeEngine` wraps its own (autotune/rank/torch_pp/engine.py
`time_schedule`: forward, backward, the loss and the point-to-point waits, under DeepSpeed's
instruction names), so the same probe writes the same CSV columns and every signal, rule and
`advise` reads them as they read the built-in engine's.

A step is one iteration of the script's loop: from the end of one `step()` call to the end of
the next (the first from its own start). So the script's optimizer step and data loading count
in the step time, untimed (idle), and samples/s is what the loop achieves; they are the
script's own code, which nothing here wraps. The face hands its steps to the probe as a plain
engine's step events (autotune/rank/step_boundary.py).

What it reads of the objects: the schedule's class and `_n_microbatches`; each stage's
`submod`, `group_size` (the pipeline's ranks) and `group_rank`; the micro-batch from each
step's batch (the first stage's input, or the last stage's `target`) over `n_microbatches`.
The data-parallel size is the world over the pipeline group's size, and a rank's replica its
rank over that size (torchtitan's mesh puts the pipeline innermost).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotune.core.trace_labels import FORWARD
from autotune.rank.step_boundary import ATTRIBUTE
from autotune.rank.torch_pp.engine import (
    INSTRUCTION_CATEGORY,
    ScheduleFace,
    _run_call,
    time_schedule,
)
from autotune.rank.torch_schedule_probe import schedule_stages, step_batch


class ScheduleSteps:
    """The face's step events (`begun()`, `ended(loss)` listeners), as step_boundary.py's PlainSteps."""

    def __init__(self) -> None:
        self.begun: list[Callable[[], None]] = []
        self.ended: list[Callable[[Any], None]] = []

    def begin(self) -> None:
        for fn in list(self.begun):
            fn()

    def end(self, loss: Any) -> None:
        for fn in list(self.ended):
            fn(loss)


class UserSchedule(ScheduleFace):
    """One rank's stages and the script's schedule object, behind the engine face."""

    def __init__(self, schedule: Any) -> None:
        import torch
        import torch.distributed as dist

        self.schedule = schedule
        self.stages = schedule_stages(schedule)
        first = self.stages[0]
        self.global_rank = dist.get_rank()
        world = dist.get_world_size()
        self.num_stages = int(getattr(first, "group_size", world))
        """The pipeline's ranks (the CSV's pipeline_stages), as the built-in torch engine counts them."""
        self.stage_id = int(getattr(first, "group_rank", self.global_rank))
        self._dp = max(1, world // self.num_stages)
        self.device = first.device
        self.module = torch.nn.ModuleList([s.submod for s in self.stages])
        self.m = int(getattr(schedule, "_n_microbatches", 1))
        self.micro = 0
        """Samples per micro-batch: from the first step's batch on the first and last stages, from the
        first forward's output on a middle one (whose `step()` gets no batch); 0 before either."""
        self.schedule_name = type(schedule).__name__
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        self.skipped_steps = 0
        self._instructions: dict[str, Callable[..., Any]] = {name: _run_call for name in INSTRUCTION_CATEGORY}
        time_schedule(self, self.stages, schedule)
        self.steps = ScheduleSteps()
        object.__setattr__(self, ATTRIBUTE, self.steps)  # the probe's step events (step_boundary.plain_steps)
        self._own_step = schedule.step
        self._begun = False
        schedule.step = self._step  # an instance attribute: the class's step is untouched

    def run(self, instruction: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        out = super().run(instruction, fn, *args, **kwargs)
        if not self.micro and instruction == FORWARD:  # a middle stage: its output's rows are the micro-batch
            self.micro = _leading_size(out) or 0
        return out

    @property
    def data_parallel_size(self) -> int:
        return self._dp

    @property
    def replica(self) -> int:
        return self.global_rank // self.num_stages

    # -- the script's step ---------------------------------------------------------------------
    def _step(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        if not self._begun:  # the first step from its own start; each later one from the last's end
            self._begun = True
            self.steps.begin()
        batch = step_batch(args, kwargs)
        if batch and self.m:
            self.micro = batch // self.m
        out = self._own_step(*args, **kwargs)
        losses = kwargs.get("losses")
        loss = (torch.stack([x.detach().float().reshape(()) for x in losses]).mean()
                if self.last and isinstance(losses, list) and losses else None)
        self.steps.end(loss)
        self.steps.begin()
        return out


def _leading_size(out: Any) -> int | None:
    """The first dimension of a forward's output (a tensor, or the first of a tuple of them)."""
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) > 0 else None
