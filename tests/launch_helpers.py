"""Helpers for tests that launch real DeepSpeed processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from autotune.core.options import WorkloadOptions
from autotune.core.summary import TrialSummary, summarize_trial
from autotune.loaders.metrics import read_records as read_metrics_csv
from autotune.rank.workload.trial_spec import SPEC_NAME, describe_workload
from autotune.trials.launcher import LaunchSpec, run_trial_process


def autotune_cli(*args: str, cwd: Path, timeout: float = 900, env: dict | None = None):
    """Run the real `autotune` CLI in a subprocess; returns CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "autotune", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def autotune_in_process(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The same CLI in this process (click's runner), for refusals before any trial: as
    `autotune_cli` returns, without the start of a Python. Keep entry-point tests on `autotune_cli`."""
    from click.testing import CliRunner

    from autotune.cli.main import cli

    before = os.getcwd()
    os.chdir(cwd)
    try:
        res = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=True)
    finally:
        os.chdir(before)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception  # a traceback the real command would have printed
    return subprocess.CompletedProcess(list(args), res.exit_code, res.stdout, res.stderr)


def run_ranks(tmp: Path, ds_config: dict, *, ranks: int = 2, steps: int = 4, warmup: int = 1,
              preset: str = "small", stages: int = 2, **workload) -> tuple[list, TrialSummary | None, int]:
    """One real multi-process training run of the built-in workload; returns (records, summary, rc).

    The ranks get a trial description as `autotune run` writes one; `workload` sets any
    other WorkloadOptions field (partition_method="uniform", slow_stage=1, ...)."""
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "ds_config.json"
    cfg.write_text(json.dumps(ds_config))
    wl = WorkloadOptions(preset=preset, pipeline_stages=stages, data_parallel_size=ranks // stages,
                         steps=steps, warmup_steps=warmup, **workload)
    trial = describe_workload(wl, trial=-1, trial_dir=str(tmp), ds_config=str(cfg))
    spec = LaunchSpec(num_ranks=ranks, log_path=tmp / "launcher.log", timeout=600,
                      script_args=["--trial-spec", str(trial.write(tmp / SPEC_NAME))])
    out = run_trial_process(spec)
    records = [r for p in sorted(tmp.glob("metrics-rank*.csv")) for r in read_metrics_csv(p)]
    return records, (summarize_trial(records) if records else None), out.returncode


def pipeline_config(micro: int, gas: int, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10**9}
    cfg.update(extra)
    return cfg
