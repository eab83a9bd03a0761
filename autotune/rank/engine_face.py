"""What the rank side reads of a training engine's layout, declared once (issue 41).

The probe, the step budget, the layer costs and the bootstrap's marker need the same few facts
of whatever engine a rank built: its rank, micro-batch, micro-batch count (accumulation steps),
data-parallel replicas and, for a pipeline, its stages and this rank's stage. `layout_of` asks
an engine that declares them (`autotune_layout()`, the torch engine's `TorchPipeEngine`), and
otherwise reads DeepSpeed's engines, here and nowhere else: a `PipelineEngine`'s `grid`,
`num_stages` and `stage_id`, or a plain `DeepSpeedEngine`'s `dp_world_size` (no stages: its
topology is None, and a pipeline-only signal such as the bubble is absent for it, never 0).

What the probe times is declared here too: an engine's instructions, each with its name and the
probe's category, as an `InstructionTable` the probe, the layer-cost hooks, the trace labels and
the built-in workload's slowdown wrap (`instructions_of`). A `PipelineEngine`'s table is its
`_INSTRUCTION_MAP`, read here and nowhere else; the torch engine declares its own
(`autotune_instructions()`); a plain DeepSpeedEngine's is its `forward`, `backward` and `step`
and the collectives of DeepSpeed's communication backend that ZeRO calls inside them
(`PlainEngineInstructions`, autotune/rank/collectives.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, cast

from autotune.rank.p2p_split import p2p_category


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
    data_parallel_rank: int
    """This rank's replica (its data shard's seed)."""
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

    def get_data_parallel_rank(self) -> int: ...


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
                            data_parallel_rank=int(pipe.grid.get_data_parallel_rank()),
                            topology=Topology(stages=int(pipe.num_stages), stage=int(pipe.stage_id)))
    dp = getattr(engine, "dp_world_size", 1)  # a plain DeepSpeedEngine's data-parallel world
    mpu = getattr(engine, "mpu", None)  # a model-parallel unit the script passed, else every rank a replica
    dp_rank = mpu.get_data_parallel_rank() if mpu is not None else rank
    return EngineLayout(rank=rank, micro_batch_size=micro, accumulation_steps=gas,
                        data_parallel_size=int(dp), data_parallel_rank=int(dp_rank), topology=None)


# -- what the probe times ---------------------------------------------------------------------
COMPUTE, OPTIMIZER, COMM, DATA = "compute", "optimizer", "comm", "data"
"""The probe's categories; a point-to-point instruction's is `p2p_category(name)` (transfer
plus wait, split by autotune/rank/p2p_split.py)."""
COLLECTIVE = "collective"
"""A collective of a plain engine, called inside its compute: the probe times each call as its
own kind (autotune/rank/collectives.py) and takes it out of the compute that encloses it."""


@dataclass(frozen=True, slots=True)
class Instruction:
    name: str
    """As a trace labels it (`deepspeed:<name>`, autotune/core/trace_labels.py) and the layer-cost
    hooks and the slowdown find it: ForwardPass, BackwardPass, ..."""
    category: str | None
    """The probe's category; None: not timed."""


class InstructionFn(Protocol):
    """An instruction's function, as the engine calls it (a PipelineEngine's with the engine
    first, a plain engine's methods and collectives bound)."""

    def __call__(self, *args: object, **kwargs: object) -> object: ...


Wrapper = Callable[[Instruction, InstructionFn], InstructionFn]
"""Given an instruction and its function, the function to run in its place (or the same one)."""


class InstructionTable(Protocol):
    def wrap(self, wrapper: Wrapper) -> Callable[[], None]:
        """Run `wrapper(instruction, fn)` in place of every instruction's function; the undo
        returned gives back the table as it was before (an earlier wrap stays underneath)."""
        ...


class DeclaresInstructions(Protocol):
    """An engine that states its own instructions rather than be read as a PipelineEngine."""

    def autotune_instructions(self) -> InstructionTable: ...


K = TypeVar("K")


class MappedInstructions(Generic[K]):
    """A table kept as a dict attribute of the engine, keyed by what `describe` names. A wrap
    sets an instance attribute, so no class (DeepSpeed's included) is patched."""

    def __init__(self, holder: object, attribute: str, describe: Callable[[K], Instruction]) -> None:
        self.holder, self.attribute, self.describe = holder, attribute, describe

    def wrap(self, wrapper: Wrapper) -> Callable[[], None]:
        previous = self.holder.__dict__.get(self.attribute)
        source: Mapping[K, InstructionFn] = getattr(self.holder, self.attribute)
        setattr(self.holder, self.attribute, {key: wrapper(self.describe(key), fn) for key, fn in source.items()})

        def undo() -> None:
            if previous is None:
                self.holder.__dict__.pop(self.attribute, None)  # the class's map again
            else:
                setattr(self.holder, self.attribute, previous)
        return undo


PLAIN_ENGINE_PHASES: dict[str, str] = {"forward": COMPUTE, "backward": COMPUTE, "step": OPTIMIZER}
"""A plain DeepSpeedEngine's step phases (deepspeed/runtime/engine.py): the script calls
`engine(x)` (its `forward`), `engine.backward(loss)` and `engine.step()` per micro-batch; the
optimizer runs in the step at the accumulation boundary."""


class PlainEngineInstructions:
    """A plain DeepSpeedEngine's phases, each an instance attribute over its method (nn.Module's
    call finds `forward` there), and the communication backend's collectives, likewise over the
    one backend object (autotune/rank/collectives.py)."""

    def __init__(self, engine: object) -> None:
        self.engine = engine

    def wrap(self, wrapper: Wrapper) -> Callable[[], None]:
        from autotune.rank.collectives import COLLECTIVES, backend

        undos = [_shadow(self.engine, name, Instruction(name, category), wrapper)
                 for name, category in PLAIN_ENGINE_PHASES.items()]
        cdb = backend()
        if cdb is not None:
            undos += [_shadow(cdb, op, Instruction(op, COLLECTIVE), wrapper) for op in COLLECTIVES if hasattr(cdb, op)]

        def undo() -> None:
            for one in reversed(undos):
                one()
        return undo


def _shadow(holder: object, name: str, instruction: Instruction, wrapper: Wrapper) -> Callable[[], None]:
    """`holder.name` replaced by its wrapped self as an instance attribute; the undo restores it."""
    had = name in holder.__dict__
    previous = holder.__dict__.get(name)
    object.__setattr__(holder, name, wrapper(instruction, getattr(holder, name)))

    def undo() -> None:
        if had:
            object.__setattr__(holder, name, previous)
        else:
            holder.__dict__.pop(name, None)
    return undo


DEEPSPEED_CATEGORY: dict[str, str] = {
    "ForwardPass": COMPUTE,
    "BackwardPass": COMPUTE,
    "OptimizerStep": OPTIMIZER,  # compute, kept apart: it runs outside the pipeline schedule
    "SendActivation": p2p_category("SendActivation"),
    "SendGrad": p2p_category("SendGrad"),
    "ReduceGrads": COMM,
    "ReduceTiedGrads": COMM,
    "RecvActivation": p2p_category("RecvActivation"),
    "RecvGrad": p2p_category("RecvGrad"),
    "LoadMicroBatch": DATA,
}
"""A PipelineEngine's instruction class name -> the probe's category (deepspeed/runtime/pipe/schedule.py).
Names, not classes, so the rank side imports without DeepSpeed."""


def _deepspeed_instruction(cls: type) -> Instruction:
    return Instruction(cls.__name__, DEEPSPEED_CATEGORY.get(cls.__name__))


def instructions_of(engine: object) -> InstructionTable:
    """The engine's instructions, to wrap."""
    own = getattr(engine, "autotune_instructions", None)
    if own is not None:
        return cast(DeclaresInstructions, engine).autotune_instructions()
    if hasattr(engine, "_INSTRUCTION_MAP"):  # a PipelineEngine: its class map, shadowed per instance
        return MappedInstructions(engine, "_INSTRUCTION_MAP", _deepspeed_instruction)
    return PlainEngineInstructions(engine)
