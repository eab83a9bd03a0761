"""What the rank side reads of a training engine's layout, declared once (issue 41).

The probe, the step budget, the layer costs and the bootstrap's marker need the same few facts
of whatever engine a rank built: its rank, micro-batch, micro-batch count (accumulation steps),
data-parallel replicas and, for a pipeline, its stages and this rank's stage. `layout_of` asks
an engine that declares them (`autotune_layout()`, the torch engine's `TorchPipeEngine`), and
otherwise reads DeepSpeed's engines, here and nowhere else: a `PipelineEngine`'s `grid`,
`num_stages` and `stage_id`, or a plain `DeepSpeedEngine`'s `dp_world_size` (no stages: its
topology is None, and a pipeline-only signal such as the bubble is absent for it, never 0).

What the probe times (the instructions and their categories) is still DeepSpeed's
`_INSTRUCTION_MAP` (autotune/rank/instrument.py), which the torch engine offers too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """A pipeline's shape as one rank sees it."""

    stages: int
    """The pipeline's ranks (the CSV's pipeline_stages)."""
    stage: int
    """This rank's place in its pipeline."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineLayout:
    rank: int
    micro_batch_size: int
    accumulation_steps: int
    """Micro-batches per optimizer step (DeepSpeed's gradient_accumulation_steps, a pipeline's
    micro-batch count)."""
    data_parallel_size: int
    topology: Topology | None
    """None: the engine has no stages (a plain DeepSpeedEngine)."""

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over every data-parallel replica."""
        return self.micro_batch_size * self.accumulation_steps * self.data_parallel_size

    @property
    def stage(self) -> int:
        """This rank's stage; 0 for an engine without stages (its one "stage" is the whole model)."""
        return self.topology.stage if self.topology is not None else 0

    @property
    def stages(self) -> int:
        return self.topology.stages if self.topology is not None else 1


class DeclaresLayout(Protocol):
    """An engine that states its own layout rather than be read as DeepSpeed's."""

    def autotune_layout(self) -> EngineLayout: ...


def layout_of(engine: object) -> EngineLayout:
    """The engine's layout now (a DeepSpeed engine can change its micro-batch count live)."""
    own = getattr(engine, "autotune_layout", None)  # per step (the probe's record): no protocol isinstance
    if own is not None:
        return cast(DeclaresLayout, engine).autotune_layout()
    return _deepspeed_layout(engine)


class _Grid(Protocol):
    data_parallel_size: int


class _DeepSpeedEngine(Protocol):
    """What `layout_of` reads of DeepSpeed's engines (deepspeed/runtime/engine.py)."""

    global_rank: int

    def train_micro_batch_size_per_gpu(self) -> int: ...

    def gradient_accumulation_steps(self) -> int: ...


class _PipelineEngine(_DeepSpeedEngine, Protocol):
    """A PipelineEngine's layout besides (deepspeed/runtime/pipe/engine.py)."""

    grid: _Grid
    num_stages: int
    stage_id: int


def _deepspeed_layout(engine: object) -> EngineLayout:
    """DeepSpeed's engines, by their own accessors."""
    e = cast(_DeepSpeedEngine, engine)
    micro, gas, rank = int(e.train_micro_batch_size_per_gpu()), int(e.gradient_accumulation_steps()), int(e.global_rank)
    if hasattr(engine, "num_stages") and hasattr(engine, "grid"):  # a PipelineEngine
        pipe = cast(_PipelineEngine, engine)
        return EngineLayout(rank=rank, micro_batch_size=micro, accumulation_steps=gas,
                            data_parallel_size=int(pipe.grid.data_parallel_size),
                            topology=Topology(stages=int(pipe.num_stages), stage=int(pipe.stage_id)))
    dp = getattr(engine, "dp_world_size", 1)  # a plain DeepSpeedEngine's data-parallel world
    return EngineLayout(rank=rank, micro_batch_size=micro, accumulation_steps=gas,
                        data_parallel_size=int(dp), topology=None)
