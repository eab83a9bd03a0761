"""Facts read from a ds_config alone, and `check_config` (what `autotune check` runs).

The facts are signals like any other (named `config.*`), so the rules that
judge them live in the rule files with the others. Each fact encodes
something verified against DeepSpeed 0.19.8 (docs/deepspeed-facts.md).
"""

from __future__ import annotations

from autotune.advisor.signals import SignalSet, layout_values
from autotune.advisor.targets import BUCKET_KEYS, byte_like, get_dotted
from autotune.core.dsconfig import (
    DEEPSPEED_DEFAULT_BUCKET,
    PIPELINE_KEYS_READ,
    DsConfig,
    reduce_bucket_acts,
    unknown_zero_keys,
)
from autotune.core.errors import ConfigError
from autotune.core.summary import ideal_bubble_fraction

FP16_LOSS_SCALE_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                        "consecutive_hysteresis", "min_loss_scale")
TIMER_SWITCHES = ("wall_clock_breakdown", "flops_profiler.enabled", "autotuning.enabled")
"""Each turns on engine timers that crash non-last pipeline stages."""
UNKNOWN_BUCKET_KEYS = ("allreduce_bucket_size", "zero_optimization.allreduce_bucket_size")
BUCKET_BUFFER_BYTES_PER_ELEMENT = 4
"""The per-step gradient buffer measured on an H200 with bf16 (5e8 elements: +1.9 GiB peak)."""


def config_facts(cfg: DsConfig, *, stages: int | None = None, world_size: int | None = None,
                 name: str = "ds_config") -> SignalSet:
    """The `config.*` signals plus, when stages/world size are known, the batch layout."""
    raw = cfg.raw
    values: dict[str, float | None] = {"config.zero_stage": float(cfg.zero_stage)}
    details: dict[str, str] = {}

    zero = raw.get("zero_optimization") or {}
    values["config.reduce_bucket_size_set"] = float("reduce_bucket_size" in zero)
    if "reduce_bucket_size" in zero:
        details["config.reduce_bucket_size_set"] = f"reduce_bucket_size = {zero['reduce_bucket_size']}"

    pipe = raw.get("pipeline")
    ignored = sorted(k for k in pipe if k not in PIPELINE_KEYS_READ) if isinstance(pipe, dict) else []
    values["config.ignored_pipeline_keys"] = float(len(ignored))
    details["config.ignored_pipeline_keys"] = ", ".join(f"pipeline.{k}" for k in ignored)

    as_bytes = [f"{k}={zero[k]}" for k in BUCKET_KEYS if k in zero and byte_like(zero[k])]
    values["config.bucket_sizes_as_bytes"] = float(len(as_bytes))
    details["config.bucket_sizes_as_bytes"] = ", ".join(as_bytes)

    bf16 = get_dotted(raw, "bf16.enabled")[1] is True
    values["config.bf16_enabled"] = float(bf16)
    fp16 = raw.get("fp16") if isinstance(raw.get("fp16"), dict) else {}
    loss_keys = [f"fp16.{k}" for k in FP16_LOSS_SCALE_KEYS if k in fp16] if bf16 else []
    values["config.fp16_keys_under_bf16"] = float(len(loss_keys))
    details["config.fp16_keys_under_bf16"] = ", ".join(loss_keys)

    auto = cfg.hf_auto_keys
    values["config.hf_auto_values"] = float(len(auto))
    details["config.hf_auto_values"] = ", ".join(auto)

    values["config.not_strict_json"] = float(cfg.not_strict_json is not None)
    details["config.not_strict_json"] = cfg.not_strict_json or ""

    timers = [k for k in TIMER_SWITCHES if get_dotted(raw, k)[1] is True]
    values["config.timers_enabled"] = float(len(timers))
    details["config.timers_enabled"] = ", ".join(timers)

    unknown = [k for k in UNKNOWN_BUCKET_KEYS if get_dotted(raw, k)[0]]
    values["config.unknown_bucket_keys"] = float(len(unknown))
    details["config.unknown_bucket_keys"] = ", ".join(unknown)

    # any other key DeepSpeed's ZeRO section refuses (allreduce_bucket_size has its own rule)
    refused = [f"zero_optimization.{k}" for k in unknown_zero_keys(raw) if k != "allreduce_bucket_size"]
    values["config.unknown_zero_keys"] = float(len(refused))
    details["config.unknown_zero_keys"] = ", ".join(refused)

    # ZeRO-1 under pipeline parallelism with contiguous_gradients (the default) allocates a
    # reduce_bucket_size-element gradient buffer on every step, however small the model
    # (stage_1_and_2.py reduce_gradients, pipeline_parallel branch), even with dp = 1.
    buffered = cfg.zero_stage == 1 and zero.get("contiguous_gradients", True) is not False
    elements = cfg.reduce_bucket_size or DEEPSPEED_DEFAULT_BUCKET
    values["config.zero1_bucket_buffer_bytes"] = float(elements * BUCKET_BUFFER_BYTES_PER_ELEMENT) if buffered else 0.0
    if buffered:
        details["config.zero1_bucket_buffer_bytes"] = (
            f"reduce_bucket_size {elements:,} elements{'' if cfg.reduce_bucket_size else ' (default)'}"
            f" x {BUCKET_BUFFER_BYTES_PER_ELEMENT} bytes")

    # a pipeline job or not: the config's own "pipeline" section says so, or --stages (1: a plain
    # DeepSpeedEngine with ZeRO); a config alone cannot tell (HF Trainer's and most ZeRO configs)
    values["config.pipeline_job"] = (1.0 if isinstance(pipe, dict) or (stages or 0) > 1
                                     else 0.0 if stages == 1 else None)

    values.update(_layout(cfg, stages, world_size))
    unavailable = {k: "pass --stages P and --world-size W" for k, v in values.items() if v is None}
    unavailable["config.pipeline_job"] = ("a config alone does not say whether the job is a pipeline: pass "
                                          "--stages P (1: a plain DeepSpeedEngine with ZeRO)")
    unavailable["reduce_bucket_size"] = "not set, or no effect (it acts only with ZeRO-1 and dp > 1)"
    return SignalSet(subject=name, kind="config", values=values, unavailable=unavailable,
                     details=details)


def _layout(cfg: DsConfig, stages: int | None, world_size: int | None) -> dict[str, float | None]:
    dp: int | None = None
    if stages is not None and world_size is not None:
        if stages < 1 or world_size < 1 or world_size % stages:
            raise ConfigError(f"--world-size {world_size} is not a positive multiple of --stages {stages}")
        dp = world_size // stages
    micro, gas = cfg.micro_batch_size, cfg.gradient_accumulation_steps
    if dp is not None:
        layout = cfg.resolve_batch(dp)
        micro, gas = layout.micro_batch_size, layout.gradient_accumulation_steps
    bucket = cfg.reduce_bucket_size if reduce_bucket_acts(cfg.zero_stage, dp) else None
    values = layout_values(micro, gas, stages, dp, bucket)
    values["bubble_fraction_ideal"] = (ideal_bubble_fraction(stages, gas)
                                       if stages is not None and gas is not None else None)
    return values
