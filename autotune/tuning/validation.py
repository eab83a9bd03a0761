"""Cross-field checks of a run's options, before anything touches a ds_config, a command line
or the study folder. Per-field types and ranges come from the option tree (autotune/core/options.py);
here are the checks that need two fields, the preset, a file or a regular expression.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from autotune.core.errors import UserError
from autotune.core.options import RunOptions, check_endpoint_fields, check_fields
from autotune.rank.workload.presets import get_preset

_JOB = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def validate(opts: RunOptions, *, built_in: bool = True) -> None:
    """Every check of `opts`; each problem is one UserError naming the option and the fix.
    `built_in=False` (the user's own command): the preset's limits do not apply to their model."""
    wl = opts.workload
    check_fields(opts)  # type and range of every field, from autotune/core/options.py
    get_preset(wl.preset)
    if wl.world_size > 1024:
        raise UserError(f"--stages x --dp = {wl.world_size} ranks; at most 1024 on one machine")
    from autotune.engines.deepspeed_zero.engine import zero_stages

    zero_stages(opts.zero_stages)  # a bad list is one line before any start-up check or trial
    if opts.trace_every_trial and not opts.trace_steps:
        raise UserError("--trace-every-trial needs --trace-steps N (the steps each trial traces)")
    if opts.rank_metrics_port is not None and opts.rank_metrics_port + wl.world_size - 1 > 65535:
        raise UserError(f"--rank-metrics-port {opts.rank_metrics_port} + {wl.world_size} ranks passes port 65535")
    for addr in {opts.metrics_addr, wl.metrics_addr}:
        _check_metrics_addr(addr)
    if built_in and wl.slow_layer is not None and wl.slow_layer >= _layer_count(wl.preset):
        raise UserError(f"--slow-layer must be in [0, {_layer_count(wl.preset) - 1}]")
    if wl.slow_stage is not None and not 0 <= wl.slow_stage < wl.pipeline_stages:
        raise UserError(f"--slow-stage must be in [0, {wl.pipeline_stages - 1}]")
    pm = wl.partition_method
    if pm.startswith("parts:"):
        from autotune.rank.pipeline_parts import check_method

        check_method(pm, wl.pipeline_stages, _layer_count(wl.preset) if built_in else None)
    elif pm not in ("parameters", "uniform") and not pm.startswith("type:"):
        raise UserError(f"--partition-method {pm!r}: use parameters, uniform, type:REGEX or parts:B0,B1,...")
    if pm.startswith("type:"):
        try:
            re.compile(pm[5:])
        except re.error as exc:
            raise UserError(f"--partition-method {pm!r}: bad regular expression ({exc})") from None
        if not pm[5:] or not pm.isprintable():
            raise UserError(f"--partition-method {pm!r}: type: needs a printable layer-name pattern")
    if wl.adaptive_steps and wl.max_steps is not None and wl.max_steps < wl.steps:
        raise UserError(f"--max-steps {wl.max_steps} is below --steps {wl.steps} (the minimum with "
                        f"--adaptive-steps): give --max-steps >= {wl.steps}, or --fixed-steps")
    if wl.workers not in ("warm", "fresh"):
        raise UserError(f"--workers {wl.workers!r}: use warm or fresh")
    if not _JOB.match(wl.job):
        raise UserError(f"job name {wl.job!r}: use 1-64 letters, digits, '_', '.', ':' or '-'")
    if not str(opts.study).strip():
        raise UserError("--study must name a folder")
    from autotune.core.faults import parse_faults
    from autotune.tuning.proposers.registry import check_name as check_proposer_name

    check_proposer_name(opts.tuner)
    parse_faults(wl.faults)
    preset = get_preset(wl.preset)
    preset_layers = preset.num_layers + 2
    if built_in and not wl.model and wl.pipeline_stages > preset_layers:
        raise UserError(f"--stages {wl.pipeline_stages} exceeds the {preset_layers} layers of preset {wl.preset}")
    if wl.tokens is not None:
        from autotune.rank.workload.data import load_token_file

        if len(load_token_file(wl.tokens, preset.vocab_size)) <= preset.seq_length:
            raise UserError(f"{wl.tokens}: token file is shorter than one sequence "
                            f"({preset.seq_length + 1} tokens); give a longer file")
        wl.tokens = str(Path(wl.tokens).resolve())  # the ranks run in another working directory
    if wl.model is not None and built_in:  # last: it imports the user's code in a subprocess
        check_model(wl.model, seed=wl.seed)


def _layer_count(preset: str) -> int:
    """PipelineModule layers of the built-in model: embedding, decoder layers, LM head."""
    return get_preset(preset).num_layers + 2


def validate_endpoints(values: dict[str, Any]) -> None:
    """The endpoint options of `autotune watch` (field name -> value), checked as `validate`
    checks `autotune run`'s: each port's range and the bind address. The rank ports' sum with
    the world size is left out: a watched command's ranks are known only once they start."""
    check_endpoint_fields(values)
    _check_metrics_addr(values["metrics_addr"])


def _check_metrics_addr(addr: str) -> None:
    if not _valid_host(addr):
        raise UserError(f"--metrics-addr {addr!r}: use an IP address or a host name (default 127.0.0.1)")


def _valid_host(addr: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        return bool(_HOST.match(addr)) and not addr.startswith("-")


def check_model(path: str, *, seed: int) -> None:
    """Before any trial: the path imports and builds a PipelineModule, checked in a subprocess
    (autotune/rank/workload/user_model.py's own main builds it, as a rank would)."""
    from autotune.rank.workload.user_model import CHECK_TIMEOUT, EXIT_BAD_MODEL, parse_model_path
    from autotune.trials.launcher import accelerator_env, free_port, remove_shm_buffers

    parse_model_path(path)

    port = free_port()
    env = {**os.environ, **accelerator_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1"}
    try:
        proc = subprocess.run([sys.executable, "-m", "autotune.rank.workload.user_model", path, str(seed)],
                              capture_output=True, text=True, env=env, timeout=CHECK_TIMEOUT,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise UserError(f"--model {path}: building it took more than {CHECK_TIMEOUT:.0f} s") from None
    finally:
        remove_shm_buffers(port)
    if proc.returncode == 0:
        return
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("autotune-model: ")]
    if proc.returncode == EXIT_BAD_MODEL and lines:
        raise UserError(lines[-1].removeprefix("autotune-model: "))
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    raise UserError(f"--model {path}: the check failed (exit {proc.returncode}): {tail}")
