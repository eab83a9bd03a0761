"""torch.distributed.pipelining's schedules as autotune names them: which ranks hold which
stages, and the bubble each schedule's theory leaves (issue 28).

No torch import: the controller checks a run's options with it before any rank starts. The
classes themselves are looked up in the installed torch (`installed`), since each release adds
some (2.13 has every name below).

Three shapes of schedule:
- single: one stage per rank (GPipe, 1F1B);
- looped: `v` stages per rank, rank r holding stages r, r + p, r + 2p, ... (Interleaved1F1B,
  LoopedBFS, InterleavedZeroBubble);
- V: two stages per rank, rank r holding stages r and 2p - 1 - r, so the first rank also holds
  the last stage (ZBVZeroBubble, DualPipeV).
"""

from __future__ import annotations

from enum import Enum

from autotune.core.errors import UserError


class Shape(Enum):
    SINGLE = "single"
    LOOPED = "looped"
    V = "V"


SCHEDULES: dict[str, Shape] = {
    "GPipe": Shape.SINGLE,
    "1F1B": Shape.SINGLE,
    "Interleaved1F1B": Shape.LOOPED,
    "LoopedBFS": Shape.LOOPED,
    "InterleavedZeroBubble": Shape.LOOPED,
    "ZBVZeroBubble": Shape.V,
    "DualPipeV": Shape.V,
}
"""autotune's name (the torch class without its `Schedule` prefix) -> the shape of its stages."""
ZERO_BUBBLE = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})
"""Schedules that split the backward into input (I) and weight (W) gradients to fill the bubble."""


def class_name(name: str) -> str:
    return "Schedule" + name


def name_of_class(cls_name: str) -> str:
    """autotune's name of a torch schedule class (`Schedule1F1B` -> `1F1B`); a class autotune has
    no name for (a schedule read from a CSV: `_PipelineScheduleRuntime`) keeps its own."""
    short = cls_name[len("Schedule"):] if cls_name.startswith("Schedule") else cls_name
    return short if short in SCHEDULES else cls_name


def places(name: str, held: list[int], rank: int, ranks: int) -> bool:
    """Whether schedule `name` puts exactly the stages `held` on rank `rank` of `ranks`."""
    per_rank = len(held)
    return (stages_per_rank(name, per_rank) == per_rank
            and sorted(stage_ids(name, rank, ranks, per_rank)) == sorted(held))


def installed() -> list[str]:
    """The names of SCHEDULES the installed torch offers, in SCHEDULES' order."""
    from torch.distributed.pipelining import schedules

    return [n for n in SCHEDULES if hasattr(schedules, class_name(n))]


def stages_per_rank(name: str, virtual_stages: int) -> int:
    shape = SCHEDULES[name]
    return 1 if shape is Shape.SINGLE else 2 if shape is Shape.V else virtual_stages


def stage_ids(name: str, rank: int, ranks: int, virtual_stages: int) -> list[int]:
    """The pipeline stages rank `rank` of `ranks` holds, in the order the schedule takes them."""
    shape = SCHEDULES[name]
    if shape is Shape.SINGLE:
        return [rank]
    if shape is Shape.V:
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(virtual_stages)]


def ideal_bubble(name: str, ranks: int, micro_batches: int, virtual_stages: int) -> float | None:
    """The idle share of a rank that the schedule's order leaves with equal stages and free
    transfers: (p-1)/(m+p-1) for GPipe and 1F1B; with v stages per rank the fill and drain
    shrink to (p-1)/v of a micro-batch's time, so (p-1)/(v m + p-1). None for the zero-bubble
    schedules: their bubble depends on the ratio of the input- and weight-gradient times, which
    no closed form here knows (they are measured, not predicted)."""
    if name in ZERO_BUBBLE:
        return None
    v = stages_per_rank(name, virtual_stages)
    return (ranks - 1) / (v * micro_batches + ranks - 1)


def check(name: str, *, ranks: int, layers: int, virtual_stages: int, available: list[str]) -> None:
    """One line and exit 2 for a schedule this run cannot build (before any trial). `layers`: the
    model's repeated (decoder) layers, laid out evenly over the stages (torchtitan's layers per
    stage; the embedding goes with the first stage, the head with the last)."""
    if name not in SCHEDULES:
        raise UserError(f"--schedule {name}: not a torch.distributed.pipelining schedule; choose one of: "
                        f"{', '.join(available)}")
    if name not in available:
        raise UserError(f"--schedule {name}: the installed torch has no {class_name(name)}; it offers: "
                        f"{', '.join(available)}")
    per_rank = stages_per_rank(name, virtual_stages)
    total = ranks * per_rank
    if layers % total:
        what = f"--virtual-stages {virtual_stages}" if SCHEDULES[name] is Shape.LOOPED else f"--schedule {name}"
        raise UserError(f"{what}: {ranks} ranks x {per_rank} stages per rank = {total} stages do not divide "
                        f"the model's {layers} decoder layers")


def fitting(*, ranks: int, layers: int, virtual_stages: int, available: list[str]) -> list[str]:
    """The installed schedules that this layout can build (the schedule sweep's candidates)."""
    out = []
    for name in available:
        try:
            check(name, ranks=ranks, layers=layers, virtual_stages=virtual_stages, available=available)
        except UserError:
            continue
        out.append(name)
    return out


def even_parts(decoder_layers: int, stages: int) -> list[int]:
    """Stage boundaries over the whole layer list (embedding, decoder layers, head): the decoder
    layers split evenly, the embedding on the first stage and the head on the last, as
    DeepSpeed's `parts` boundaries are written (autotune/core/partition.py)."""
    per = decoder_layers // stages
    return [0] + [1 + per * s for s in range(1, stages)] + [decoder_layers + 2]


def refuses(name: str, *, ranks: int, micro_batches: int, virtual_stages: int) -> str | None:
    """Why the installed torch's schedule `name` refuses `micro_batches` on `ranks` ranks (its
    constructor raises ValueError; torch 2.13), or None. 1F1B needs at least one micro-batch per
    stage, DualPipeV one per stage of its V (2p), and the interleaved schedules a count that
    their rounds of max(1, m // p) micro-batches divide."""
    m, p = micro_batches, ranks
    if name == "1F1B" and m < p:
        return f"1F1B needs at least {p} micro-batches (one per stage), not {m}"
    if name == "DualPipeV" and m < 2 * p:
        return f"DualPipeV needs at least {2 * p} micro-batches (one per stage of its V), not {m}"
    if name in ("Interleaved1F1B", "InterleavedZeroBubble") and m % max(1, m // p):
        return f"{name} runs rounds of {max(1, m // p)} micro-batches, which do not divide {m}"
    return None
