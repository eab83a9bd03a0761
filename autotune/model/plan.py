"""`autotune plan`: rank the layouts of the study's model on a cluster of N GPUs.

The layouts: every stage count that divides N (at most one stage per layer) with dp = N /
stages, every power-of-two micro-batch whose GAS keeps the global batch, checkpointing off
and on, each with the partition that balances the modelled per-layer time. Each is replayed
through DeepSpeed's schedule (`schedule.replay`) with durations for the target device:

- compute: the model's 6 x parameters x tokens FLOPs per sample (forward 2, backward 4) at
  the preset's peak FLOP/s x its assumed utilisation, split over the layers as the study
  measured their work (so a cheap embedding stays cheap and attention keeps its share);
  on a study measured on the target itself (`hardware=None`) the measured fits are used;
- point-to-point: the stage output (micro x sequence x hidden x 2 bytes) over NVLink within a
  node and InfiniBand across nodes (DeepSpeed places ranks data-parallel-fastest: stage s
  holds ranks s*dp .. s*dp + dp - 1);
- the reduction: a ring all-reduce of the stage's half-precision gradients, 2(dp-1)/dp of
  their bytes over the slowest link of the group, plus a latency per bucket and ring step;
- the optimizer: ZeRO-1's share of Adam's update, about 32 bytes per parameter moved
  through HBM;
- the engine: DeepSpeed's own host time per instruction and per step, measured on the study's
  host; an instruction takes at least its host time (the kernels are issued from Python);
- memory: half-precision weights and gradients, fp32 master weights and Adam's moments
  partitioned over dp, the saved activations (measured in fp32 here, halved) times the
  micro-batches in flight, the bucket, and the preset's context bytes.

Everything taken from a preset is marked "preset"; a CPU study planned onto GPUs is an
extrapolation, and the plan says so first.
"""

from __future__ import annotations

import math

from autotune.core.errors import UserError
from autotune.core.partition import balanced_parts, in_flight
from autotune.core.space import powers_of_two
from autotune.model.plan_types import HEADROOM, Cluster, Plan, PlannedLayout
from autotune.model.schedule import StageTimes, replay
from autotune.model.step_model import DEFAULT_BUCKET, Calibration, Layout, predict
from autotune.model.study_model import StudyModel
from autotune.model.zero_plan import plan_plain

__all__ = ["Cluster", "Plan", "PlannedLayout", "plan", "reason"]

HALF, FP32 = 2, 4
ADAM_UPDATE_BYTES = 32
"""Bytes one parameter's Adam update moves through memory: read fp32 master, two moments and
the gradient, write them back and the half-precision weight."""


def model_shape(model: StudyModel) -> tuple[int | None, int | None, str]:
    """(sequence length, hidden size, how the hidden size is known)."""
    seq = next((o.seq_length for o in model.observations if o.seq_length), None)
    wl = model.workload or {}
    if wl.get("preset") and not wl.get("model"):
        from autotune.rank.workload.presets import PRESETS

        preset = PRESETS.get(wl["preset"])
        if preset is not None:
            return seq or preset.seq_length, preset.hidden_size, f"the {preset.name} preset's"
    layers = model.calibration.layers
    if layers is None:
        return seq, None, ""
    biggest = max(layers.parameters)
    return seq, max(1, round(math.sqrt(biggest / 12))), "estimated from the largest layer's parameters (12 h^2)"


def plan(model: StudyModel, cluster: Cluster, *, stages: int | None = None, dp: int | None = None) -> Plan:
    """Every layout of `cluster`, predicted; a UserError where the cluster cannot hold the job."""
    cal = model.calibration
    if cal.zero is not None:
        return plan_plain(model, cluster, stages=stages, dp=dp)
    if cal.layers is None:
        from autotune.rank.layer_costs import HOW_TO_MEASURE

        raise UserError(f"{model.root}: planning a layout needs each layer's cost, and the study measured none: "
                        f"{HOW_TO_MEASURE}")
    n_layers = len(cal.layers.names)
    if cluster.gpus < 1 or cluster.gpus_per_node < 1:
        raise UserError("--gpus and --gpus-per-node must be >= 1")
    if stages is not None and dp is not None and stages * dp != cluster.gpus:
        raise UserError(f"--stages {stages} x --dp {dp} = {stages * dp} GPUs, not the --gpus {cluster.gpus}")
    counts = [s for s in range(1, min(n_layers, cluster.gpus) + 1) if cluster.gpus % s == 0]
    if stages is not None:
        if stages not in counts:
            raise UserError(f"--stages {stages}: must divide --gpus {cluster.gpus} and be at most the "
                            f"{n_layers} layers")
        counts = [stages]
    if dp is not None:
        if cluster.gpus % dp:
            raise UserError(f"--dp {dp} does not divide --gpus {cluster.gpus}")
        counts = [c for c in counts if c == cluster.gpus // dp]
        if not counts:
            raise UserError(f"--dp {dp}: {cluster.gpus // dp} stages for {n_layers} layers")
    counts = [c for c in counts if cluster.global_batch % (cluster.gpus // c) == 0]
    if not counts:
        raise UserError(f"global batch {cluster.global_batch} splits over no data-parallel degree of {cluster.gpus} "
                        "GPUs: pass --global-batch as a multiple of the dp you want")
    notes: list[str] = []
    scaled: list[str] = []
    hw = cluster.hardware
    if hw is None and cal.device == "cpu":
        raise UserError("the study ran on a CPU: a plan for GPUs needs --hardware (a100, h100, h200 or a TOML file)")
    if hw is not None:
        if cal.device == "cpu":
            notes.append(f"extrapolation: the study ran on a CPU; every time and byte below is scaled from "
                         f"the {hw.name} figures ({hw.file}), not measured on a GPU")
        scaled += [f"compute at {hw.peak_flops / 1e12:,.0f} TFLOP/s x {hw.model_flops_utilization:g} utilisation "
                   "(preset, the utilisation assumed)",
                   f"transfers at {hw.nvlink_bandwidth / 1e9:,.0f} GB/s NVLink, {hw.network_bandwidth / 1e9:,.0f} GB/s "
                   "across nodes (preset)", f"memory {hw.memory_bytes / 1e9:,.0f} GB per GPU, "
                   f"{hw.context_bytes / 1e9:g} GB of it outside the model (preset, assumed)"]
    seq, hidden, how = model_shape(model)
    if hw is not None and (seq is None or hidden is None):
        raise UserError(f"{model.root}: the study recorded no sequence length (not a token model?): a plan onto "
                        "other hardware needs the tokens per sample")
    if hidden is not None and how.startswith("estimated"):
        notes.append(f"hidden size {hidden}: {how}")
    out: list[PlannedLayout] = []
    for p in counts:
        d = cluster.gpus // p
        per_replica = cluster.global_batch // d
        for micro in [b for b in powers_of_two(1, per_replica) if per_replica % b == 0]:
            for ckpt in (0, 1):
                lay = Layout(micro_batch_size=micro, gradient_accumulation_steps=per_replica // micro, stages=p,
                             data_parallel_size=d, reduce_bucket_size=_bucket(model), checkpoint_interval=ckpt)
                out.append(_on_target(model, lay, cluster, seq, hidden) if hw is not None
                           else _measured_device(model, lay, cluster))
    ranked = sorted((x for x in out if x.fits), key=lambda x: -x.samples_per_second)
    too_big = sorted((x for x in out if not x.fits), key=lambda x: x.overflow[1])
    return Plan(cluster=cluster, ranked=ranked, too_big=too_big, notes=notes, scaled=scaled)


def _bucket(model: StudyModel) -> int | None:
    best = max(model.observations, key=lambda o: o.samples_per_second)
    return best.reduce_bucket_size


def _measured_device(model: StudyModel, lay: Layout, cluster: Cluster) -> PlannedLayout:
    p = predict(model.calibration, lay)
    limit = cluster.device_memory * (1 - HEADROOM) if cluster.device_memory else None
    return PlannedLayout(layout=lay, parts=p.parts or [], samples_per_second=p.samples_per_second,
                         step_seconds=p.step_seconds, bubble_fraction=p.bubble_fraction,
                         stage_memory_bytes=p.stage_memory_bytes or [0.0] * lay.stages, memory_limit_bytes=limit,
                         terms=p.terms)


def _on_target(model: StudyModel, lay: Layout, cluster: Cluster, seq: int | None, hidden: int | None) -> PlannedLayout:
    cal: Calibration = model.calibration
    hw = cluster.hardware
    assert hw is not None and cal.layers is not None and seq is not None and hidden is not None
    layers = cal.layers
    b, m, p, d = lay.micro_batch_size, lay.gradient_accumulation_steps, lay.stages, lay.data_parallel_size
    total_params = sum(layers.parameters)
    flops = 6.0 * total_params * b * seq  # per micro-batch, forward 2 + backward 4
    work = [layers.forward[i](b) + layers.backward[i](b) for i in range(len(layers.names))]
    share_total = sum(work) or 1.0
    seconds = [flops * w / share_total / hw.achieved_flops for w in work]
    fwd_share = [layers.forward[i](b) / w if w else 1 / 3 for i, w in enumerate(work)]
    parts = balanced_parts(seconds, p)
    times = []
    for s in range(p):
        lo, hi = parts[s], parts[s + 1]
        f = sum(seconds[i] * fwd_share[i] for i in range(lo, hi))
        bw = sum(seconds[i] * (1 - fwd_share[i]) for i in range(lo, hi))
        # the host issues each instruction's kernels: the engine's own time per forward and backward
        # (measured on this host) bounds an instruction whose kernels take less
        host = cal.overhead_per_micro / 2
        times.append(StageTimes(forward=max(f, host), backward=max(bw + (f if lay.checkpoint_interval else 0.0), host)))
    nodes_of = [[(s * d + k) // cluster.gpus_per_node for k in range(d)] for s in range(p)]
    transfers = []
    for s in range(p - 1):
        across = any(a != c for a, c in zip(nodes_of[s], nodes_of[s + 1], strict=True))
        bw_link, lat = (hw.network_bandwidth, hw.network_latency) if across else (hw.nvlink_bandwidth, hw.nvlink_latency)
        transfers.append(lat + b * seq * hidden * HALF / bw_link)
    run = replay(times, m, transfers, replicas=d)
    stage_params = [float(sum(layers.parameters[parts[s]:parts[s + 1]])) for s in range(p)]
    reduce, opt, memory = [], [], []
    for s in range(p):
        params = stage_params[s]
        if d > 1:
            across = len(set(nodes_of[s])) > 1
            bw_link, lat = (hw.network_bandwidth, hw.network_latency) if across else (hw.nvlink_bandwidth, hw.nvlink_latency)
            buckets = max(1, math.ceil(params / (lay.reduce_bucket_size or DEFAULT_BUCKET)))
            reduce.append(2 * (d - 1) / d * params * HALF / bw_link + buckets * 2 * (d - 1) * lat)
        else:
            reduce.append(0.0)
        opt.append(params / d * ADAM_UPDATE_BYTES / hw.memory_bandwidth)
        acts_full = sum(layers.activation_bytes_per_sample[parts[s]:parts[s + 1]]) * b * HALF / FP32
        if lay.checkpoint_interval:  # only each layer's input stays, plus one layer's activations in the recompute
            kept = (parts[s + 1] - parts[s]) * b * seq * hidden * HALF
            biggest = max(layers.activation_bytes_per_sample[parts[s]:parts[s + 1]]) * b * HALF / FP32
            acts = kept * in_flight(p, s, m) + biggest
        else:
            acts = acts_full * in_flight(p, s, m)
        state = params * (HALF + HALF + (FP32 + 8) / d)
        bucket = min(params, lay.reduce_bucket_size or DEFAULT_BUCKET) * HALF if d > 1 else 0.0
        memory.append(state + acts + bucket + hw.context_bytes)
    ends = [run.stage_end_seconds[s] + reduce[s] + opt[s] for s in range(p)]
    slow = max(range(p), key=lambda s: ends[s])
    engine = cal.overhead_per_step + cal.overhead_per_micro * m  # the engine's Python: measured on this host
    step = ends[slow] + cal.overhead_per_step
    terms = {"compute": run.stage_busy_seconds[slow], "transfer": run.stage_transfer_seconds[slow],
             "wait": run.stage_wait_seconds[slow], "reduce": reduce[slow], "optimizer": opt[slow], "engine": engine}
    return PlannedLayout(layout=lay, parts=list(parts), samples_per_second=lay.global_batch / step, step_seconds=step,
                         bubble_fraction=run.bubble_fraction, stage_memory_bytes=memory,
                         memory_limit_bytes=hw.memory_bytes * (1 - HEADROOM), terms=terms)


def reason(x: PlannedLayout, best: PlannedLayout | None) -> str:
    """Why a layout ranks where it does, in a few words."""
    lay = x.layout
    bits = [f"bubble {x.bubble_fraction * 100:.0f} %"] if x.bubble_fraction is not None else []
    dominant = max(("transfer", "reduce", "optimizer", "engine", "wait"), key=lambda k: x.terms.get(k, 0.0))
    if x.terms.get(dominant, 0.0) > 0.1 * x.step_seconds:
        bits.append(f"{dominant} {x.terms[dominant] / x.step_seconds * 100:.0f} % of the step")
    if lay.checkpoint_interval:
        bits.append("recompute costs a forward")
    if x.memory_limit_bytes and math.isfinite(max(x.stage_memory_bytes)):
        head = x.memory_limit_bytes - max(x.stage_memory_bytes)
        where = "per rank" if x.bubble_fraction is None else "on the fullest stage"
        bits.append(f"{head / 2**30:,.1f} GiB headroom {where}")
    if best is not None and best is not x:
        bits.append(f"{(x.samples_per_second / best.samples_per_second - 1) * 100:+.1f} % vs the first")
    return "; ".join(bits)


