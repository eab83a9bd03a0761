"""Running one trial: write its ds_config, launch the ranks, read and judge the result.

Failures are classified (oom, timeout, killed, nonfinite_loss,
loss_scale_collapse, crash, no_metrics, launcher_missing) and returned as a
failed TrialResult: a trial never crashes the tuning run. The table with
causes and evidence is in docs/robustness.md.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from autotune.dsconfig import DsConfig
from autotune.errors import InputFileError
from autotune.faults import RANK_FAULTS
from autotune.launcher import LaunchOutcome, LaunchSpec, TrialProcess
from autotune.loaders.metrics import read_trial_columns
from autotune.options import WorkloadOptions
from autotune.proposers.base import STATUS_FAILED, STATUS_OK, TrialResult
from autotune.space import TrialConfig
from autotune.summary import TrialSummary, summarize_columns
from autotune.workload.train import EXIT_LOSS_SCALE, EXIT_NONFINITE_LOSS, EXIT_OOM
from autotune.workload.trial_spec import SPEC_NAME, TrialSpec

OOM_PATTERN = re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory", re.I)
MISSING_PATTERN = re.compile(r"No module named '?deepspeed|can't open file .*train\.py")


@dataclass(kw_only=True, slots=True)
class TrialOutcome:
    result: TrialResult
    summary: TrialSummary | None
    failure_detail: str | None
    wall_seconds: float


class TrialRunner:
    """Runs trials of one workload; `on_start` receives the process (to record its group id)."""

    def __init__(self, workload: WorkloadOptions, base_config: DsConfig, *,
                 launcher: list[str] | None = None) -> None:
        self.workload = workload
        self.base_config = base_config
        self.launcher = launcher

    def ds_config_for(self, config: TrialConfig) -> dict:
        return self.base_config.with_trial(
            micro_batch_size=config.micro_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            data_parallel_size=self.workload.data_parallel_size,
            reduce_bucket_size=config.reduce_bucket_size,
        ).to_dict()

    def describe(self, number: int, trial_dir: Path) -> TrialSpec:
        """What trial `number`'s ranks are told (written as trial-NNN/trial.json)."""
        fault = self.workload.fault_for(number)
        return TrialSpec(workload=self.workload, trial=number, ds_config=str(trial_dir / "ds_config.json"),
                         metrics_csv=str(trial_dir / "metrics-rank{rank}.csv"),
                         fault=fault if fault in RANK_FAULTS else None)  # a runner fault stays here

    def run(self, number: int, config: TrialConfig, trial_dir: Path, *, timeout: float,
            on_start: Callable[[TrialProcess], None] | None = None) -> TrialOutcome:
        trial_dir = trial_dir.resolve()  # absolute in every command line: leftovers are found by it
        trial_dir.mkdir(parents=True, exist_ok=True)
        for old in trial_dir.glob("metrics-rank*.csv"):  # a re-run after an interruption starts clean
            old.unlink()
        _keep_old_log(trial_dir / "launcher.log")
        ds_path = trial_dir / "ds_config.json"
        ds_path.write_text(json.dumps(self.ds_config_for(config), indent=2) + "\n", encoding="utf-8")
        fault = self.workload.fault_for(number)
        description = self.describe(number, trial_dir)
        spec = LaunchSpec(
            num_ranks=self.workload.world_size,
            script_args=["--trial-spec", str(description.write(trial_dir / SPEC_NAME))],
            log_path=trial_dir / "launcher.log", timeout=timeout,
        )
        if self.launcher is not None:
            spec.launcher = list(self.launcher)
        if fault == "nolauncher":
            spec.launcher = [str(trial_dir / "no-such-launcher")]
        elif fault == "noscript":
            spec.script = trial_dir / "no-such-train.py"
        if not spec.script.is_file():
            detail = f"training script {spec.script} not found; reinstall autotune"
            spec.log_path.write_text(detail + "\n", encoding="utf-8")
            return _failed("launcher_missing", detail, 0.0)
        proc = TrialProcess(spec)
        try:
            error = proc.start()
            if error is not None:
                spec.log_path.write_text(error + "\n", encoding="utf-8")
                return _failed("launcher_missing", error, 0.0)
            if on_start is not None:
                on_start(proc)
            rc, timed_out = proc.wait()
        finally:
            proc.stop(grace=2.0)  # ranks the launcher left behind, or a Ctrl-C: the whole group goes
        outcome = LaunchOutcome(returncode=rc, timed_out=timed_out,
                                wall_seconds=time.monotonic() - proc.started, log_path=spec.log_path)
        return judge(outcome, trial_dir, timeout)


def _keep_old_log(log: Path) -> None:
    """A re-run keeps the log of the interrupted attempt next to its own."""
    if not log.exists():
        return
    k = 1
    while (kept := log.with_name(f"launcher.interrupted-{k}.log")).exists():
        k += 1
    log.rename(kept)


def judge(outcome: LaunchOutcome, trial_dir: Path, timeout: float) -> TrialOutcome:
    """Classify a finished launch and summarize its metrics."""
    wall = outcome.wall_seconds
    log = _tail(outcome.log_path)
    if outcome.timed_out:
        return _failed("timeout", f"no result within {timeout:.0f} s; every rank was stopped", wall)
    rc = outcome.returncode
    if rc != 0:
        def exited(code: int) -> bool:
            return rc == code or f"exits with return code = {code}" in log

        if exited(EXIT_OOM) or OOM_PATTERN.search(log):
            return _failed("oom", _last_line(log, OOM_PATTERN) or "out of memory", wall)
        if exited(EXIT_LOSS_SCALE):
            return _failed("loss_scale_collapse",
                           _last_line(log, re.compile("loss scale")) or "fp16 loss scale collapsed", wall)
        if exited(EXIT_NONFINITE_LOSS):
            return _failed("nonfinite_loss", _last_line(log, re.compile("non-finite")) or "loss became NaN/inf", wall)
        killed = re.search(r"return code = -(\d+)", log)
        if killed or (rc is not None and rc < 0):
            signum = int(killed.group(1)) if killed else -(rc or 0)
            return _failed("killed", f"a rank was killed by signal {signum} ({_signal_name(signum)}); "
                                     "the launcher stopped the others", wall)
        if MISSING_PATTERN.search(log):
            return _failed("launcher_missing", _last_line(log, MISSING_PATTERN) or "launcher missing", wall)
        return _failed("crash", _last_line(log, re.compile(r"Error|error")) or f"exit code {rc}", wall)
    try:  # the one reader and the one summary, as advise uses them
        files = sorted(trial_dir.glob("metrics-rank*.csv"))
        summaries = summarize_columns(read_trial_columns(files), source=str(trial_dir)) if files else []
    except InputFileError as exc:
        return _failed("no_metrics", str(exc), wall)
    summary = summaries[0] if summaries else None
    if summary is None:
        return _failed("no_metrics", "the trial exited 0 but wrote no measured step", wall)
    return TrialOutcome(
        result=TrialResult(status=STATUS_OK, samples_per_second=summary.samples_per_second, summary=summary),
        summary=summary, failure_detail=None, wall_seconds=wall,
    )


def _signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


def _failed(reason: str, detail: str, wall: float) -> TrialOutcome:
    return TrialOutcome(result=TrialResult(status=STATUS_FAILED, failure_reason=reason),
                        summary=None, failure_detail=detail.strip()[:500], wall_seconds=wall)


def _tail(path: Path, size: int = 20000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - size))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _last_line(text: str, pattern: re.Pattern) -> str | None:
    hits = [ln for ln in text.splitlines() if pattern.search(ln)]
    return hits[-1].strip() if hits else None
