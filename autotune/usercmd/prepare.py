"""Reading the user's command into its job: a new study's start-up check, or a stored study's record.

`prepare_user_job` checks the command and its config, runs the start-up check (autotune/trials/
user_command.py `probe_shape`) and returns the job its script builds: a DeepSpeed engine's
(autotune/usercmd/job.py `UserJob`) or a torch.distributed.pipelining schedule's
(autotune/usercmd/torch_job.py `TorchScriptJob`). A study's record (meta `user_command`) reads back
as the same kind (`record_of`). The one module that knows both kinds, so neither imports the other's.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.core.dsconfig import DsConfig, check_known_zero_keys, load_ds_config
from autotune.core.errors import ConfigError, UserError
from autotune.core.trainer_args import GAS_FLAG, HF_TRAINER, MICRO_FLAG
from autotune.study.job_record import META_KEY
from autotune.trials.multinode import resolve_cluster
from autotune.trials.user_command import PROBE_TIMEOUT, probe_shape
from autotune.usercmd.command import CONFIG_FLAGS, check_launcher_installed, parse_command
from autotune.usercmd.job import (
    FILLED,
    FROM_CODE,
    UserJob,
    _checked,
    _config_marker,
    _finite,
    auto_unfilled,
    config_from_code,
    framework_hint,
    refuse_builtin_only,
    refuse_pipeline_only,
    with_autotune_launcher_options,
)
from autotune.usercmd.torch_job import TORCH, TorchScriptJob, torch_job

if TYPE_CHECKING:
    from autotune.core.options import RunOptions
    from autotune.study.store import Study


def prepare_user_job(opts: RunOptions, argv: list[str], note: Callable[[str], None]) -> UserJob:
    """Check the command and measure its pipeline; `opts` is pointed at the user's config and shape.

    An existing study is resumed with its own command (no probe); another command for it is refused.
    """
    root = Path(opts.study)
    if (root / "study.db").is_file():
        stored = stored_job(root)
        if stored is None:
            raise UserError(f"{root} is a study of the built-in workload; give your command another --study")
        if list(argv) != stored.argv:
            raise UserError(f"{root} was created for another command ({stored.command_text()}); resume it with "
                            "that command or none, or give this one another --study")
        return stored
    refuse_builtin_only(opts)
    cwd = Path.cwd().resolve()
    cmd = with_autotune_launcher_options(parse_command(argv, cwd=cwd), opts)
    if opts.knobs:  # a knob that names no flag, or the config's: one line before anything runs
        from autotune.usercmd.knobs import check_against_command, parse_knobs

        check_against_command(parse_knobs(opts.knobs), cmd.script_args, cmd.config_at)
    check_launcher_installed(cmd)
    cluster = resolve_cluster(cmd.cluster_options(), None)  # hostfile, launcher, hosts: before any run
    if cluster is not None:
        note(f"nodes: {cluster.describe()}" + (f" (multi-node through {cluster.options.launcher})"
                                                 if cluster.multi_node else ""))
    config = cmd.config_path(opts.config, cwd, in_code=True)  # None: the script builds its own
    auto: list[str] = []
    if config is not None:
        base = load_ds_config(config)  # missing or unparseable: one line, exit 2
        check_known_zero_keys(base, str(config))  # DeepSpeed would refuse it in every trial
        auto = base.hf_auto_keys  # an HF Trainer fills them: the start-up check tells whether one does
        if auto and cmd.config_flag in CONFIG_FLAGS:  # DeepSpeed's own flag: no Trainer reads that one
            raise ConfigError(f"{config}: {auto_unfilled(auto, cmd.config_flag)}")
        if not auto:
            _checked(base, str(config))  # before the start-up check: every trial would fail alike
    note("start-up check: running the command once, up to deepspeed.initialize (or a torch pipelining schedule's "
         "first step), to read its engine: pipeline stages (or none) and data-parallel size"
         + ("" if config is not None else ", and the DeepSpeed config the script builds, if any"))
    shape, failure, probe_dir = probe_shape(cmd, ds_config=config, cwd=cwd,
                                            timeout=opts.trial_timeout or PROBE_TIMEOUT,
                                            startup_timeout=opts.startup_timeout)
    marker = shape.script_config if shape is not None else _config_marker(probe_dir)
    built_by = (marker or {}).get("built_by")
    if auto and built_by != HF_TRAINER:
        if failure is None:
            shutil.rmtree(probe_dir, ignore_errors=True)
        raise ConfigError(f"{config}: {auto_unfilled(auto, None)}")
    if shape is not None and shape.torch_pipelining is not None:  # no DeepSpeed: the script's own schedule
        shutil.rmtree(probe_dir, ignore_errors=True)
        job = torch_job(argv, cwd, shape, note)
        job.validate(opts)
        opts.config = None
        opts.workload.pipeline_stages = shape.stages
        opts.workload.data_parallel_size = shape.data_parallel_size
        return job
    if failure is not None:
        hint = framework_hint(cmd, failure.failure_detail or "", built_by)
        if config is not None and base.zero_stage >= 2 and not built_by:  # DeepSpeed's PipelineEngine asserts on it before the bootstrap sees it
            hint = (f"; if the script builds a PipelineModule: zero_optimization.stage {base.zero_stage} is "
                    "refused by DeepSpeed with pipeline parallelism (stage 0 or 1)")
        raise UserError(f"the command failed its start-up check ({failure.result.failure_reason}): "
                        f"{failure.failure_detail}; log kept in {probe_dir / 'launcher.log'}{hint}")
    shutil.rmtree(probe_dir, ignore_errors=True)
    assert shape is not None  # no failure: the probe read the engine
    script_config = filled = None
    if built_by == HF_TRAINER and config is not None:
        filled = (marker or {}).get("config")
        if not isinstance(filled, dict):
            raise UserError("the HF Trainer's DeepSpeed config could not be read at deepspeed.initialize "
                            f"({(marker or {}).get('error', 'not a dict')})")
        clean = _finite(filled)  # the study and summary.json stay strict JSON
        assert isinstance(clean, dict)
        filled = clean
        base = DsConfig.from_dict(filled, source=FILLED)
        _checked(base, FILLED)
        note(f"the job: an HF Trainer's; its batch is set through its arguments ({MICRO_FLAG}, {GAS_FLAG}), "
             "and each trial's config keeps your \"auto\" values for the Trainer to fill")
    if config is None:
        base = config_from_code(shape.script_config)
        _checked(base, FROM_CODE)
        script_config = dict(base.raw)
        note(f"the config: {FROM_CODE}, read at deepspeed.initialize; each trial's is handed to it there, "
             f"and best_ds_config.json is it with the tuned values")
    if shape.pipeline and shape.stages < 2:
        raise UserError(f"the script's PipelineModule has {shape.stages} stage; autotune tunes pipelines of "
                        "2 or more stages (num_stages)")
    if shape.pipeline:
        base.check_pipeline()
        note(f"the job: {shape.stages} pipeline stages x {shape.data_parallel_size} data-parallel = "
             f"{shape.stages * shape.data_parallel_size} ranks, {shape.parameters:,} parameters, "
             f"micro {shape.micro_batch_size} x GAS {shape.gradient_accumulation_steps}")
    else:
        refuse_pipeline_only(opts)
        note(f"the job: {shape.data_parallel_size} data-parallel ranks of a plain DeepSpeedEngine (ZeRO-"
             f"{shape.zero_stage}; not a pipeline job), {shape.parameters:,} parameters, "
             f"micro {shape.micro_batch_size} x GAS {shape.gradient_accumulation_steps}")
    opts.config = str(config) if config is not None else None
    opts.workload.pipeline_stages = shape.stages
    opts.workload.data_parallel_size = shape.data_parallel_size
    return UserJob(argv=list(argv), cwd=str(cwd), parameters=shape.parameters, pipeline_stages=shape.stages,
                   data_parallel_size=shape.data_parallel_size, micro_batch_size=shape.micro_batch_size,
                   gradient_accumulation_steps=shape.gradient_accumulation_steps, script_config=script_config,
                   built_by=built_by, filled_config=filled)


def resumed_user_job(study: Study) -> UserJob | None:
    """The command a study of a user's command was created for (a resume without one); None: none."""
    stored = study.get_meta_json(META_KEY)
    return record_of(stored) if stored else None


def stored_job(root: Path) -> UserJob | None:
    """A study's command, read-only (the study may be locked by nobody or by a live run)."""
    from autotune.study.store import stored_meta

    raw = stored_meta(root, META_KEY)
    return record_of(json.loads(raw)) if raw is not None else None


def record_of(stored: dict[str, Any]) -> UserJob:
    """The job a study's record describes: a torch pipelining script's or a DeepSpeed script's."""
    return TorchScriptJob(**stored) if stored.get("engine") == TORCH else UserJob(**stored)
