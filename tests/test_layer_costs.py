"""Per-layer costs (autotune/rank/layer_costs.py): the file format, and the truth on real runs.

The slow tests inject a known per-layer cost (the workload's `slow_layer` hook makes one
layer's forward take FACTOR times as long) and check that the measured layer costs name
that layer and its stage, that the solver moves layers off that stage, and that a tuning
run with --balance-stages runs the balanced partition as a trial.
"""

from __future__ import annotations

import csv
import json
import statistics

import pytest
from launch_helpers import autotune_cli, pipeline_config, run_ranks
from robust_helpers import write_config
from shared_studies import USER_PARTS

from autotune.core.errors import InputFileError
from autotune.core.partition import balanced_parts, stage_times
from autotune.rank.layer_costs import COLUMNS, read_layer_costs, read_trial_layer_costs, rows_to_csv
from autotune.rank.wiring import LAYER_COST_STEPS
from autotune.rank.workload.presets import get_preset

FACTOR = 20
"""Large against a tiny layer's few milliseconds, so a shared machine's preemptions cannot hide it."""
SLOW_LAYER = 1  # the first decoder layer of `tiny`: on stage 0 with the uniform partition [0, 3, 6]


def _row(stage: int, layer: int, fwd: float, **kw) -> dict:
    return {"rank": stage, "stage": stage, "stages": 2, "layer": layer, "name": "L", "forward_seconds": fwd,
            "backward_seconds": 2 * fwd, "parameters": 10, "activation_bytes": 100,
            "stage_overhead_seconds": 0.5 * stage, "stage_peak_memory_bytes": 1e6 + stage,
            "peak_memory_kind": "process_max_rss", "micro_batch_size": 2, "gradient_accumulation_steps": 4,
            "steps": 3, **kw}


def test_files_of_all_stages_merge_into_one_model(tmp_path):
    (tmp_path / "layer-costs-rank0.csv").write_text(rows_to_csv([_row(0, 0, 1.0), _row(0, 1, 1.0)]))
    (tmp_path / "layer-costs-rank1.csv").write_text(rows_to_csv([_row(1, 2, 3.0)]))
    lc = read_trial_layer_costs(tmp_path)
    assert lc.parts == [0, 2, 3]
    assert lc.costs == [3.0, 3.0, 9.0]
    assert lc.stage_fixed_seconds == [0.0, 0.5]
    assert lc.stage_peak_memory_bytes == [1e6, 1e6 + 1]
    assert balanced_parts(lc.costs, 2, stage_fixed=lc.stage_fixed_seconds) == [0, 2, 3]


def test_a_missing_stage_or_a_foreign_file_is_said(tmp_path):
    f0 = tmp_path / "layer-costs-rank0.csv"
    f0.write_text(rows_to_csv([_row(0, 0, 1.0)]))
    with pytest.raises(InputFileError, match="every stage's file is needed"):
        read_layer_costs([f0])
    bad = tmp_path / "other.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(InputFileError, match="not a layer-costs file"):
        read_layer_costs([bad])


@pytest.mark.slow
def test_injected_slow_layer_is_named_and_moved(tmp_path):
    _, summary, rc = run_ranks(tmp_path, pipeline_config(4, 4), preset="tiny", steps=4, warmup=1,
                               partition_method="uniform", layer_costs=True, slow_layer=SLOW_LAYER,
                               slow_factor=FACTOR)
    assert rc == 0
    files = sorted(tmp_path.glob("layer-costs-rank*.csv"))
    assert [f.name for f in files] == ["layer-costs-rank0.csv", "layer-costs-rank1.csv"]
    assert files[0].read_text().splitlines()[0] == ",".join(COLUMNS)
    lc = read_trial_layer_costs(tmp_path)
    assert lc.parts == [0, 3, 6]
    decoders = [i for i, n in enumerate(lc.names) if n == "DecoderLayerPipe"]
    assert decoders == [1, 2, 3, 4]
    others = statistics.median(lc.forward_seconds[i] for i in decoders if i != SLOW_LAYER)
    # the injected layer's forward is FACTOR x its own; at least half of that shows
    assert lc.forward_seconds[SLOW_LAYER] > FACTOR / 2 * others
    assert max(range(len(lc.costs)), key=lc.costs.__getitem__) == SLOW_LAYER
    times = stage_times(lc.costs, lc.parts, lc.stage_fixed_seconds)
    assert times.index(max(times)) == 0 == summary.slowest_stage
    parts = balanced_parts(lc.costs, 2, stage_fixed=lc.stage_fixed_seconds)
    assert parts[1] < 3  # layers move off the slow stage
    h, f = get_preset("tiny").hidden_size, get_preset("tiny").ffn_size
    assert lc.parameters[SLOW_LAYER] == 2 * h + 4 * h * h + 3 * h * f
    assert all(lc.activation_bytes[i] > 0 for i in decoders)
    assert all(m > 0 for m in lc.stage_peak_memory_bytes) and lc.peak_memory_kind == "process_max_rss"
    # measured in a block after the measured steps, outside every figure: the metrics CSVs hold the
    # warm-up and the 4 measured steps only, and the costs are medians over the block's steps
    for rank in (0, 1):
        rows = list(csv.DictReader((tmp_path / f"metrics-rank{rank}.csv").open()))
        assert [int(r["warmup"]) for r in rows] == [1, 0, 0, 0, 0]
    assert {r["steps"] for f in files for r in csv.DictReader(f.open())} == {str(LAYER_COST_STEPS)}


@pytest.mark.slow
def test_tuning_run_balances_an_unbalanced_baseline(tmp_path):
    cfg = write_config(tmp_path)
    study = tmp_path / "study"
    proc = autotune_cli("run", "--study", str(study), "--config", str(cfg), "--budget", "2", "--tuner", "random",
                        "--preset", "tiny", "--stages", "2", "--dp", "1", "--steps", "4", "--warmup-steps", "1",
                        "--partition-method", "uniform",
                        "--balance-stages", "--slow-layer", str(SLOW_LAYER), "--slow-factor", str(FACTOR),
                        "--workers", "fresh", "--no-metrics", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in (study / "trial-000").glob("layer-costs-rank*.csv")) == [
        "layer-costs-rank0.csv", "layer-costs-rank1.csv"]
    decision = json.loads((study / "partition.json").read_text())
    first = decision["rounds"][0]
    assert decision["measured_parts"] == [0, 3, 6] and first["parts"][1] < 3 and first["trial"] == 1
    spec = json.loads((study / "trial-001" / "trial.json").read_text())
    assert spec["workload"]["partition_method"] == "parts:" + ",".join(map(str, first["parts"]))
    assert decision["decision"] in ("kept", "rejected")
    assert "partition" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_users_script_gets_the_hooks_and_the_parts(usercmd_study):
    """An unmodified user script (the session's user-command study, tests/shared_studies.py, run
    with --layer-costs --partition-method parts:0,2,6): the bootstrap builds its PipelineModule
    with the given parts (its own code asks for `parameters`) and the layer-cost sink rides on
    its engine."""
    proc = usercmd_study
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lc = read_trial_layer_costs(usercmd_study.study / "trial-000")
    assert "parts:" + ",".join(map(str, lc.parts)) == USER_PARTS == "parts:0,2,6"
    assert lc.names[0] == "Embedding" and lc.names[-1] == "Head"
    assert all(f > 0 for f in lc.forward_seconds) and all(b > 0 for b in lc.backward_seconds[1:])
