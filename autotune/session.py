"""Assembles a tuning run from validated options: config, space, proposer, study, runner.

The CLI only parses arguments into RunOptions and calls `tune()`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.display import ProgressDisplay
from autotune.dsconfig import DEEPSPEED_DEFAULT_BUCKET, DsConfig, load_ds_config
from autotune.errors import UserError
from autotune.extras import require
from autotune.precision import check_precision
from autotune.space import SearchSpace, TrialConfig
from autotune.study import Study
from autotune.trial import TrialRunner, WorkloadOptions
from autotune.tuner import Tuner, TuneResult, dump_space
from autotune.workload.defaults import default_ds_config
from autotune.workload.presets import get_preset, parameter_count


@dataclass(kw_only=True, slots=True)
class RunOptions:
    budget: int = 20
    study: str = "autotune-study"
    resume: bool = False
    config: str | None = None
    """Starting ds_config.json; None = the built-in workload's default."""
    tuner: str = "hybrid"
    seed: int = 0
    global_batch: int | None = None
    """Fixed global batch; None = keep the starting config's train_batch_size."""
    free_batch: bool = False
    micro_min: int = 1
    micro_max: int = 64
    gas_min: int = 1
    gas_max: int = 64
    max_global_batch: int | None = None
    integer_micro: bool = False
    bucket_min: int = 10_000
    bucket_max: int = 500_000_000
    trial_timeout: float | None = None
    metrics_port: int | None = None
    """Controller endpoint port; None = off."""
    rank_metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    workload: WorkloadOptions = field(default_factory=WorkloadOptions)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunOptions:
        d = dict(d)
        wl = dict(d.pop("workload", {}))
        wl["extra_args"] = tuple(wl.get("extra_args", ()))
        return cls(**d, workload=WorkloadOptions(**wl))


_JOB = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def validate(opts: RunOptions) -> None:
    """Check every option's type and range before anything reaches a ds_config, a command line
    or the study folder; each problem is one UserError naming the option and the fix."""
    wl = opts.workload
    _ints(opts, wl)
    if opts.budget < 1:
        raise UserError(f"--budget must be >= 1, got {opts.budget}")
    get_preset(wl.preset)
    if wl.pipeline_stages < 2:
        raise UserError(f"--stages must be >= 2 for pipeline parallelism, got {wl.pipeline_stages}")
    if wl.data_parallel_size < 1:
        raise UserError(f"--dp must be >= 1, got {wl.data_parallel_size}")
    if wl.world_size > 1024:
        raise UserError(f"--stages x --dp = {wl.world_size} ranks; at most 1024 on one machine")
    if wl.steps < 1 or wl.warmup_steps < 0:
        raise UserError("--steps must be >= 1 and --warmup-steps >= 0")
    if wl.steps > 100_000 or wl.warmup_steps > 100_000:
        raise UserError("--steps and --warmup-steps must be <= 100000 (a trial is a short measurement)")
    if wl.activation_checkpoint_interval < 0:
        raise UserError(f"--activation-checkpoint-interval must be >= 0, got {wl.activation_checkpoint_interval}")
    if wl.threads < 1 or wl.slow_factor < 1 or wl.seed < 0:
        raise UserError("threads and --slow-factor must be >= 1 and --seed >= 0")
    if not 0 <= opts.seed < 2**32:
        raise UserError(f"--seed must be in [0, 2^32), got {opts.seed}")
    for name, port in (("--metrics-port", opts.metrics_port), ("--rank-metrics-port", opts.rank_metrics_port),
                       ("rank metrics port", wl.metrics_port)):
        if port is not None and not 1 <= port <= 65535:
            raise UserError(f"{name} must be a port 1-65535, got {port}")
    if opts.rank_metrics_port is not None and opts.rank_metrics_port + wl.world_size - 1 > 65535:
        raise UserError(f"--rank-metrics-port {opts.rank_metrics_port} + {wl.world_size} ranks passes port 65535")
    for addr in {opts.metrics_addr, wl.metrics_addr}:
        if not _valid_host(addr):
            raise UserError(f"--metrics-addr {addr!r}: use an IP address or a host name (default 127.0.0.1)")
    if opts.trial_timeout is not None and not (math.isfinite(opts.trial_timeout) and opts.trial_timeout > 0):
        raise UserError(f"--trial-timeout must be a finite number of seconds > 0, got {opts.trial_timeout}")
    if wl.slow_stage is not None and not 0 <= wl.slow_stage < wl.pipeline_stages:
        raise UserError(f"--slow-stage must be in [0, {wl.pipeline_stages - 1}]")
    pm = wl.partition_method
    if pm not in ("parameters", "uniform") and not pm.startswith("type:"):
        raise UserError(f"--partition-method {pm!r}: use parameters, uniform or type:REGEX")
    if pm.startswith("type:"):
        try:
            re.compile(pm[5:])
        except re.error as exc:
            raise UserError(f"--partition-method {pm!r}: bad regular expression ({exc})") from None
        if not pm[5:] or not pm.isprintable():
            raise UserError(f"--partition-method {pm!r}: type: needs a printable layer-name pattern")
    if not _JOB.match(wl.job):
        raise UserError(f"job name {wl.job!r}: use 1-64 letters, digits, '_', '.', ':' or '-'")
    if opts.global_batch is not None and opts.global_batch < 1:
        raise UserError(f"--global-batch must be >= 1, got {opts.global_batch}")
    if opts.max_global_batch is not None and opts.max_global_batch < 1:
        raise UserError(f"--max-global-batch must be >= 1, got {opts.max_global_batch}")
    for name, v in (("--micro-max", opts.micro_max), ("--gas-max", opts.gas_max)):
        if v > 65536:
            raise UserError(f"{name} must be <= 65536, got {v}")
    if opts.bucket_max > 10**12:
        raise UserError(f"--bucket-max must be <= 1e12 elements, got {opts.bucket_max}")
    if not str(opts.study).strip():
        raise UserError("--study must name a folder")
    from autotune.proposers.registry import check_name as check_proposer_name
    from autotune.trial import parse_faults

    check_proposer_name(opts.tuner)
    parse_faults(wl.faults)
    preset = get_preset(wl.preset)
    preset_layers = preset.num_layers + 2
    if wl.pipeline_stages > preset_layers:
        raise UserError(f"--stages {wl.pipeline_stages} exceeds the {preset_layers} layers of preset {wl.preset}")
    if wl.tokens is not None:
        from autotune.workload.data import load_token_file

        if len(load_token_file(wl.tokens, preset.vocab_size)) <= preset.seq_length:
            raise UserError(f"{wl.tokens}: token file is shorter than one sequence "
                            f"({preset.seq_length + 1} tokens); give a longer file")
        wl.tokens = str(Path(wl.tokens).resolve())  # never read as an option by the rank's parser
    # The search space (bounds, batch arithmetic) before the study folder is touched:
    # a new study is never created with settings that cannot run.
    build_space(opts, load_base_config(opts))


def _ints(opts: RunOptions, wl: WorkloadOptions) -> None:
    for owner, names in ((opts, ("budget", "seed", "micro_min", "micro_max", "gas_min", "gas_max",
                                 "bucket_min", "bucket_max")),
                         (wl, ("pipeline_stages", "data_parallel_size", "steps", "warmup_steps",
                               "activation_checkpoint_interval", "threads", "seed", "slow_factor"))):
        for name in names:
            v = getattr(owner, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise UserError(f"{name.replace('_', '-')} must be an integer, got {v!r}")
    for owner, names in ((opts, ("global_batch", "max_global_batch", "metrics_port", "rank_metrics_port")),
                         (wl, ("slow_stage", "metrics_port"))):
        for name in names:
            v = getattr(owner, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise UserError(f"{name.replace('_', '-')} must be an integer, got {v!r}")
    for name in ("preset", "partition_method", "job", "metrics_addr"):
        if not isinstance(getattr(wl, name), str):
            raise UserError(f"{name.replace('_', '-')} must be a string")
    if not isinstance(opts.tuner, str) or not isinstance(opts.metrics_addr, str):
        raise UserError("--tuner and --metrics-addr must be strings")


def _valid_host(addr: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        return bool(_HOST.match(addr)) and not addr.startswith("-")


def load_base_config(opts: RunOptions) -> DsConfig:
    dp = opts.workload.data_parallel_size
    if opts.config is None:
        cfg = DsConfig.from_dict(default_ds_config(dp), source="built-in default")
    else:
        cfg = load_ds_config(opts.config)
    cfg.check_pipeline()
    cfg.resolve_batch(dp)  # raises with the arithmetic when impossible
    return cfg


def build_space(opts: RunOptions, base: DsConfig) -> SearchSpace:
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
        model_parameters=parameter_count(get_preset(opts.workload.preset)),
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


def open_study(opts: RunOptions) -> tuple[Study, RunOptions]:
    """Create a new study, or reopen an existing one with the settings it was created with."""
    root = Path(opts.study)
    if (root / "study.db").exists():
        study = Study.open(root, create=False)
        stored = study.get_meta_json("settings")
        if stored is None:
            raise UserError(f"{root}: study has no stored settings; it is damaged or from another version")
        try:
            resumed = RunOptions.from_dict(stored)
        except (TypeError, ValueError, AttributeError):
            study.close()
            raise UserError(f"{root}: stored settings are not readable by this autotune (another "
                            "version?); start a new study with another --study") from None
        resumed.budget, resumed.resume = opts.budget, True
        resumed.trial_timeout = opts.trial_timeout or resumed.trial_timeout
        return study, resumed
    if opts.resume:
        raise UserError(f"{root}: nothing to resume (no study.db); drop --resume to start a new study")
    return Study.open(root, create=True, meta={"settings": opts.to_dict()}), opts


def tune(opts: RunOptions, display: ProgressDisplay | None = None) -> TuneResult:
    require("tune", what="autotune run")  # before any trial: not N launcher_missing failures
    validate(opts)
    base = load_base_config(opts)  # validate before touching the study folder
    check_precision(base)  # a precision the devices lack would fail every trial alike
    study, opts = open_study(opts)
    try:
        base = load_base_config(opts)
        check_precision(base)  # a resumed study runs its stored config: ask again, before writing
        space = build_space(opts, base)
        display = display or ProgressDisplay(budget=opts.budget)
        display.budget = opts.budget
        _store_meta(study, opts, space)
        from autotune.proposers.registry import make_proposer

        moves, fired = _rules_hooks()
        proposer = make_proposer(opts.tuner, space, seed=opts.seed, moves=moves, budget=opts.budget)
        baseline = baseline_config(base, opts, space)
        wl = opts.workload
        if opts.rank_metrics_port is not None:
            wl.metrics_port, wl.metrics_addr = opts.rank_metrics_port, opts.metrics_addr
        display.note(f"study: {study.root}  |  workload: {wl.preset}, {wl.pipeline_stages} stages x "
                     f"{wl.data_parallel_size} dp = {wl.world_size} ranks  |  tuner: {opts.tuner}, "
                     f"budget {opts.budget}")
        display.note(f"space: {space.describe()}")
        exporter = _controller_exporter(opts, display)
        tuner = Tuner(study=study, runner=TrialRunner(wl, base), space=space, proposer=proposer,
                      baseline=baseline, display=display, budget=opts.budget,
                      trial_timeout=opts.trial_timeout, rules_fired=fired, exporter=exporter)
        return tuner.run()
    finally:
        study.close()


def _store_meta(study: Study, opts: RunOptions, space: SearchSpace) -> None:
    import json

    with study._db:
        study._db.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", [
            ("budget", json.dumps(opts.budget)), ("space", json.dumps(dump_space(space))),
            ("workload", json.dumps(dataclasses.asdict(opts.workload))),
        ])


def _rules_hooks():
    """The advisor's moves (steer the hybrid) and fired-rule ids (for the report)."""
    from autotune.advisor.engine import evaluate
    from autotune.proposers.rule_moves import propose_moves

    def fired(summary) -> list[str]:
        return sorted({f.rule_id for f in evaluate([summary]) if getattr(f, "fired", True)})

    return propose_moves, fired


def _controller_exporter(opts: RunOptions, display: ProgressDisplay):
    if opts.metrics_port is None:
        if opts.rank_metrics_port is not None:
            last = opts.rank_metrics_port + opts.workload.world_size - 1
            display.note(f"rank metrics: http://{opts.metrics_addr}:{opts.rank_metrics_port}..{last}/metrics")
        return None
    from exporters.prometheus_controller import ControllerExporter

    exporter = ControllerExporter(job=opts.workload.job)
    exporter.serve(addr=opts.metrics_addr, port=opts.metrics_port)  # prints its URL, or warns
    if opts.rank_metrics_port is not None:
        last = opts.rank_metrics_port + opts.workload.world_size - 1
        display.note(f"rank metrics: http://{opts.metrics_addr}:{opts.rank_metrics_port}..{last}/metrics "
                     "while a trial runs (fallback ports, if any, are in each trial's launcher.log)")
    return exporter


