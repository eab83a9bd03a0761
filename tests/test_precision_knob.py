"""A precision knob the built-in workload's warm workers cannot change is refused before any
trial: one line naming the flag to use (--config with the precision set), exit 2, and an
existing study is left exactly as it was (autotune/usercmd/knobs.py `refuse_for_built_in`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import autotune_in_process

from autotune.study.store import Study
from autotune.usercmd.knobs import is_precision

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _autotune(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The installed command, in a subprocess."""
    return subprocess.run([sys.executable, "-m", "autotune", "run", *args], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, **ENV}, timeout=120)


@pytest.mark.parametrize("knob", ["precision:fp16,bf16=--precision {value}", "dtype:fp32,bf16=--dtype={value}",
                                  "mixed_precision:0,1=--amp {value}"])
def test_a_precision_knob_names_the_flag_to_use(tmp_path, knob):
    r = autotune_in_process("run", "--budget", "2", "--study", "st", "--knob", knob, cwd=tmp_path, env=ENV)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error: --knob "), lines
    assert "warm workers cannot change the precision" in lines[0]
    assert "--config FILE with bf16.enabled or fp16.enabled true" in lines[0]
    assert not (tmp_path / "st").exists()


def test_an_existing_study_is_not_touched(tmp_path):
    root = tmp_path / "st"
    study = Study.open(root, create=True, meta={"settings": {"budget": 3}})
    study.close()

    def files() -> dict[str, bytes]:  # a reader's SQLite -wal/-shm files are not the study's content
        return {p.name: p.read_bytes() for p in root.iterdir() if p.is_file() and not p.name.endswith(("-wal", "-shm"))}

    before = files()
    r = _autotune(tmp_path, "--study", "st", "--knob", "bf16:0,1=--bf16 {value}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert files() == before


def test_only_precision_names_get_the_precision_answer():
    assert all(is_precision(n) for n in ("precision", "dtype", "bf16", "FP16", "mixed_precision", "half"))
    assert not any(is_precision(n) for n in ("partition_method", "activation_checkpoint_interval", "lr"))
