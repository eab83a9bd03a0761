"""Trial summaries: every derived signal, computed once, here, from metrics rows.

The exporter, `advise`, the rules and the tuner all read these definitions;
the README's "Signals" section documents them. Warm-up rows are excluded.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from autotune.schema import StepRecord


def ideal_bubble_fraction(stages: int, micro_batches: int) -> float:
    """1F1B idle share of a stage: (p-1)/(m+p-1)."""
    if stages < 1 or micro_batches < 1:
        raise ValueError("stages and micro_batches must be >= 1")
    return (stages - 1) / (micro_batches + stages - 1)


def fluctuation(samples: Sequence[float]) -> float | None:
    """Device utilization fluctuation: population standard deviation of 0-1 samples.

    0.15 means utilization swings by about 15 percentage points around its mean.
    None when fewer than two samples exist.
    """
    vals = [v for v in samples if v is not None]
    if len(vals) < 2:
        return None
    return statistics.pstdev(vals)


def bubble_fraction(compute_seconds: float, step_seconds: float, optimizer_seconds: float = 0.0) -> float:
    """Measured bubble: the share of the pipeline schedule a rank was not computing.

    1 - (compute - optimizer) / (step - optimizer): the optimizer step runs after
    the 1F1B schedule, outside the bubble the ideal (p-1)/(m+p-1) describes. The
    idle share holds waiting for peer stages plus transfer and data-loading time,
    so it sits at or above the ideal.
    """
    schedule = step_seconds - optimizer_seconds
    if schedule <= 0:
        return 0.0
    return max(0.0, 1.0 - (compute_seconds - optimizer_seconds) / schedule)


def comm_compute_ratio(comm: float, wait: float, compute: float) -> float | None:
    """(communication + waiting for peers) / compute time; None without compute time."""
    if compute <= 0:
        return None
    return (comm + wait) / compute


def busy_fraction(compute_seconds: float, step_seconds: float) -> float:
    """Share of the step inside timed instructions: the CPU utilization definition."""
    return min(1.0, compute_seconds / step_seconds) if step_seconds > 0 else 0.0


def host_bound_fraction(utilization_mean: float, busy_fraction_mean: float) -> float | None:
    """Share of instruction time in which the GPU ran no kernel: 1 - utilization / busy.

    `utilization_mean` is the device's own counter (NVML: share of time a kernel ran),
    `busy_fraction_mean` the share of the step inside timed instructions (compute/step,
    CUDA events). Events span an instruction from its first to its last kernel, gaps
    included, so when the host cannot launch kernels fast enough (small kernels, Python
    overhead) busy stays near 1 while the GPU idles: the step is host-bound.
    """
    if busy_fraction_mean <= 0:
        return None
    return max(0.0, 1.0 - utilization_mean / busy_fraction_mean)


@dataclass(kw_only=True, slots=True)
class RankSummary:
    rank: int
    stage: int
    steps: int
    device_utilization_mean: float
    device_utilization_fluctuation: float | None
    comm_compute_ratio: float | None
    compute_seconds_mean: float
    """Forward + backward + optimizer step."""
    schedule_compute_seconds_mean: float
    """Forward + backward only: the work the pipeline partition splits across stages."""
    comm_seconds_mean: float
    wait_seconds_mean: float
    bubble_fraction: float
    """Measured idle share: 1 - compute / step time (waiting, transfers, data loading)."""
    wait_fraction: float
    """The part of the step spent in receive instructions (waiting for the peer stage)."""
    host_bound_fraction: float | None = None
    """`host_bound_fraction` over the steps whose utilization came from the device
    (NVML); None where none did (CPU: utilization is the busy fraction itself)."""


@dataclass(kw_only=True, slots=True)
class TrialSummary:
    trial: int
    steps: int
    """Measured (non-warm-up) steps."""
    warmup_steps: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    reduce_bucket_size: int | None
    pipeline_stages: int
    data_parallel_size: int
    samples_per_second: float
    """Median over steps of global samples / slowest rank's step time."""
    samples_per_second_p10: float
    samples_per_second_p90: float
    tokens_per_second: float
    step_seconds: float
    """Median step time (slowest rank)."""
    step_time_jitter: float
    """Coefficient of variation of step time (std / mean)."""
    device_utilization_mean: float
    device_utilization_fluctuation: float | None
    """Worst per-rank fluctuation (std of that rank's samples)."""
    cross_device_fluctuation: float | None
    """Std of per-rank mean utilization (stage imbalance seen as utilization)."""
    comm_compute_ratio: float | None
    """Worst per-rank (comm + wait) / compute."""
    comm_compute_ratio_mean: float | None
    transfer_compute_ratio: float | None
    """comm (sends + reductions, without waiting) / compute, worst rank."""
    bubble_fraction_measured: float
    """Mean over ranks of the idle share of the pipeline schedule (`bubble_fraction`; compare with the ideal)."""
    bubble_fraction_ideal: float
    stage_compute_imbalance: float
    """max / mean of per-stage mean forward+backward seconds (1.0 = balanced)."""
    slowest_stage: int
    stage_compute_seconds: list[float]
    memory_fragmentation_ratio: float | None
    """Worst rank's median 1 - allocated/reserved; None where not available (CPU)."""
    memory_peak_bytes: float | None
    memory_reserved_bytes: float | None
    loss_first: float | None
    loss_last: float | None
    ranks: list[RankSummary] = field(default_factory=list)
    host_bound_fraction: float | None = None
    """Worst rank's share of instruction time with no kernel running; None on CPU."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrialSummary:
        d = dict(d)
        ranks = []
        for r in d.get("ranks", []):
            r = dict(r)
            r.setdefault("schedule_compute_seconds_mean", r["compute_seconds_mean"])  # format 1 studies
            ranks.append(RankSummary(**r))
        d["ranks"] = ranks
        return cls(**d)


def _quantile(vals: Sequence[float], q: float) -> float:
    s = sorted(vals)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _max_or_none(vals: Iterable[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return max(got) if got else None


def summarize(records: Iterable[StepRecord]) -> list[TrialSummary]:
    """Summaries of every trial in `records` (a metrics CSV may hold several)."""
    by_trial: dict[int, list[StepRecord]] = defaultdict(list)
    for r in records:
        by_trial[r.trial].append(r)
    return [s for t in sorted(by_trial) if (s := summarize_trial(by_trial[t])) is not None]


def summarize_trial(records: Sequence[StepRecord]) -> TrialSummary | None:
    """One trial's summary, or None when it has no measured (non-warm-up) step."""
    measured = [r for r in records if not r.warmup]
    if not measured:
        return None
    first = measured[0]
    warm = sum(1 for r in records if r.warmup and r.rank == first.rank)

    # Per step: the pipeline moves as fast as its slowest rank.
    by_step: dict[int, list[StepRecord]] = defaultdict(list)
    for r in measured:
        by_step[r.step].append(r)
    global_batch = first.micro_batch_size * first.gradient_accumulation_steps * first.data_parallel_size
    step_secs = [max(r.step_seconds for r in rows) for _, rows in sorted(by_step.items())]
    sps = [global_batch / s for s in step_secs if s > 0]
    seq = first.seq_length or 0

    by_rank: dict[int, list[StepRecord]] = defaultdict(list)
    for r in measured:
        by_rank[r.rank].append(r)
    ranks = []
    for rank, rows in sorted(by_rank.items()):
        comp = sum(r.compute_seconds for r in rows)
        opt = sum(r.optimizer_seconds or 0.0 for r in rows)
        comm = sum(r.comm_seconds for r in rows)
        wait = sum(r.wait_seconds for r in rows)
        total = sum(r.step_seconds for r in rows)
        utils = [r.device_utilization for r in rows]
        dev = [r for r in rows if r.utilization_from_device == 1]
        ranks.append(RankSummary(
            rank=rank, stage=rows[0].stage, steps=len(rows),
            device_utilization_mean=statistics.fmean(utils),
            device_utilization_fluctuation=fluctuation(utils),
            comm_compute_ratio=comm_compute_ratio(comm, wait, comp),
            compute_seconds_mean=comp / len(rows),
            schedule_compute_seconds_mean=(comp - opt) / len(rows), comm_seconds_mean=comm / len(rows),
            wait_seconds_mean=wait / len(rows),
            bubble_fraction=bubble_fraction(comp, total, opt),
            wait_fraction=wait / total if total > 0 else 0.0,
            host_bound_fraction=host_bound_fraction(
                statistics.fmean(r.device_utilization for r in dev),
                statistics.fmean(busy_fraction(r.compute_seconds, r.step_seconds) for r in dev)) if dev else None,
        ))

    stage_comp: dict[int, list[float]] = defaultdict(list)
    for rs in ranks:
        stage_comp[rs.stage].append(rs.schedule_compute_seconds_mean)
    stage_means = [statistics.fmean(stage_comp[s]) for s in sorted(stage_comp)]
    mean_comp = statistics.fmean(stage_means)
    imbalance = max(stage_means) / mean_comp if mean_comp > 0 else 1.0
    slowest = sorted(stage_comp)[stage_means.index(max(stage_means))]

    frag_by_rank = [
        statistics.median(v) if (v := [r.memory_fragmentation_ratio for r in rows
                                       if r.memory_fragmentation_ratio is not None]) else None
        for rows in by_rank.values()
    ]
    losses = [r.loss for r in sorted(measured, key=lambda r: r.step) if r.loss is not None]
    ratios = [rs.comm_compute_ratio for rs in ranks if rs.comm_compute_ratio is not None]
    transfer = [
        sum(r.comm_seconds for r in rows) / c
        for rows in by_rank.values() if (c := sum(r.compute_seconds for r in rows)) > 0
    ]
    mean_step = statistics.fmean(step_secs)
    return TrialSummary(
        trial=first.trial, steps=len(step_secs), warmup_steps=warm,
        micro_batch_size=first.micro_batch_size,
        gradient_accumulation_steps=first.gradient_accumulation_steps,
        reduce_bucket_size=first.reduce_bucket_size, pipeline_stages=first.pipeline_stages,
        data_parallel_size=first.data_parallel_size,
        samples_per_second=statistics.median(sps),
        samples_per_second_p10=_quantile(sps, 0.1), samples_per_second_p90=_quantile(sps, 0.9),
        tokens_per_second=statistics.median(sps) * seq,
        step_seconds=statistics.median(step_secs),
        step_time_jitter=(statistics.pstdev(step_secs) / mean_step) if len(step_secs) > 1 and mean_step > 0 else 0.0,
        device_utilization_mean=statistics.fmean(rs.device_utilization_mean for rs in ranks),
        device_utilization_fluctuation=_max_or_none(rs.device_utilization_fluctuation for rs in ranks),
        cross_device_fluctuation=(statistics.pstdev([rs.device_utilization_mean for rs in ranks])
                                  if len(ranks) > 1 else None),
        comm_compute_ratio=max(ratios) if ratios else None,
        comm_compute_ratio_mean=statistics.fmean(ratios) if ratios else None,
        transfer_compute_ratio=max(transfer) if transfer else None,
        bubble_fraction_measured=statistics.fmean(rs.bubble_fraction for rs in ranks),
        bubble_fraction_ideal=ideal_bubble_fraction(first.pipeline_stages, first.gradient_accumulation_steps),
        stage_compute_imbalance=imbalance, slowest_stage=slowest, stage_compute_seconds=stage_means,
        memory_fragmentation_ratio=_max_or_none(frag_by_rank),
        memory_peak_bytes=_max_or_none(r.memory_peak_bytes for r in measured),
        memory_reserved_bytes=_max_or_none(r.memory_reserved_bytes for r in measured),
        loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None,
        ranks=ranks, host_bound_fraction=_max_or_none(rs.host_bound_fraction for rs in ranks),
    )
