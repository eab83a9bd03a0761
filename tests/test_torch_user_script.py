"""The user's own torch.distributed.pipelining script at the start-up check (issue 43, first step).

examples/torch_pipeline_train.py, unmodified, through `autotune run -- torchrun ...`: the
bootstrap reads the schedule object the script builds (autotune/rank/torch_schedule_probe.py)
and stops every rank before its first step; the run says what it read and that such a script
cannot be tuned yet, in one line and exit 2, where it used to fail as `no_engine`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from launch_helpers import autotune_cli

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "torch_pipeline_train.py"


@pytest.mark.slow
def test_the_start_up_check_reads_a_torch_pipelining_script_and_refuses_in_one_line(tmp_path):
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = autotune_cli("run", "--budget", "2", "--study", str(tmp_path / "st"), "--",
                        "torchrun", "--nproc-per-node", "2", str(SCRIPT), "--schedule", "GPipe",
                        "--n-microbatches", "4", "--batch", "24", "--layers", "6", cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error:"), proc.stderr
    line = lines[0]
    assert "Traceback" not in proc.stderr and "no_engine" not in line
    parameters = 6 * (64 * 64 + 64)  # the script's six Linear(64, 64) layers, over both stages
    for read in ("2 stages (1 per rank)", "schedule ScheduleGPipe", "n_microbatches 4",
                 "micro-batch 6 (the step's batch 24 over 4)", "data-parallel 1", f"{parameters:,} parameters",
                 "issue 43"):
        assert read in line, (read, line)
    assert not (tmp_path / "st").exists()


def _losses(text: str) -> list[float]:
    """The script's own `step N loss X` lines."""
    import re

    return [float(x) for x in re.findall(r"^step \d+ loss ([\d.]+)$", text, flags=re.M)]


@pytest.mark.slow
def test_watch_instruments_the_users_schedule_and_leaves_its_training_unchanged(tmp_path):
    """`autotune watch -- torchrun ...` on the unmodified script, 3 ranks: every step of its own loop is
    a CSV row with the pipeline's layout read from its objects (the middle stage, whose `step()`
    gets no batch, too), the point-to-point time split out, and the loss the last stage computed. Parity: fp32, the same seed: the losses it prints under watch
    are the losses it prints alone (the instrumentation only times; tolerance 1e-6 relative)."""
    import csv
    import subprocess

    from autotune.trials.launcher import free_port

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}
    script = [str(SCRIPT), "--schedule", "1F1B", "--n-microbatches", "4", "--batch", "16", "--steps", "8",
              "--layers", "6"]
    alone = subprocess.run(["torchrun", "--nproc-per-node", "3", "--master-port", str(free_port()), *script], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300, env=env)
    assert alone.returncode == 0, alone.stderr[-2000:]
    proc = autotune_cli("watch", "--out", str(tmp_path / "w"), "--no-metrics", "--warmup-steps", "1", "--",
                        "torchrun", "--nproc-per-node", "3", *script, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("the job: a torch.distributed.pipelining schedule, Schedule1F1B: 3 pipeline ranks x 1 data-parallel, "
            "n_microbatches 4") in proc.stdout
    run = tmp_path / "w" / "run-001"
    own, watched = _losses(alone.stdout), _losses((run / "launcher.log").read_text())
    assert len(own) == len(watched) == 8
    assert watched == pytest.approx(own, rel=1e-6)
    for rank in (0, 1, 2):
        rows = list(csv.DictReader((run / f"metrics-rank{rank}.csv").open()))
        assert [int(r["step"]) for r in rows] == list(range(8)) and [r["warmup"] for r in rows].count("1") == 1
        assert {(r["stage"], r["pipeline_stages"], r["micro_batch_size"], r["gradient_accumulation_steps"],
                 r["data_parallel_size"]) for r in rows} == {(str(rank), "3", "4", "4", "1")}
        assert all(float(r["step_seconds"]) > float(r["compute_seconds"]) > 0 for r in rows)
        assert all(float(r["p2p_seconds"]) > 0 for r in rows)  # the stages' sends and receives, timed
        logged = [float(r["loss"]) for r in rows if r["loss"]]
        if rank == 2:  # the last stage computes the loss
            assert logged == pytest.approx(own, rel=1e-4)
        else:
            assert logged == []
    assert (run / "findings.json").is_file()
