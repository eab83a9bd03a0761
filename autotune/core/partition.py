"""Balanced pipeline stages: the contiguous partition that minimizes the slowest stage.

Pure arithmetic on measured per-layer costs (autotune/rank/layer_costs.py writes them);
no torch, no DeepSpeed. A partition is DeepSpeed's `parts` list, as
`PipelineModule.parts` holds it: stage s owns layers `parts[s] .. parts[s+1]-1`,
`len(parts) == stages + 1`, `parts[0] == 0`, `parts[-1] == num_layers`.

The solver is exact: a dynamic programme over (stage, first layer of the next
stage), O(stages x layers^2), which is instant for any real model (hundreds of
layers). Every stage is non-empty (DeepSpeed's `type:` method can leave one
empty; we never do). An optional memory limit per stage is a hard constraint:
a stage holds its layers' parameter state plus, under 1F1B, the activations of
up to `min(stages - stage_id, micro_batches)` micro-batches in flight
(deepspeed/runtime/pipe/schedule.py `TrainSchedule.num_pipe_buffers`), so the
first stage carries the most activation memory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.core.errors import UserError


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryModel:
    """What one stage's memory is made of, and how much it may use."""

    limit_bytes: float
    """Memory one stage may use (e.g. device memory minus head-room)."""
    parameter_bytes: Sequence[float]
    """Per layer: bytes of its parameter state (weights, gradients, optimizer state)."""
    activation_bytes: Sequence[float]
    """Per layer: bytes autograd keeps for backward, per micro-batch."""
    micro_batches: int = 1_000_000
    """Micro-batches per step (GAS): caps the activations in flight."""
    stage_fixed_bytes: Sequence[float] = ()
    """Per stage: bytes it holds whatever its layers (the CUDA context, the engine's buffers,
    the loss's logits on the last stage); empty: none."""


def in_flight(stages: int, stage_id: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage_id` holds at once under 1F1B."""
    return max(1, min(stages - stage_id, micro_batches))


def stage_memory(parts: Sequence[int], memory: MemoryModel) -> list[float]:
    """Bytes each stage of `parts` needs under `memory`."""
    stages = len(parts) - 1
    out = []
    for s in range(stages):
        lo, hi = parts[s], parts[s + 1]
        params = sum(memory.parameter_bytes[lo:hi])
        acts = sum(memory.activation_bytes[lo:hi])
        fixed = float(memory.stage_fixed_bytes[s]) if memory.stage_fixed_bytes else 0.0
        out.append(params + acts * in_flight(stages, s, memory.micro_batches) + fixed)
    return out


def check_parts(parts: Sequence[int], num_layers: int, stages: int | None = None) -> list[int]:
    """`parts` as a list of ints, or a UserError saying what is wrong with it."""
    try:
        parts = [int(p) for p in parts]
    except (TypeError, ValueError):
        raise UserError(f"partition {parts!r}: boundaries must be integers") from None
    if stages is not None and len(parts) != stages + 1:
        raise UserError(f"partition {parts}: {len(parts)} boundaries for {stages} stages; "
                        f"give {stages + 1} (0, ..., {num_layers})")
    if len(parts) < 2 or parts[0] != 0 or parts[-1] != num_layers:
        raise UserError(f"partition {parts}: must start at 0 and end at the layer count {num_layers}")
    if any(b <= a for a, b in zip(parts, parts[1:], strict=False)):
        raise UserError(f"partition {parts}: boundaries must increase (every stage needs a layer)")
    return parts


def parse_parts(text: str) -> list[int]:
    """'0,5,12' (or '[0, 5, 12]') -> [0, 5, 12]."""
    body = text.strip().removeprefix("[").removesuffix("]")
    try:
        return [int(x) for x in body.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"partition {text!r}: expected comma-separated layer boundaries, e.g. 0,5,12") from None


def stage_times(costs: Sequence[float], parts: Sequence[int],
                stage_fixed: Sequence[float] | None = None) -> list[float]:
    """Predicted compute seconds of each stage: the sum of its layers' costs (plus its fixed cost)."""
    fixed = stage_fixed or [0.0] * (len(parts) - 1)
    return [float(sum(costs[parts[s]:parts[s + 1]])) + float(fixed[s]) for s in range(len(parts) - 1)]


def imbalance(times: Sequence[float]) -> float:
    """max / mean of stage times (1.0 = perfectly balanced), as summary.stage_compute_imbalance."""
    mean = sum(times) / len(times) if times else 0.0
    return max(times) / mean if mean > 0 else 1.0


def balanced_parts(costs: Sequence[float], stages: int, *, memory: MemoryModel | None = None,
                   stage_fixed: Sequence[float] | None = None) -> list[int]:
    """The contiguous partition of `costs` into `stages` non-empty stages with the least slowest stage.

    `stage_fixed`: seconds a stage costs whatever layers it holds (the loss on the last
    stage). Among partitions with the same slowest stage, the one with the least sum of squared
    stage times is kept (the rest of the stages balanced too, not only the worst).
    Raises UserError when no partition fits (too few layers, or memory).
    """
    n = len(costs)
    if stages < 1:
        raise UserError(f"stages must be >= 1, got {stages}")
    if n < stages:
        raise UserError(f"{n} layers cannot fill {stages} stages (every stage needs a layer)")
    if any(not math.isfinite(c) or c < 0 for c in costs):
        raise UserError("layer costs must be finite and >= 0")
    if memory is not None and (len(memory.parameter_bytes) != n or len(memory.activation_bytes) != n):
        raise UserError(f"memory model has {len(memory.parameter_bytes)}/{len(memory.activation_bytes)} "
                        f"layers, the costs {n}")
    if memory is not None and memory.stage_fixed_bytes and len(memory.stage_fixed_bytes) != stages:
        raise UserError(f"{len(memory.stage_fixed_bytes)} fixed stage memories for {stages} stages")
    fixed = [float(f) for f in stage_fixed] if stage_fixed is not None else [0.0] * stages
    if len(fixed) != stages:
        raise UserError(f"{len(fixed)} fixed stage costs for {stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    pprefix, aprefix = [0.0], [0.0]
    if memory is not None:
        for p, a in zip(memory.parameter_bytes, memory.activation_bytes, strict=True):
            pprefix.append(pprefix[-1] + float(p))
            aprefix.append(aprefix[-1] + float(a))

    def fits(s: int, lo: int, hi: int) -> bool:
        if memory is None:
            return True
        need = (pprefix[hi] - pprefix[lo]) + (aprefix[hi] - aprefix[lo]) * in_flight(stages, s, memory.micro_batches)
        if memory.stage_fixed_bytes:
            need += float(memory.stage_fixed_bytes[s])
        return need <= memory.limit_bytes

    inf = (math.inf, math.inf)
    # best[s][j]: (slowest, sum of squares) of the first s+1 stages covering layers 0..j-1
    best = [[inf] * (n + 1) for _ in range(stages)]
    back = [[-1] * (n + 1) for _ in range(stages)]
    for j in range(1, n - stages + 2):
        if fits(0, 0, j):
            t = prefix[j] + fixed[0]
            best[0][j] = (t, t * t)
    for s in range(1, stages):
        for j in range(s + 1, n - (stages - s - 1) + 1):
            cand, arg = inf, -1
            for i in range(s, j):
                prev = best[s - 1][i]
                if prev[0] == math.inf or not fits(s, i, j):
                    continue
                t = prefix[j] - prefix[i] + fixed[s]
                value = (max(prev[0], t), prev[1] + t * t)
                if value < cand:
                    cand, arg = value, i
            best[s][j], back[s][j] = cand, arg
    if best[stages - 1][n][0] == math.inf:
        raise UserError(f"no partition of {n} layers into {stages} stages fits "
                        f"{memory.limit_bytes:.4g} bytes per stage" if memory else "no partition found")
    parts = [n]
    j = n
    for s in range(stages - 1, 0, -1):
        j = back[s][j]
        parts.append(j)
    parts.append(0)
    return parts[::-1]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerMove:
    """One layer that changes stage between two partitions."""

    layer: int
    from_stage: int
    to_stage: int


def stage_of(parts: Sequence[int], layer: int) -> int:
    for s in range(len(parts) - 1):
        if parts[s] <= layer < parts[s + 1]:
            return s
    raise ValueError(f"layer {layer} outside partition {list(parts)}")


def moves(old: Sequence[int], new: Sequence[int]) -> list[LayerMove]:
    """Which layers move where from `old` to `new` (same layer count and stages)."""
    if old[-1] != new[-1] or len(old) != len(new):
        raise UserError(f"partitions {list(old)} and {list(new)} differ in layers or stages")
    out = []
    for layer in range(old[-1]):
        a, b = stage_of(old, layer), stage_of(new, layer)
        if a != b:
            out.append(LayerMove(layer=layer, from_stage=a, to_stage=b))
    return out


def describe_moves(old: Sequence[int], new: Sequence[int], names: Sequence[str] | None = None) -> str:
    """'layers 5-6 (DecoderLayerPipe) stage 1 -> 0' lines, grouped into runs; '' when nothing moves."""
    runs: list[list[LayerMove]] = []
    for m in moves(old, new):
        last = runs[-1][-1] if runs else None
        if last and m.layer == last.layer + 1 and (m.from_stage, m.to_stage) == (last.from_stage, last.to_stage):
            runs[-1].append(m)
        else:
            runs.append([m])
    lines = []
    for run in runs:
        a, b = run[0].layer, run[-1].layer
        span = f"layer {a}" if a == b else f"layers {a}-{b}"
        kinds = sorted({names[m.layer] for m in run}) if names else []
        label = f" ({', '.join(kinds)})" if kinds else ""
        lines.append(f"{span}{label}: stage {run[0].from_stage} -> {run[0].to_stage}")
    return "; ".join(lines)


# -- DeepSpeed 0.19.8's own methods (PipelineModule._partition_layers), ported -------------------

def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed 0.19.8's `runtime.utils.partition_uniform` (the `uniform` method), ported so
    that the controller needs neither torch nor DeepSpeed (tests compare it with DeepSpeed's)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):
        parts[i + 1:] = [x + 1 for x in parts[i + 1:]]
    return parts


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed 0.19.8's `runtime.utils.partition_balanced` (the `parameters` method on the
    layers' parameter counts, `type:` on 0/1 weights), ported step for step, ties included."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    dp_max[0][0] = dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                run = prefix[i] - prefix[k]
                max_sum, min_sum = max(dp_max[k][j - 1], run), min(dp_min[k][j - 1], run)
                if dp_cost[i][j] >= max_sum - min_sum:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j] = max_sum - min_sum, max_sum, min_sum
                    position[i][j] = k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


TYPE_SUBSETS_MAX = 255
"""`type:` regexes tried at most (sets of the model's classes, the smallest sets first)."""


def type_regex(classes: Sequence[str]) -> str:
    """The `type:` regex that finds exactly these layer classes: `^Linear$`, `^(Conv2d|Linear)$`.
    No ':' in it (DeepSpeed splits the method at the first one)."""
    alts = "|".join(re.escape(c) for c in classes)
    return f"^{alts}$" if len(classes) == 1 else f"^({alts})$"


def type_parts(names: Sequence[str], regex: str, stages: int) -> list[int] | None:
    """The parts DeepSpeed 0.19.8 builds for `partition_method='type:REGEX'` over layers of these
    class names: the method lower-cased, the regex searched case-insensitively in each class
    name (`_find_layer_type`), `partition_balanced` over 1 per match, 0 otherwise. None where no
    layer matches (DeepSpeed raises), a stage would be empty (we never propose that), or a stage
    would hold no matching layer (the parts then follow from DeepSpeed's tie rule, not from a
    balance of the matches, and read as a riddle in the user's code)."""
    pattern = re.compile(regex.lower(), re.IGNORECASE)
    weights = [1 if pattern.search(n) else 0 for n in names]
    if not any(weights):
        return None
    parts = partition_balanced(weights, stages)
    if len(parts) != stages + 1 or any(b <= a or not any(weights[a:b]) for a, b in zip(parts, parts[1:], strict=False)):
        return None
    return parts


def type_methods(names: Sequence[str], stages: int) -> list[tuple[str, list[int]]]:
    """The distinct partitions `type:REGEX` methods over the model's own classes build at `stages`:
    (method, parts), the method with the fewest classes for each parts."""
    from itertools import combinations

    classes = [c for c in dict.fromkeys(names) if ":" not in c]
    out: dict[tuple[int, ...], str] = {}
    tried = 0
    for size in range(1, len(classes) + 1):
        for subset in combinations(classes, size):
            if tried >= TYPE_SUBSETS_MAX:
                return [(m, list(p)) for p, m in out.items()]
            tried += 1
            regex = type_regex(subset)
            parts = type_parts(names, regex, stages)
            if parts is not None:
                out.setdefault(tuple(parts), f"type:{regex}")
    return [(m, list(p)) for p, m in out.items()]


def best_type_method(names: Sequence[str], costs: Sequence[float], stages: int,
                     stage_fixed: Sequence[float] | None = None) -> tuple[str, list[int]] | None:
    """The `type:` method over the model's classes whose parts have the least slowest stage
    (ties: the fewest classes, then the least sum of squared stage times); None: no class builds
    a partition with every stage non-empty."""
    best: tuple[tuple[float, float], str, list[int]] | None = None
    for method, parts in type_methods(names, stages):
        t = stage_times(costs, parts, stage_fixed)
        key = (max(t), sum(x * x for x in t))
        if best is None or key < best[0]:
            best = (key, method, parts)
    return (best[1], best[2]) if best else None


# -- when no partition can help: the layer that bounds it --------------------------------------

def dominant_layer(costs: Sequence[float]) -> tuple[int, float]:
    """The dearest layer and its share of all layers' cost."""
    total = float(sum(costs))
    i = max(range(len(costs)), key=lambda k: costs[k])
    return i, (float(costs[i]) / total if total > 0 else 0.0)


def other_stage_fixed(stage_fixed: Sequence[float] | None, stages: int) -> list[float] | None:
    """A measured stage_fixed carried to another stage count: the last stage keeps its own (the
    loss), every other stage the mean of the measured non-last stages'."""
    if not stage_fixed:
        return None
    head = list(stage_fixed[:-1])
    rest = sum(head) / len(head) if head else 0.0
    return [rest] * (stages - 1) + [float(stage_fixed[-1])]


def isolating_stages(costs: Sequence[float], stages: int, stage_fixed: Sequence[float] | None = None,
                     *, more: int = 8) -> tuple[int, list[int]] | None:
    """The fewest stages above `stages` (up to `more` above, and the layer count) whose balanced
    partition gives the dearest layer a stage of its own: (stage count, parts); None if none."""
    layer, _ = dominant_layer(costs)
    for k in range(stages + 1, min(len(costs), stages + more) + 1):
        parts = balanced_parts(costs, k, stage_fixed=other_stage_fixed(stage_fixed, k))
        if layer in parts and layer + 1 in parts:
            return k, parts
    return None


def no_gain_text(names: Sequence[str], costs: Sequence[float], now: Sequence[int], best: Sequence[int],
                 fixed: Sequence[float] | None, *, margin: float, lead: str, keep: str = "keep what you have") -> str:
    """One line for a partition not worth changing: the costs predict the best contiguous partition
    (`best`) no more than `margin` faster than the one in force (`now`). Names the layer whose
    share bounds every partition at this stage count where that is why, and what would help: the
    stage count that gives it a stage of its own, or fewer stages."""
    stages = len(now) - 1
    t_now, t_best = stage_times(costs, now, fixed), stage_times(costs, best, fixed)
    gain = max(t_now) / max(t_best) - 1.0
    moved = (f"{imbalance(t_now):.2f} -> {imbalance(t_best):.2f}, {gain:.1%} faster, below the {margin:.0%} a round"
             " can tell from a tie" if list(best) != list(now) else f"{imbalance(t_now):.2f}, already the best")
    line = (f"{lead}: the layer costs predict no {stages}-stage contiguous partition better than "
            f"{list(best)} (work imbalance {moved})")
    layer, share = dominant_layer(costs)
    if bounding_layer(costs, best, fixed) is None:
        return f"{line}; {keep}"
    # the slowest stage of the best partition holds the dearest layer: that layer sets the pace
    line += (f": layer {layer} ({names[layer]}) does {share:.0%} of the layers' work, and its stage is the "
             f"slowest even in the best {stages}-stage partition; {keep}; what would help: ")
    found = isolating_stages(costs, stages, fixed)
    if found is not None:
        k, parts = found
        t_k = stage_times(costs, parts, other_stage_fixed(fixed, k))
        if max(t_best) / max(t_k) - 1.0 > margin:
            line += (f"{k} stages, parts {parts}, give layer {layer} a stage of its own (the slowest stage "
                     f"{max(t_best) / max(t_k):.2f}x faster, predicted imbalance {imbalance(t_k):.2f}: the "
                     "other stages wait for it), or ")
    return line + "fewer stages and more data parallelism, where the model fits (at 1 stage no stage waits)"


def bounding_layer(costs: Sequence[float], best: Sequence[int], fixed: Sequence[float] | None) -> int | None:
    """The dearest layer, where the slowest stage of the best partition holds it (it sets the
    pace at this stage count, whatever the micro-batch); else None."""
    layer, _ = dominant_layer(costs)
    t = stage_times(costs, best, fixed)
    slow = max(range(len(t)), key=t.__getitem__)
    return layer if best[slow] <= layer < best[slow + 1] else None
