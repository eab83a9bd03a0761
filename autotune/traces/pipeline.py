"""A pipeline job's stages, from the ranks' point-to-point transfers in their traces.

Under 1F1B every stage but the first begins a step by receiving its first activation, and the
first stage begins by sending one (DeepSpeed's `TrainSchedule`; torch's `Schedule1F1B` and
GPipe alike). So a rank whose first transfer is a send is stage 0, and a rank whose first
transfer is a receive sits one stage after the rank it receives from. The peers come from the
traces' `c10d::send` / `c10d::recv_` operators (their destination and source, recorded with
`record_shapes`; a trial's traces have them). Ranks whose chain leads to a rank whose trace is
missing keep no stage. The data-parallel degree is the world size over the stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autotune.traces.rank_trace import RankTrace


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    stages: int
    stage_of: dict[int, int]
    """Global rank -> stage, for every rank whose stage the traces tell."""
    data_parallel_size: int | None


def pipeline_layout(traces: Sequence[RankTrace]) -> PipelineLayout | None:
    """The stages of the ranks, or None when no trace holds a send or receive with its peer."""
    first: dict[int, tuple[str, int]] = {}
    peers: dict[int, set[int]] = {}
    for t in traces:
        p2p = [c for c in t.collectives if c.name in ("send", "recv") and c.peer is not None]
        if p2p and t.rank is not None:
            first[t.rank] = (p2p[0].name, int(p2p[0].peer))  # type: ignore[arg-type]
            peers[t.rank] = {int(c.peer) for c in p2p}  # type: ignore[arg-type]
    if not first:
        return None
    stage = {r: 0 for r, (op, _) in first.items() if op == "send"}
    changed = True
    while changed:
        changed = False
        for r, (op, peer) in first.items():
            if r not in stage and op == "recv" and peer in stage:
                stage[r] = stage[peer] + 1
                changed = True
    if not stage:
        return None
    stages = max(stage.values()) + 1
    for r, s in stage.items():  # a peer after a rank whose trace is missing: the stages go on
        upstream = first[r][1] if first[r][0] == "recv" else None
        if any(p not in stage and p != upstream for p in peers[r]):
            stages = max(stages, s + 2)
    world = next((t.world_size for t in traces if t.world_size), None)
    dp = world // stages if world and stages > 1 and world % stages == 0 else None
    return PipelineLayout(stages=stages, stage_of=stage, data_parallel_size=dp)
