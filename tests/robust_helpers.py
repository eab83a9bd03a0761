"""Helpers for the robustness tests: a small fast study setup and process accounting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from autotune.study.store import open_study_readonly
from autotune.trials.launcher import processes_with

FAST = ["--dp", "1", "--steps", "2", "--warmup-steps", "1", "--fixed-steps"]  # exactly 2: fast, countable
FAST_CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10**9}


def write_config(folder: Path, **extra) -> Path:
    p = folder / "ds_config.json"
    p.write_text(json.dumps({**FAST_CONFIG, **extra}))
    return p


def start_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})


def rows(study: Path) -> list[tuple]:
    """(number, status, failure_reason, pgid) of every trial row, in the order they started: read
    as every reader reads a study, read-only (a live run may hold it); StudyError until it is one."""
    st = open_study_readonly(study)
    try:
        return [(t.number, t.status, t.failure_reason, t.pgid) for t in st.trials()]
    finally:
        st.close()


def alive_under(path: Path) -> list[int]:
    """Live processes whose command line names anything under `path` (ranks, launchers)."""
    return processes_with(str(path.resolve()))
