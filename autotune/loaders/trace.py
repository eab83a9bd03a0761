"""torch.profiler traces as `advise` subjects: one job's per-rank traces -> one SignalSet.

The signals keep the definitions of the metrics CSV (README "Signals"), measured from the
trace (autotune/traces/breakdown.py):
- device utilization: the busy share of each step's wall time (any kernel on a device; the
  computing host operators of a CPU-only trace); fluctuation: its population std over the
  steps, worst rank; across devices: the std of the ranks' means;
- communication/compute: the union of communication kernels (c10d/gloo operators on a host)
  over the union of compute kernels, per rank; the job's value is the worst rank's. A trace
  cannot split a transfer from its wait for the peer (an NCCL kernel spins until the peer
  arrives), so this is an upper bound of the CSV's transfer-only ratio, and the note says so;
- for a pipeline job (stages from the send/receive pattern, autotune/traces/pipeline.py):
  the bubble per rank (idle share from a step's first compute to its last backward), the
  stage compute imbalance (max / mean of the stages' compute) and the bottleneck stage;
- the gradient reductions: all-reduce and reduce-scatter messages of more than
  `REDUCTION_MIN_ELEMENTS` elements (a loss, an overflow flag or a norm is smaller), per step:
  how many calls and how many elements, against `reduce_bucket_size` (`bucket_one_call`:
  the bucket that reduces them in one call).
The micro-batch, GAS and bucket are not in a trace: `--config` gives them, as does the
ds_config.json beside a study trial's `traces/`. Memory, peer waits and samples/s (without a
config) are "not in this input", never 0.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from autotune.advisor.signals import LEAD_SIGNALS, RankValue, SignalSet, layout_values
from autotune.core.errors import InputFileError
from autotune.core.summary import fluctuation
from autotune.traces.breakdown import RankBreakdown, breakdown
from autotune.traces.pipeline import PipelineLayout, pipeline_layout
from autotune.traces.rank_trace import RankTrace, read_rank_trace

REDUCTION_MIN_ELEMENTS = 1024
REDUCTIONS = ("allreduce", "reduce_scatter")
HOST_ONLY_NOTE = ("host-only trace (no device kernels, a CPU job on gloo): device time is not in this input; "
                  "compute and communication are the host operators' time, and a wait for a peer that no "
                  "operator covers counts as idle")
DEVICE_NOTE = ("trace input: an NCCL kernel's time includes its wait for the slowest peer, so the "
               "communication/compute ratio is an upper bound of the transfer time; memory and peer waits "
               "are not in a trace")
NOT_IN_TRACE = {
    "memory_fragmentation_ratio": "not in this input: a trace holds no allocator state",
    "memory_peak_bytes": "not in this input: a trace holds no memory profile",
    "memory_used_ratio": "not in this input: a trace holds no memory profile",
    "peer_wait_fraction": "not in this input: a trace cannot tell a transfer from a wait for the peer",
    "peer_wait_fraction_mean": "not in this input: a trace cannot tell a transfer from a wait for the peer",
    "imbalance_idle_fraction": "not in this input: a trace cannot tell a transfer from a wait for the peer",
    "transfer_compute_ratio": "not in this input: a trace cannot tell a transfer from a wait for the peer",
    "host_bound_fraction": "not in this input (needs NVML utilization beside the kernel time)",
    "oom": "a trace does not say whether a run ran out of memory",
    "samples_per_second": "not in this input: a trace holds no batch size (pass --config)",
    "bubble_fraction_ideal": "needs the GAS: pass --config",
    "micro_batch_size": "not in this input: pass --config",
    "gradient_accumulation_steps": "not in this input: pass --config",
    "reduce_bucket_size": "not in this input: pass --config",
}


def read_job_traces(paths: Sequence[Path]) -> list[RankTrace]:
    """One job's traces, one per rank; one-line errors for what cannot be one job."""
    traces = [read_rank_trace(p) for p in paths]
    worlds = {t.world_size for t in traces if t.world_size is not None}
    if len(worlds) > 1:
        a = next(t for t in traces if t.world_size == min(worlds))
        b = next(t for t in traces if t.world_size == max(worlds))
        raise InputFileError(f"{b.path}: world size {b.world_size}, but {a.path} has {a.world_size}: "
                             "these traces come from different jobs; advise each job's folder on its own")
    seen: dict[int, Path] = {}
    for t in traces:
        if t.rank is not None and t.rank in seen:
            raise InputFileError(f"{t.path}: a second trace of rank {t.rank} (also {seen[t.rank].name}): "
                                 "one job's traces hold each rank once; advise each run on its own")
        if t.rank is not None:
            seen[t.rank] = t.path
    return traces


def trace_signals(traces: Sequence[RankTrace], *, name: str, micro: int | None = None, gas: int | None = None,
                  bucket: int | None = None, trial: int | None = None) -> tuple[SignalSet, list[str]]:
    """The job's signals and what the user should know about them."""
    parts = [breakdown(t) for t in traces]
    layout = pipeline_layout(traces)
    stage = layout.stage_of if layout else {}
    notes = [HOST_ONLY_NOTE if not any(b.device for b in parts) else DEVICE_NOTE, f"{name}: {_breakdown_text(parts)}"]
    utils = [b.utilization for b in parts]
    ratios = [(b, r) for b in parts if (r := b.comm_compute_ratio) is not None]
    values: dict[str, float | None] = {
        "device_utilization_mean": statistics.fmean(u for us in utils for u in us) if any(utils) else None,
        "device_utilization_fluctuation": max((f for us in utils if (f := fluctuation(us)) is not None),
                                              default=None),
        "cross_device_fluctuation": (statistics.pstdev([statistics.fmean(us) for us in utils if us])
                                     if sum(1 for us in utils if us) > 1 else None),
        "comm_compute_ratio": max((r for _, r in ratios), default=None),
        "comm_compute_ratio_mean": statistics.fmean(r for _, r in ratios) if ratios else None,
        "step_time_jitter": _jitter(parts),
    }
    labelled = {b.micro_batches for b in parts if b.micro_batches}
    if gas is None and len(labelled) == 1:  # the schedule's own labels count them (trace_labels.py)
        gas = labelled.pop()
        notes.append(f"{name}: {gas} micro-batches per step, counted from the pipeline's labelled forwards "
                     "(the GAS, or a torch schedule's n_microbatches)")
    stages = layout.stages if layout else None
    dp = layout.data_parallel_size if layout else (traces[0].world_size if traces[0].world_size else None)
    world = traces[0].world_size
    values.update(layout_values(micro, gas, stages or (1 if layout is None and world else None), dp, bucket,
                                bucket_one_call=_one_call(traces)))
    per_rank: dict[str, list[RankValue]] = {
        "device_utilization_fluctuation": [RankValue(f, b.rank, stage.get(b.rank)) for b in parts  # type: ignore[arg-type]
                                           if (f := fluctuation(b.utilization)) is not None],
        "comm_compute_ratio": [RankValue(r, b.rank, stage.get(b.rank)) for b, r in ratios],  # type: ignore[arg-type]
    }
    details: dict[str, str] = {}
    if micro and gas and dp:
        slowest = max(statistics.median(b.step_seconds) for b in parts if b.step_seconds)
        values["samples_per_second"] = micro * gas * dp / slowest if slowest > 0 else None
        notes.append(f"{name}: samples/s is the traced steps' own, under the profiler (a trial's measured "
                     "steps, in its metrics CSV, ran without it)")
    if layout is not None and stages and stages > 1:
        _pipeline_values(parts, layout, gas, values, per_rank, details)
    elif layout is None and world and world > 1:
        notes.append(f"{name}: no send or receive with its peer in the traces: not read as a pipeline job "
                     "(stage signals need a pipeline trace recorded with record_shapes=True)")
    reductions = _reductions_text(traces, bucket)
    if reductions:
        details["comm_compute_ratio"] = reductions
        notes.append(f"{name}: {reductions}")
    if world and len(traces) < world:
        notes.append(f"{name}: {len(traces)} of {world} ranks' traces: imbalance with the missing ranks is unseen")
    unavailable = {k: v for k, v in NOT_IN_TRACE.items() if values.get(k) is None}
    if values["device_utilization_fluctuation"] is None:
        unavailable["device_utilization_fluctuation"] = "needs at least two steps per rank in the trace"
    if values["step_time_jitter"] is None:
        unavailable["step_time_jitter"] = "needs at least two steps in the trace (HTA's convention: the last is not analysed)"
    if values["cross_device_fluctuation"] is None:
        unavailable["cross_device_fluctuation"] = "needs at least two ranks' traces"
    if values.get("stage_compute_imbalance") is None:
        unavailable["stage_compute_imbalance"] = ("needs a pipeline job's traces of every stage "
                                                  "(stages come from the sends and receives)")
    return SignalSet(subject=name, kind="metrics", trial=trial, values=values, per_rank=per_rank,
                     unavailable=unavailable, details=details, not_needed=frozenset(LEAD_SIGNALS),
                     sources=tuple(str(t.path) for t in traces)), notes


def _pipeline_values(parts: list[RankBreakdown], layout: PipelineLayout, gas: int | None,
                     values: dict[str, float | None], per_rank: dict[str, list[RankValue]],
                     details: dict[str, str]) -> None:
    stage_of = layout.stage_of
    bubbles = [(b, x) for b in parts if (x := b.bubble) is not None]
    if bubbles:
        values["bubble_fraction_measured"] = statistics.fmean(x for _, x in bubbles)
        per_rank["bubble_fraction_measured"] = [RankValue(x, b.rank, stage_of.get(b.rank))  # type: ignore[arg-type]
                                                for b, x in bubbles]
    if gas:
        ideal = (layout.stages - 1) / (gas + layout.stages - 1)
        values["bubble_fraction_ideal"] = ideal
        if bubbles:
            values["bubble_fraction_excess"] = values["bubble_fraction_measured"] - ideal  # type: ignore[operator]
            per_rank["bubble_fraction_excess"] = [RankValue(x - ideal, b.rank, stage_of.get(b.rank))  # type: ignore[arg-type]
                                                  for b, x in bubbles]
    by_stage: dict[int, list[float]] = {}
    for b in parts:
        if b.rank in stage_of:
            by_stage.setdefault(stage_of[b.rank], []).append(b.compute_seconds)
    if len(by_stage) == layout.stages:
        comp = [statistics.fmean(by_stage[s]) for s in range(layout.stages)]
        mean = statistics.fmean(comp)
        if mean > 0:
            worst = max(range(len(comp)), key=comp.__getitem__)
            values["stage_compute_imbalance"] = max(comp) / mean
            ranks = sorted(r for r, s in stage_of.items() if s == worst)
            per_rank["stage_compute_imbalance"] = [RankValue(max(comp) / mean, r, worst) for r in ranks]
            details["stage_compute_imbalance"] = (
                f"bottleneck stage {worst} (ranks {','.join(map(str, ranks))}): {comp[worst]:.3g} s compute per "
                f"step, {max(comp) / mean:.2f}x the mean stage ({mean:.3g} s); per-stage compute s: "
                + ", ".join(f"{c:.3g}" for c in comp))


SHOWN_RANKS = 8
"""Ranks whose temporal breakdown the note spells out; the rest are counted."""


def _breakdown_text(parts: list[RankBreakdown]) -> str:
    """Each rank's share of the window by kind (HTA's temporal breakdown), its overlap, and the
    slowest rank."""
    device = any(b.device for b in parts)
    head = ("temporal breakdown per rank (compute / communication / memory / idle % of the window, "
            "communication overlapped by compute)" if device else
            "temporal breakdown per rank (compute / communication / idle % of the steps, host operators)")
    rows = []
    for b in sorted(parts, key=lambda b: (b.rank is None, b.rank or 0))[:SHOWN_RANKS]:
        shares = [b.compute_share, b.communication_share] + ([b.memory_share or 0.0] if device else []) + [b.idle_share]
        text = f"{b.label} " + " / ".join(f"{x * 100:.1f}" for x in shares)
        if b.overlap is not None and device:
            text += f", overlap {b.overlap * 100:.1f} %"
        rows.append(text)
    more = f"; and {len(parts) - SHOWN_RANKS} more" if len(parts) > SHOWN_RANKS else ""
    timed = [b for b in parts if b.step_seconds]
    slowest = max(timed, key=lambda b: statistics.median(b.step_seconds)) if timed else None
    tail = (f"; slowest {slowest.label}: {statistics.median(slowest.step_seconds):.3g} s per step"
            if slowest is not None and len(timed) > 1 else "")
    return f"{head}: " + "; ".join(rows) + more + tail


def _jitter(parts: list[RankBreakdown]) -> float | None:
    """std / mean of the step times of the slowest rank (two steps at least)."""
    rows = [b.step_seconds for b in parts if len(b.step_seconds) > 1]
    if not rows:
        return None
    slowest = max(rows, key=statistics.median)
    mean = statistics.fmean(slowest)
    return statistics.pstdev(slowest) / mean if mean > 0 else None


def _step_reductions(t: RankTrace) -> list[list[int]]:
    """Per analysed step, the element counts of its gradient reductions."""
    out = []
    for s in t.steps:
        out.append([c.elements for c in t.collectives
                    if c.name in REDUCTIONS and c.elements is not None and c.elements > REDUCTION_MIN_ELEMENTS
                    and s.ts <= c.ts < s.end])
    return [r for r in out if r]


def _one_call(traces: Sequence[RankTrace]) -> int | None:
    """The largest step's gradient elements on any rank: the bucket that reduces them in one call."""
    totals = [sum(r) for t in traces for r in _step_reductions(t)]
    return max(totals) if totals else None


def _reductions_text(traces: Sequence[RankTrace], bucket: int | None) -> str:
    steps = [r for t in traces for r in _step_reductions(t)]
    if not steps:
        return ""
    calls = max(len(r) for r in steps)
    largest = max(max(r) for r in steps)
    total = max(sum(r) for r in steps)
    text = (f"gradient reductions: {calls} call{'s' if calls > 1 else ''} per step, the largest "
            f"{largest:,} elements, {total:,} in all (a reduce_bucket_size of {total:,} reduces them in one call)")
    if bucket:
        text += f"; reduce_bucket_size is {bucket:,}"
    return text


def trial_config_beside(paths: Sequence[Path]) -> Path | None:
    """A study trial's ds_config.json when the traces lie in its `traces/` folder."""
    folders = {p.resolve().parent for p in paths}
    if len(folders) != 1:
        return None
    folder = folders.pop()
    cfg = folder.parent / "ds_config.json"
    return cfg if folder.name == "traces" and folder.parent.name.startswith("trial-") and cfg.is_file() else None
