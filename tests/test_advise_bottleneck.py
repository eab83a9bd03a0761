"""The bottleneck advice against an injected ground truth (fast: built inputs, in-process CLI).

nvidia-smi logs with one device made busier than the others, and metrics CSVs with one
stage made slower: the finding must name exactly that device / stage / ranks and the
injected ratio; a balanced input must name none. A slow test does the same on a real
2-rank DeepSpeed run with a slowed stage.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import click
import pytest
from builders import csv_text, record
from click.testing import CliRunner

from autotune.cli.advise import advise_command

SMI_HEADER = "timestamp, index, name, pci.bus_id, utilization.gpu [%], memory.used [MiB], memory.total [MiB]\n"


@click.group()
def cli() -> None:
    """Local group: the lead registers the commands in autotune.cli.main."""


cli.add_command(advise_command)


def advise(*args) -> dict:
    r = CliRunner().invoke(cli, ["advise", "--format", "json", *map(str, args)])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def finding(data: dict, rule_id: str) -> dict | None:
    got = [f for f in data["findings"] if f["rule_id"] == rule_id and f["status"] == "fired"]
    assert len(got) <= 1
    return got[0] if got else None


def smi_log(path: Path, means: list[float], *, samples: int = 30, noise: float = 0.04, seed: int = 0,
            spike_device: int | None = None) -> Path:
    """An nvidia-smi `-l` log of len(means) GPUs; utilization = mean + uniform noise (0-1 means).
    `spike_device`: that device is far busier in one sampling round only."""
    rnd = random.Random(seed)
    lines = [SMI_HEADER]
    for k in range(samples):
        for g, m in enumerate(means):
            u = m + rnd.uniform(-noise, noise)
            if spike_device == g and k == 3:
                u = 1.0
            u = min(1.0, max(0.0, u))
            lines.append(f"2026/12/01 10:00:{k:02d}.000, {g}, NVIDIA H200, 00000000:{0x18 + g:02X}:00.0, "
                         f"{round(u * 100)} %, 1000 MiB, 143771 MiB\n")
    path.write_text("".join(lines))
    return path


@pytest.mark.parametrize("devices,hot", [(2, 1), (4, 2), (8, 5)])
def test_the_busy_device_is_named_with_its_lead(tmp_path, devices, hot):
    means = [0.5] * devices
    means[hot] = 0.9
    data = advise(smi_log(tmp_path / "smi.csv", means))
    f = finding(data, "bottleneck-device")
    assert f is not None
    ev = f["evidence"][0]
    assert ev["devices"] == [f"gpu{hot}"] and ev["stages"] == [] and ev["ranks"] == []
    assert ev["measured"] == pytest.approx(0.9 / 0.5, rel=0.05)
    assert f"gpu{hot} (NVIDIA H200, 00000000:{0x18 + hot:02X}:00.0)" in ev["detail"]
    assert "over 30 samples" in ev["detail"] and f"{30 * (devices - 1)} samples" in ev["detail"]
    assert "pass --stages N" in ev["detail"]
    targets = [c["target"] for c in f["changes"]]
    assert targets == ["PipelineModule:partition_method", f"the stage on gpu{hot}"]


@pytest.mark.parametrize("devices,stages,hot_stage", [(4, 4, 2), (4, 2, 1), (8, 2, 0), (8, 4, 3)])
def test_stages_name_the_stage_as_deepspeed_maps_ranks(tmp_path, devices, stages, hot_stage):
    """PipeDataParallelTopology (axes pipe, data): rank = stage x dp + data, so stage = rank // dp.
    A slow stage keeps every one of its dp devices busy: the stage's devices are compared with the rest."""
    dp = devices // stages
    hot = [d for d in range(devices) if d // dp == hot_stage]
    means = [0.9 if d in hot else 0.45 for d in range(devices)]
    data = advise(smi_log(tmp_path / "smi.csv", means), "--stages", stages)
    f = finding(data, "bottleneck-device")
    assert f is not None
    ev = f["evidence"][0]
    assert ev["devices"] == sorted(f"gpu{d}" for d in hot) and ev["ranks"] == hot and ev["stages"] == [hot_stage]
    assert ev["measured"] == pytest.approx(2.0, rel=0.05)
    assert f"stage {hot_stage} of {stages}" in ev["detail"] and f"over {30 * dp} samples" in ev["detail"]
    move = next(c for c in f["changes"] if c["target"].startswith("pipeline stage"))
    assert move["target"] == f"pipeline stage {hot_stage}"
    share = 1 - 1 / (stages * 2.0 / (2.0 + stages - 1))  # to the mean stage
    assert f"{share:.0%}" in move["new"]


def test_a_balanced_log_names_no_device(tmp_path):
    data = advise(smi_log(tmp_path / "smi.csv", [0.7, 0.72, 0.69, 0.71]))
    assert finding(data, "bottleneck-device") is None
    assert not [f for f in data["findings"] if f["rule_id"] == "bottleneck-device"]  # decided, not insufficient


def test_a_single_spike_is_not_a_bottleneck(tmp_path):
    """Far above the others in one round of 30, level otherwise: it does not *stay* above."""
    data = advise(smi_log(tmp_path / "smi.csv", [0.6, 0.6], samples=5, noise=0.0, spike_device=0))
    f = [x for x in data["findings"] if x["rule_id"] == "bottleneck-device"]
    assert f == []


def test_stage_timing_rules_stay_insufficient_on_a_device_log(tmp_path):
    data = advise(smi_log(tmp_path / "smi.csv", [0.9, 0.5]))
    status = {f["rule_id"]: f for f in data["findings"]}
    assert status["stage-imbalance"]["status"] == "insufficient_data"
    assert status["comm-compute-high"]["status"] == "insufficient_data"
    assert "nvidia-smi" in json.dumps(status["stage-imbalance"]["missing"])


def test_stages_that_do_not_divide_the_devices_are_refused(tmp_path):
    r = CliRunner().invoke(cli, ["advise", str(smi_log(tmp_path / "smi.csv", [0.9, 0.5, 0.5])), "--stages", "2"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "not a multiple of 2" in r.output


def test_config_gives_the_numbers(tmp_path):
    """With --config: the method the user wrote (an ignored pipeline key) becomes the current value,
    the micro-batch moves get numbers, and the patch removes what DeepSpeed ignores."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
                               "pipeline": {"partition_method": "uniform"}}))
    log = smi_log(tmp_path / "smi.csv", [0.5, 0.95, 0.5, 0.5], noise=0.3)
    out = tmp_path / "new.json"
    data = advise(log, "--stages", 4, "--config", cfg, "--write-config", out)
    f = finding(data, "bottleneck-device")
    method = f["changes"][0]
    assert (method["current"], method["new"]) == ("uniform", "parameters")
    assert "not a ds_config key" in method["note"]
    fl = finding(data, "utilization-fluctuation")
    assert fl is not None and {(c["current"], c["new"]) for c in fl["changes"]} == {(4, 8), (4, 2)}
    bubble = finding(data, "bubble-ideal-above-target")  # GAS 8 on 4 stages: ideal bubble 3/11
    assert bubble is not None and (bubble["changes"][0]["current"], bubble["changes"][0]["new"]) == (8, 12)
    assert "pipeline" not in json.loads(out.read_text()) or "partition_method" not in json.loads(out.read_text())["pipeline"]


def test_without_config_a_scale_move_is_a_factor_not_no_change(tmp_path):
    data = advise(smi_log(tmp_path / "smi.csv", [0.9, 0.3], noise=0.3))
    f = finding(data, "utilization-fluctuation")
    assert f is not None and f["changes"]
    assert {c["new"] for c in f["changes"]} == {"2x the current value", "1/2 the current value"}
    assert all(c["kind"] == "advice" for c in f["changes"])


# -- metrics CSV: the stage is timed -------------------------------------------------------
def metrics_job(folder: Path, stage_compute: list[float], *, dp: int = 1, step: float = 2.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = len(stage_compute)
    for r in range(p * dp):
        st = r // dp
        recs = [record(trial=-1, rank=r, stage=st, step=s, warmup=int(s == 0), step_seconds=step,
                       compute_seconds=stage_compute[st], wait_seconds=step - stage_compute[st] - 0.05,
                       pipeline_stages=p, data_parallel_size=dp, gradient_accumulation_steps=4 * p)
                for s in range(5)]
        (folder / f"metrics-rank{r}.csv").write_text(csv_text(recs))
    return folder


@pytest.mark.parametrize("stage_compute,dp,slow", [([0.5, 0.9], 1, 1), ([0.9, 0.5, 0.5, 0.5], 2, 0),
                                                   ([0.4, 0.4, 0.8, 0.4], 1, 2)])
def test_the_slow_stage_is_named_with_its_ranks_and_share(tmp_path, stage_compute, dp, slow):
    data = advise(metrics_job(tmp_path / "run", stage_compute, dp=dp))
    f = finding(data, "stage-imbalance")
    assert f is not None
    ev = f["evidence"][0]
    mean = sum(stage_compute) / len(stage_compute)
    assert ev["stages"] == [slow] and ev["ranks"] == [slow * dp + d for d in range(dp)]
    assert ev["measured"] == pytest.approx(stage_compute[slow] / mean, rel=0.02)
    assert f"bottleneck stage {slow}" in ev["detail"]
    assert f"{stage_compute[slow] / 2.0:.0%} of the 2 s step" in ev["detail"]
    assert f"{stage_compute[slow] / mean:.2f}x the mean stage" in ev["detail"]
    move = next(c for c in f["changes"] if c["target"] == f"pipeline stage {slow}")
    assert f"{1 - mean / stage_compute[slow]:.0%}" in move["new"]
    assert f["changes"][0]["target"] == "PipelineModule:partition_method"
    assert finding(data, "bottleneck-device") is None
    assert not [x for x in data["findings"] if x["rule_id"] == "bottleneck-device"]  # timed: not even insufficient


def test_a_balanced_job_names_no_stage(tmp_path):
    data = advise(metrics_job(tmp_path / "run", [0.6, 0.62, 0.6, 0.61]))
    assert finding(data, "stage-imbalance") is None


@pytest.mark.slow
def test_a_real_slowed_stage_is_named(tmp_path):
    """2 ranks of the built-in workload, stage 1 made 3x slower on every step: advise on the
    two per-rank files (merged as one job) names stage 1 and rank 1."""
    from launch_helpers import pipeline_config, run_ranks

    _, summary, rc = run_ranks(tmp_path, pipeline_config(4, 4), steps=6, partition_method="uniform",
                               slow_stage=1, slow_factor=3, slow_every=1)
    assert rc == 0 and summary is not None
    files = sorted(tmp_path.glob("metrics-rank*.csv"))
    assert len(files) == 2
    data = advise(*files)
    f = finding(data, "stage-imbalance")
    assert f is not None and f["evidence"][0]["stages"] == [1] and f["evidence"][0]["ranks"] == [1]
    assert f["subject"] == "metrics-rank0.csv + 1 more"
    assert f["evidence"][0]["measured"] == pytest.approx(summary.stage_compute_imbalance)


def write_layer_costs(folder: Path, costs: list[float], parts: list[int]) -> None:
    from autotune.rank.layer_costs import rows_to_csv

    stages = len(parts) - 1
    for st in range(stages):
        rows = [{"rank": st, "stage": st, "stages": stages, "layer": i, "name": "Block",
                 "forward_seconds": costs[i] / 3, "backward_seconds": 2 * costs[i] / 3, "parameters": 1000,
                 "activation_bytes": 4096, "stage_overhead_seconds": 0.0, "stage_peak_memory_bytes": 1e9,
                 "peak_memory_kind": "process_max_rss", "micro_batch_size": 4, "gradient_accumulation_steps": 8,
                 "steps": 5} for i in range(parts[st], parts[st + 1])]
        (folder / f"layer-costs-rank{st}.csv").write_text(rows_to_csv(rows))


def test_layer_cost_files_give_the_proposed_parts(tmp_path):
    """Stage 1's four layers cost 3x stage 0's: the balanced contiguous split moves layer 4 to stage 0."""
    run = metrics_job(tmp_path / "run", [0.2, 0.6])
    write_layer_costs(run, [0.05] * 4 + [0.15] * 4, [0, 4, 8])
    data = advise(run)
    f = finding(data, "stage-imbalance")
    parts = next(c for c in f["changes"] if c["target"] == "PipelineModule parts")
    assert parts["current"] == [0, 4, 8] and parts["new"] == [0, 5, 8]
    assert "layer 4 (Block): stage 1 -> 0" in parts["note"] and "0.6 s -> 0.45 s" in parts["note"]
    assert not any("layer-costs" in s for s in data["sources"])  # read by the advice, not as inputs


def test_without_layer_cost_files_no_parts_are_made_up(tmp_path):
    data = advise(metrics_job(tmp_path / "run", [0.2, 0.6]))
    f = finding(data, "stage-imbalance")
    assert "PipelineModule parts" not in {c["target"] for c in f["changes"]}


def test_unreadable_layer_costs_are_one_line(tmp_path):
    run = metrics_job(tmp_path / "run", [0.2, 0.6])
    (run / "layer-costs-rank0.csv").write_text("rank,stage\n0,0\n")
    r = CliRunner().invoke(cli, ["advise", str(run)])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "layer costs beside the metrics" in r.output


@pytest.mark.parametrize("method,new", [("parameters", "uniform"), ("uniform", "parameters"),
                                        ("type:Block", "parameters"), ("parts:0,3,8", "uniform")])
def test_the_other_built_in_method_is_proposed(tmp_path, method, new):
    trial = metrics_job(tmp_path / "study" / "trial-000", [0.2, 0.6])
    for f in trial.glob("metrics-rank*.csv"):
        f.write_text(f.read_text().replace("\n1700000000.0,-1,", "\n1700000000.0,0,"))
    (trial / "trial.json").write_text(json.dumps({"workload": {"partition_method": method}}))
    f = finding(advise(trial), "stage-imbalance")
    assert f["subject"] == "trial 0"
    change = f["changes"][0]
    assert (change["current"], change["new"]) == (method, new) and "as the trial's model was built" in change["note"]
