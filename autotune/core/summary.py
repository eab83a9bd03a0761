"""Trial summaries: every derived signal, computed once, here, from metrics rows.

The exporter, `advise`, the rules and the tuner all read these definitions;
the README's "Signals" section documents them. Warm-up rows are excluded.

One aggregation, column-wise with numpy (`summarize_columns`): `advise` must
analyse a 1,000,000-row file in at most twice the time pandas needs to read it,
so no path builds one object per row. `summarize`/`summarize_trial` are adapters
that turn StepRecords into the same columns. The per-step scalar definitions
(`bubble_fraction`, `busy_fraction`, ...) are shared with the live exporter.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from autotune.core.errors import InputFileError
from autotune.core.schema import StepRecord
from autotune.core.step_budget import median_interval

NOT_A_PIPELINE = "not a pipeline job"
"""Why a job with one stage (a plain DeepSpeedEngine) has no bubble, stage imbalance or
point-to-point signal: absent, said in these words (shared/docs/design.md)."""
PIPELINE_ONLY = ("bubble_fraction_measured", "bubble_fraction_ideal", "bubble_fraction_excess",
                 "stage_compute_imbalance", "imbalance_idle_fraction")
"""The signals only a pipeline job has."""


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


def comm_compute_ratio(comm: float, compute: float) -> float | None:
    """Communication (transfer only: point-to-point transfers and gradient reductions, not the
    wait for a peer) / compute time; None without compute time. Before schema 2 (issue 24) the
    wait was added in, so a merely unbalanced job read as "chatty"."""
    if compute <= 0:
        return None
    return comm / compute


def peer_wait_fraction(wait: float, step: float) -> float | None:
    """The share of the step a rank waited for a peer stage in sends and receives; None without a step."""
    return wait / step if step > 0 else None


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
    """The share of the step this rank waited for a peer stage (sends and receives; schema 1
    CSVs: the receives' whole time)."""
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
    tokens_per_second: float | None
    """samples_per_second x the sequence length; None when no row knows one (not a token model;
    an older CSV's seq_length 0 meant the same)."""
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
    """Worst per-rank comm / compute: transfer only (`comm_compute_ratio`)."""
    comm_compute_ratio_mean: float | None
    transfer_compute_ratio: float | None
    """The same as comm_compute_ratio since schema 2 (kept for rule files that name it)."""
    bubble_fraction_measured: float | None
    """Mean over ranks of the idle share of the pipeline schedule (`bubble_fraction`; compare with
    the ideal); None for a job that is not a pipeline (`NOT_A_PIPELINE`), never 0."""
    bubble_fraction_ideal: float | None
    stage_compute_imbalance: float | None
    """max / mean of per-stage mean forward+backward seconds (1.0 = balanced); None: not a pipeline."""
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
    step_seconds_low: float | None = None
    """Low end of the 95 % distribution-free interval of the median step time (order statistics,
    autotune/core/step_budget.py); None below 6 measured steps. It says how well THIS trial measured its
    median: the spread between launches of one configuration is larger on the CPU demo
    (docs/trial-length.md), so the tuner's comparisons keep their own between-launch noise margin."""
    step_seconds_high: float | None = None
    """High end of that interval."""
    step_seconds_rel_half_width: float | None = None
    """(high - low) / 2 / median step time: 0.021 reads "+-2.1 %"."""
    stage_work_seconds: list[float] | None = None
    """Per stage, mean forward+backward work per step: thread CPU seconds on a CPU
    (`compute_cpu_seconds`), the same as `stage_compute_seconds` on a GPU (CUDA events
    are the device's own time). None where the CSV has no CPU-time column."""
    stage_work_imbalance: float | None = None
    """max / mean of `stage_work_seconds`: the imbalance a partition can fix. On a CPU
    with fewer cores than ranks the wall-time `stage_compute_imbalance` also holds each
    stage's wait for a core, which the partition does not decide (docs/partition.md)."""
    stopped_early: bool = False
    """The ranks ended the trial early: its interval lay below the best trial so far by more than
    the noise margin (the value is still the trial's measured median)."""
    steps_ended_by: str | None = None
    """Why the measured steps ended: fixed, precision, cap or hopeless (None: not recorded)."""
    memory_capacity_bytes: float | None = None
    """The smallest device memory of the trial's ranks (the out-of-memory model's prior
    limit, autotune/tuning/proposers/feasibility.py); None on CPU."""
    imbalance_idle_fraction: float | None = None
    """The idle share the stage imbalance alone explains: the mean over stages of (slowest
    stage's forward+backward - this stage's) / step time."""
    peer_wait_fraction: float | None = None
    """Worst rank's share of the step spent waiting for a peer stage (`peer_wait_fraction`): the
    cause is the other stage (imbalance, the bubble), not the link."""
    peer_wait_fraction_mean: float | None = None
    """The ranks' mean share of the step spent waiting for a peer stage: the part of the measured
    bubble (which also holds transfers, data loading and untimed host work) that is stages
    waiting on each other."""
    metrics_schema: int | None = None
    """The oldest SCHEMA_VERSION among the rows (1: comm held the sends' waits); None: not read from rows."""
    startup_seconds: float | None = None
    """The slowest rank's start-up: process start (a warm worker: taking the trial) to its first
    step (autotune/rank/watchdog.py). Sets the next trials' start-up limit (autotune/trials/limits.py)."""
    zero_stage: int | None = None
    """The engine's ZeRO stage as the ranks recorded it; None where the CSV has none."""
    collective_calls_per_micro_batch: float | None = None
    """A plain engine's collective calls per micro-batch (the worst rank's median per step / GAS):
    how chatty its gradient reduction is; None on a pipeline engine (`collective_calls`)."""
    gather_comm_fraction: float | None = None
    """The all-gathers' share of a plain engine's communication (worst rank, transfer only):
    ZeRO-3's parameter gathers; None where `gather_seconds` is."""

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


SUMMARY_COLUMNS = frozenset({
    "trial", "rank", "stage", "step", "warmup", "step_seconds", "compute_seconds", "comm_seconds",
    "wait_seconds", "device_utilization", "memory_fragmentation_ratio", "loss", "micro_batch_size",
    "gradient_accumulation_steps", "reduce_bucket_size", "pipeline_stages", "data_parallel_size",
    "seq_length", "memory_peak_bytes", "memory_reserved_bytes", "optimizer_seconds",
    "utilization_from_device", "compute_cpu_seconds", "memory_capacity_bytes", "schema_version",
    "zero_stage", "collective_calls", "gather_seconds",
})
"""The columns summarize reads; the others are only validated."""

Columns = dict[str, np.ndarray]
"""Metrics columns as float64 arrays (NaN = empty cell), the shape the CSV reader returns."""


def records_to_columns(records: Iterable[StepRecord]) -> Columns:
    """StepRecords (a rank's live rows, a test's) as the columns the summary reads."""
    rows = list(records)
    return {name: np.array([_cell(getattr(r, name)) for r in rows], dtype=np.float64)
            for name in SUMMARY_COLUMNS}


def _cell(value: object) -> float:
    return math.nan if value is None else float(value)  # type: ignore[arg-type]


def summarize(records: Iterable[StepRecord]) -> list[TrialSummary]:
    """Summaries of every trial in `records` (a metrics CSV may hold several)."""
    rows = list(records)
    return summarize_columns(records_to_columns(rows)) if rows else []


def summarize_trial(records: Sequence[StepRecord]) -> TrialSummary | None:
    """One trial's summary, or None when it has no measured (non-warm-up) step."""
    out = summarize(records)
    return out[0] if out else None


def _schema(m: Columns) -> int:
    """The oldest SCHEMA_VERSION among the rows; a row without one (an empty cell, or no such
    column) was written with 1."""
    v = m.get("schema_version")
    if v is None or not v.size:
        return 1
    v = np.where(np.isfinite(v), v, 1.0)
    return int(max(1.0, float(v.min())))


def _seq_length(m: Columns) -> int | None:
    """The trial's tokens per sample: the largest recorded seq_length, None when none is above 0.

    Empty means not known (a user script's later stages never see the input; images have
    no tokens); 0 is what CSVs written before that change held for "not known"."""
    v = m.get("seq_length")
    v = v[np.isfinite(v) & (v > 0)] if v is not None else np.empty(0)
    return int(v.max()) if v.size else None


def summarize_columns(cols: Columns, source: str = "metrics") -> list[TrialSummary]:
    """Every trial's summary from metrics columns (several trials may share one table)."""
    cols = {k: v for k, v in cols.items() if k in SUMMARY_COLUMNS}
    order = np.argsort(cols["trial"], kind="stable")
    trials = cols["trial"][order]
    cuts = np.flatnonzero(np.diff(trials)) + 1
    out = []
    for rows in np.split(order, cuts):
        part = {k: v[rows] for k, v in cols.items()}
        s = _summarize_trial(part, source)
        if s is not None:
            out.append(s)
    return out


def _opt(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def _summarize_trial(c: Columns, source: str) -> TrialSummary | None:
    warm = c["warmup"] != 0
    meas = ~warm
    if not meas.any():
        return None
    i0 = int(np.argmax(meas))
    first = {k: v[i0] for k, v in c.items()}
    warm_steps = int(np.count_nonzero(warm & (c["rank"] == first["rank"])))
    m = {k: v[meas] for k, v in c.items()}

    _, sinv = np.unique(m["step"], return_inverse=True)
    step_secs = np.full(int(sinv.max()) + 1, -np.inf)
    np.maximum.at(step_secs, sinv, m["step_seconds"])
    micro, gas, dp = int(first["micro_batch_size"]), int(first["gradient_accumulation_steps"]), int(first["data_parallel_size"])
    stages = int(first["pipeline_stages"])
    sps = (micro * gas * dp) / step_secs[step_secs > 0]
    if sps.size == 0:
        raise InputFileError(f"{source}: trial {int(first['trial'])}: no step with step_seconds > 0")

    ranks, r_first, rinv = np.unique(m["rank"], return_index=True, return_inverse=True)
    n = np.bincount(rinv).astype(np.float64)
    sums = {k: np.bincount(rinv, weights=m[k]) for k in
            ("compute_seconds", "comm_seconds", "wait_seconds", "step_seconds", "device_utilization")}
    util_mean = sums["device_utilization"] / n
    util_std = np.sqrt(np.bincount(rinv, weights=(m["device_utilization"] - util_mean[rinv]) ** 2) / n)
    comp, comm, wait, total = (sums[k] for k in ("compute_seconds", "comm_seconds", "wait_seconds", "step_seconds"))
    opt_col = np.nan_to_num(m["optimizer_seconds"]) if "optimizer_seconds" in m else np.zeros_like(m["step_seconds"])
    opt = np.bincount(rinv, weights=opt_col, minlength=len(n))
    rank_stage = m["stage"][r_first].astype(int)
    # Host-bound share: only over steps whose utilization is the device's own counter.
    dev = (m["utilization_from_device"] == 1) if "utilization_from_device" in m else np.zeros(len(rinv), bool)
    busy = np.where(m["step_seconds"] > 0, np.minimum(1.0, m["compute_seconds"] / np.where(
        m["step_seconds"] > 0, m["step_seconds"], 1.0)), 0.0)
    n_dev = np.bincount(rinv, weights=dev, minlength=len(n))
    util_dev = np.bincount(rinv, weights=m["device_utilization"] * dev, minlength=len(n))
    busy_dev = np.bincount(rinv, weights=busy * dev, minlength=len(n))
    rank_rows = []
    for k, rank in enumerate(ranks):
        rank_rows.append(RankSummary(
            rank=int(rank), stage=int(rank_stage[k]), steps=int(n[k]),
            device_utilization_mean=float(util_mean[k]),
            device_utilization_fluctuation=float(util_std[k]) if n[k] >= 2 else None,
            comm_compute_ratio=comm_compute_ratio(float(comm[k]), float(comp[k])),
            compute_seconds_mean=float(comp[k] / n[k]),
            schedule_compute_seconds_mean=float((comp[k] - opt[k]) / n[k]), comm_seconds_mean=float(comm[k] / n[k]),
            wait_seconds_mean=float(wait[k] / n[k]),
            bubble_fraction=bubble_fraction(float(comp[k]), float(total[k]), float(opt[k])),
            wait_fraction=float(wait[k] / total[k]) if total[k] > 0 else 0.0,
            host_bound_fraction=host_bound_fraction(float(util_dev[k] / n_dev[k]), float(busy_dev[k] / n_dev[k]))
            if n_dev[k] else None,
        ))

    stage_ids = sorted(set(rank_stage.tolist()))
    stage_means = [float(np.mean([r.schedule_compute_seconds_mean for r in rank_rows if r.stage == s]))
                   for s in stage_ids]
    mean_comp = float(np.mean(stage_means))
    imbalance = max(stage_means) / mean_comp if mean_comp > 0 else 1.0
    slowest = stage_ids[stage_means.index(max(stage_means))]
    work_means, work_imbalance = _stage_work(m, rinv, rank_stage, stage_ids, stage_means)

    frag = []
    for k in range(len(ranks)):
        v = m["memory_fragmentation_ratio"][rinv == k] if "memory_fragmentation_ratio" in m else np.empty(0)
        v = v[~np.isnan(v)]
        if v.size:
            frag.append(float(np.median(v)))
    losses = m["loss"][np.argsort(m["step"], kind="stable")] if "loss" in m else np.empty(0)
    losses = losses[~np.isnan(losses)]
    ratios = [r.comm_compute_ratio for r in rank_rows if r.comm_compute_ratio is not None]
    flucts = [r.device_utilization_fluctuation for r in rank_rows if r.device_utilization_fluctuation is not None]
    means = np.array([r.device_utilization_mean for r in rank_rows])
    mean_step = float(np.mean(step_secs))
    try:
        ideal = ideal_bubble_fraction(stages, gas)
    except ValueError as exc:
        raise InputFileError(f"{source}: trial {int(first['trial'])}: {exc}") from None
    pipeline = stages > 1  # a plain engine's one "stage" has no bubble and no imbalance: absent
    median_sps = float(np.median(sps))
    median_step = float(np.median(step_secs))
    bucket = first.get("reduce_bucket_size", math.nan)
    iv = median_interval(step_secs.tolist())  # the ranks' rule, on the same slowest-rank step times
    return TrialSummary(
        trial=int(first["trial"]), steps=int(step_secs.size), warmup_steps=warm_steps,
        micro_batch_size=micro, gradient_accumulation_steps=gas,
        reduce_bucket_size=None if math.isnan(bucket) else int(bucket),
        pipeline_stages=stages, data_parallel_size=dp,
        samples_per_second=median_sps,
        samples_per_second_p10=float(np.quantile(sps, 0.1)),
        samples_per_second_p90=float(np.quantile(sps, 0.9)),
        tokens_per_second=median_sps * seq if (seq := _seq_length(m)) else None,
        step_seconds=median_step,
        step_time_jitter=float(np.std(step_secs) / mean_step) if step_secs.size > 1 and mean_step > 0 else 0.0,
        device_utilization_mean=float(np.mean(means)),
        device_utilization_fluctuation=max(flucts) if flucts else None,
        cross_device_fluctuation=float(np.std(means)) if len(rank_rows) > 1 else None,
        comm_compute_ratio=max(ratios) if ratios else None,
        comm_compute_ratio_mean=float(np.mean(ratios)) if ratios else None,
        transfer_compute_ratio=max(ratios) if ratios else None,  # the same since schema 2
        peer_wait_fraction=max(r.wait_fraction for r in rank_rows) if rank_rows else None,
        peer_wait_fraction_mean=float(np.mean([r.wait_fraction for r in rank_rows])) if rank_rows else None,
        imbalance_idle_fraction=float(np.mean([max(stage_means) - c for c in stage_means]) / median_step)
        if median_step > 0 and pipeline else None,
        metrics_schema=_schema(m),
        bubble_fraction_measured=float(np.mean([r.bubble_fraction for r in rank_rows])) if pipeline else None,
        bubble_fraction_ideal=ideal if pipeline else None,
        stage_compute_imbalance=imbalance if pipeline else None, slowest_stage=slowest,
        stage_compute_seconds=stage_means,
        stage_work_seconds=work_means, stage_work_imbalance=work_imbalance,
        memory_fragmentation_ratio=max(frag) if frag else None,
        memory_peak_bytes=_nanmax(m, "memory_peak_bytes"),
        memory_reserved_bytes=_nanmax(m, "memory_reserved_bytes"),
        memory_capacity_bytes=_nanmin(m, "memory_capacity_bytes"),
        loss_first=float(losses[0]) if losses.size else None,
        loss_last=float(losses[-1]) if losses.size else None,
        ranks=rank_rows,
        host_bound_fraction=max(hb) if (hb := [r.host_bound_fraction for r in rank_rows
                                                if r.host_bound_fraction is not None]) else None,
        step_seconds_low=iv.low if iv else None, step_seconds_high=iv.high if iv else None,
        step_seconds_rel_half_width=iv.relative_half_width if iv else None,
        zero_stage=int(z) if (z := _nanmax(m, "zero_stage")) is not None else None,
        **_collectives(m, rinv, len(ranks), gas),
    )


def _collectives(m: Columns, rinv: np.ndarray, ranks: int, gas: int) -> dict[str, float | None]:
    """Per-kind communication of a plain engine: calls per micro-batch and the gathers' share
    (worst rank each); None for both where the CSV has no `collective_calls` (a pipeline)."""
    calls, gathered = m.get("collective_calls"), m.get("gather_seconds")
    if calls is None or np.isnan(calls).all():
        return {"collective_calls_per_micro_batch": None, "gather_comm_fraction": None}
    per_rank = [float(np.median(v[~np.isnan(v)])) for k in range(ranks) if (v := calls[rinv == k]).size
                and not np.isnan(v).all()]
    shares = []
    if gathered is not None and not np.isnan(gathered).all():
        for k in range(ranks):
            comm = float(np.nansum(m["comm_seconds"][rinv == k]))
            if comm > 0:
                shares.append(float(np.nansum(gathered[rinv == k])) / comm)
    return {"collective_calls_per_micro_batch": max(per_rank) / max(1, gas) if per_rank else None,
            "gather_comm_fraction": max(shares) if shares else None}


def _nanmin(m: Columns, name: str) -> float | None:
    return _nan_reduce(m, name, np.min)


def _nanmax(m: Columns, name: str) -> float | None:
    return _nan_reduce(m, name, np.max)


def _nan_reduce(m: Columns, name: str, reduce: Callable[[np.ndarray], Any]) -> float | None:
    """`reduce` over a column's recorded cells; None when the column is absent or all empty."""
    v = m.get(name)
    if v is None:
        return None
    v = v[~np.isnan(v)]
    return float(reduce(v)) if v.size else None


def _stage_work(m: dict, rinv: np.ndarray, rank_stage: np.ndarray, stage_ids: list[int],
                stage_means: list[float]) -> tuple[list[float] | None, float | None]:
    """Per-stage work and its imbalance: thread CPU time where the CSV has it, else on a GPU
    (reserved bytes come only from the CUDA allocator) the compute time itself, else None
    (a CPU CSV written before the column existed)."""
    col = m.get("compute_cpu_seconds")
    reserved = m.get("memory_reserved_bytes")
    on_gpu = reserved is not None and not np.isnan(reserved).all()
    if col is not None and not np.isnan(col).all():
        per_rank = np.bincount(rinv, weights=np.nan_to_num(col)) / np.bincount(rinv)
        means = [float(np.mean(per_rank[rank_stage == s])) for s in stage_ids]
    elif on_gpu:
        means = list(stage_means)
    else:
        return None, None
    mean = float(np.mean(means))
    return means, (max(means) / mean if mean > 0 else 1.0)
