"""A simulated pipeline-training landscape for benchmarking proposers.

Why a simulator: a real trial costs tens of seconds to minutes; comparing seven
tuners over 80+ runs of 20 trials needs thousands of trials. The model is
analytic and small, but it has the shapes that make tuning hard:

- 1F1B schedule (DeepSpeed `TrainSchedule`): a step runs ``2*(m+p-1)`` slots of
  one forward or one backward; the slowest stage sets the slot time, so the
  ideal bubble is ``(p-1)/(m+p-1)`` and stage imbalance costs throughput.
- per-micro-batch compute ``overhead + mb * t_sample / eff(mb)`` with a device
  efficiency curve rising in the micro-batch (small micro-batches starve the
  device, as measured on CPU: micro 1/GAS 1 5.3 samples/s, 32/4 19.9);
- bucketed data-parallel gradient reduction, never overlapped (DeepSpeed runs
  ReduceGrads after the last backward of the step): ``ceil(P/b)`` calls with a
  per-call latency, a bandwidth term, and a per-step cost of the
  ``b``-element buffer DeepSpeed allocates every step (ZeRO-1 + pipeline);
  fitted to 1e4 -> 55.7, 1e5 -> 71.2, 5e8 -> 45.0 samples/s (CPU, single runs);
- memory: static + activations ``mb * max(2, min(p, m))`` micro-batches in
  flight on stage 0 + the bucket buffer (4 bytes x b, as measured on an H200),
  against a limit with per-trial jitter,
  so out-of-memory is random near the edge; trials that report memory also
  report the device's capacity, of which the limit is `usable_share` (95 %:
  CUDA context, communication buffers and fragmentation take the rest);
- 2 % multiplicative noise and 5 % straggler trials (0.6-0.85x).

`Scenario.run()` returns a `TrialResult` carrying a real
`autotune.core.summary.TrialSummary` (bubble ideal/measured, comm/compute ratio,
stage imbalance, utilization, peak memory), so rules see real signal fields.
`Scenario.true_value()` is the noise-free expected throughput
``samples/s * P(no OOM)``: a config that fits only on lucky days is worth less.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.summary import RankSummary, TrialSummary, ideal_bubble_fraction
from autotune.core.trial_result import STATUS_FAILED, STATUS_OK, TrialResult

DEFAULT_BUCKET = 500_000_000
"""DeepSpeed's reduce_bucket_size default (elements), also the hard-coded ZeRO-0 bucket."""
GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One model/cluster instance: a search space plus the physics that scores it."""

    name: str
    space: SearchSpace
    baseline: TrialConfig
    """The user's starting configuration (trial 0)."""
    stage_sample_seconds: tuple[float, ...]
    """Forward+backward seconds per sample per stage at full device efficiency."""
    micro_overhead_seconds: float
    """Fixed cost per micro-batch per stage (launches, p2p latency)."""
    eff_floor: float
    """Device efficiency at a vanishing micro-batch (0-1)."""
    eff_half: float
    """Micro-batch size at which the efficiency gap to 1 has halved."""
    params_per_stage: float
    """Gradient elements reduced by the largest stage."""
    allreduce_latency_seconds: float
    allreduce_seconds_per_element: float
    buffer_seconds_per_element: float = 0.0
    """Per-step cost of allocating the reduce_bucket_size buffer, per element."""
    optimizer_seconds: float = 0.0
    mem_static_bytes: float
    mem_activation_bytes_per_sample: float
    mem_limit_bytes: float
    mem_jitter: float = 0.02
    """Relative std of the effective memory limit from trial to trial."""
    reports_memory: bool = True
    """False for CPU runs: the summary has no peak memory (the veto must cope)."""
    reports_capacity: bool = True
    """With reports_memory: the summary carries the device's capacity (GPU trials do)."""
    usable_share: float = 0.95
    """mem_limit_bytes / the device's capacity."""
    noise: float = 0.02
    straggler_rate: float = 0.05
    seq_length: int = 512
    zero_stage: int = 1
    """`zero_optimization.stage` the space was built with (the model's bucket rule reads it)."""

    # ---- physics -------------------------------------------------------
    def efficiency(self, mb: int) -> float:
        """Device efficiency (0-1) at a micro-batch size."""
        return 1.0 - (1.0 - self.eff_floor) * self.eff_half / (mb + self.eff_half)

    def _micro_seconds(self, stage: int, mb: int) -> float:
        return self.micro_overhead_seconds + self.stage_sample_seconds[stage] * mb / self.efficiency(mb)

    def _bucket(self, cfg: TrialConfig) -> float:
        return float(cfg.reduce_bucket_size or DEFAULT_BUCKET)

    def _reduce_seconds(self, cfg: TrialConfig) -> float:
        if self.space.data_parallel_size <= 1:
            return 0.0
        p, b = self.params_per_stage, self._bucket(cfg)
        calls = math.ceil(p / b)
        bw = p * self.allreduce_seconds_per_element
        return calls * self.allreduce_latency_seconds + bw + b * self.buffer_seconds_per_element

    def memory_bytes(self, cfg: TrialConfig) -> float:
        m = cfg.gradient_accumulation_steps
        inflight = max(2, min(self.space.pipeline_stages, m))
        act = self.mem_activation_bytes_per_sample * cfg.micro_batch_size * min(inflight, m)
        buf = 0.0
        if self.space.data_parallel_size > 1:
            buf = 4 * self._bucket(cfg)
        return self.mem_static_bytes + act + buf

    def breakdown(self, cfg: TrialConfig) -> dict:
        """Noise-free timings of one step (seconds)."""
        p, m, mb = self.space.pipeline_stages, cfg.gradient_accumulation_steps, cfg.micro_batch_size
        per_stage = [self._micro_seconds(s, mb) for s in range(p)]
        slot = max(per_stage)
        pipe = (m + p - 1) * slot
        reduce = self._reduce_seconds(cfg)
        step = pipe + reduce + self.optimizer_seconds
        return {"per_micro": per_stage, "pipe": pipe, "reduce": reduce, "step": step,
                "samples": mb * m * self.space.data_parallel_size}

    def throughput(self, cfg: TrialConfig) -> float:
        b = self.breakdown(cfg)
        return b["samples"] / b["step"]

    def p_ok(self, cfg: TrialConfig) -> float:
        z = (self.mem_limit_bytes - self.memory_bytes(cfg)) / (self.mem_jitter * self.mem_limit_bytes)
        return 0.5 * math.erfc(-z / math.sqrt(2))

    def true_value(self, cfg: TrialConfig) -> float:
        """Expected noise-free samples/s, counting the chance of running out of memory."""
        return self.throughput(cfg) * self.p_ok(cfg)

    def optimum(self, bucket_points: int = 41) -> tuple[TrialConfig, float]:
        """Exhaustive optimum over the space (buckets on a fine log grid)."""
        best = max(self.space.grid(bucket_points), key=self.true_value)
        return best, self.true_value(best)

    # ---- one noisy trial -------------------------------------------------
    def run(self, cfg: TrialConfig, rng: np.random.Generator, trial: int = 0) -> TrialResult:
        limit = self.mem_limit_bytes * (1 + self.mem_jitter * rng.standard_normal())
        if self.memory_bytes(cfg) > limit:
            return TrialResult(status=STATUS_FAILED, failure_reason="oom",
                               extra={"message": "simulated CUDA out of memory"})
        factor = math.exp(self.noise * rng.standard_normal())
        if rng.random() < self.straggler_rate:
            factor *= rng.uniform(0.6, 0.85)
        summary = self.summary(cfg, factor, trial, rng)
        return TrialResult(status=STATUS_OK, samples_per_second=summary.samples_per_second,
                           summary=summary)

    def summary(self, cfg: TrialConfig, factor: float, trial: int,
                rng: np.random.Generator) -> TrialSummary:
        """A TrialSummary as `autotune.core.summary.summarize_trial` would compute it."""
        sp = self.space
        p, m = sp.pipeline_stages, cfg.gradient_accumulation_steps
        bd = self.breakdown(cfg)
        step = bd["step"] / factor
        p2p = 0.15 * self.micro_overhead_seconds * m  # sends are part of the per-micro overhead
        # A starved device (small micro-batch) shows utilization swinging between kernels.
        starved = 0.35 * (1.0 - self.efficiency(cfg.micro_batch_size))
        ranks = []
        for s in range(p):
            compute = m * bd["per_micro"][s] / factor - p2p
            comm = p2p + bd["reduce"] / factor
            wait = max(step - compute - comm, 0.0)
            util = compute / step
            ranks.append(RankSummary(
                rank=s, stage=s, steps=8, device_utilization_mean=util,
                device_utilization_fluctuation=starved + float(abs(rng.normal(0.0, 0.01))),
                comm_compute_ratio=comm / compute, compute_seconds_mean=compute,
                schedule_compute_seconds_mean=compute,
                comm_seconds_mean=comm, wait_seconds_mean=wait,
                bubble_fraction=max(0.0, 1.0 - compute / step), wait_fraction=wait / step))
        stage_comp = [r.compute_seconds_mean for r in ranks]
        mean_comp = float(np.mean(stage_comp))
        sps = bd["samples"] / step
        mem = self.memory_bytes(cfg) if self.reports_memory else None
        ratios = [r.comm_compute_ratio for r in ranks]
        return TrialSummary(
            trial=trial, steps=8, warmup_steps=2, micro_batch_size=cfg.micro_batch_size,
            gradient_accumulation_steps=m, reduce_bucket_size=cfg.reduce_bucket_size,
            pipeline_stages=p, data_parallel_size=sp.data_parallel_size,
            samples_per_second=sps, samples_per_second_p10=sps * 0.97, samples_per_second_p90=sps * 1.03,
            tokens_per_second=sps * self.seq_length, step_seconds=step, step_time_jitter=0.02,
            device_utilization_mean=float(np.mean([r.device_utilization_mean for r in ranks])),
            device_utilization_fluctuation=max(r.device_utilization_fluctuation or 0.0 for r in ranks),
            cross_device_fluctuation=float(np.std([r.device_utilization_mean for r in ranks])),
            comm_compute_ratio=max(ratios), comm_compute_ratio_mean=float(np.mean(ratios)),
            transfer_compute_ratio=max(r.comm_seconds_mean / r.compute_seconds_mean for r in ranks),
            bubble_fraction_measured=float(np.mean([r.bubble_fraction for r in ranks])),
            bubble_fraction_ideal=ideal_bubble_fraction(p, m),
            stage_compute_imbalance=max(stage_comp) / mean_comp,
            slowest_stage=int(np.argmax(stage_comp)), stage_compute_seconds=stage_comp,
            memory_fragmentation_ratio=0.03 if self.reports_memory else None,
            memory_peak_bytes=mem, memory_reserved_bytes=mem * 1.05 if mem else None,
            memory_capacity_bytes=(self.mem_limit_bytes / self.usable_share
                                   if self.reports_memory and self.reports_capacity else None),
            loss_first=None, loss_last=None, ranks=ranks)


# ---- scenarios ------------------------------------------------------------------
# Compute constants of the CPU scenario are fitted to deepspeed-facts.md
# (see `calibration()`); the GPU scenarios use LLaMA-like shapes with the
# memory limit placed so that the best micro-batch sits near the cliff.

def _cpu_tiny() -> Scenario:
    space = SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1,
                              micro_max=64, gas_max=32, max_global_batch=1024)
    return Scenario(
        name="cpu-tiny-2x2", space=space,
        baseline=TrialConfig(micro_batch_size=4, gradient_accumulation_steps=4,
                             reduce_bucket_size=DEFAULT_BUCKET),
        stage_sample_seconds=(0.036, 0.036), micro_overhead_seconds=0.015,
        eff_floor=0.4, eff_half=6.0, params_per_stage=8.4e6,
        allreduce_latency_seconds=1.0e-3, allreduce_seconds_per_element=1.7e-7,
        buffer_seconds_per_element=3.3e-9,
        optimizer_seconds=0.01, mem_static_bytes=2 * GIB, mem_activation_bytes_per_sample=64e6,
        mem_limit_bytes=8 * GIB, reports_memory=False)


def _llama7b_fixed() -> Scenario:
    space = SearchSpace.build(pipeline_stages=8, data_parallel_size=4, zero_stage=1,
                              global_batch=1024, micro_max=64, bucket_min=1_000_000)
    return Scenario(
        name="llama7b-8x4-gb1024", space=space,
        baseline=TrialConfig(micro_batch_size=1, gradient_accumulation_steps=256,
                             reduce_bucket_size=DEFAULT_BUCKET),
        stage_sample_seconds=(0.030,) * 8, micro_overhead_seconds=0.006,
        eff_floor=0.35, eff_half=4.0, params_per_stage=8.5e8,
        allreduce_latency_seconds=0.004, allreduce_seconds_per_element=2.5e-9,
        buffer_seconds_per_element=1e-10,
        optimizer_seconds=0.05, mem_static_bytes=14 * GIB, mem_activation_bytes_per_sample=0.9 * GIB,
        mem_limit_bytes=80 * GIB)


def _llama13b_free() -> Scenario:
    space = SearchSpace.build(pipeline_stages=8, data_parallel_size=2, zero_stage=1,
                              micro_max=16, gas_max=64, bucket_min=1_000_000,
                              min_global_batch=64, max_global_batch=1024)
    return Scenario(
        name="llama13b-8x2-free", space=space,
        baseline=TrialConfig(micro_batch_size=1, gradient_accumulation_steps=32,
                             reduce_bucket_size=DEFAULT_BUCKET),
        stage_sample_seconds=(0.055,) * 8, micro_overhead_seconds=0.008,
        eff_floor=0.4, eff_half=3.0, params_per_stage=1.65e9,
        allreduce_latency_seconds=0.006, allreduce_seconds_per_element=3e-9,
        buffer_seconds_per_element=1e-10,
        optimizer_seconds=0.08, mem_static_bytes=30 * GIB, mem_activation_bytes_per_sample=1.45 * GIB,
        mem_limit_bytes=80 * GIB)


def _imbalanced() -> Scenario:
    space = SearchSpace.build(pipeline_stages=4, data_parallel_size=1, zero_stage=0,
                              micro_max=64, gas_max=32, min_global_batch=16, max_global_batch=512)
    return Scenario(
        name="gpt-4x1-imbalanced", space=space, zero_stage=0,
        baseline=TrialConfig(micro_batch_size=2, gradient_accumulation_steps=8),
        stage_sample_seconds=(0.010, 0.010, 0.010, 0.013), micro_overhead_seconds=0.004,
        eff_floor=0.3, eff_half=8.0, params_per_stage=3e8,
        allreduce_latency_seconds=0.0, allreduce_seconds_per_element=0.0,
        optimizer_seconds=0.02, mem_static_bytes=8 * GIB, mem_activation_bytes_per_sample=0.5 * GIB,
        mem_limit_bytes=41 * GIB)


def scenarios() -> list[Scenario]:
    return [_cpu_tiny(), _llama7b_fixed(), _llama13b_free(), _imbalanced()]


def calibration() -> list[tuple[str, float, float]]:
    """(setting, measured, model) for the real CPU figures of deepspeed-facts.md.

    The micro/GAS figures (dp 1) are absolute samples/s. The bucket figures
    came from a different run (dp 2, four processes on two cores), so only
    their shape is matched: values relative to the 1e5 bucket.
    """
    base = _cpu_tiny()
    dp1 = replace(base, space=SearchSpace.build(pipeline_stages=2, data_parallel_size=1, zero_stage=0,
                                                micro_max=64, gas_max=32))
    rows = [
        ("dp1 micro 1 GAS 1 (samples/s)", 5.3,
         dp1.throughput(TrialConfig(micro_batch_size=1, gradient_accumulation_steps=1))),
        ("dp1 micro 32 GAS 4 (samples/s)", 19.9,
         dp1.throughput(TrialConfig(micro_batch_size=32, gradient_accumulation_steps=4))),
    ]

    def at(b: int) -> float:
        return base.throughput(TrialConfig(micro_batch_size=4, gradient_accumulation_steps=4, reduce_bucket_size=b))

    for b, real in ((10_000, 55.7), (100_000, 71.2), (500_000_000, 45.0)):
        rows.append((f"dp2 micro 4 GAS 4 bucket {b:.0e} (relative to 1e5)", real / 71.2, at(b) / at(100_000)))
    return rows


@dataclass
class SimRun:
    """A scenario plus the random stream of one benchmark run."""

    scenario: Scenario
    seed: int
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, cfg: TrialConfig, trial: int = 0) -> TrialResult:
        return self.scenario.run(cfg, self.rng, trial)
