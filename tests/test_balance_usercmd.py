"""`autotune run --balance-stages -- deepspeed SCRIPT ...`: the partition step on a user's own script.

The script (tests/usercmd_scripts/uneven_pipeline.py) is unmodified and uneven by
construction: layer 1 runs its MLP LOOPS (5) times, a block's parameters with five blocks'
compute, and the script's own `uniform` partition [0, 4, 8] leaves it on stage 0 with two
more blocks. That is the injected ground truth: stage 0 is the bottleneck, and the balanced
parts hand the looped layer's neighbours (layers 2 and 3 predicted, layer 3 at least) to
stage 1 while the looped layer stays. The bootstrap forces the parts on the script's PipelineModule; the
trial's engine markers say which layers each stage really built. Work figures (thread CPU
time) are asserted with margin, the throughput decision only for consistency: on shared
cores either decision can be right.
"""

from __future__ import annotations

import json
import os
import sqlite3
import statistics
import sys
from pathlib import Path

import pytest
from launch_helpers import autotune_cli

from autotune.rank.layer_costs import read_trial_layer_costs
from autotune.tuning.balance import THRESHOLD

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parent / "usercmd_scripts" / "uneven_pipeline.py"
HEAVY, LOOPS = 1, 5  # as in the script
SCRIPT_PARTS = [0, 4, 8]  # DeepSpeed's uniform partition of its 8 layers over 2 stages


def _env() -> dict[str, str]:
    return {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def balanced_study(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("balance-usercmd")
    (cwd / "ds.json").write_text(json.dumps({
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 1000000}))
    proc = autotune_cli("run", "--budget", "2", "--study", "st", "--steps", "6", "--warmup-steps", "1",
                        "--fixed-steps", "--trial-timeout", "600", "--no-metrics", "--balance-stages", "--",
                        "deepspeed", "--num_gpus", "2", str(SCRIPT), "--deepspeed_config", "ds.json",
                        "--steps", "100000", cwd=cwd, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = cwd / "st"
    db = sqlite3.connect(study / "study.db")
    try:
        rows = db.execute("SELECT number, status, source, summary_json FROM trials ORDER BY number").fetchall()
    finally:
        db.close()
    return study, proc, rows, json.loads((study / "partition.json").read_text())


def test_the_partition_trial_ran_the_users_script_with_explicit_parts(balanced_study):
    study, _, rows, decision = balanced_study
    assert [(r[0], r[1], r[2]) for r in rows] == [(0, "ok", "baseline"), (1, "ok", "partition")]
    first = decision["rounds"][0]
    assert decision["measured_parts"] == SCRIPT_PARTS and first["trial"] == 1
    for n, parts in ((0, SCRIPT_PARTS), (1, first["parts"])):  # what each stage's engine really built
        engines = [json.loads(p.read_text()) for p in sorted((study / f"trial-{n:03d}").glob("engine-rank*.json"))]
        assert [e["parts"] for e in engines] == [parts, parts], n
        assert read_trial_layer_costs(study / f"trial-{n:03d}").parts == parts


def test_the_parts_move_the_heavy_layers_neighbours_off_the_bottleneck(balanced_study):
    study, _, _, decision = balanced_study
    lc = read_trial_layer_costs(study / "trial-000")
    blocks = statistics.median(c for i, c in enumerate(lc.costs) if lc.names[i] == "Block")
    assert lc.names[HEAVY] == "Looped" and lc.costs[HEAVY] > LOOPS / 2 * blocks  # the injected cost shows
    assert decision["slowest_stage"] == 0
    parts = decision["rounds"][0]["parts"]
    # stage 0 keeps the looped layer and gives up layer 3 at least: [0, 2, 8] predicted
    assert parts[0] == 0 and parts[2] == 8 and HEAVY < parts[1] < SCRIPT_PARTS[1]
    assert "stage 0 -> 1" in decision["rounds"][0]["moves"]


def test_the_partition_trial_measures_a_lower_stage_work_imbalance(balanced_study):
    _, _, rows, decision = balanced_study
    base, part = (json.loads(r[3])["stage_work_imbalance"] for r in rows)
    assert base > THRESHOLD and decision["measured_imbalance"] == base
    assert part < base - 0.05, (base, part)  # the margin is wide (figures in docs/partition.md)
    assert decision["rounds"][0]["measured_imbalance"] == part


def test_the_run_says_what_to_write_in_the_script(balanced_study):
    study, proc, _, decision = balanced_study
    summary = json.loads((study / "summary.json").read_text())
    report = (study / "report.md").read_text()
    parts = decision["rounds"][0]["parts"]
    assert summary["partition"] == decision
    if decision["decision"] == "kept":
        advice = decision["in_your_code"]
        assert advice["parts"] == parts and advice["builtin_parts"]["uniform"] == SCRIPT_PARTS
        assert f"PARTS = {parts}" in advice["text"]  # neither uniform nor parameters builds them
        assert summary["best"]["trial"] == 1
        for text in (proc.stdout, report):
            assert f"partition: parts {parts} kept" in text.lower() and f"PARTS = {parts}" in text
    else:
        assert decision["decision"] == "rejected" and "in_your_code" not in decision
        assert summary["best"]["trial"] == 0 and summary["best"]["measurements"] == 1  # not averaged with it
        for text in (proc.stdout, report):
            assert f"partition: parts {parts} measured" in text.lower() and "not kept" in text
