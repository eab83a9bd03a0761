"""The model of one DeepSpeed pipeline step, calibrated from a study's own trials.

Terms (each fitted from the observations, autotune/model/observations.py):
- compute: each layer's forward and backward work as it grows with the micro-batch
  (`fits.GrowthFit`, from the per-layer costs), summed over the layers of a stage, plus the
  stage's own overhead (the loss on the last stage); without layer costs, each stage's
  measured work fitted the same way (the partition and the stage count cannot then change);
- activation checkpointing: the backward of a checkpointed stage recomputes its forward;
- point-to-point: one transfer, latency plus a part that grows with the micro-batch
  (from the fastest send or receive each rank saw: a transfer that waited for nobody);
- the data-parallel gradient reduction: a cost per bucket plus a cost per step, where the
  buckets are the stage's parameters over reduce_bucket_size (where it acts, by
  core/dsconfig.py's rule: ZeRO-1, dp > 1; else DeepSpeed's fixed 5e8), scaled by
  the ring's 2(dp - 1)/dp to another dp;
- the optimizer step: per stage, in proportion to the parameters it updates (ZeRO-1
  partitions them over dp);
- the schedule: DeepSpeed's TrainSchedule replayed on those durations (`schedule.replay`),
  which gives the fill and drain bubble and the waits an unbalanced partition causes;
- the engine's own time per step and per micro-batch: what the measured step holds beyond
  the terms above, fitted (non-negative) over the trials.

Ranks sharing fewer cores than there are ranks (this machine: 4 ranks on 2 cores) make
compute special: a stage's forward runs slower when every stage computes at once than in
the fill and drain. The replay models it as processor sharing over the cores
(`Calibration.cores`) and every prediction says so.

Memory per stage (`stage_memory`): parameters, gradients and optimizer states (ZeRO-1: the
optimizer states partitioned over dp), the saved activations times the micro-batches in
flight under 1F1B (min(p - s, m)), the reduction bucket, and what each stage holds beyond
that (the process or the CUDA context), calibrated from the measured peaks.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from autotune.core.dsconfig import DEEPSPEED_DEFAULT_BUCKET, reduce_bucket_acts
from autotune.core.errors import UserError
from autotune.core.partition import in_flight
from autotune.model.fits import GrowthFit, fit_growth, nonnegative_least_squares
from autotune.model.observations import Observation
from autotune.model.schedule import StageTimes, replay
from autotune.model.zero_step import ZeroTerms, calibrate_zero, is_plain
from autotune.model.zero_step import step as zero_step

DEFAULT_BUCKET = DEEPSPEED_DEFAULT_BUCKET
"""DeepSpeed's reduce_bucket_size when the config sets none, and ZeRO-0's fixed bucket: a trial
whose bucket does not act records none (autotune/core/dsconfig.py `reduce_bucket_acts`)."""
WEIGHT_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8
"""fp32 weights and gradients, Adam's two moments (autotune's built-in workload and fp32 jobs)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """A configuration to predict."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    stages: int
    data_parallel_size: int
    reduce_bucket_size: int | None = None
    parts: tuple[int, ...] | None = None
    """Layer boundaries, stages + 1 of them; None: the calibrated partition (or, at another
    stage count, the one that balances the modelled work)."""
    checkpoint_interval: int = 0
    zero_stage: int | None = None
    """`zero_optimization.stage`; None: the calibrating study's."""

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size


@dataclass(frozen=True, slots=True)
class LayerModel:
    names: list[str]
    forward: list[GrowthFit]
    """Per layer: forward work per micro-batch, as a function of the micro-batch."""
    backward: list[GrowthFit]
    parameters: list[int]
    activation_bytes_per_sample: list[float]
    first_overhead: GrowthFit
    middle_overhead: GrowthFit
    last_overhead: GrowthFit
    """A stage's work outside its layers, per micro-batch (the last stage's holds the loss)."""


@dataclass(frozen=True, slots=True)
class Calibration:
    """The fitted terms, and what they were fitted from."""

    trials: list[int]
    device: str
    stages: int
    data_parallel_size: int
    parts: list[int] | None
    micro_batches_measured: list[int]
    cores: float | None
    """Cores the ranks shared (a CPU); None: a device per rank."""
    stage_work: list[GrowthFit]
    """Without layer costs: per stage, work per micro-batch."""
    layers: LayerModel | None
    work_scale: list[float]
    """Per stage: the metrics' measured work over the layer model's (hooks and probes see
    slightly different spans); 1.0 without layer costs."""
    forward_share: list[float]
    transfer: GrowthFit | None
    reduce_per_bucket: float
    reduce_per_step: float
    buckets_measured: list[int]
    """The bucket counts per stage the reduction was measured at."""
    model_parameters: int | None
    optimizer_per_parameter: float | None
    optimizer_seconds: list[float]
    data_per_micro: list[float]
    overhead_per_step: float
    overhead_per_micro: float
    memory_fixed_bytes: list[float] | None
    memory_kind: str | None
    notes: list[str] = field(default_factory=list)
    zero_stage: int | None = None
    """The calibrating trials' ZeRO stage (None: not known); a plain engine's: its best trial's."""
    zero: ZeroTerms | None = None
    """A plain engine's terms (autotune/model/zero_step.py); None: a pipeline."""

    @property
    def num_layers(self) -> int | None:
        return len(self.layers.names) if self.layers else None


def calibrate(observations: Sequence[Observation], *, cores: float | None = None,
              model_parameters: int | None = None) -> Calibration:
    """Fit the model on `observations` (one study's trials: one model, one machine).

    `model_parameters`: the model's parameter count, where the study knows it; without layer
    costs each stage is taken to hold an equal share (for its bucket count)."""
    obs = [o for o in observations if o.stage]
    if not obs:
        raise UserError("no trial to calibrate from")
    stages = {o.stages for o in obs}
    if len(stages) != 1 or len({o.data_parallel_size for o in obs}) != 1:
        obs = [o for o in obs if (o.stages, o.data_parallel_size) == (obs[0].stages, obs[0].data_parallel_size)]
    p, dp, device = obs[0].stages, obs[0].data_parallel_size, obs[0].device
    notes: list[str] = []
    if device != "cpu":
        cores = None
    if is_plain(obs):
        return _calibrate_plain(obs, cores, model_parameters)
    tail = core_share(cores, p * dp)  # the measured wall times of the step's tail, as each rank's work

    micro = [o.micro_batch_size for o in obs]
    layered = [o for o in obs if o.layer_costs is not None and o.checkpoint_interval == 0]
    plain = [o for o in obs if o.checkpoint_interval == 0] or obs
    layers = _layer_model(layered) if layered else None
    parts = layered[0].parts if layered else None
    stage_work = [fit_growth([o.micro_batch_size for o in plain],
                             [o.stage[s].work_seconds / o.gradient_accumulation_steps for o in plain])
                  for s in range(p)]
    if layers is not None and parts is not None and len(_sizes(layered)) < len(_sizes(plain)):
        layers = _grown_as_stages(layers, parts, stage_work, _sizes(layered)[0])
        notes.append(f"layer costs measured at micro-batch {_sizes(layered)[0]} only: each layer grows with the "
                     "micro-batch as its stage's measured work does")
    if layers is not None and parts is not None:
        scale = []
        for s in range(p):
            ratios = [o.stage[s].work_seconds / o.gradient_accumulation_steps
                      / _layer_work(layers, parts, s, p, o.micro_batch_size) for o in layered]
            scale.append(float(statistics.median(ratios)))
        forward_share = [_forward_share(layers, parts, s, p, 4) for s in range(p)]
    else:
        scale = [1.0] * p
        forward_share = [1 / 3] * p
        notes.append("no layer costs: the forward is taken as a third of the forward and backward "
                     "(the study ran with --no-layer-costs, or is not a pipeline; a new `autotune run` measures "
                     "them in its baseline, and predicts other partitions)")

    transfers = [(o.micro_batch_size, statistics.median([s.transfer_seconds for s in o.stage if s.transfer_seconds]))
                 for o in obs if any(s.transfer_seconds for s in o.stage)]
    transfer = fit_growth([b for b, _ in transfers], [t for _, t in transfers]) if transfers and p > 1 else None

    # the reduction: per bucket and per step, over every stage of every trial
    rows, ys = [], []
    for o in obs:
        if o.data_parallel_size < 2:
            continue
        for s in range(p):
            bucket = bucket_in_effect(o.reduce_bucket_size, o.zero_stage, o.data_parallel_size)
            rows.append([_buckets(_stage_parameters(layers, parts, s, p, model_parameters), bucket), 1.0])
            ys.append(o.stage[s].reduce_seconds * tail)
    buckets_seen = sorted({int(r[0]) for r in rows})
    if len(buckets_seen) > 1:
        per_bucket, per_step = nonnegative_least_squares(np.array(rows), np.array(ys))
    else:  # one bucket count: its cost per bucket cannot be told from the cost per step
        per_bucket, per_step = 0.0, (float(statistics.median(ys)) if ys else 0.0)
        if ys:
            notes.append(f"the reduction was measured at {buckets_seen[0]} bucket(s) per stage only: another "
                         "reduce_bucket_size is predicted to cost the same (a trial with a smaller bucket measures it)")

    optimizer = [float(statistics.median([o.stage[s].optimizer_seconds * tail for o in obs])) for s in range(p)]
    per_param = None
    if layers is not None and parts is not None:
        per_param = statistics.median(
            [optimizer[s] / max(1.0, _stage_parameters(layers, parts, s, p) / dp) for s in range(p)])
    data = [float(statistics.median([o.stage[s].data_seconds / o.gradient_accumulation_steps for o in obs]))
            for s in range(p)]

    cal = Calibration(trials=[o.trial for o in obs], device=device, stages=p, data_parallel_size=dp, parts=parts,
                      micro_batches_measured=sorted(set(micro)), cores=cores, stage_work=stage_work, layers=layers,
                      work_scale=scale, forward_share=forward_share, transfer=transfer,
                      reduce_per_bucket=float(per_bucket), reduce_per_step=float(per_step),
                      buckets_measured=buckets_seen, model_parameters=model_parameters,
                      optimizer_per_parameter=per_param, optimizer_seconds=optimizer, data_per_micro=data,
                      zero_stage=obs[0].zero_stage,
                      overhead_per_step=0.0, overhead_per_micro=0.0, memory_fixed_bytes=None,
                      memory_kind=obs[0].peak_memory_kind, notes=notes)
    o0, o1 = _fit_engine(cal, obs, tail)
    fixed = _memory_fixed(cal, obs)
    return _replace(cal, overhead_per_step=o0, overhead_per_micro=o1, memory_fixed_bytes=fixed)


def _calibrate_plain(obs: Sequence[Observation], cores: float | None, model_parameters: int | None) -> Calibration:
    """A plain engine's calibration: its ZeRO terms, and the pipeline fields as one stage."""
    dp = obs[0].data_parallel_size
    zero = calibrate_zero(obs, share=core_share(cores, dp), parameters=model_parameters)
    return Calibration(
        trials=[o.trial for o in obs], device=obs[0].device, stages=1, data_parallel_size=dp, parts=None,
        micro_batches_measured=_sizes(obs), cores=cores, stage_work=[zero.work], layers=None, work_scale=[1.0],
        forward_share=[1 / 3], transfer=None, reduce_per_bucket=zero.reduce_per_bucket, reduce_per_step=0.0,
        buckets_measured=sorted({t.buckets for t in zero.stages.values()}), model_parameters=model_parameters,
        optimizer_per_parameter=None, optimizer_seconds=[statistics.median([o.stage[0].optimizer_seconds for o in obs])],
        data_per_micro=[0.0], overhead_per_step=0.0, overhead_per_micro=0.0,
        memory_fixed_bytes=None, memory_kind=obs[0].peak_memory_kind, notes=list(zero.notes),
        zero_stage=zero.default_stage, zero=zero)


def core_share(cores: float | None, ranks: int) -> float:
    """The share of a core each of `ranks` ranks gets when all of them compute at once."""
    return 1.0 if cores is None else min(1.0, cores / ranks)


def _fit_engine(cal: Calibration, obs: Sequence[Observation], tail: float) -> tuple[float, float]:
    """The engine's own work per micro-batch (inside the schedule, shared for cores like compute)
    and per step (in the tail): what the measured steps hold beyond the modelled terms, with
    the least squared relative error (a search over the per-micro-batch work, since it runs
    through the replay; the per-step work is then the mean of what is left, non-negative)."""
    def residuals(per_micro: float) -> tuple[float, float]:
        c = _replace(cal, overhead_per_micro=per_micro, overhead_per_step=0.0)
        steps = [_step(c, layout_of(o)).step_seconds for o in obs]
        per_step = max(0.0, statistics.fmean([o.step_seconds - t for o, t in zip(obs, steps, strict=True)])) * tail
        # the per-step work only adds to the step (`_step`: per_step / tail after the replay)
        err = sum(((o.step_seconds - (t + per_step / tail)) / o.step_seconds) ** 2 for o, t in zip(obs, steps, strict=True))
        return err, per_step

    scale = statistics.median([o.step_seconds / o.gradient_accumulation_steps for o in obs])
    grid = [0.0] + [scale * f for f in np.geomspace(1e-3, 1.0, 25)]
    scored = [(residuals(g), g) for g in grid]
    (err, per_step), best = min(scored, key=lambda x: x[0][0])
    i = grid.index(best)
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    for _ in range(20):  # golden-section refinement between the neighbours
        a, b = lo + (hi - lo) * 0.382, lo + (hi - lo) * 0.618
        if residuals(a)[0] < residuals(b)[0]:
            hi = b
        else:
            lo = a
    mid = (lo + hi) / 2
    (err_mid, step_mid) = residuals(mid)
    if err_mid < err:
        best, per_step = mid, step_mid
    return float(per_step), float(best)


def _replace(cal: Calibration, **changes: object) -> Calibration:
    import dataclasses

    return dataclasses.replace(cal, **changes)  # type: ignore[arg-type]


def layout_of(o: Observation) -> Layout:
    """The layout a trial ran."""
    return Layout(micro_batch_size=o.micro_batch_size, gradient_accumulation_steps=o.gradient_accumulation_steps,
                  stages=o.stages, data_parallel_size=o.data_parallel_size, reduce_bucket_size=o.reduce_bucket_size,
                  parts=tuple(o.parts) if o.parts else None, checkpoint_interval=o.checkpoint_interval,
                  zero_stage=o.zero_stage)


def _layer_model(obs: Sequence[Observation]) -> LayerModel:
    first = obs[0].layer_costs
    assert first is not None
    n = len(first.names)
    same = [o for o in obs if o.layer_costs is not None and len(o.layer_costs.names) == n]
    b = [o.micro_batch_size for o in same]

    def per_micro(o: Observation, values: Sequence[float]) -> list[float]:
        return [v / o.gradient_accumulation_steps for v in values]

    fwd = [fit_growth(b, [per_micro(o, o.layer_costs.forward_seconds)[i] for o in same]) for i in range(n)]  # type: ignore[union-attr]
    bwd = [fit_growth(b, [per_micro(o, o.layer_costs.backward_seconds)[i] for o in same]) for i in range(n)]  # type: ignore[union-attr]
    acts = [float(statistics.median([o.layer_costs.activation_bytes[i] / o.micro_batch_size for o in same]))  # type: ignore[union-attr]
            for i in range(n)]
    p = first.stages

    def overhead(stage_ids: list[int]) -> GrowthFit:
        pts = [(o.micro_batch_size, o.layer_costs.stage_overhead_seconds[s] / o.gradient_accumulation_steps)  # type: ignore[union-attr]
               for o in same for s in stage_ids]
        return fit_growth([q for q, _ in pts], [v for _, v in pts])

    middle = list(range(0, p - 1)) or [0]
    return LayerModel(names=list(first.names), forward=fwd, backward=bwd, parameters=list(first.parameters),
                      activation_bytes_per_sample=acts, first_overhead=overhead([0]),
                      middle_overhead=overhead(middle[1:] or middle), last_overhead=overhead([p - 1]))


def _sizes(obs: Sequence[Observation]) -> list[int]:
    """The distinct micro-batch sizes of `obs`, smallest first."""
    return sorted({o.micro_batch_size for o in obs})


def _grown_as_stages(layers: LayerModel, parts: Sequence[int], stage_work: Sequence[GrowthFit], at: int) -> LayerModel:
    """Layer costs measured at one micro-batch size (`at`: a study's baseline) grown as the stage
    that held each layer grew over every trial of the study.

    One size can only scale a layer in proportion (fits.py), which puts no fixed cost in any
    layer: measured at micro-batch 1, it predicted a micro-batch of 8 a third slower than that
    very trial measured, where the stage fits over every micro-batch the study ran know better.
    So each layer keeps its share of its stage's work at `at`, and takes the stage's growth."""
    p = len(parts) - 1

    def as_stage(fit: GrowthFit, s: int) -> GrowthFit:
        stage = stage_work[s]
        k = fit(at) / stage(at) if stage(at) > 0 else 0.0
        return GrowthFit(stage.fixed * k, stage.per_unit * k, stage.exponent, stage.measured)

    stage_of = [next(s for s in range(p) if parts[s] <= i < parts[s + 1]) for i in range(len(layers.names))]
    middle = 1 if p > 2 else 0
    return replace(
        layers, forward=[as_stage(f, stage_of[i]) for i, f in enumerate(layers.forward)],
        backward=[as_stage(f, stage_of[i]) for i, f in enumerate(layers.backward)],
        first_overhead=as_stage(layers.first_overhead, 0), middle_overhead=as_stage(layers.middle_overhead, middle),
        last_overhead=as_stage(layers.last_overhead, p - 1))


def _stage_overhead(layers: LayerModel, s: int, p: int) -> GrowthFit:
    if s == p - 1:
        return layers.last_overhead
    return layers.first_overhead if s == 0 else layers.middle_overhead


def _layer_work(layers: LayerModel, parts: Sequence[int], s: int, p: int, b: int) -> float:
    lo, hi = parts[s], parts[s + 1]
    return (sum(layers.forward[i](b) + layers.backward[i](b) for i in range(lo, hi))
            + _stage_overhead(layers, s, p)(b))


def _forward_share(layers: LayerModel, parts: Sequence[int], s: int, p: int, b: int) -> float:
    lo, hi = parts[s], parts[s + 1]
    f = sum(layers.forward[i](b) for i in range(lo, hi))
    total = sum(layers.forward[i](b) + layers.backward[i](b) for i in range(lo, hi))
    return f / total if total > 0 else 1 / 3


def _stage_parameters(layers: LayerModel | None, parts: Sequence[int] | None, s: int, p: int,
                      model_parameters: int | None = None) -> float:
    if layers is None or parts is None or len(parts) != p + 1:
        return model_parameters / p if model_parameters else math.nan
    return float(sum(layers.parameters[parts[s]:parts[s + 1]]))


def bucket_in_effect(bucket: int | None, zero_stage: int | None, data_parallel_size: int) -> int | None:
    """The reduce_bucket_size the gradient reduction runs in: the config's where the bucket
    acts (core/dsconfig.py's rule: ZeRO-1, dp > 1), else None, DeepSpeed's fixed 5e8 elements.
    `zero_stage` None (not known): the config's."""
    if zero_stage is None or reduce_bucket_acts(zero_stage, data_parallel_size):
        return bucket
    return None


def _layout_bucket(cal: Calibration, layout: Layout) -> int | None:
    zero = layout.zero_stage if layout.zero_stage is not None else cal.zero_stage
    return bucket_in_effect(layout.reduce_bucket_size, zero, layout.data_parallel_size)


def _buckets(parameters: float, bucket: int | None) -> float:
    """Buckets one stage's gradients are reduced in (1 where the parameters are not known)."""
    if not math.isfinite(parameters):
        return 1.0
    return float(max(1, math.ceil(parameters / (bucket or DEFAULT_BUCKET))))


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the model says of one layout."""

    layout: Layout
    parts: list[int] | None
    step_seconds: float
    samples_per_second: float
    terms: dict[str, float]
    """Seconds of the slowest stage's step by term: compute, recompute, transfer, wait, reduce,
    optimizer, data, engine."""
    bubble_fraction: float | None
    """None: not a pipeline job (a plain engine has no bubble, not a bubble of 0)."""
    stage_compute_seconds: list[float]
    stage_memory_bytes: list[float] | None
    measured_terms: list[str]
    extrapolated: list[str]
    notes: list[str]


def predict(cal: Calibration, layout: Layout) -> Prediction:
    """Predict `layout` with the calibrated terms; raise UserError where it cannot be said."""
    _check(cal, layout)
    return _step(cal, layout)


def _check(cal: Calibration, layout: Layout) -> None:
    if layout.micro_batch_size < 1 or layout.gradient_accumulation_steps < 1:
        raise UserError("micro-batch and gradient accumulation steps must be >= 1")
    if layout.stages < 1 or layout.data_parallel_size < 1:
        raise UserError("stages and dp must be >= 1")
    if cal.zero is not None:
        _check_plain(cal, layout)
        return
    if layout.zero_stage not in (None, cal.zero_stage) and layout.zero_stage in (2, 3):
        raise UserError(f"ZeRO-{layout.zero_stage} with a pipeline: DeepSpeed's pipeline engine refuses ZeRO-2 and 3")
    n = cal.num_layers
    if cal.layers is None and (layout.stages != cal.stages or (layout.parts and list(layout.parts) != cal.parts)):
        from autotune.rank.layer_costs import HOW_TO_MEASURE

        raise UserError(f"another partition or stage count needs each layer's cost, and the study has none "
                        f"(it ran {cal.stages} stages): {HOW_TO_MEASURE}")
    if layout.checkpoint_interval and cal.layers is None:
        from autotune.rank.layer_costs import HOW_TO_MEASURE

        raise UserError(f"activation checkpointing needs each layer's forward, and the study has none: {HOW_TO_MEASURE}")
    if n is not None and layout.stages > n:
        raise UserError(f"{layout.stages} stages for {n} layers: every stage needs a layer")
    if layout.parts is not None:
        from autotune.core.partition import check_parts

        check_parts(list(layout.parts), n if n is not None else layout.parts[-1], layout.stages)


def _check_plain(cal: Calibration, layout: Layout) -> None:
    if layout.stages != 1 or layout.parts or layout.checkpoint_interval:
        raise UserError("the study ran a plain DeepSpeedEngine (no pipeline): stages, parts and the pipeline's "
                        "activation checkpointing need a pipeline study (`autotune run` of a PipelineModule job)")
    if layout.zero_stage is not None and layout.zero_stage not in (0, 1, 2, 3):
        raise UserError(f"--zero-stage {layout.zero_stage}: DeepSpeed's ZeRO stages are 0-3")


def default_parts(cal: Calibration, stages: int, micro: int) -> list[int] | None:
    """The calibrated partition at its stage count; at another, the one that balances the modelled work."""
    if cal.layers is None:
        return cal.parts
    if stages == cal.stages and cal.parts:
        return list(cal.parts)
    from autotune.core.partition import balanced_parts

    costs = [cal.layers.forward[i](micro) + cal.layers.backward[i](micro) for i in range(len(cal.layers.names))]
    fixed = [_stage_overhead(cal.layers, s, stages)(micro) for s in range(stages)]
    return list(balanced_parts(costs, stages, stage_fixed=fixed))


def _step(cal: Calibration, layout: Layout) -> Prediction:
    if cal.zero is not None:
        return _plain_step(cal, cal.zero, layout)
    p, dp, b, m = layout.stages, layout.data_parallel_size, layout.micro_batch_size, layout.gradient_accumulation_steps
    parts = list(layout.parts) if layout.parts else default_parts(cal, p, b)
    measured, extrapolated, notes = [], [], list(cal.notes)
    work, fshare, recompute = [], [], []
    for s in range(p):
        if cal.layers is not None and parts is not None:
            scale = cal.work_scale[s] if p == cal.stages else statistics.fmean(cal.work_scale)
            w = _layer_work(cal.layers, parts, s, p, b) * scale
            f = _forward_share(cal.layers, parts, s, p, b)
        else:
            w, f = cal.stage_work[s](b), cal.forward_share[s]
        work.append(w)
        fshare.append(f)
        recompute.append(w * f if layout.checkpoint_interval else 0.0)
    data = [cal.data_per_micro[min(s, cal.stages - 1)] if s in (0, p - 1) else 0.0 for s in range(p)]
    half = cal.overhead_per_micro / 2  # the engine's own work around each forward and backward
    times = [StageTimes(forward=work[s] * fshare[s] + data[s] + half,
                        backward=work[s] * (1 - fshare[s]) + recompute[s] + half) for s in range(p)]
    transfer = cal.transfer(b) if cal.transfer is not None and p > 1 else 0.0
    cores = cal.cores
    if cores is not None and cores < p * dp:
        notes.append(f"{p * dp} ranks share {cores:g} cores: compute is modelled as processor sharing (a stage's "
                     "forward is slower while every stage computes than in the fill and drain), and the step's "
                     "tail (reduction, optimizer) as every rank's work at once")
    if cores is not None and p * dp != cal.stages * cal.data_parallel_size:
        extrapolated.append(f"core sharing at {p * dp} ranks (measured at {cal.stages * cal.data_parallel_size})")
    run = replay(times, m, [transfer] * max(0, p - 1), replicas=dp, cores=cores)
    tail = core_share(cores, p * dp)
    reduce = [_reduce(cal, _stage_parameters(cal.layers, parts, s, p, cal.model_parameters), layout) / tail
              for s in range(p)]
    opt = [_optimizer(cal, parts, s, p, dp) / tail for s in range(p)]
    ends = [run.stage_end_seconds[s] + reduce[s] + opt[s] for s in range(p)]
    slow = int(np.argmax(ends))
    engine_step = cal.overhead_per_step / tail
    engine = engine_step + cal.overhead_per_micro * m
    step = ends[slow] + engine_step
    compute = run.stage_busy_seconds[slow]
    terms = {"compute": compute * (1 - recompute[slow] / max(1e-18, times[slow].forward + times[slow].backward)),
             "recompute": compute * recompute[slow] / max(1e-18, times[slow].forward + times[slow].backward),
             "transfer": run.stage_transfer_seconds[slow],
             "wait": max(0.0, ends[slow] - (run.stage_busy_seconds[slow] + run.stage_transfer_seconds[slow]
                                           + reduce[slow] + opt[slow])),
             "reduce": reduce[slow], "optimizer": opt[slow], "engine": engine}
    terms["compute"] = max(0.0, terms["compute"] - cal.overhead_per_micro * m)  # the engine's part shown as engine
    lo, hi = min(cal.micro_batches_measured), max(cal.micro_batches_measured)
    if b > hi or b < lo:
        factor = b / hi if b > hi else lo / b
        extrapolated.append(f"micro-batch {b} is {factor:.3g}x {'beyond the largest' if b > hi else 'below the smallest'} "
                            f"measured ({hi if b > hi else lo})")
    measured.append("compute (per layer)" if cal.layers is not None else "compute (per stage)")
    if p != cal.stages:
        extrapolated.append(f"{p} stages (calibrated at {cal.stages}): the partition {parts} balances the modelled work")
    if dp != cal.data_parallel_size:
        extrapolated.append(f"dp {dp} (calibrated at {cal.data_parallel_size}): the reduction scaled by the ring's 2(dp-1)/dp, "
                            "the optimizer step by 1/dp")
    if layout.checkpoint_interval:
        extrapolated.append("recompute: the checkpointed stages' forward again in their backward")
    if cal.layers is not None and parts is not None and cal.parts is not None and parts != cal.parts:
        extrapolated.append(f"partition {parts} (measured {cal.parts}): from each layer's cost")
    measured += [t for t, ok in (("transfer", cal.transfer is not None), ("reduce", cal.data_parallel_size > 1),
                                 ("optimizer", True), ("engine", True)) if ok]
    if dp > 1 and cal.buckets_measured and (cal.layers is not None or cal.model_parameters):
        counts = [int(_buckets(_stage_parameters(cal.layers, parts, s, p, cal.model_parameters),
                               _layout_bucket(cal, layout))) for s in range(p)]
        if max(counts) > max(cal.buckets_measured) or min(counts) < min(cal.buckets_measured):
            extrapolated.append(f"reduction in {max(counts)} bucket(s) per stage (measured "
                                f"{', '.join(map(str, cal.buckets_measured))})")
    memory = stage_memory(cal, layout, parts)
    return Prediction(layout=layout, parts=parts, step_seconds=step, samples_per_second=layout.global_batch / step,
                      terms=terms, bubble_fraction=run.bubble_fraction,
                      stage_compute_seconds=[t.forward * m + t.backward * m for t in times],
                      stage_memory_bytes=memory, measured_terms=measured, extrapolated=extrapolated, notes=notes)


def _plain_step(cal: Calibration, zero: ZeroTerms, layout: Layout) -> Prediction:
    dp = layout.data_parallel_size
    z = zero_step(zero, micro=layout.micro_batch_size, gas=layout.gradient_accumulation_steps, dp=dp,
                  bucket=layout.reduce_bucket_size, stage=layout.zero_stage, calibrated_dp=cal.data_parallel_size,
                  share=core_share(cal.cores, dp), measured_micro=cal.micro_batches_measured)
    stage = zero.default_stage if layout.zero_stage is None else layout.zero_stage
    measured = ["compute", "reduce", "optimizer", "engine"] if cal.data_parallel_size > 1 else ["compute", "optimizer", "engine"]
    extrapolated = list(z.extrapolated)
    if cal.cores is not None and dp != cal.data_parallel_size:
        extrapolated.append(f"core sharing at {dp} ranks (measured at {cal.data_parallel_size})")
    return Prediction(layout=replace(layout, zero_stage=stage), parts=None, step_seconds=z.step_seconds,
                      samples_per_second=layout.global_batch / z.step_seconds, terms=z.terms, bubble_fraction=None,
                      stage_compute_seconds=[z.compute_seconds],
                      stage_memory_bytes=[z.memory_bytes] if z.memory_bytes is not None else None,
                      measured_terms=measured, extrapolated=extrapolated,
                      notes=list(cal.notes) + [n for n in z.notes if n not in cal.notes])


def _reduce(cal: Calibration, parameters: float, layout: Layout) -> float:
    dp = layout.data_parallel_size
    if dp < 2:
        return 0.0
    ring = (2 * (dp - 1) / dp) / (2 * (cal.data_parallel_size - 1) / cal.data_parallel_size) \
        if cal.data_parallel_size > 1 else 1.0
    return (cal.reduce_per_bucket * _buckets(parameters, _layout_bucket(cal, layout)) + cal.reduce_per_step) * ring


def _optimizer(cal: Calibration, parts: Sequence[int] | None, s: int, p: int, dp: int) -> float:
    if cal.optimizer_per_parameter is not None and parts is not None and cal.layers is not None:
        return cal.optimizer_per_parameter * _stage_parameters(cal.layers, parts, s, p) / dp
    return cal.optimizer_seconds[min(s, cal.stages - 1)] * cal.data_parallel_size / dp


def _modelled_memory(cal: Calibration, layout: Layout, parts: Sequence[int] | None) -> list[float] | None:
    if cal.layers is None or parts is None:
        return None
    p, dp = layout.stages, layout.data_parallel_size
    out = []
    for s in range(p):
        params = _stage_parameters(cal.layers, parts, s, p)
        state = params * (WEIGHT_BYTES + GRAD_BYTES + ADAM_BYTES / dp)
        acts = sum(cal.layers.activation_bytes_per_sample[parts[s]:parts[s + 1]]) * layout.micro_batch_size
        bucket = 0.0
        if dp > 1:
            bucket = min(params, layout.reduce_bucket_size or DEFAULT_BUCKET) * GRAD_BYTES
        out.append(state + acts * in_flight(p, s, layout.gradient_accumulation_steps) + bucket)
    return out


def _memory_fixed(cal: Calibration, obs: Sequence[Observation]) -> list[float] | None:
    per_stage: list[list[float]] = [[] for _ in range(cal.stages)]
    for o in obs:
        modelled = _modelled_memory(cal, layout_of(o), o.parts or cal.parts)
        if modelled is None:
            return None
        for s in range(cal.stages):
            peak = o.stage[s].peak_memory_bytes
            if peak is not None:
                per_stage[s].append(peak - modelled[s])
    if not all(per_stage):
        return None
    return [float(statistics.median(v)) for v in per_stage]


def stage_memory(cal: Calibration, layout: Layout, parts: Sequence[int] | None) -> list[float] | None:
    """Predicted peak bytes per stage; None where the study measured no layers or no peaks."""
    modelled = _modelled_memory(cal, layout, parts)
    if modelled is None or cal.memory_fixed_bytes is None:
        return None
    fixed = cal.memory_fixed_bytes
    mid = statistics.fmean(fixed[1:-1]) if len(fixed) > 2 else statistics.fmean(fixed)
    out = []
    for s, m in enumerate(modelled):
        f = fixed[0] if s == 0 else fixed[-1] if s == layout.stages - 1 else mid
        out.append(m + f)
    return out
