"""Turn a rule's move into a concrete change (current value -> new value).

Moves in rule files name a fixed set of computations (`compute = "..."`);
each is a small function here, so rule files stay data and never carry code.
"""

from __future__ import annotations

import math
import os
from typing import Any

from autotune.advisor.findings import Change
from autotune.advisor.rulebook import Move
from autotune.advisor.signals import SignalSet
from autotune.core.space import round_bucket

DEFAULT_BUBBLE_TARGET = 0.2
BYTE_LIKE_UNIT = 1 << 20
"""A bucket size that is an exact multiple of 1 MiB was almost surely written as bytes."""
BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size")
BOTTLENECK_COMPUTES = frozenset({"other_partition_method", "rebalance_stage", "measured_parts",
                                 "type_partition"})
"""Advice on an unbalanced pipeline (autotune/advisor/bottleneck.py)."""


def gas_for_bubble(stages: int, target: float) -> int:
    """Smallest multiple of `stages` micro-batches m with (p-1)/(m+p-1) <= target."""
    m = math.ceil((stages - 1) * (1 - target) / target - 1e-9)
    return max(stages, math.ceil(max(m, 1) / stages) * stages)


def loader_workers(cores: int) -> int:
    """Data-loader workers at 50-75 % of the cores (the midpoint, at least 1)."""
    lo, hi = max(1, math.ceil(0.5 * cores)), max(1, math.floor(0.75 * cores))
    return max(lo, min(hi, round(0.625 * cores)))


def get_dotted(raw: dict[str, Any] | None, dotted: str) -> tuple[bool, Any]:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def bytes_per_element(raw: dict[str, Any] | None) -> int:
    half = any(get_dotted(raw, f"{k}.enabled")[1] is True for k in ("bf16", "fp16"))
    return 2 if half else 4


def resolve(move: Move, s: SignalSet, raw: dict[str, Any] | None, cpu_count: int | None) -> Change | None:
    """The concrete change a move proposes on this subject, or None if it does not apply."""
    if move.kind == "trial":
        return _trial(move, s)
    if move.kind == "config":
        return _config(move, raw)
    return _advice(move, s, raw, cpu_count)


def _trial(move: Move, s: SignalSet) -> Change | None:
    cur = s.get(move.target)
    if move.compute in ("gas_for_bubble", "next_multiple_of_stages"):
        p, gas = s.get("pipeline_stages"), s.get("gradient_accumulation_steps")
        if p is None or gas is None or p < 2:
            return None
        if move.compute == "gas_for_bubble":
            new: float = max(gas_for_bubble(int(p), move.bubble_target or DEFAULT_BUBBLE_TARGET),
                             math.ceil(gas / p) * p)
        else:
            new = math.ceil(gas / p) * p
        cur = gas
    elif cur is None:
        # No layout in the input at all (a device log): say the move as a factor. Where the
        # layout is known, None means the parameter does not act (a bucket under ZeRO-0).
        return _relative(move) if s.get("micro_batch_size") is None else None
    elif move.compute == "one_bucket":
        # One bucket holds every gradient: the fewest reduction calls. Known only where
        # the model's size is (autotune run); advise falls back to the rule's advice.
        top = s.get("bucket_one_call")
        if top is None or cur >= top:
            return None
        new = top
    elif move.scale is not None:
        new = cur * move.scale
        new = round_bucket(new) if move.target == "reduce_bucket_size" else max(1, round(new))
    else:
        new = int(move.value)  # type: ignore[arg-type]
    if new == cur:
        return None
    return Change(kind="trial", target=move.target, current=int(cur), new=int(new), note=move.note)


def _relative(move: Move) -> Change | None:
    """A scale move on a subject that does not know the current value (a device log without
    --config): said as a factor, an advice the config patch leaves alone."""
    if move.scale is None:
        return None
    factor = f"{move.scale:g}x" if move.scale >= 1 else f"1/{1 / move.scale:g}"
    note = "; ".join(x for x in (move.note, "the current value is not in this input: pass --config") if x)
    return Change(kind="advice", target=move.target, current=None, new=f"{factor} the current value", note=note)


def _config(move: Move, raw: dict[str, Any] | None) -> Change | None:
    if raw is None:
        return None
    present, cur = get_dotted(raw, move.target)
    if move.delete:
        return Change(kind="config", target=move.target, current=cur, new=None, action="delete",
                      note=move.note) if present else None
    if move.keep_only is not None:
        if not present or not isinstance(cur, dict):
            return None
        drop = sorted(k for k in cur if k not in move.keep_only)
        return Change(kind="config", target=move.target, current=drop,
                      new={k: v for k, v in cur.items() if k in move.keep_only},
                      action="keep_only", note=move.note) if drop else None
    if move.compute == "bytes_to_elements":
        if not present or not byte_like(cur):
            return None
        bpe = bytes_per_element(raw)
        new = round_bucket(cur / bpe)
        note = move.note or f"{cur} looks like bytes; DeepSpeed reads elements ({bpe} bytes each)"
        return Change(kind="config", target=move.target, current=cur, new=new, note=note)
    if (not present and move.value is False) or (present and cur == move.value):
        return None
    return Change(kind="config", target=move.target, current=cur if present else None,
                  new=move.value, note=move.note)


def _advice(move: Move, s: SignalSet, raw: dict[str, Any] | None, cpu_count: int | None) -> Change | None:
    if move.compute in BOTTLENECK_COMPUTES:
        from autotune.advisor.bottleneck import bottleneck_change

        return bottleneck_change(move, s, raw)
    if move.compute == "loader_workers":
        cores = cpu_count or os.cpu_count() or 1
        n = loader_workers(cores)
        new = f"num_workers={n}, persistent_workers=True, pin_memory=True"
        note = move.note or f"{n} of {cores} cores per node; divide by the ranks per node"
        return Change(kind="advice", target=move.target, current=None, new=new, note=note)
    return Change(kind="advice", target=move.target, current=None, new=move.value, note=move.note)


def byte_like(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= BYTE_LIKE_UNIT
            and float(v).is_integer() and int(v) % BYTE_LIKE_UNIT == 0)
