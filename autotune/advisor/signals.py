"""Signal sets: the named numbers rules read, whatever the input format.

A rule never sees a TrialSummary, an nvidia-smi table or a ds_config
directly; it sees a `SignalSet` (name -> value) so that one condition
language works for every input. A value of None means "not available" and
`unavailable` says why, so the engine can report insufficient data instead
of skipping a rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autotune.core.summary import NOT_A_PIPELINE, PIPELINE_ONLY, TrialSummary

# Signals derived from measurements (metrics CSV, nvidia-smi, Prometheus export).
METRIC_SIGNALS: frozenset[str] = frozenset({
    "device_utilization_fluctuation", "cross_device_fluctuation", "device_utilization_mean",
    "comm_compute_ratio", "comm_compute_ratio_mean", "transfer_compute_ratio", "peer_wait_fraction",
    "peer_wait_fraction_mean", "imbalance_idle_fraction",
    "bubble_fraction_measured", "bubble_fraction_ideal", "bubble_fraction_excess",
    "stage_compute_imbalance", "step_time_jitter", "samples_per_second",
    "memory_fragmentation_ratio", "memory_peak_bytes", "memory_used_ratio", "oom",
    "host_bound_fraction", "device_utilization_lead", "device_utilization_lead_points",
    "device_utilization_lead_share", "zero_stage", "collective_calls_per_micro_batch", "gather_comm_fraction",
})
# The batch layout: known from a trial's metrics or from a ds_config plus --stages/--world-size.
LAYOUT_SIGNALS: frozenset[str] = frozenset({
    "micro_batch_size", "gradient_accumulation_steps", "pipeline_stages", "data_parallel_size",
    "reduce_bucket_size", "micro_batches_remainder", "global_batch_fixed", "bucket_one_call",
})
# Facts read from the ds_config alone (computed in config_rules.py).
CONFIG_SIGNALS: frozenset[str] = frozenset({
    "config.zero_stage", "config.reduce_bucket_size_set", "config.ignored_pipeline_keys",
    "config.bucket_sizes_as_bytes", "config.bf16_enabled", "config.fp16_keys_under_bf16",
    "config.timers_enabled", "config.unknown_bucket_keys", "config.zero1_bucket_buffer_bytes",
    "config.not_strict_json", "config.hf_auto_values", "config.pipeline_job", "config.unknown_zero_keys",
})
ALL_SIGNALS: frozenset[str] = METRIC_SIGNALS | LAYOUT_SIGNALS | CONFIG_SIGNALS

HOST_BOUND_NOT_AVAILABLE = (
    "not available: utilization in this input is the busy fraction (CPU, or a GPU without NVML), "
    "so there is no kernel-time counter to compare with"
)
FRAGMENTATION_NOT_AVAILABLE = (
    "not available: no CUDA caching allocator in this input (CPU run), never reported as 0"
)

PER_CALL_NOT_AVAILABLE = (
    "not available on a pipeline engine: its gradient reduction is one timed instruction (ReduceGrads), "
    "not one call each"
)
OLD_CSV = "not in this input (a CSV written before the column existed)"


@dataclass(frozen=True, slots=True)
class RankValue:
    """One rank's (or one device's) value of a signal: evidence for "which ranks/stages"."""

    value: float
    rank: int | None = None
    stage: int | None = None
    device: str = ""


@dataclass(kw_only=True, slots=True)
class SignalSet:
    """Everything the rules may read about one subject (a trial, a device log, a config)."""

    subject: str
    """Human name: "trial 3", "nvidia-smi log", "ds_config.json"."""
    kind: str = "metrics"
    """"metrics" (a measured trial or log) or "config" (a ds_config alone)."""
    trial: int | None = None
    values: dict[str, float | None] = field(default_factory=dict)
    per_rank: dict[str, list[RankValue]] = field(default_factory=dict)
    """Per-rank breakdown of a signal, used to name the ranks/stages a finding concerns."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """Signal -> why it is missing (printed in "insufficient data" findings)."""
    details: dict[str, str] = field(default_factory=dict)
    """Signal -> extra evidence text (e.g. which config keys)."""
    partition_method: str | None = None
    """The PipelineModule partition method the run used, where the input says so (a study's
    trial.json); the bottleneck advice proposes the other built-in method."""
    not_needed: frozenset[str] = frozenset()
    """Signals this input answers through another rule: a rule lacking only these yields no
    finding at all, not "insufficient data" (the device lead, where stages are timed)."""
    sources: tuple[str, ...] = ()
    """The files this subject was read from (the advice looks for per-layer cost files beside them)."""

    def get(self, name: str) -> float | None:
        return self.values.get(name)

    def why_missing(self, name: str) -> str:
        return self.unavailable.get(name, "not present in this input")


def layout_values(micro: int | None, gas: int | None, stages: int | None, dp: int | None,
                  bucket: int | None, *, global_batch_fixed: bool = False,
                  bucket_one_call: int | None = None) -> dict[str, float | None]:
    """The layout signals, including the derived micro-batch remainder (GAS mod stages).

    `global_batch_fixed` is 1 when micro x GAS x dp must stay constant (the tuner's
    default space): then more GAS means a smaller micro-batch, and moves that only
    help by growing the batch are skipped. `advise` patches train_batch_size, so 0.
    `bucket_one_call` is the smallest bucket that holds every gradient (the search
    space's top when it ends at the model's size); None where the model is unknown.
    """
    rem = float(gas % stages) if gas is not None and stages else None
    return {
        "micro_batch_size": _f(micro), "gradient_accumulation_steps": _f(gas),
        "pipeline_stages": _f(stages), "data_parallel_size": _f(dp),
        "reduce_bucket_size": _f(bucket), "micro_batches_remainder": rem,
        "global_batch_fixed": 1.0 if global_batch_fixed else 0.0,
        "bucket_one_call": _f(bucket_one_call),
    }


def _f(v: int | float | None) -> float | None:
    return None if v is None else float(v)


def from_summary(s: TrialSummary, *, oom: bool | None = None,
                 device_memory_bytes: float | None = None, subject: str | None = None) -> SignalSet:
    """A trial summary as signals. `oom` is the trial outcome when the caller knows it;
    `subject` names it (default "trial N", or "this run" outside a study, trial -1; `advise`
    names it by its files or folder)."""
    values: dict[str, float | None] = {
        "device_utilization_fluctuation": s.device_utilization_fluctuation,
        "cross_device_fluctuation": s.cross_device_fluctuation,
        "device_utilization_mean": s.device_utilization_mean,
        "comm_compute_ratio": s.comm_compute_ratio,
        "comm_compute_ratio_mean": s.comm_compute_ratio_mean,
        "transfer_compute_ratio": s.transfer_compute_ratio,
        "peer_wait_fraction": s.peer_wait_fraction,
        "peer_wait_fraction_mean": s.peer_wait_fraction_mean,
        "imbalance_idle_fraction": s.imbalance_idle_fraction,
        "bubble_fraction_measured": s.bubble_fraction_measured,
        "bubble_fraction_ideal": s.bubble_fraction_ideal,
        "bubble_fraction_excess": (s.bubble_fraction_measured - s.bubble_fraction_ideal
                                   if s.bubble_fraction_measured is not None and s.bubble_fraction_ideal is not None
                                   else None),
        "stage_compute_imbalance": s.stage_compute_imbalance,
        "step_time_jitter": s.step_time_jitter if s.steps > 1 else None,
        "samples_per_second": s.samples_per_second,
        "memory_fragmentation_ratio": s.memory_fragmentation_ratio,
        "memory_peak_bytes": s.memory_peak_bytes,
        "memory_used_ratio": (s.memory_peak_bytes / device_memory_bytes
                              if s.memory_peak_bytes is not None and device_memory_bytes else None),
        "oom": None if oom is None else float(oom),
        "host_bound_fraction": s.host_bound_fraction,
        "zero_stage": None if s.zero_stage is None else float(s.zero_stage),
        "collective_calls_per_micro_batch": s.collective_calls_per_micro_batch,
        "gather_comm_fraction": s.gather_comm_fraction,
    }
    values.update(layout_values(s.micro_batch_size, s.gradient_accumulation_steps,
                                s.pipeline_stages, s.data_parallel_size, s.reduce_bucket_size))
    per_rank: dict[str, list[RankValue]] = {
        "device_utilization_fluctuation": [
            RankValue(r.device_utilization_fluctuation, r.rank, r.stage) for r in s.ranks
            if r.device_utilization_fluctuation is not None],
        "comm_compute_ratio": [RankValue(r.comm_compute_ratio, r.rank, r.stage) for r in s.ranks
                               if r.comm_compute_ratio is not None],
        "host_bound_fraction": [RankValue(r.host_bound_fraction, r.rank, r.stage) for r in s.ranks
                                if r.host_bound_fraction is not None],
    }
    if s.bubble_fraction_ideal is not None and s.stage_compute_imbalance is not None:  # a pipeline job
        ideal, imbalance = s.bubble_fraction_ideal, s.stage_compute_imbalance
        per_rank["bubble_fraction_measured"] = [RankValue(r.bubble_fraction, r.rank, r.stage) for r in s.ranks]
        per_rank["bubble_fraction_excess"] = [RankValue(r.bubble_fraction - ideal, r.rank, r.stage) for r in s.ranks]
        # The bottleneck stage and every rank on it (the evidence names them).
        per_rank["stage_compute_imbalance"] = ([RankValue(imbalance, r.rank, r.stage)
                                                for r in s.ranks if r.stage == s.slowest_stage]
                                               or [RankValue(imbalance, None, s.slowest_stage)])
    unavailable = {
        "memory_fragmentation_ratio": FRAGMENTATION_NOT_AVAILABLE,
        "host_bound_fraction": HOST_BOUND_NOT_AVAILABLE,
        "oom": "the metrics do not say whether a trial ran out of memory (autotune run does)",
        "memory_used_ratio": "device memory size unknown (a CPU, or a CSV without memory_capacity_bytes)",
        "step_time_jitter": "needs at least two measured steps",
        "device_utilization_fluctuation": "needs at least two measured steps per rank",
        "cross_device_fluctuation": "needs at least two ranks",
        "comm_compute_ratio": "no compute time recorded",
        "transfer_compute_ratio": "no compute time recorded",
        "reduce_bucket_size": "not set, or has no effect in this run",
        "zero_stage": "not recorded (an engine without ZeRO, or a CSV written before the column existed)",
        "collective_calls_per_micro_batch": PER_CALL_NOT_AVAILABLE if s.pipeline_stages > 1 else OLD_CSV,
        "gather_comm_fraction": PER_CALL_NOT_AVAILABLE if s.pipeline_stages > 1 else OLD_CSV,
    }
    if s.pipeline_stages < 2:
        unavailable.update(dict.fromkeys(PIPELINE_ONLY, NOT_A_PIPELINE))
    details = {"stage_compute_imbalance": stage_share_text(s)} if s.pipeline_stages > 1 else {}
    name = subject or (f"trial {s.trial}" if s.trial >= 0 else "this run (outside a study)")
    return SignalSet(subject=name, kind="metrics",
                     trial=s.trial if s.trial >= 0 else None, values=values,
                     per_rank=per_rank, unavailable=unavailable, details=details,
                     not_needed=frozenset(LEAD_SIGNALS))


LEAD_SIGNALS = ("device_utilization_lead", "device_utilization_lead_points", "device_utilization_lead_share")
"""Utilization lead of the busiest device: the bottleneck seen from inputs without per-stage
timing (an nvidia-smi log). A metrics CSV times each stage (stage-imbalance reads that)."""


def stage_share_text(s: TrialSummary) -> str:
    """The bottleneck stage's share of the step: vs. the step and vs. the mean stage, with its ranks."""
    comp = s.stage_compute_seconds
    if not comp:
        return ""
    mean = sum(comp) / len(comp)
    stage_ids = sorted({r.stage for r in s.ranks}) or list(range(len(comp)))
    worst = comp[stage_ids.index(s.slowest_stage)] if s.slowest_stage in stage_ids else max(comp)
    ranks = sorted(r.rank for r in s.ranks if r.stage == s.slowest_stage)
    on = f" (ranks {','.join(map(str, ranks))})" if ranks else ""
    share = f", {worst / s.step_seconds:.0%} of the {s.step_seconds:.3g} s step" if s.step_seconds > 0 else ""
    return (f"bottleneck stage {s.slowest_stage}{on}: {worst:.3g} s forward+backward per step{share}, "
            f"{s.stage_compute_imbalance:.2f}x the mean stage ({mean:.3g} s); per-stage compute s: "
            + ", ".join(f"{c:.3g}" for c in comp))
