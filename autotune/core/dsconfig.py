"""Typed view of the parts of a DeepSpeed config that autotune reads and writes.

Parsed once at the edge (`load_ds_config` / `DsConfig.from_dict`); the rest
of the code works on `DsConfig`. Unknown keys are kept verbatim so that a
patched config round-trips everything the user wrote.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.core.errors import ConfigError

DEEPSPEED_DEFAULT_BUCKET = 500_000_000
"""reduce_bucket_size DeepSpeed uses when the config leaves it out (elements)."""

# Keys of the `pipeline` section that DeepSpeed 0.19.8 actually reads.
PIPELINE_KEYS_READ = frozenset(
    {"pipe_partitioned", "grad_partitioned", "use_reentrant", "activation_checkpoint_interval"}
)


@dataclass(kw_only=True, slots=True)
class BatchLayout:
    """How the global batch splits: micro x GAS x dp == train_batch_size."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    data_parallel_size: int

    @property
    def train_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size


@dataclass(kw_only=True, slots=True)
class DsConfig:
    """A DeepSpeed config with the tuned fields typed and everything else preserved."""

    raw: dict[str, Any] = field(default_factory=dict)
    """The config exactly as given (tuned fields are written back by `to_dict`)."""
    train_batch_size: int | None = None
    micro_batch_size: int | None = None
    """`train_micro_batch_size_per_gpu`."""
    gradient_accumulation_steps: int | None = None
    zero_stage: int = 0
    reduce_bucket_size: int | None = None
    """`zero_optimization.reduce_bucket_size`, in elements (not bytes)."""
    not_strict_json: str | None = None
    """Where the file it was read from leaves strict JSON (comments, trailing commas: the hjson
    DeepSpeed reads, `load_ds_config`); None: strict JSON, or not read from a file."""

    @classmethod
    def from_dict(cls, raw: Any, *, source: str = "ds_config") -> DsConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: a DeepSpeed config must be a JSON object, got {type(raw).__name__}")
        zero = raw.get("zero_optimization", {}) or {}
        if not isinstance(zero, dict):
            raise ConfigError(f"{source}: zero_optimization must be an object")
        return cls(
            raw=copy.deepcopy(raw),
            train_batch_size=_pos_int(raw, "train_batch_size", source),
            micro_batch_size=_pos_int(raw, "train_micro_batch_size_per_gpu", source),
            gradient_accumulation_steps=_pos_int(raw, "gradient_accumulation_steps", source),
            zero_stage=_int_in(zero, "stage", source, lo=0, hi=3, default=0, prefix="zero_optimization."),
            reduce_bucket_size=_pos_int(zero, "reduce_bucket_size", source, prefix="zero_optimization."),
        )

    def resolve_batch(self, data_parallel_size: int) -> BatchLayout:
        """Fill in the missing one of train_batch / micro / GAS as DeepSpeed does, or explain why not."""
        tb, mb, gas, dp = (
            self.train_batch_size, self.micro_batch_size, self.gradient_accumulation_steps,
            data_parallel_size,
        )
        if mb is None and gas is None and tb is None:
            raise ConfigError(
                "ds_config sets none of train_batch_size, train_micro_batch_size_per_gpu, "
                "gradient_accumulation_steps; set at least train_micro_batch_size_per_gpu"
            )
        if mb is not None and gas is not None:
            if tb is not None and tb != mb * gas * dp:
                good = mb * gas * dp
                raise ConfigError(
                    f"train_batch_size {tb} != micro {mb} x GAS {gas} x dp {dp}; "
                    f"use train_batch_size {good} or change micro/GAS"
                )
            return BatchLayout(micro_batch_size=mb, gradient_accumulation_steps=gas, data_parallel_size=dp)
        if tb is None:
            return BatchLayout(micro_batch_size=mb or 1, gradient_accumulation_steps=gas or 1,
                               data_parallel_size=dp)
        known = mb if mb is not None else gas
        if known is None:
            if tb % dp:
                raise ConfigError(f"train_batch_size {tb} is not divisible by dp {dp}; use {tb // dp * dp or dp}")
            return BatchLayout(micro_batch_size=tb // dp, gradient_accumulation_steps=1, data_parallel_size=dp)
        if tb % (known * dp):
            name = "micro" if mb is not None else "GAS"
            raise ConfigError(
                f"train_batch_size {tb} is not divisible by {name} {known} x dp {dp}; "
                f"use train_batch_size {max(1, tb // (known * dp)) * known * dp}"
            )
        other = tb // (known * dp)
        if mb is not None:
            return BatchLayout(micro_batch_size=mb, gradient_accumulation_steps=other, data_parallel_size=dp)
        return BatchLayout(micro_batch_size=other, gradient_accumulation_steps=gas or 1, data_parallel_size=dp)

    def check_pipeline(self) -> None:
        """Refuse what DeepSpeed refuses under pipeline parallelism, with the fix."""
        if self.zero_stage >= 2:
            raise ConfigError(
                f"zero_optimization.stage {self.zero_stage} is refused by DeepSpeed with pipeline "
                "parallelism; use stage 1 (ZeRO-1 shards optimizer state and works with pipelines)"
            )

    @property
    def hf_auto_keys(self) -> list[str]:
        """The dotted keys set to HF Trainer's "auto" (the Trainer fills them from its arguments;
        DeepSpeed alone does not read "auto")."""
        return auto_keys(self.raw)

    def check_no_hf_auto(self) -> None:
        """Refuse "auto" values where no Trainer fills them: every trial would hand them to DeepSpeed."""
        keys = self.hf_auto_keys
        if keys:
            raise ConfigError(
                f"HF Trainer's \"auto\" at {', '.join(keys)}: a Trainer fills these from its arguments and "
                "DeepSpeed alone does not read them; put numbers there, or tune the Trainer script that fills "
                "them: autotune run -- deepspeed train.py --deepspeed ds.json ... (docs/hf-trainer.md)")

    def with_trial(self, *, micro_batch_size: int, gradient_accumulation_steps: int,
                   data_parallel_size: int, reduce_bucket_size: int | None,
                   activation_checkpoint_interval: int = 0) -> DsConfig:
        raw = copy.deepcopy(self.raw)
        raw["train_micro_batch_size_per_gpu"] = micro_batch_size
        raw["gradient_accumulation_steps"] = gradient_accumulation_steps
        raw["train_batch_size"] = micro_batch_size * gradient_accumulation_steps * data_parallel_size
        if reduce_bucket_size is not None:
            raw.setdefault("zero_optimization", {})["reduce_bucket_size"] = int(reduce_bucket_size)
        if activation_checkpoint_interval > 0:  # DeepSpeed's PipelineEngine sets it on the module
            raw.setdefault("pipeline", {})["activation_checkpoint_interval"] = int(activation_checkpoint_interval)
        return DsConfig.from_dict(raw)

    @property
    def activation_checkpoint_interval(self) -> int:
        return checkpoint_interval(self.raw)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.raw)


def reduce_bucket_inert(zero_stage: int, data_parallel_size: int | None, *, pipeline: bool = True) -> str | None:
    """Why `zero_optimization.reduce_bucket_size` cannot change a pipeline run's speed here,
    or None where it acts: only with ZeRO-1 and dp > 1.

    Under pipeline parallelism only ZeRO-1 buckets the data-parallel gradient reduction by
    reduce_bucket_size; ZeRO-0 (and bf16 with the BF16 optimizer) reduces with a hard-coded
    5e8-element bucket, and with dp = 1 there is no reduction to bucket (deepspeed-facts.md,
    "Bucket sizes"). `data_parallel_size` None: not known, so the bucket may act. Memory is
    another matter: ZeRO-1 allocates the bucket's buffer every step even with dp = 1
    (advisor/config_rules.py, `config.zero1_bucket_buffer_bytes`).

    `pipeline=False`, a plain DeepSpeedEngine (docs/zero-facts.md): ZeRO-1, 2 and 3 all bucket
    their reduction by reduce_bucket_size; ZeRO-0 all-reduces in fixed 5e8-element buffers
    (`allreduce_gradients`' default, `MEMORY_OPT_ALLREDUCE_SIZE`, deepspeed/runtime/engine.py).
    """
    if zero_stage == 0 or (pipeline and zero_stage != 1):
        return "ZeRO-0 uses a fixed 5e8-element bucket"
    if data_parallel_size is not None and data_parallel_size < 2:
        return "dp = 1 has no gradient reduction"
    return None


def reduce_bucket_acts(zero_stage: int, data_parallel_size: int | None, *, pipeline: bool = True) -> bool:
    """Whether reduce_bucket_size changes the run's speed: ZeRO-1 and dp > 1 under a pipeline,
    ZeRO-1 to 3 and dp > 1 on a plain engine (`reduce_bucket_inert`)."""
    return reduce_bucket_inert(zero_stage, data_parallel_size, pipeline=pipeline) is None


def checkpoint_interval(raw: dict) -> int:
    """`pipeline.activation_checkpoint_interval` of a raw config as DeepSpeed reads it (0: the module's own)."""
    pipeline = raw.get("pipeline")
    v = pipeline.get("activation_checkpoint_interval", 0) if isinstance(pipeline, dict) else 0
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def auto_keys(raw: object, prefix: str = "") -> list[str]:
    """Dotted paths of the values that are the string "auto" (HF Trainer's placeholder)."""
    if isinstance(raw, dict):
        return [k for key, v in raw.items() for k in auto_keys(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if raw == "auto" else []


def _pos_int(d: dict, key: str, source: str, prefix: str = "") -> int | None:
    if key not in d or d[key] is None or d[key] == "auto":
        return None
    v = d[key]
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            or v != int(v) or v < 1):
        raise ConfigError(f"{source}: {prefix}{key} must be a positive integer, got {v!r}")
    return int(v)


def _int_in(d: dict, key: str, source: str, *, lo: int, hi: int, default: int, prefix: str = "") -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(f"{source}: {prefix}{key} must be an integer {lo}-{hi}, got {v!r}")
    return v


def load_ds_config(path: str | Path) -> DsConfig:
    """Read a ds_config file as DeepSpeed does (strict JSON, else its hjson: comments and trailing
    commas load, and `not_strict_json` says where); every failure is a one-line ConfigError."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file; pass an existing ds_config.json") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read ({exc.__class__.__name__}); pass a UTF-8 JSON file") from None
    try:
        raw, lenient = parse_config_text(text)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None
    cfg = DsConfig.from_dict(raw, source=str(p))
    return dataclasses.replace(cfg, not_strict_json=lenient) if lenient else cfg


class _DuplicateKeys(ValueError):
    pass


class _Unreadable(ValueError):
    pass


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """DeepSpeed's own rule (runtime/config_utils.py `dict_raise_error_on_duplicate_keys`)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        names = [k for k, _ in pairs]
        raise _DuplicateKeys(", ".join(sorted({k for k in names if names.count(k) > 1})))
    return out


def parse_config_text(text: str) -> tuple[Any, str | None]:
    """A config file's content as DeepSpeed 0.19.8 reads it (runtime/config.py: `hjson.load`,
    duplicate keys refused), and where it leaves strict JSON (None: it does not); a one-line
    ConfigError where DeepSpeed could not read it either. Strict JSON is read first: its error
    names the spot a strict reader (HF Trainer) would stop at."""
    try:
        return _parse(text)
    except _DuplicateKeys as exc:
        raise ConfigError(f"duplicate keys {exc}: DeepSpeed refuses such a config") from None
    except _Unreadable as exc:
        raise ConfigError(f"not valid JSON ({exc}), nor the hjson DeepSpeed also reads") from None


def _parse(text: str) -> tuple[Any, str | None]:
    if not text.strip():
        raise _Unreadable("the file is empty")  # hjson would read it as {}
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicate_keys), None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}: {exc.msg}"
    except RecursionError:
        raise _Unreadable("nested too deeply") from None
    import hjson  # DeepSpeed's own reader, a dependency of autotune too

    try:
        raw = hjson.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except _DuplicateKeys:
        raise
    except (ValueError, RecursionError, OverflowError):  # HjsonDecodeError is a ValueError; 1e999 overflows
        raise _Unreadable(where) from None
    return raw, f"not strict JSON from {where} (comments or trailing commas: DeepSpeed reads it as hjson)"


def with_settings(raw: dict, settings: dict[str, str]) -> dict:
    """`raw` with each dotted key of `settings` set to its value read as JSON (a knob's text:
    "2" -> 2, "true" -> True), the sections on the way created; `raw` itself is left alone."""
    if not settings:
        return raw
    out = json.loads(json.dumps(raw))
    for dotted, text in settings.items():
        *path, last = dotted.split(".")
        node = out
        for key in path:
            child = node.get(key)
            node[key] = child = dict(child) if isinstance(child, dict) else {}
            node = child
        node[last] = json.loads(text)
    return out


ZERO_KEYS = frozenset({
    "allgather_bucket_size", "allgather_partitions", "allgather_sequential", "compute_grad_norm",
    "contiguous_gradients", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
    "elastic_checkpoint", "enable_sanity_checks", "gather_16bit_weights_on_model_save",
    "ignore_unused_parameters", "leaf_module", "legacy_stage1", "load_from_fp32_weights",
    "log_trace_cache_warnings", "max_live_parameters", "max_reuse_distance", "memory_efficient_linear",
    "model_persistence_threshold", "module_granularity_threshold", "offload_optimizer",
    "offload_param", "overlap_comm", "override_module_apply", "param_persistence_threshold",
    "parameter_alignment", "pipeline_loading_checkpoint", "prefetch_bucket_size", "reduce_bucket_size",
    "reduce_scatter", "round_robin_gradients", "save_muon_momentum_buffer_in_memory", "stage",
    "stage3_allgather_sequential", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
    "stage3_module_granularity_threshold", "stage3_param_persistence_threshold",
    "stage3_prefetch_bucket_size", "stage3_use_all_reduce_for_fetch_params", "sub_group_size",
    "use_all_reduce_for_fetch_params", "use_multi_rank_bucket_allreduce", "zenflow",
    "zero_hpz_partition_size", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
    "zero_quantized_weights",
})
"""Every key DeepSpeed 0.19.8's `zero_optimization` section takes (DeepSpeedZeroConfig's fields and
aliases). Its model forbids any other ("Extra inputs are not permitted"): a config with one fails
every trial at deepspeed.initialize. tests/test_dsconfig.py pins this set against the installed
DeepSpeed."""


def unknown_zero_keys(raw: dict) -> list[str]:
    """The keys of the config's `zero_optimization` section that DeepSpeed refuses."""
    zero = raw.get("zero_optimization")
    return sorted(k for k in zero if k not in ZERO_KEYS) if isinstance(zero, dict) else []


def check_known_zero_keys(cfg: DsConfig, where: str) -> None:
    """One line before any trial for a `zero_optimization` key DeepSpeed refuses, with the nearest
    it knows."""
    import difflib

    unknown = unknown_zero_keys(cfg.raw)
    if unknown:
        key = unknown[0]
        near = difflib.get_close_matches(key, sorted(ZERO_KEYS), n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        more = f" (and {', '.join(unknown[1:])})" if unknown[1:] else ""
        raise ConfigError(f"{where}: zero_optimization.{key}{more}: DeepSpeed 0.19.8 does not know this key and "
                          f"refuses the config (its ZeRO section forbids unknown keys), so every trial would fail{hint}")


ZERO_STAGE_KEY = "zero_optimization.stage"
ZERO_SIZES = {"zero_optimization.allgather_bucket_size": 500_000_000,
              "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
              "zero_optimization.stage3_param_persistence_threshold": 100_000,
              "zero_optimization.stage3_max_live_parameters": 1_000_000_000}
"""The size settings a plain engine's sweep tries, with DeepSpeed 0.19.8's defaults (zero/config.py)."""
ZERO_SETTINGS = (ZERO_STAGE_KEY, "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                 *ZERO_SIZES)
"""The ZeRO settings a plain engine's sweep sets per trial, in the order it sweeps them."""
ZERO_ALIASES = {"zero_optimization.stage3_prefetch_bucket_size": "prefetch_bucket_size",
                "zero_optimization.stage3_param_persistence_threshold": "param_persistence_threshold",
                "zero_optimization.stage3_max_live_parameters": "max_live_parameters"}
"""DeepSpeed's field names behind the `stage3_*` spellings (both load)."""


def mixed_precision(config: DsConfig) -> bool:
    """fp16 or bf16 enabled (DeepSpeed's `fp16.enabled` / `bf16.enabled`; HF's "auto" counts as
    not known, so not enabled): the training DeepSpeed's memory estimators assume."""
    return any(isinstance(section := config.raw.get(key), dict) and section.get("enabled") is True
               for key in ("fp16", "bf16"))


def effective_zero_settings(base: DsConfig) -> dict[str, str]:
    """What DeepSpeed 0.19.8 runs for each of ZERO_SETTINGS with this config, as knob text: the
    config's value, else DeepSpeed's default (zero/config.py: overlap_comm only at stage 3,
    contiguous_gradients on, ZERO_SIZES); a size as an integer's text."""
    section = base.raw.get("zero_optimization")
    zero: dict = section if isinstance(section, dict) else {}
    out = {ZERO_STAGE_KEY: str(base.zero_stage),
           "zero_optimization.overlap_comm": json.dumps(bool(zero.get("overlap_comm", base.zero_stage == 3))),
           "zero_optimization.contiguous_gradients": json.dumps(bool(zero.get("contiguous_gradients", True)))}
    for dotted, default in ZERO_SIZES.items():
        key = dotted.removeprefix("zero_optimization.")
        value = zero.get(key, zero.get(ZERO_ALIASES.get(dotted, key), default))
        out[dotted] = str(int(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
    return out


def with_swept(raw: dict, values: dict[str, str]) -> dict:
    """`raw` with a setting step's knob values (dotted ds_config keys, knob text), each written only
    where it changes what DeepSpeed runs: a ZeRO setting equal to its effective value for the
    trial's config (the stage first, then the settings that depend on it) is left out, so a
    trial at the config's own values runs the config as written."""
    out = raw
    for dotted in sorted(values, key=lambda k: ZERO_SETTINGS.index(k) if k in ZERO_SETTINGS else len(ZERO_SETTINGS)):
        runs = effective_zero_settings(DsConfig.from_dict(out)).get(dotted)
        if runs != values[dotted]:
            out = with_settings(out, {dotted: values[dotted]})
    return out
