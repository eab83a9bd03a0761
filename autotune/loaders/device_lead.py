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
from autotune.core.errors import UserError

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
    """Set the lead signals (and, with `stages`, the layout) on an nvidia-smi subject.

    Without `stages` each device is compared with the others; with it each stage (the
    mean of its dp devices), since a slow stage keeps all of its data-parallel devices busy.
    """
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
    units = ({st: [d for d in order if where[d][1] == st] for st in range(stages)} if stages
             else {d: [d] for d in order})
    if len(units) < 2:
        for k in lead_signals:
            out.unavailable[k] = ("needs at least two devices in the log" if not stages
                                  else "needs at least two pipeline stages")
        return
    rounds = min(len(util[d]) for d in order)
    unit_mean = {u: statistics.fmean(means[d] for d in ds) for u, ds in units.items()}
    unit_round = {u: [statistics.fmean(util[d][k] for d in ds) for k in range(rounds)] for u, ds in units.items()}
    busiest = max(units, key=lambda u: unit_mean[u])
    others = [u for u in units if u != busiest]
    others_mean = statistics.fmean(unit_mean[u] for u in others)
    lead = unit_mean[busiest] / max(others_mean, MIN_OTHERS_MEAN)
    above = sum(unit_round[busiest][k] > statistics.fmean(unit_round[u][k] for u in others) for k in range(rounds))
    out.values.update({"device_utilization_lead": lead,
                       "device_utilization_lead_points": unit_mean[busiest] - others_mean,
                       "device_utilization_lead_share": above / rounds if rounds else None})
    for k in lead_signals:
        out.unavailable.pop(k, None)
    hot = units[busiest]
    out.per_rank["device_utilization_lead"] = [
        RankValue(lead, *(where.get(d) or (None, None)), device=f"gpu{d}") for d in hot]
    ident = "; ".join((f"gpu{d} " if stages else "") + names[d] for d in hot if d in names)
    n_hot = sum(len(util[d]) for d in hot)
    n_other = sum(len(util[d]) for u in others for d in units[u])
    if stages:
        ranks = ",".join(str(where[d][0]) for d in hot)
        what = f"stage {busiest} of {stages} (gpu{', gpu'.join(hot)}: ranks {ranks})"
        shown = ", ".join(f"stage {u} {unit_mean[u]:.0%}" for u in others)
        how = "; ranks in device order, stage = rank // dp (DeepSpeed's pipe-data topology)"
    else:
        what = f"gpu{busiest}"
        shown = ", ".join(f"gpu{u} {unit_mean[u]:.0%}" for u in others)
        how = "; pass --stages N to name its pipeline stage"
    out.details["device_utilization_lead"] = (
        f"{what}{f' ({ident})' if ident else ''}: mean utilization {unit_mean[busiest]:.1%} over {n_hot} "
        f"samples vs. {others_mean:.1%} mean of the others ({shown}; {n_other} samples), "
        f"{unit_mean[busiest] - others_mean:.0%} points above; above the others in {above} of {rounds} "
        f"sampling rounds{how}")
