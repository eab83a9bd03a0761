"""The busiest device against the others: a pipeline's bottleneck seen from utilization alone.

In a pipeline every stage waits for the slowest one, so the device of the bottleneck
stage stays busy while the others idle between micro-batches: its mean utilization
stays above the others'. Three signals say how far and how steadily:

- `device_utilization_lead`: the busiest device's mean utilization / the mean of the
  other devices' means (1.0 = level);
- `device_utilization_lead_points`: the same as a difference (0-1, 0.3 = 30 points);
- `device_utilization_lead_share`: the share of sampling rounds (the k-th sample of
  every device) in which the busiest device is above the others' mean of that round.

With `stages`, devices map to stages the way DeepSpeed's PipeDataParallelTopology
orders ranks (axes pipe, data: global rank = stage x dp + data index, so
stage = rank // dp) with one rank per device in index order (the launcher's local
rank is the device index on one node).
"""

from __future__ import annotations

import statistics

from autotune.advisor.signals import RankValue, SignalSet
from autotune.errors import UserError

MIN_OTHERS_MEAN = 0.01
"""Floor of the others' mean in the ratio, so an idle peer does not make it infinite."""


def device_order(devices: list[str]) -> list[str]:
    return sorted(devices, key=lambda d: (0, int(d)) if d.isdigit() else (1, d))


def stage_map(devices: list[str], stages: int, source: str) -> dict[str, tuple[int, int]]:
    """device -> (global rank, stage) for one rank per device in index order."""
    n = len(devices)
    if stages > n or n % stages:
        raise UserError(f"--stages {stages}: {source} has {n} device(s), not a multiple of {stages} "
                        "(one rank per device; DeepSpeed puts rank r on stage r // dp)")
    dp = n // stages
    return {d: (r, r // dp) for r, d in enumerate(device_order(devices))}


def add_device_lead(out: SignalSet, util: dict[str, list[float]], names: dict[str, str], *,
                    stages: int | None, source: str) -> None:
    """Set the lead signals (and, with `stages`, the layout) on an nvidia-smi subject."""
    order = device_order(list(util))
    where = stage_map(order, stages, source) if stages else {}
    means = {d: statistics.fmean(util[d]) for d in order}
    out.per_rank["device_utilization_mean"] = [
        RankValue(means[d], *(where.get(d) or (None, None)), device=f"gpu{d}") for d in order]
    if stages:
        out.values["pipeline_stages"] = float(stages)
        out.values["data_parallel_size"] = float(len(order) // stages)
        for k in ("pipeline_stages", "data_parallel_size"):
            out.unavailable.pop(k, None)
    lead_signals = ("device_utilization_lead", "device_utilization_lead_points", "device_utilization_lead_share")
    if len(order) < 2:
        for k in lead_signals:
            out.unavailable[k] = "needs at least two devices in the log"
        return
    busiest = max(order, key=lambda d: means[d])
    others = [d for d in order if d != busiest]
    others_mean = statistics.fmean(means[d] for d in others)
    lead = means[busiest] / max(others_mean, MIN_OTHERS_MEAN)
    rounds = min(len(util[d]) for d in order)
    above = sum(util[busiest][k] > statistics.fmean(util[d][k] for d in others) for k in range(rounds))
    out.values.update({"device_utilization_lead": lead,
                       "device_utilization_lead_points": means[busiest] - others_mean,
                       "device_utilization_lead_share": above / rounds if rounds else None})
    for k in lead_signals:
        out.unavailable.pop(k, None)
    rank, stage = where.get(busiest) or (None, None)
    out.per_rank["device_utilization_lead"] = [RankValue(lead, rank, stage, device=f"gpu{busiest}")]
    ident = f" ({names[busiest]})" if busiest in names else ""
    on = (f"; stage {stage} of {stages} (rank {rank}; ranks in device order, stage = rank // dp)"
          if stage is not None else "; pass --stages N to name its pipeline stage")
    others_n = ", ".join(f"gpu{d} {means[d]:.0%}" for d in others)
    out.details["device_utilization_lead"] = (
        f"gpu{busiest}{ident}: mean utilization {means[busiest]:.1%} over {len(util[busiest])} samples "
        f"vs. {others_mean:.1%} mean of the others ({others_n}; {sum(len(util[d]) for d in others)} samples), "
        f"{means[busiest] - others_mean:.0%} points above; above the others in {above} of {rounds} "
        f"sampling rounds{on}")
