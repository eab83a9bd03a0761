"""How a trial ended: the classified reason of a failed one, the summary of a finished one.

The reasons (oom, hang, timeout, killed, nonfinite_loss, loss_scale_collapse, crash,
no_metrics, launcher_missing) and their evidence are the table in docs/robustness.md.
A trial never crashes the tuning run: every ending is a TrialOutcome.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from autotune.core.errors import InputFileError
from autotune.core.step_budget import read_record
from autotune.core.summary import TrialSummary, summarize_columns
from autotune.core.trial_result import STATUS_FAILED, STATUS_OK, TrialResult
from autotune.loaders.metrics import read_trial_columns
from autotune.rank.workload.train import EXIT_LOSS_SCALE, EXIT_NONFINITE_LOSS, EXIT_OOM
from autotune.trials.hangs import read_hang
from autotune.trials.launcher import LaunchOutcome

OOM_PATTERN = re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory", re.I)
MISSING_PATTERN = re.compile(r"No module named '?deepspeed|can't open file .*train\.py")


@dataclass(kw_only=True, slots=True)
class TrialOutcome:
    result: TrialResult
    summary: TrialSummary | None
    failure_detail: str | None
    wall_seconds: float


PEER_LOST = re.compile(r"Connection (reset|closed) by peer")
"""gloo's error in a rank whose peer went away (tcp/pair.cc): the peer's end, not this rank's fault."""
RANK_ERROR = re.compile(r"^\[rank\d+\]: \w*(Error|Exception)\b")
"""A rank's own exception as torchrun prefixes it (`[rank1]: ValueError: ...`): the cause, where
torchrun's failure summary after it (`ChildFailedError`, `error_file: <N/A>`) only says a rank failed."""
EXCEPTION_LINE = re.compile(r"^(?!torch\.distributed\.elastic\.)[\w.]*(Error|Exception): ")
"""A Python exception's last line printed without torchrun's rank prefix (a rank's own stderr, as
Lightning's refusal on CPU reaches the log): not torchrun's summary (its `traceback :` line
only points at its documentation, and its own ChildFailedError only says a rank failed)."""


def judge(outcome: LaunchOutcome, trial_dir: Path, timeout: float) -> TrialOutcome:
    """Classify a finished launch and summarize its metrics."""
    wall = outcome.wall_seconds
    if outcome.launch_error is not None:  # the launcher itself could not be started
        return failed("launcher_missing", outcome.launch_error, wall)
    log = _tail(outcome.log_path)
    if outcome.timed_out or outcome.returncode != 0:
        hang = read_hang(trial_dir)  # a rank's watchdog saw it stall and wrote where
        if hang is not None:
            return failed("hang", hang.describe(), wall)
    if outcome.timed_out:
        return failed("timeout", f"no result within {timeout:.0f} s; every rank was stopped", wall)
    rc = outcome.returncode
    if rc != 0:
        def exited(code: int) -> bool:  # DeepSpeed's launcher, then torchrun's failure summary
            return (rc == code or f"exits with return code = {code}" in log
                    or re.search(rf"exitcode\s*:\s*{code}\b", log) is not None)

        if exited(EXIT_OOM) or OOM_PATTERN.search(log):
            return failed("oom", _last_line(log, OOM_PATTERN) or "out of memory", wall)
        if exited(EXIT_LOSS_SCALE):
            return failed("loss_scale_collapse",
                           _last_line(log, re.compile("loss scale")) or "fp16 loss scale collapsed", wall)
        if exited(EXIT_NONFINITE_LOSS):
            return failed("nonfinite_loss", _last_line(log, re.compile("non-finite")) or "loss became NaN/inf", wall)
        killed = re.search(r"return code = -(\d+)", log) or re.search(r"exitcode\s*:\s*-(\d+)", log)
        if killed and killed.group(1) == "15" and re.search(r"exitcode\s*:\s*[1-9]", log):
            killed = None  # torchrun's SIGTERM to the survivors of a rank that failed on its own: its cause counts
        if killed or (rc is not None and rc < 0):
            signum = int(killed.group(1)) if killed else -(rc or 0)
            return failed("killed", f"a rank was killed by signal {signum} ({_signal_name(signum)}); "
                                     "the launcher stopped the others", wall)
        errors = [ln for ln in log.splitlines() if RANK_ERROR.search(ln)]
        if errors and all(PEER_LOST.search(ln) for ln in errors):
            # a rank vanished without a trace (SIGKILL, the OOM killer) and the launcher reported a
            # peer that died of the lost connection first: the peer's error is not the cause
            return failed("killed", "a rank ended without a trace (killed by a signal: SIGKILL, the kernel's "
                                     "OOM killer) and its peers lost the connection to it; "
                                     f"{errors[-1].strip()[:200]}", wall)
        if MISSING_PATTERN.search(log):
            return failed("launcher_missing", _last_line(log, MISSING_PATTERN) or "launcher missing", wall)
        return failed("crash", _last_line(log, RANK_ERROR) or _last_line(log, EXCEPTION_LINE)
                      or _last_line(log, re.compile(r"Error|error"))
                      or f"exit code {rc}", wall)
    try:  # the one reader and the one summary, as advise uses them
        files = sorted(trial_dir.glob("metrics-rank*.csv"))
        summaries = summarize_columns(read_trial_columns(files), source=str(trial_dir)) if files else []
    except InputFileError as exc:
        return failed("no_metrics", str(exc), wall)
    summary = summaries[0] if summaries else None
    if summary is None:
        return failed("no_metrics", "the trial exited 0 but wrote no measured step", wall)
    summary.startup_seconds = read_startup(trial_dir)
    record = read_record(trial_dir)  # how the ranks ended the steps (autotune/core/step_budget.py)
    if record is not None:
        summary.stopped_early = bool(record.get("stopped_early"))
        summary.steps_ended_by = record.get("reason")
    return TrialOutcome(
        result=TrialResult(status=STATUS_OK, samples_per_second=summary.samples_per_second, summary=summary),
        summary=summary, failure_detail=None, wall_seconds=wall,
    )


def read_startup(trial_dir: Path) -> float | None:
    """The slowest rank's measured start-up (startup-rankR.json, autotune/rank/watchdog.py)."""
    values = []
    for p in trial_dir.glob("startup-rank*.json"):
        try:
            values.append(float(json.loads(p.read_text(encoding="utf-8"))["seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max(values) if values else None


def _signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


def failed(reason: str, detail: str, wall: float) -> TrialOutcome:
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
