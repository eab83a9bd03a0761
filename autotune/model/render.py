"""A prediction (or a plan) in words and as JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune.core.space import fmt_bucket
from autotune.model.plan import Plan, PlannedLayout
from autotune.model.step_model import Calibration, Layout, Prediction
from autotune.model.study_model import StudyModel

if TYPE_CHECKING:
    from autotune.model.interval import Interval
    from autotune.model.observations import Observation
    from autotune.model.validation import HeldOut

TERM_ORDER = ("compute", "recompute", "transfer", "wait", "reduce", "optimizer", "engine")


@dataclass(frozen=True, slots=True)
class LeaveOneOut:
    """The model's errors on the study's trials it had not seen (autotune/model/validation.py)."""

    points: list[HeldOut]
    trials: int
    """The study's trials the model was calibrated on."""
    shape: tuple[int, int] | None = None
    """(stages, dp) every held-out trial ran: their errors say nothing of another (None: any)."""

    @property
    def mape(self) -> float | None:
        from autotune.model.validation import mean_abs_error

        return mean_abs_error(self.points)

    def interval(self, samples_per_second: float, layout: Layout | None = None) -> Interval | None:
        """The interval around a prediction; None for too few held-out trials, or for a `layout` of
        another stage count or dp than the study's (`why_no_interval` says which)."""
        from autotune.model.interval import interval

        if self.elsewhere(layout):
            return None
        return interval(samples_per_second, self.points)

    def elsewhere(self, layout: Layout | None) -> bool:
        return (layout is not None and self.shape is not None
                and (layout.stages, layout.data_parallel_size) != self.shape)

    def why_no_interval(self, layout: Layout | None = None) -> str:
        from autotune.model.interval import LEVEL, why_none

        if self.elsewhere(layout) and self.shape is not None and layout is not None:
            return (f"no {LEVEL:.0%} interval for {layout.stages} stages x {layout.data_parallel_size} dp: the "
                    f"study's held-out trials all ran {self.shape[0]} x {self.shape[1]}, so their errors do not "
                    "cover another layout (docs/model.md)")
        return why_none(self.trials, len(self.points))


def leave_one_out(model: StudyModel) -> LeaveOneOut:
    """The model's step-time errors on the study's trials it had not seen."""
    from autotune.model.validation import held_out

    cal = model.calibration
    return LeaveOneOut(points=held_out(model), trials=len(model.observations),
                       shape=(cal.stages, cal.data_parallel_size))


def interval_text(loo: LeaveOneOut, samples_per_second: float, layout: Layout | None = None) -> str:
    iv = loo.interval(samples_per_second, layout)
    if iv is None:
        return loo.why_no_interval(layout)
    return (f"{iv.level:.0%} interval {iv.low:,.1f}-{iv.high:,.1f} (one launch; from the errors on "
            f"{iv.from_trials} held-out trials)")


def interval_dict(loo: LeaveOneOut, samples_per_second: float, layout: Layout | None = None) -> dict[str, object] | None:
    iv = loo.interval(samples_per_second, layout)
    if iv is None:
        return None
    return {"level": iv.level, "low": iv.low, "high": iv.high, "from_trials": iv.from_trials}


def _layout_text(p: Prediction) -> str:
    lay = p.layout
    bucket = "-" if lay.reduce_bucket_size is None else fmt_bucket(lay.reduce_bucket_size)
    ckpt = f", checkpoint every {lay.checkpoint_interval}" if lay.checkpoint_interval else ""
    parts = f", parts {p.parts}" if p.parts else ""
    if p.bubble_fraction is None:  # a plain engine: its ZeRO stage, no stages
        return (f"micro {lay.micro_batch_size}, GAS {lay.gradient_accumulation_steps}, bucket {bucket}, "
                f"ZeRO-{lay.zero_stage}, {lay.data_parallel_size} dp (not a pipeline job)")
    return (f"micro {lay.micro_batch_size}, GAS {lay.gradient_accumulation_steps}, bucket {bucket}, "
            f"{lay.stages} stages x {lay.data_parallel_size} dp{parts}{ckpt}")


def measured_match(model: StudyModel, p: Prediction) -> Observation | None:
    """The study's trial that ran this very layout, if one did."""
    lay = p.layout
    for o in model.observations:
        if ((o.micro_batch_size, o.gradient_accumulation_steps, o.stages, o.data_parallel_size,
             o.reduce_bucket_size, o.checkpoint_interval)
                == (lay.micro_batch_size, lay.gradient_accumulation_steps, lay.stages, lay.data_parallel_size,
                    lay.reduce_bucket_size, lay.checkpoint_interval)
                and (lay.zero_stage is None or o.zero_stage is None or o.zero_stage == lay.zero_stage)
                and (p.parts is None or o.parts is None or list(o.parts) == list(p.parts))):
            return o
    return None


def prediction_text(model: StudyModel, p: Prediction, loo: LeaveOneOut) -> str:
    cal = model.calibration
    lines = [f"predicted: {_layout_text(p)}",
             f"  samples/s   {p.samples_per_second:,.1f}  (step {p.step_seconds * 1000:.1f} ms)",
             f"              {interval_text(loo, p.samples_per_second, p.layout)}"]
    seen = measured_match(model, p)
    if seen is not None:
        lines.append(f"  measured    {seen.samples_per_second:,.1f} in trial {seen.trial} "
                     f"({(p.samples_per_second / seen.samples_per_second - 1) * 100:+.1f} % predicted)")
    lines.append("  step by term" + (" (slowest stage)" if p.bubble_fraction is not None else "") + ": " + ", ".join(
        f"{k} {p.terms[k] * 1000:.1f} ms" for k in TERM_ORDER if p.terms.get(k, 0) > 0 or k == "compute"))
    if p.bubble_fraction is None:
        lines.append("  bubble      not a pipeline job")
    else:
        lines.append(f"  bubble      {p.bubble_fraction * 100:.1f} % of the schedule (ideal 1F1B "
                     f"{(p.layout.stages - 1) / (p.layout.gradient_accumulation_steps + p.layout.stages - 1) * 100:.1f} %)")
    kind = {"process_max_rss": "the process's peak resident set", "cuda_max_allocated": "CUDA peak allocated"}
    if p.bubble_fraction is None:  # a plain engine: one figure per rank, or its notes say why none
        if p.stage_memory_bytes is not None:
            lines.append(f"  peak memory {p.stage_memory_bytes[0] / 2**20:,.0f} MiB per rank "
                         f"({kind.get(cal.memory_kind or '', cal.memory_kind)})")
    elif p.stage_memory_bytes is not None:
        lines.append("  peak memory " + ", ".join(f"stage {s} {b / 2**20:,.0f} MiB" for s, b in enumerate(p.stage_memory_bytes))
                     + f" ({kind.get(cal.memory_kind or '', cal.memory_kind)})")
    else:
        lines.append("  peak memory not modelled: the study measured no layer costs (it ran with --no-layer-costs)")
    lines.append(f"  measured terms: {', '.join(p.measured_terms)}")
    if p.extrapolated:
        lines.append("  extrapolated: " + "; ".join(p.extrapolated))
    for n in p.notes:
        lines.append(f"  note: {n}")
    err, count = loo.mape, len(loo.points)
    lines.append(f"  calibrated on {len(cal.trials)} trial(s) of {model.root}; "
                 + (f"error on trials it had not seen (leave-one-out, {count}): {err * 100:.1f} % of the step time"
                    if err is not None else "too few trials for a leave-one-out error (3 needed)"))
    return "\n".join(lines)


def prediction_dict(model: StudyModel, p: Prediction, loo: LeaveOneOut) -> dict[str, object]:
    seen = measured_match(model, p)
    err, n = loo.mape, len(loo.points)
    iv = interval_dict(loo, p.samples_per_second, p.layout)
    return {"layout": dataclasses.asdict(p.layout) | {"parts": p.parts},
            "samples_per_second": p.samples_per_second,
            "samples_per_second_interval": iv, "interval_missing": None if iv else loo.why_no_interval(p.layout),
            "step_seconds": p.step_seconds,
            "terms_seconds": {k: p.terms.get(k, 0.0) for k in TERM_ORDER},
            "bubble_fraction": p.bubble_fraction,
            "bubble_missing": "not a pipeline job" if p.bubble_fraction is None else None,
            "stage_peak_memory_bytes": p.stage_memory_bytes,
            "memory_kind": model.calibration.memory_kind if p.stage_memory_bytes is not None else None,
            "measured_terms": p.measured_terms, "extrapolated": p.extrapolated, "notes": p.notes,
            "measured": ({"trial": seen.trial, "samples_per_second": seen.samples_per_second} if seen else None),
            "calibration": calibration_dict(model.calibration) | {"leave_one_out_mape": err, "leave_one_out_trials": n}}


def calibration_dict(cal: Calibration) -> dict[str, object]:
    zero = None
    if cal.zero is not None:
        zero = {"reference_stage": cal.zero.reference_stage, "default_stage": cal.zero.default_stage,
                "stages_measured": sorted(cal.zero.stages), "seconds_per_volume": cal.zero.seconds_per_volume,
                "reduce_per_bucket_seconds": cal.zero.reduce_per_bucket,
                "work_factor": {str(z): t.work_factor for z, t in sorted(cal.zero.stages.items())}}
    return {"job": "plain engine" if cal.zero is not None else "pipeline", "zero": zero,
            "trials": cal.trials, "device": cal.device, "stages": cal.stages,
            "data_parallel_size": cal.data_parallel_size, "parts": cal.parts, "cores": cal.cores,
            "micro_batches_measured": cal.micro_batches_measured, "layer_costs": cal.layers is not None,
            "overhead_per_step_seconds": cal.overhead_per_step, "overhead_per_micro_seconds": cal.overhead_per_micro,
            "reduce_per_bucket_seconds": cal.reduce_per_bucket, "reduce_per_step_seconds": cal.reduce_per_step}


def to_json(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=False)


PRESET_NO_INTERVAL = ("no interval: a plan onto other hardware is scaled from its preset's figures, "
                      "which the study's held-out errors do not measure")


def plan_intervals(plan: Plan, loo: LeaveOneOut | None) -> tuple[list[Interval | None], str | None]:
    """Each ranked layout's interval (the study's held-out errors, on the study's own device
    only), and why there are none."""
    if loo is None:
        return [None] * len(plan.ranked), None
    if plan.cluster.hardware is not None:
        return [None] * len(plan.ranked), PRESET_NO_INTERVAL
    ivs = [loo.interval(x.samples_per_second, x.layout) for x in plan.ranked]
    if any(ivs) or not ivs:
        return ivs, None
    return ivs, loo.why_no_interval(plan.ranked[0].layout)


def plan_text(plan: Plan, top: int, loo: LeaveOneOut | None = None) -> str:
    from autotune.model.plan import reason

    c = plan.cluster
    hw = c.hardware.name if c.hardware else "the study's own device"
    ivs, no_interval = plan_intervals(plan, loo)
    lines = [f"plan: {c.gpus} GPUs ({c.gpus_per_node} per node) of {hw}, global batch {c.global_batch}"]
    lines += [f"  {n}" for n in plan.notes]
    if no_interval:
        lines.append(f"  {no_interval}")
    if plan.scaled:
        lines.append("  scaled from the preset: " + "; ".join(plan.scaled))
    best = plan.ranked[0] if plan.ranked else None
    lines.append(f"{'rank':>4}  {'stages x dp':>11}  {'micro':>5}  {'GAS':>4}  {'ckpt':>4}  {'samples/s':>11}  "
                 f"{'step ms':>9}  {'peak GiB':>8}  parts / why")
    plain = bool(plan.ranked or plan.too_big) and (plan.ranked or plan.too_big)[0].bubble_fraction is None
    if plain:  # a plain engine: its ZeRO stage where a pipeline has stages and a partition
        lines[-1] = (f"{'rank':>4}  {'ZeRO x dp':>11}  {'micro':>5}  {'GAS':>4}  {'ckpt':>4}  {'samples/s':>11}  "
                     f"{'step ms':>9}  {'peak GiB':>8}  why")
    for i, x in enumerate(plan.ranked[:top], 1):
        lay = x.layout
        peak = max(x.stage_memory_bytes)
        shape = f"{lay.zero_stage} x {lay.data_parallel_size}" if plain else f"{lay.stages} x {lay.data_parallel_size}"
        lines.append(f"{i:>4}  {shape:>11}  {lay.micro_batch_size:>5}  "
                     f"{lay.gradient_accumulation_steps:>4}  {'on' if lay.checkpoint_interval else 'off':>4}  "
                     f"{x.samples_per_second:>11,.1f}  {x.step_seconds * 1000:>9.2f}  "
                     f"{f'{peak / 2**30:.2f}' if math.isfinite(peak) else '-':>8}  "
                     + ("" if plain else f"{x.parts}: ") + reason(x, best)
                     + (f" ({iv.level:.0%}: {iv.low:,.1f}-{iv.high:,.1f})" if (iv := ivs[i - 1]) else ""))
    if len(plan.ranked) > top:
        lines.append(f"  ... {len(plan.ranked) - top} more layouts fit (--top to list them)")
    if not plan.ranked:
        lines.append("  no layout fits the device's memory")
    if plan.too_big:
        lines.append(f"do not fit ({len(plan.too_big)} layouts; the least over first):")
        for x in plan.too_big[:top]:
            s, over = x.overflow
            lay = x.layout
            where = (f"ZeRO-{lay.zero_stage} x {lay.data_parallel_size} dp" if plain
                     else f"{lay.stages} x {lay.data_parallel_size}")
            lines.append(f"      {where}, micro {lay.micro_batch_size}, GAS "
                         f"{lay.gradient_accumulation_steps}, ckpt {'on' if lay.checkpoint_interval else 'off'}: "
                         + ("each rank needs" if plain else f"stage {s} needs") + f" {x.stage_memory_bytes[s] / 2**30:,.2f} GiB, "
                         f"{over / 2**30:,.2f} GiB over the {x.memory_limit_bytes / 2**30 if x.memory_limit_bytes else 0:,.2f} GiB it may use")
    return "\n".join(lines)


def plan_dict(plan: Plan, loo: LeaveOneOut | None = None) -> dict[str, object]:
    ivs, no_interval = plan_intervals(plan, loo)
    by_id = {id(x): iv for x, iv in zip(plan.ranked, ivs, strict=True)}

    def one(x: PlannedLayout) -> dict[str, object]:
        iv = by_id.get(id(x))
        return {"layout": dataclasses.asdict(x.layout) | {"parts": x.parts}, "samples_per_second": x.samples_per_second,
                "samples_per_second_interval": ({"level": iv.level, "low": iv.low, "high": iv.high,
                                                 "from_trials": iv.from_trials} if iv else None),
                "step_seconds": x.step_seconds, "bubble_fraction": x.bubble_fraction,
                "stage_peak_memory_bytes": x.stage_memory_bytes, "memory_limit_bytes": x.memory_limit_bytes,
                "terms_seconds": x.terms, "fits": x.fits}

    c = plan.cluster
    return {"gpus": c.gpus, "gpus_per_node": c.gpus_per_node, "global_batch": c.global_batch,
            "hardware": (dataclasses.asdict(c.hardware) if c.hardware else None), "notes": plan.notes,
            "scaled_from_preset": plan.scaled, "interval_missing": no_interval,
            "ranked": [one(x) for x in plan.ranked],
            "do_not_fit": [one(x) | {"overflow_stage": x.overflow[0], "overflow_bytes": x.overflow[1]}
                           for x in plan.too_big]}
