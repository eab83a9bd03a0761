"""Assembles a tuning run from validated options: config, space, proposer, study, runner.

The CLI only parses arguments into RunOptions and calls `tune()`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from autotune.display import ProgressDisplay
from autotune.dsconfig import DEEPSPEED_DEFAULT_BUCKET, DsConfig, load_ds_config
from autotune.errors import UserError
from autotune.extras import require
from autotune.options import RunOptions, check_fields
from autotune.precision import check_precision
from autotune.space import SearchSpace, TrialConfig
from autotune.study import Study
from autotune.trial import TrialRunner
from autotune.tuner import Tuner, TuneResult, dump_space
from autotune.workload.defaults import default_ds_config
from autotune.workload.presets import get_preset, parameter_count

_JOB = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def validate(opts: RunOptions) -> tuple[DsConfig, SearchSpace]:
    """Check every option's type and range before anything reaches a ds_config, a command line
    or the study folder; each problem is one UserError naming the option and the fix.
    Returns the starting config and the search space, each built once."""
    wl = opts.workload
    check_fields(opts)  # type and range of every field, from autotune/options.py
    get_preset(wl.preset)
    if wl.world_size > 1024:
        raise UserError(f"--stages x --dp = {wl.world_size} ranks; at most 1024 on one machine")
    if opts.rank_metrics_port is not None and opts.rank_metrics_port + wl.world_size - 1 > 65535:
        raise UserError(f"--rank-metrics-port {opts.rank_metrics_port} + {wl.world_size} ranks passes port 65535")
    for addr in {opts.metrics_addr, wl.metrics_addr}:
        if not _valid_host(addr):
            raise UserError(f"--metrics-addr {addr!r}: use an IP address or a host name (default 127.0.0.1)")
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
    if not str(opts.study).strip():
        raise UserError("--study must name a folder")
    from autotune.faults import parse_faults
    from autotune.proposers.registry import check_name as check_proposer_name

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
        wl.tokens = str(Path(wl.tokens).resolve())  # the ranks run in another working directory
    # The search space (bounds, batch arithmetic) before the study folder is touched:
    # a new study is never created with settings that cannot run.
    base = load_base_config(opts)
    return base, build_space(opts, base)


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


def tune(opts: RunOptions, display: ProgressDisplay | None = None, *,
         command: list[str] | None = None) -> TuneResult:
    """`command`: the user's own training command (autotune/usercmd); None = the built-in workload."""
    require("tune", what="autotune run")  # before any trial: not N launcher_missing failures
    from autotune.usercmd.job import attach_user_job, prepare_user_job

    display = display or ProgressDisplay(budget=opts.budget)
    job = prepare_user_job(opts, command, display.note) if command else None  # sets config, stages, dp
    base, space = validate(opts)  # before the study folder is touched
    check_precision(base)  # a precision the devices lack would fail every trial alike
    study, stored = open_study(opts)
    try:
        if stored is not opts:  # a resumed study runs the settings it was created with
            opts = stored
            base = load_base_config(opts)
            check_precision(base)  # ask again for the stored config, before anything is written
            space = build_space(opts, base)
        job = attach_user_job(study, job)  # a resumed study of a user's command finds it here
        if job is not None:
            space = job.space(opts, base)
        display.budget = opts.budget
        _store_meta(study, opts, space)
        from autotune.proposers.registry import make_proposer

        moves, fired = _rules_hooks()
        proposer = make_proposer(opts.tuner, space, seed=opts.seed, moves=moves, budget=opts.budget)
        baseline = baseline_config(base, opts, space)
        wl = opts.workload
        if opts.rank_metrics_port is not None:
            wl.metrics_port, wl.metrics_addr = opts.rank_metrics_port, opts.metrics_addr
        display.note(f"study: {study.root}  |  workload: {job.describe() if job else wl.preset}, "
                     f"{wl.pipeline_stages} stages x "
                     f"{wl.data_parallel_size} dp = {wl.world_size} ranks  |  tuner: {opts.tuner}, "
                     f"budget {opts.budget}")
        display.note(f"space: {space.describe()}")
        exporter = _controller_exporter(opts, display)
        runner = job.runner(opts, base) if job else TrialRunner(wl, base)
        tuner = Tuner(study=study, runner=runner, space=space, proposer=proposer,
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


