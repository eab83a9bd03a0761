"""Where a run starts: the starting ds_config, the search space over it, the baseline trial.

Shared by the run's assembly (autotune/tuning/session.py) and a user's own job (autotune/usercmd),
which builds its space the same way once it knows the job's stages and dp.
"""

from __future__ import annotations

from autotune.core.dsconfig import DEEPSPEED_DEFAULT_BUCKET, DsConfig, load_ds_config
from autotune.core.errors import ConfigError, UserError
from autotune.core.options import RunOptions
from autotune.core.space import SearchSpace, TrialConfig
from autotune.rank.workload.defaults import default_ds_config
from autotune.rank.workload.presets import get_preset, parameter_count


def load_base_config(opts: RunOptions) -> DsConfig:
    dp = opts.workload.data_parallel_size
    if opts.config is None:
        cfg = DsConfig.from_dict(default_ds_config(dp), source="built-in default")
    else:
        cfg = load_ds_config(opts.config)
        try:
            cfg.check_no_hf_auto()  # the built-in workload has no Trainer to fill them
        except ConfigError as exc:
            raise ConfigError(f"{opts.config}: {exc}") from None
    cfg.resolve_batch(dp)  # raises with the arithmetic when impossible
    return cfg


def require_optimizer(base: DsConfig, path: str | None) -> None:
    """The built-in workload hands DeepSpeed no optimizer of its own: a config without an
    "optimizer" section would fail every trial alike ("must provide optimizer during init")."""
    if not isinstance(base.raw.get("optimizer"), dict):
        raise UserError(f"{path or 'the config'}: no \"optimizer\" section, and the built-in workload passes "
                        "DeepSpeed none of its own, so every trial would fail; add one, e.g. "
                        "\"optimizer\": {\"type\": \"Adam\", \"params\": {\"lr\": 0.001}}")


def build_space(opts: RunOptions, base: DsConfig, *, model_parameters: int | None = None,
                pipeline: bool = True) -> SearchSpace:
    """The search space over `base`; `model_parameters` bound the bucket range (None: the preset's);
    `pipeline=False`: a plain engine's bucket rule (autotune/core/dsconfig.py `reduce_bucket_inert`)."""
    layout = base.resolve_batch(opts.workload.data_parallel_size)
    global_batch = None
    if not opts.free_batch:
        global_batch = opts.global_batch or layout.train_batch_size
    return SearchSpace.build(
        pipeline_stages=opts.workload.pipeline_stages, data_parallel_size=opts.workload.data_parallel_size,
        zero_stage=base.zero_stage, global_batch=global_batch, micro_min=opts.micro_min,
        micro_max=opts.micro_max, gas_min=opts.gas_min, gas_max=opts.gas_max,
        powers_of_two_only=not opts.integer_micro, bucket_min=opts.bucket_min,
        bucket_max=opts.bucket_max, max_global_batch=opts.max_global_batch,
        model_parameters=(parameter_count(get_preset(opts.workload.preset)) if model_parameters is None
                          else model_parameters), pipeline=pipeline,
    )


def baseline_config(base: DsConfig, opts: RunOptions, space: SearchSpace) -> TrialConfig:
    layout = base.resolve_batch(opts.workload.data_parallel_size)
    bucket = None
    if space.bucket_range is not None:
        bucket = base.reduce_bucket_size or DEEPSPEED_DEFAULT_BUCKET
    micro, gas = layout.micro_batch_size, layout.gradient_accumulation_steps
    if space.global_batch is not None and layout.train_batch_size != space.global_batch:
        # --global-batch overrides the config's: keep its micro-batch where it divides, so the
        # baseline runs the same global batch as every other trial (a fair speed-up).
        per_replica = space.global_batch // space.data_parallel_size
        if per_replica % micro:
            micro = space.micro_batch_sizes[0]
        gas = per_replica // micro
    return TrialConfig(micro_batch_size=micro, gradient_accumulation_steps=gas, reduce_bucket_size=bucket)
