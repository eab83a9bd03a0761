"""The search space: micro-batch size, gradient accumulation steps, reduce_bucket_size.

Two batch modes:
- fixed global batch (`global_batch`): micro x GAS x dp == B; micro ranges
  over the divisors of B/dp and GAS is derived (never a constraint the
  optimizer could violate);
- free global batch: micro and GAS are independent within their bounds and
  the global batch must stay within [min_global_batch, max_global_batch].

`reduce_bucket_size` only acts with ZeRO-1 and dp > 1 under pipeline
parallelism (`dsconfig.reduce_bucket_acts`); elsewhere `bucket_range` is None and the
knob is not searched. Where the model is smaller than the bucket range, the
range ends at the model's parameter count: a bucket that large already holds
every gradient in one reduction, and a larger one reduces the same way while
DeepSpeed allocates a buffer of its full size every step (ZeRO-1 with pipeline
parallelism and contiguous_gradients, stage_1_and_2.py `reduce_gradients`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autotune.core.dsconfig import reduce_bucket_inert
from autotune.core.errors import UserError


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialConfig:
    """One point of the space: the values a trial runs with."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    reduce_bucket_size: int | None = None
    activation_checkpoint_interval: int = 0
    """`pipeline.activation_checkpoint_interval` of the trial (0: as the base config says). Not a
    dimension the proposers search: only the checkpoint step sets it (autotune/tuning/checkpoint_step.py),
    for a micro-batch that ran out of memory without it."""

    def key(self) -> tuple[int, int, int | None, int]:
        return (self.micro_batch_size, self.gradient_accumulation_steps, self.reduce_bucket_size,
                self.activation_checkpoint_interval)

    def describe(self) -> str:
        bucket = "-" if self.reduce_bucket_size is None else fmt_bucket(self.reduce_bucket_size)
        ckpt = f" ckpt={self.activation_checkpoint_interval}" if self.activation_checkpoint_interval else ""
        return f"micro={self.micro_batch_size} gas={self.gradient_accumulation_steps} bucket={bucket}{ckpt}"


def fmt_bucket(elements: int) -> str:
    """5e8, 2.4e5: bucket sizes as people write them."""
    return f"{elements:.2g}".replace("+0", "").replace("+", "")


def powers_of_two(lo: int, hi: int) -> list[int]:
    out, v = [], 1
    while v <= hi:
        if v >= lo:
            out.append(v)
        v *= 2
    return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(kw_only=True, slots=True)
class SearchSpace:
    pipeline_stages: int
    data_parallel_size: int
    micro_batch_sizes: list[int]
    """Allowed micro-batch sizes, ascending."""
    gas_values: list[int] = field(default_factory=list)
    """Allowed GAS values in free mode, ascending; unused with a fixed global batch."""
    global_batch: int | None = None
    min_global_batch: int = 1
    max_global_batch: int | None = None
    bucket_range: tuple[int, int] | None = None
    """(lo, hi) elements, searched on a log scale; None when the knob cannot act."""
    bucket_note: str = ""
    """Why the bucket knob is or is not searched (printed to the user)."""
    bucket_saturation: int | None = None
    """Set when the range ends at the model's parameter count: every bucket at or
    above the range's top reduces the same way (one bucket), so it stands for them."""
    model_parameters: int | None = None
    """The model's parameter count where known (the performance model's bucket counts)."""
    min_gas: int = 1
    """Fixed-batch mode: smallest GAS allowed (default: pipeline_stages)."""

    @classmethod
    def build(
        cls, *, pipeline_stages: int, data_parallel_size: int, zero_stage: int,
        global_batch: int | None = None, micro_min: int = 1, micro_max: int = 64,
        gas_min: int = 1, gas_max: int = 32, powers_of_two_only: bool = True,
        bucket_min: int = 10_000, bucket_max: int = 500_000_000,
        min_global_batch: int = 1, max_global_batch: int | None = None,
        model_parameters: int | None = None, pipeline: bool = True,
    ) -> SearchSpace:
        for name, v in (("micro-min", micro_min), ("micro-max", micro_max), ("gas-min", gas_min),
                        ("gas-max", gas_max), ("bucket-min", bucket_min), ("bucket-max", bucket_max)):
            if v < 1:
                raise UserError(f"--{name} must be >= 1, got {v}")
        if micro_min > micro_max:
            raise UserError(f"--micro-min {micro_min} > --micro-max {micro_max}; swap them")
        if gas_min > gas_max:
            raise UserError(f"--gas-min {gas_min} > --gas-max {gas_max}; swap them")
        if bucket_min > bucket_max:
            raise UserError(f"--bucket-min {bucket_min} > --bucket-max {bucket_max}; swap them")
        p, dp = pipeline_stages, data_parallel_size
        pick = powers_of_two if powers_of_two_only else (lambda lo, hi: list(range(lo, hi + 1)))
        saturation = None
        inert = reduce_bucket_inert(zero_stage, dp, pipeline=pipeline)
        where = "ZeRO-1, dp > 1" if pipeline else f"ZeRO-{zero_stage}, dp > 1"
        if inert is None:
            bucket: tuple[int, int] | None = (bucket_min, bucket_max)
            note = f"reduce_bucket_size searched ({where})"
            top = ceil_bucket(model_parameters) if model_parameters else None
            if top is not None and bucket_min < top < bucket_max:
                bucket, saturation = (bucket_min, top), top
                note = (f"reduce_bucket_size searched in [{fmt_bucket(bucket_min)}, {fmt_bucket(top)}] ({where}): "
                        f"the model has {model_parameters:,} parameters, so a larger bucket reduces "
                        "the same single bucket and only allocates a larger buffer every step")
        else:
            bucket = None
            note = f"reduce_bucket_size not searched: {inert}" + (" under pipeline parallelism" if pipeline else "")
        if global_batch is not None:
            if global_batch < 1 or global_batch % dp:
                raise UserError(f"--global-batch {global_batch} is not a positive multiple of dp {dp}")
            per_replica = global_batch // dp
            min_gas = min(p, per_replica)
            micros = [m for m in divisors(per_replica)
                      if micro_min <= m <= micro_max and per_replica // m >= min_gas
                      and (not powers_of_two_only or m & (m - 1) == 0)]
            if not micros:
                raise UserError(
                    f"--global-batch {global_batch} with dp {dp} leaves no micro-batch in "
                    f"[{micro_min}, {micro_max}] with GAS >= {min_gas}; use a global batch that is a "
                    f"multiple of {dp * p * micro_min}"
                )
            return cls(pipeline_stages=p, data_parallel_size=dp, micro_batch_sizes=micros,
                       global_batch=global_batch, bucket_range=bucket, bucket_note=note, min_gas=min_gas,
                       bucket_saturation=saturation, model_parameters=model_parameters)
        micros, gas = pick(micro_min, micro_max), pick(gas_min, gas_max)
        if not micros or not gas:
            raise UserError("no power-of-two value inside the micro/GAS bounds; widen them")
        return cls(pipeline_stages=p, data_parallel_size=dp, micro_batch_sizes=micros, gas_values=gas,
                   min_global_batch=min_global_batch, max_global_batch=max_global_batch,
                   bucket_range=bucket, bucket_note=note, bucket_saturation=saturation,
                   model_parameters=model_parameters)

    def gas_for(self, micro: int) -> int:
        """Fixed-batch mode: the GAS that micro implies."""
        assert self.global_batch is not None
        return self.global_batch // (self.data_parallel_size * micro)

    def canonical(self, cfg: TrialConfig) -> TrialConfig:
        """The in-space stand-in of a config whose bucket is above a saturated range
        (e.g. a baseline's default 5e8 on a small model); other configs unchanged."""
        b = cfg.reduce_bucket_size
        if self.bucket_saturation is None or b is None or b <= self.bucket_saturation:
            return cfg
        return TrialConfig(micro_batch_size=cfg.micro_batch_size,
                           gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                           reduce_bucket_size=self.bucket_saturation,
                           activation_checkpoint_interval=cfg.activation_checkpoint_interval)

    def contains(self, cfg: TrialConfig) -> bool:
        if cfg.micro_batch_size not in self.micro_batch_sizes:
            return False
        if self.global_batch is not None:
            ok = cfg.gradient_accumulation_steps == self.gas_for(cfg.micro_batch_size)
        else:
            gb = cfg.micro_batch_size * cfg.gradient_accumulation_steps * self.data_parallel_size
            ok = (cfg.gradient_accumulation_steps in self.gas_values and gb >= self.min_global_batch
                  and (self.max_global_batch is None or gb <= self.max_global_batch))
        if self.bucket_range is None:
            return ok and cfg.reduce_bucket_size is None
        lo, hi = self.bucket_range
        return ok and cfg.reduce_bucket_size is not None and lo <= cfg.reduce_bucket_size <= hi

    def grid(self, bucket_points: int = 4) -> list[TrialConfig]:
        """Every point (buckets at `bucket_points` log-spaced values): the exhaustive sweep."""
        buckets = self.bucket_grid(bucket_points)
        out = []
        for m in self.micro_batch_sizes:
            gases = [self.gas_for(m)] if self.global_batch is not None else self.gas_values
            for g in gases:
                for b in buckets:
                    cfg = TrialConfig(micro_batch_size=m, gradient_accumulation_steps=g, reduce_bucket_size=b)
                    if self.contains(cfg):
                        out.append(cfg)
        return out

    def bucket_grid(self, points: int) -> list[int | None]:
        if self.bucket_range is None:
            return [None]
        lo, hi = self.bucket_range
        if points <= 1 or lo == hi:
            return [lo]
        step = (math.log10(hi) - math.log10(lo)) / (points - 1)
        return [round_bucket(10 ** (math.log10(lo) + i * step)) for i in range(points)]

    def describe(self) -> str:
        if self.global_batch is not None:
            batch = f"global batch {self.global_batch} fixed; micro in {self.micro_batch_sizes}, GAS derived"
        else:
            batch = f"micro in {self.micro_batch_sizes}, GAS in {self.gas_values}"
        return f"{batch}; {self.bucket_note}"


def ceil_bucket(value: float) -> int:
    """Round a bucket size up to two significant digits (234,048 -> 240,000)."""
    return _two_digits(value, math.ceil)


def round_bucket(value: float) -> int:
    """Round a bucket size to two significant digits (5e8, 1.2e5): readable, and dedupes near-equal points."""
    return _two_digits(value, round)


def _two_digits(value: float, rounding) -> int:
    if value <= 0:
        return 1
    unit = 10 ** max(int(math.floor(math.log10(value))) - 1, 0)
    return int(rounding(value / unit) * unit)
