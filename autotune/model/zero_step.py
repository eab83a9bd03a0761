"""The model of one plain DeepSpeedEngine step (ZeRO stage 0-3, no pipeline), calibrated from a
study's own trials (issue 42). autotune/model/step_model.py calls it for a study whose trials
all ran a plain engine; the pipeline's replay has nothing to do here.

A step of GAS m micro-batches of size b on dp ranks at ZeRO stage z:

    step = m x (k_z x work(b) / share + comm_micro_z + engine_micro_z)
           + comm_step_z + optimizer_z + engine_step_z

- work(b): the forward and backward work per micro-batch (`compute_cpu_seconds` on a CPU), fitted
  over the micro-batches of the stage with the most of them (`fits.GrowthFit`); k_z: each other
  stage's measured work over it at the same micro-batch (ZeRO-2's gradient hooks and ZeRO-3's
  gathers add work inside the forward and backward: 1.5x and 3x on the tiny decoder here);
  share: the core each rank gets where more ranks than cores share a CPU;
- communication, split by where DeepSpeed 0.19.8 runs it (docs/zero-facts.md):
  ZeRO-0 all-reduces the gradients and ZeRO-1 reduces them and gathers the updated partitions
  once per step, at the accumulation boundary; ZeRO-2 reduces in the backward of every
  micro-batch and gathers once per step (the CSV's `gather_seconds` tells the two apart);
  ZeRO-3 gathers the parameters and reduces the gradients in every micro-batch. Another dp is
  scaled by the ring's (dp-1)/dp; a stage the study never ran takes the measured seconds per
  unit of volume (the ZeRO paper's counts, in units of the parameters: ZeRO-0/1 2 per step,
  ZeRO-2 1 per micro-batch + 1 per step, ZeRO-3 3 per micro-batch), and says so;
- reduce_bucket_size (acting at ZeRO-1 to 3 with dp > 1 on a plain engine, core/dsconfig.py): a
  cost per extra reduction call (per step at ZeRO-1, per micro-batch at ZeRO-2/3), where the
  study ran two bucket counts at one stage; else the same at any bucket, and said;
- the optimizer step: per stage, in proportion to the parameters a rank updates (1/dp from
  ZeRO-1 on);
- the engine: what each stage's measured step holds beyond those, per micro-batch (a stage
  measured at one GAS) or per micro-batch and per step (at two or more);
- memory (a GPU with fp16/bf16 only): the model states per rank (autotune/model/zero_memory.py,
  DeepSpeed's own estimators' counts) plus what the measured peaks hold beyond them, fixed and
  per sample. On a CPU a warm worker's peak resident set holds every earlier trial's, and the
  training is fp32, which the estimators do not cover: no memory is predicted there.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from autotune.core.dsconfig import DEEPSPEED_DEFAULT_BUCKET, reduce_bucket_acts
from autotune.model.fits import GrowthFit, fit_growth, nonnegative_least_squares
from autotune.model.observations import Observation
from autotune.model.zero_memory import model_states_bytes

ZERO_STAGES = (0, 1, 2, 3)
VOLUME_PER_MICRO = {0: 0.0, 1: 0.0, 2: 1.0, 3: 3.0}
VOLUME_PER_STEP = {0: 2.0, 1: 2.0, 2: 1.0, 3: 0.0}
"""Communication per rank in units of the parameters x (dp-1)/dp (the ZeRO paper's counts: an
all-reduce moves 2, a reduce-scatter or an all-gather 1)."""


@dataclass(frozen=True, slots=True)
class StageTerms:
    """What the study measured of one ZeRO stage, at the study's dp."""

    stage: int
    trials: list[int]
    work_factor: float
    """The stage's forward+backward work over the reference stage's at the same micro-batch."""
    comm_per_micro: float
    comm_per_step: float
    buckets: int
    """Reduction calls per round (per micro-batch at ZeRO-2/3, per step at ZeRO-1) it was measured at."""
    optimizer_all: float
    """The optimizer step over every parameter on one rank (the measured one times the partition)."""
    engine_per_micro: float
    engine_per_step: float


@dataclass(frozen=True, slots=True)
class ZeroMemory:
    """Peak bytes per rank beyond the model states: fixed + per_sample x micro-batch."""

    fixed: float
    per_sample: float
    kind: str


@dataclass(frozen=True, slots=True)
class ZeroTerms:
    reference_stage: int
    default_stage: int
    """The stage a layout that names none runs: the study's best trial's."""
    work: GrowthFit
    stages: dict[int, StageTerms]
    seconds_per_volume: float
    """Measured communication per unit of volume (VOLUME_*) at the study's dp: for a stage it never ran."""
    reduce_per_bucket: float
    parameters: int | None
    memory: ZeroMemory | None
    memory_missing: str | None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ZeroStep:
    step_seconds: float
    terms: dict[str, float]
    compute_seconds: float
    memory_bytes: float | None
    extrapolated: list[str]
    notes: list[str]


def is_plain(observations: Sequence[Observation]) -> bool:
    """Every trial ran a plain engine with a known ZeRO stage: this model, not the pipeline's."""
    return bool(observations) and all(o.plain_engine and o.zero_stage in ZERO_STAGES and o.stages == 1
                                      for o in observations)


def same_settings(observations: Sequence[Observation]) -> tuple[list[Observation], str | None]:
    """The trials that ran the ZeRO settings most trials ran besides the stage and the bucket, and
    a note naming the others: a knob trial of the sweep ran another `overlap_comm` or size, a step
    the terms here have no term for, so it is not calibrated on (tests/test_zero_model.py)."""
    counts: dict[tuple, int] = {}
    for o in observations:
        counts[o.zero_settings] = counts.get(o.zero_settings, 0) + 1
    common = max(counts, key=lambda k: counts[k])
    kept = [o for o in observations if o.zero_settings == common]
    left = [o for o in observations if o.zero_settings != common]
    if not left:
        return kept, None
    usual = dict(common)
    what = sorted({k.removeprefix("zero_optimization.") for o in left for k, v in o.zero_settings
                   if usual.get(k) != v})
    return kept, (f"trial(s) {', '.join(str(o.trial) for o in left)} ran other ZeRO settings "
                  f"({', '.join(what)}): not calibrated on (the model has no term for them)")


def ring(dp: int) -> float:
    return (dp - 1) / dp if dp > 1 else 0.0


def buckets(parameters: int | None, bucket: int | None, stage: int, dp: int) -> int:
    """Reduction calls per round: the parameters over the bucket where it acts (core/dsconfig.py)."""
    if not parameters or not reduce_bucket_acts(stage, dp, pipeline=False):
        return 1
    return max(1, math.ceil(parameters / (bucket or DEEPSPEED_DEFAULT_BUCKET)))


def _split_comm(o: Observation) -> tuple[float, float]:
    """(per micro-batch, per step) seconds of the trial's communication, by DeepSpeed's stage."""
    comm, m = o.stage[0].reduce_seconds, o.gradient_accumulation_steps
    gather = o.stage[0].gather_seconds or 0.0
    z = o.zero_stage
    if z == 3:
        return comm / m, 0.0
    if z == 2:
        return max(0.0, comm - gather) / m, min(gather, comm)
    return 0.0, comm


def calibrate_zero(obs: Sequence[Observation], *, share: float, parameters: int | None) -> ZeroTerms:
    """Fit the terms on one study's plain-engine trials (one dp: the caller keeps the first's)."""
    by_stage: dict[int, list[Observation]] = {}
    for o in obs:
        by_stage.setdefault(int(o.zero_stage or 0), []).append(o)
    ref = max(by_stage, key=lambda z: (len({o.micro_batch_size for o in by_stage[z]}), len(by_stage[z])))
    best = max(obs, key=lambda o: o.samples_per_second)
    notes: list[str] = []

    def work_per_micro(o: Observation) -> float:
        return o.stage[0].work_seconds / o.gradient_accumulation_steps

    ref_obs = by_stage[ref]
    work = fit_growth([o.micro_batch_size for o in ref_obs], [work_per_micro(o) for o in ref_obs])
    dp = obs[0].data_parallel_size

    volumes = []
    for o in obs:
        v = (VOLUME_PER_MICRO[int(o.zero_stage or 0)] * o.gradient_accumulation_steps
             + VOLUME_PER_STEP[int(o.zero_stage or 0)])
        if v > 0 and dp > 1:
            volumes.append(o.stage[0].reduce_seconds / v)
    per_volume = float(statistics.median(volumes)) if volumes else 0.0

    per_bucket = _bucket_slope(obs, parameters)
    if per_bucket is None:
        per_bucket = 0.0
        if dp > 1 and any(reduce_bucket_acts(z, dp, pipeline=False) for z in by_stage):
            notes.append("the reduction was measured at one bucket count per stage: another reduce_bucket_size "
                         "is predicted to cost the same (a trial with a smaller bucket measures it)")

    stages: dict[int, StageTerms] = {}
    for z, group in sorted(by_stage.items()):
        factor = float(statistics.median([work_per_micro(o) / work(o.micro_batch_size) for o in group])) \
            if z != ref else 1.0
        split = [_split_comm(o) for o in group]
        counts = [buckets(parameters, o.reduce_bucket_size, z, o.data_parallel_size) for o in group]
        n = int(statistics.median_low(counts))
        # each trial's reduction brought to the median bucket count, so the medians agree
        per_micro = float(statistics.median([a - (per_bucket * (c - n) if z >= 2 else 0.0)
                                             for (a, _), c in zip(split, counts, strict=True)]))
        per_step = float(statistics.median([b - (per_bucket * (c - n) if z == 1 else 0.0)
                                            for (_, b), c in zip(split, counts, strict=True)]))
        optimizer_all = float(statistics.median([o.stage[0].optimizer_seconds * (o.data_parallel_size if z else 1)
                                                 for o in group]))
        engine_micro, engine_step = _engine(group, factor, work, share)
        stages[z] = StageTerms(stage=z, trials=[o.trial for o in group], work_factor=factor,
                               comm_per_micro=max(0.0, per_micro), comm_per_step=max(0.0, per_step), buckets=n,
                               optimizer_all=optimizer_all, engine_per_micro=engine_micro, engine_per_step=engine_step)
    memory, missing = _memory(obs, parameters)
    return ZeroTerms(reference_stage=ref, default_stage=int(best.zero_stage or 0), work=work, stages=stages,
                     seconds_per_volume=per_volume, reduce_per_bucket=per_bucket, parameters=parameters,
                     memory=memory, memory_missing=missing, notes=notes)


def _bucket_slope(obs: Sequence[Observation], parameters: int | None) -> float | None:
    """Seconds per extra reduction call, from a stage measured at two or more bucket counts."""
    slopes = []
    for z in (1, 2, 3):
        group = [o for o in obs if o.zero_stage == z]
        counts = [buckets(parameters, o.reduce_bucket_size, z, o.data_parallel_size) for o in group]
        if len(set(counts)) < 2:
            continue
        ys = [(_split_comm(o)[0] if z >= 2 else _split_comm(o)[1]) for o in group]
        coef = nonnegative_least_squares(np.array([[c, 1.0] for c in counts]), np.array(ys))
        slopes.append(float(coef[0]))
    return float(statistics.median(slopes)) if slopes else None


def _engine(group: Sequence[Observation], factor: float, work: GrowthFit, share: float) -> tuple[float, float]:
    """A stage's own time beyond the modelled terms: per micro-batch, and per step where its
    trials ran two or more GAS (one GAS cannot tell them apart: all of it per micro-batch)."""
    rows, ys = [], []
    for o in group:
        m = o.gradient_accumulation_steps
        modelled = (m * factor * work(o.micro_batch_size) / share + o.stage[0].reduce_seconds
                    + o.stage[0].optimizer_seconds)
        rows.append([float(m), 1.0])
        ys.append(max(0.0, o.step_seconds - modelled))
    if len({r[0] for r in rows}) >= 2:
        coef = nonnegative_least_squares(np.array(rows), np.array(ys))
        return float(coef[0]), float(coef[1])
    return float(statistics.median([y / r[0] for r, y in zip(rows, ys, strict=True)])), 0.0


def _memory(obs: Sequence[Observation], parameters: int | None) -> tuple[ZeroMemory | None, str | None]:
    kind = obs[0].peak_memory_kind
    if obs[0].device == "cpu":
        return None, ("peak memory not modelled on a CPU: a warm worker's peak resident set holds every earlier "
                      "trial's, and fp32 training is not what DeepSpeed's estimators count (docs/zero-facts.md)")
    if not parameters:
        return None, "peak memory not modelled: the study did not record the model's parameter count"
    if not all(o.mixed_precision for o in obs):
        return None, "peak memory not modelled: fp32 training, which DeepSpeed's estimators do not count"
    pts = [(o.micro_batch_size, o.stage[0].peak_memory_bytes
            - model_states_bytes(parameters, int(o.zero_stage or 0), o.data_parallel_size))
           for o in obs if o.stage[0].peak_memory_bytes is not None]
    if len({b for b, _ in pts}) < 2:
        return None, "peak memory not modelled: the study measured peaks at one micro-batch size only"
    coef = nonnegative_least_squares(np.array([[1.0, float(b)] for b, _ in pts]),
                                     np.array([max(0.0, y) for _, y in pts]))
    return ZeroMemory(fixed=float(coef[0]), per_sample=float(coef[1]), kind=kind or "cuda_max_allocated"), None


def step(terms: ZeroTerms, *, micro: int, gas: int, dp: int, bucket: int | None, stage: int | None,
         calibrated_dp: int, share: float, measured_micro: Sequence[int]) -> ZeroStep:
    """One layout's step, by term."""
    z = terms.default_stage if stage is None else stage
    extrapolated: list[str] = []
    notes = list(terms.notes)
    scale = ring(dp) / ring(calibrated_dp) if calibrated_dp > 1 else (1.0 if dp == 1 else math.nan)
    st = terms.stages.get(z)
    if st is None:  # never run: the reference stage's work and engine, the volume rule's communication
        ref = terms.stages[terms.reference_stage]
        factor, engine_micro, engine_step = 1.0, ref.engine_per_micro, ref.engine_per_step
        comm_micro = terms.seconds_per_volume * VOLUME_PER_MICRO[z]
        comm_step = terms.seconds_per_volume * VOLUME_PER_STEP[z]
        optimizer_all = ref.optimizer_all
        extrapolated.append(f"ZeRO-{z} never ran in the study: its forward, backward and engine time are "
                            f"ZeRO-{terms.reference_stage}'s, its communication the measured seconds per unit "
                            "of volume times the stage's volume (docs/model.md)")
        n_measured = buckets(terms.parameters, bucket, z, calibrated_dp)
    else:
        factor, engine_micro, engine_step = st.work_factor, st.engine_per_micro, st.engine_per_step
        comm_micro, comm_step, optimizer_all, n_measured = st.comm_per_micro, st.comm_per_step, st.optimizer_all, st.buckets
    if not math.isfinite(scale):
        scale = 1.0
        extrapolated.append(f"dp {dp} from a study at dp 1: no communication was measured, so none is predicted")
    n = buckets(terms.parameters, bucket, z, dp)
    extra = terms.reduce_per_bucket * (n - n_measured)
    if z >= 2:
        comm_micro = max(0.0, comm_micro + extra)
    elif z == 1:
        comm_step = max(0.0, comm_step + extra)
    compute = gas * factor * terms.work(micro) / share
    comm = (gas * comm_micro + comm_step) * scale
    optimizer = optimizer_all / (dp if z else 1)
    engine = gas * engine_micro + engine_step
    total = compute + comm + optimizer + engine
    lo, hi = min(measured_micro), max(measured_micro)
    if micro > hi or micro < lo:
        factor_x = micro / hi if micro > hi else lo / micro
        extrapolated.append(f"micro-batch {micro} is {factor_x:.3g}x {'beyond the largest' if micro > hi else 'below the smallest'} "
                            f"measured ({hi if micro > hi else lo})")
    if dp != calibrated_dp:
        extrapolated.append(f"dp {dp} (calibrated at {calibrated_dp}): communication scaled by the ring's (dp-1)/dp, "
                            "the optimizer step by the partition")
    memory = None
    if terms.memory is not None and terms.parameters:
        memory = (model_states_bytes(terms.parameters, z, dp) + terms.memory.fixed
                  + terms.memory.per_sample * micro)
    elif terms.memory_missing:
        notes.append(terms.memory_missing)
    return ZeroStep(step_seconds=total, terms={"compute": compute, "reduce": comm, "optimizer": optimizer,
                                               "engine": engine},
                    compute_seconds=compute, memory_bytes=memory, extrapolated=extrapolated, notes=notes)
