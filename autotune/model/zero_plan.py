"""`autotune plan` for a plain DeepSpeedEngine study: rank the ZeRO layouts on N GPUs (issue 42).

The layouts: dp = N (no pipeline), every ZeRO stage 0-3, every power-of-two micro-batch whose
GAS keeps the global batch, at the best trial's reduce_bucket_size. Each is predicted:

- on the study's own device (a GPU study, no --hardware): the calibrated model
  (autotune/model/zero_step.py) at dp = N;
- onto a preset: compute is the model's 6 x parameters x tokens FLOPs per sample at the preset's
  achieved FLOP/s (at least the engine's own host time per micro-batch, measured at the stage on
  the study's host); communication is each stage's volume (zero_step.VOLUME_*: in half-precision
  parameters x (dp-1)/dp) over the slowest link of the group (NVLink within a node, the network
  across nodes) plus a latency per reduction call and ring step; the optimizer is the share of
  Adam's update a rank makes (1/dp from ZeRO-1 on) through HBM; memory is the model states of
  the stage (autotune/model/zero_memory.py, DeepSpeed's estimators' counts), the saved
  activations of a decoder layer (Korthikanti et al. 2022: s x h x (34 + 5 a s / h) bytes per
  sample per layer in half precision, no recompute) and the preset's context bytes.

The out-of-memory cliff is the model's: a layout over the device's memory less HEADROOM is
listed as not fitting, with its overflow, never ranked.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autotune.core.errors import UserError
from autotune.core.space import powers_of_two
from autotune.model.plan_types import HEADROOM, Cluster, Plan, PlannedLayout
from autotune.model.step_model import Layout, predict
from autotune.model.zero_memory import model_states_bytes
from autotune.model.zero_step import VOLUME_PER_MICRO, VOLUME_PER_STEP, ZERO_STAGES, buckets, ring

if TYPE_CHECKING:
    from autotune.model.study_model import StudyModel

HALF = 2
ADAM_UPDATE_BYTES = 32
"""Bytes one parameter's Adam update moves through memory (autotune/model/plan.py's figure)."""
FIXED_BUCKET = int(5e8)
"""DeepSpeed's allgather_bucket_size default (the updated partitions' gathers at ZeRO-1/2) and
ZeRO-0's fixed all-reduce buffer: elements per call."""


def plan_plain(model: StudyModel, cluster: Cluster, *, stages: int | None = None, dp: int | None = None) -> Plan:
    cal = model.calibration
    zero = cal.zero
    assert zero is not None
    if stages not in (None, 1):
        raise UserError(f"--stages {stages}: the study ran a plain DeepSpeedEngine (no pipeline); its layouts are "
                        "ZeRO stages over data-parallel ranks only")
    if dp is not None and dp != cluster.gpus:
        raise UserError(f"--dp {dp}: a plain engine runs every GPU data-parallel (dp = --gpus {cluster.gpus})")
    d = cluster.gpus
    if cluster.global_batch % d:
        raise UserError(f"global batch {cluster.global_batch} does not split over {d} data-parallel GPUs: pass "
                        "--global-batch as a multiple of --gpus")
    hw = cluster.hardware
    if hw is None and cal.device == "cpu":
        raise UserError("the study ran on a CPU: a plan for GPUs needs --hardware (a100, h100, h200 or a TOML file)")
    notes: list[str] = ["not a pipeline job: every layout is ZeRO over data-parallel ranks, no stages, no bubble"]
    scaled: list[str] = []
    shape = _shape(model)
    if hw is not None:
        if cal.device == "cpu":
            notes.append(f"extrapolation: the study ran on a CPU; every time and byte below is scaled from the "
                         f"{hw.name} figures ({hw.file}), not measured on a GPU")
        if shape is None or not zero.parameters:
            raise UserError(f"{model.root}: a plan onto other hardware needs the model's parameter count, sequence "
                            "length and shape, and the study recorded them only for the built-in workload's presets")
        scaled += [f"compute at {hw.peak_flops / 1e12:,.0f} TFLOP/s x {hw.model_flops_utilization:g} utilisation "
                   "(preset, the utilisation assumed)",
                   f"collectives at {hw.nvlink_bandwidth / 1e9:,.0f} GB/s NVLink, {hw.network_bandwidth / 1e9:,.0f} GB/s "
                   "across nodes (preset)",
                   f"memory {hw.memory_bytes / 1e9:,.0f} GB per GPU, {hw.context_bytes / 1e9:g} GB of it outside the "
                   "model (preset, assumed); activations from the decoder's shape (Korthikanti et al.)"]
    best = max(model.observations, key=lambda o: o.samples_per_second)
    per_replica = cluster.global_batch // d
    out: list[PlannedLayout] = []
    for z in ZERO_STAGES:
        for micro in [b for b in powers_of_two(1, per_replica) if per_replica % b == 0]:
            lay = Layout(micro_batch_size=micro, gradient_accumulation_steps=per_replica // micro, stages=1,
                         data_parallel_size=d, reduce_bucket_size=best.reduce_bucket_size, zero_stage=z)
            out.append(_on_target(model, lay, cluster, shape) if hw is not None else _measured(model, lay, cluster))
    if hw is None and all(not math.isfinite(x.stage_memory_bytes[0]) for x in out):
        notes.append(zero.memory_missing or "peak memory not modelled")
    ranked = sorted((x for x in out if x.fits), key=lambda x: -x.samples_per_second)
    too_big = sorted((x for x in out if not x.fits), key=lambda x: x.overflow[1])
    return Plan(cluster=cluster, ranked=ranked, too_big=too_big, notes=notes, scaled=scaled)


def _measured(model: StudyModel, lay: Layout, cluster: Cluster) -> PlannedLayout:
    p = predict(model.calibration, lay)
    limit = cluster.device_memory * (1 - HEADROOM) if cluster.device_memory else None
    memory = p.stage_memory_bytes or [math.nan]
    return PlannedLayout(layout=lay, parts=[], samples_per_second=p.samples_per_second, step_seconds=p.step_seconds,
                         bubble_fraction=None, stage_memory_bytes=memory,
                         memory_limit_bytes=limit if math.isfinite(memory[0]) else None, terms=p.terms)


def _shape(model: StudyModel) -> tuple[int, int, int, int] | None:
    """(sequence length, hidden size, heads, layers) of the built-in preset the study ran."""
    wl = model.workload or {}
    if not wl.get("preset") or wl.get("model"):
        return None
    from autotune.rank.workload.presets import PRESETS

    preset = PRESETS.get(wl["preset"])
    if preset is None:
        return None
    seq = next((o.seq_length for o in model.observations if o.seq_length), None) or preset.seq_length
    return seq, preset.hidden_size, preset.num_heads, preset.num_layers


def activation_bytes_per_sample(seq: int, hidden: int, heads: int, layers: int) -> float:
    """A decoder's saved activations per sample in half precision, no recompute (Korthikanti et al.)."""
    return layers * seq * hidden * (34 + 5 * heads * seq / hidden)


def _on_target(model: StudyModel, lay: Layout, cluster: Cluster, shape: tuple[int, int, int, int] | None) -> PlannedLayout:
    cal = model.calibration
    zero, hw = cal.zero, cluster.hardware
    assert zero is not None and hw is not None and shape is not None and zero.parameters
    seq, hidden, heads, layers = shape
    z, b, m, d = int(lay.zero_stage or 0), lay.micro_batch_size, lay.gradient_accumulation_steps, lay.data_parallel_size
    psi = zero.parameters
    measured = zero.stages.get(z) or zero.stages[zero.reference_stage]
    flops = 6.0 * psi * b * seq
    compute = max(flops / hw.achieved_flops, measured.engine_per_micro)  # the host issues each micro-batch's kernels
    across = d > cluster.gpus_per_node
    bandwidth, latency = (hw.network_bandwidth, hw.network_latency) if across else (hw.nvlink_bandwidth, hw.nvlink_latency)
    unit = psi * HALF * ring(d) / bandwidth  # one volume unit: the half-precision parameters, ring-shared
    reduce_calls = buckets(psi, lay.reduce_bucket_size, z, d)
    fixed_calls = max(1, math.ceil(psi / FIXED_BUCKET))
    calls_micro = {0: 0, 1: 0, 2: reduce_calls, 3: reduce_calls + 2 * layers}[z]
    calls_step = {0: fixed_calls, 1: reduce_calls + fixed_calls, 2: fixed_calls, 3: 0}[z]
    steps = 2 * (d - 1) if d > 1 else 0
    comm = (m * (VOLUME_PER_MICRO[z] * unit + calls_micro * steps * latency)
            + VOLUME_PER_STEP[z] * unit + calls_step * steps * latency) if d > 1 else 0.0
    optimizer = psi / (d if z else 1) * ADAM_UPDATE_BYTES / hw.memory_bandwidth
    engine = measured.engine_per_step
    step = m * compute + comm + optimizer + engine
    largest = 12 * hidden * hidden  # a decoder layer's weights (attention 4h^2, MLP about 8h^2)
    acts = activation_bytes_per_sample(seq, hidden, heads, layers) * b
    memory = model_states_bytes(psi, z, d, largest_layer_params=largest) + acts + hw.context_bytes
    terms = {"compute": m * compute, "reduce": comm, "optimizer": optimizer, "engine": engine}
    return PlannedLayout(layout=lay, parts=[], samples_per_second=lay.global_batch / step, step_seconds=step,
                         bubble_fraction=None, stage_memory_bytes=[memory],
                         memory_limit_bytes=hw.memory_bytes * (1 - HEADROOM), terms=terms)
