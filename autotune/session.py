"""Assembles a tuning run from validated options: config, space, proposer, study, runner.

The CLI only parses arguments into RunOptions and calls `tune()`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.display import ProgressDisplay
from autotune.dsconfig import DsConfig, load_ds_config
from autotune.errors import UserError
from autotune.space import SearchSpace, TrialConfig
from autotune.study import Study
from autotune.trial import TrialRunner, WorkloadOptions
from autotune.tuner import Tuner, TuneResult, dump_space
from autotune.workload.defaults import default_ds_config
from autotune.workload.presets import get_preset


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


def validate(opts: RunOptions) -> None:
    wl = opts.workload
    if opts.budget < 1:
        raise UserError(f"--budget must be >= 1, got {opts.budget}")
    get_preset(wl.preset)
    if wl.pipeline_stages < 2:
        raise UserError(f"--stages must be >= 2 for pipeline parallelism, got {wl.pipeline_stages}")
    if wl.data_parallel_size < 1:
        raise UserError(f"--dp must be >= 1, got {wl.data_parallel_size}")
    if wl.steps < 1 or wl.warmup_steps < 0:
        raise UserError("--steps must be >= 1 and --warmup-steps >= 0")
    for name, port in (("--metrics-port", opts.metrics_port), ("--rank-metrics-port", opts.rank_metrics_port)):
        if port is not None and not 1 <= port <= 65535:
            raise UserError(f"{name} must be a port 1-65535, got {port}")
    if opts.trial_timeout is not None and opts.trial_timeout <= 0:
        raise UserError(f"--trial-timeout must be > 0 seconds, got {opts.trial_timeout}")
    if wl.slow_stage is not None and not 0 <= wl.slow_stage < wl.pipeline_stages:
        raise UserError(f"--slow-stage must be in [0, {wl.pipeline_stages - 1}]")
    if wl.partition_method not in ("parameters", "uniform") and not wl.partition_method.startswith("type:"):
        raise UserError(f"--partition-method {wl.partition_method!r}: use parameters, uniform or type:REGEX")
    preset_layers = get_preset(wl.preset).num_layers + 2
    if wl.pipeline_stages > preset_layers:
        raise UserError(f"--stages {wl.pipeline_stages} exceeds the {preset_layers} layers of preset {wl.preset}")


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
    )


def baseline_config(base: DsConfig, opts: RunOptions, space: SearchSpace) -> TrialConfig:
    layout = base.resolve_batch(opts.workload.data_parallel_size)
    bucket = None
    if space.bucket_range is not None:
        bucket = base.reduce_bucket_size or 500_000_000  # DeepSpeed's default when unset
    return TrialConfig(micro_batch_size=layout.micro_batch_size,
                       gradient_accumulation_steps=layout.gradient_accumulation_steps,
                       reduce_bucket_size=bucket)


def open_study(opts: RunOptions) -> tuple[Study, RunOptions]:
    """Create a new study, or reopen an existing one with the settings it was created with."""
    root = Path(opts.study)
    if (root / "study.db").exists():
        study = Study.open(root, create=False)
        stored = study.get_meta_json("settings")
        if stored is None:
            raise UserError(f"{root}: study has no stored settings; it is damaged or from another version")
        resumed = RunOptions.from_dict(stored)
        resumed.budget, resumed.resume = opts.budget, True
        resumed.trial_timeout = opts.trial_timeout or resumed.trial_timeout
        return study, resumed
    if opts.resume:
        raise UserError(f"{root}: nothing to resume (no study.db); drop --resume to start a new study")
    return Study.open(root, create=True, meta={"settings": opts.to_dict()}), opts


def tune(opts: RunOptions, display: ProgressDisplay | None = None) -> TuneResult:
    validate(opts)
    base = load_base_config(opts)  # validate before touching the study folder
    study, opts = open_study(opts)
    try:
        base = load_base_config(opts)
        space = build_space(opts, base)
        display = display or ProgressDisplay(budget=opts.budget)
        display.budget = opts.budget
        _store_meta(study, opts, space)
        from autotune.proposers.registry import make_proposer

        moves, fired = _rules_hooks()
        proposer = make_proposer(opts.tuner, space, seed=opts.seed, moves=moves)
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
    """The advisor's moves (steer the hybrid) and fired-rule ids (for the report), when present."""
    try:
        from autotune.advisor.engine import evaluate
        from autotune.advisor.moves import propose_moves
    except ImportError:
        return None, None

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


