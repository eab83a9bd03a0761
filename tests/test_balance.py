"""The partition step of a tuning run (autotune/balance.py), decision by decision, without DeepSpeed.

The layer costs are real layer-cost files in a real study folder; the runner is the built-in
TrialRunner (nothing is launched: only its workload is read and replaced)."""

from __future__ import annotations

import json

from builders import healthy_summary

from autotune.balance import SOURCE, StageBalancer
from autotune.dsconfig import DsConfig
from autotune.layer_costs import rows_to_csv
from autotune.options import WorkloadOptions
from autotune.proposers.base import Proposal
from autotune.space import TrialConfig
from autotune.trial import TrialRunner

CFG = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4)


def _costs(folder, parts, costs, *, activation=1, peaks=None, kind="process_max_rss"):
    folder.mkdir(parents=True)
    for s in range(len(parts) - 1):
        rows = [{"rank": s, "stage": s, "stages": len(parts) - 1, "layer": i, "name": f"L{i}",
                 "forward_seconds": costs[i] / 2, "backward_seconds": costs[i] / 2, "parameters": 1,
                 "activation_bytes": activation, "stage_overhead_seconds": 0.0,
                 "stage_peak_memory_bytes": peaks[s] if peaks else 1.0,
                 "peak_memory_kind": kind, "micro_batch_size": 2, "gradient_accumulation_steps": 4,
                 "steps": 2} for i in range(parts[s], parts[s + 1])]
        (folder / f"layer-costs-rank{s}.csv").write_text(rows_to_csv(rows))


def _runner():
    wl = WorkloadOptions(preset="tiny", pipeline_stages=2, partition_method="uniform", workers="fresh")
    return TrialRunner(wl, DsConfig.from_dict({"train_micro_batch_size_per_gpu": 2,
                                               "gradient_accumulation_steps": 4}))


def test_unbalanced_baseline_gets_one_partition_trial_kept_when_faster(tmp_path):
    _costs(tmp_path / "trial-000", [0, 3, 6], [1, 1, 1, 1, 1, 4])
    runner = _runner()
    b = StageBalancer(runner, tmp_path, note=lambda _: None)
    base = Proposal(config=CFG, source="baseline")
    b.before(0, base)
    assert runner.workload.layer_costs and runner.workload.partition_method == "uniform"
    b.after(0, base, True, 10.0, healthy_summary(stage_compute_imbalance=1.4, slowest_stage=1))
    p = b.next_proposal()
    assert p is not None and p.source == SOURCE and p.config == CFG and "stage 1" in p.reason
    assert b.next_proposal() is None  # once
    b.before(1, p)
    assert runner.workload.partition_method == "parts:0,4,6" and runner.workload.layer_costs
    b.after(1, p, True, 12.0, healthy_summary())
    later = Proposal(config=CFG, source="bayes")
    b.before(2, later)
    assert runner.workload.partition_method == "parts:0,4,6" and not runner.workload.layer_costs
    decision = json.loads((tmp_path / "partition.json").read_text())
    assert decision["decision"] == "kept" and decision["parts"] == [0, 4, 6]
    assert decision["measured_parts"] == [0, 3, 6] and "layer 3" in decision["rounds"][0]["moves"]
    assert decision["rounds"][0]["kept"] is True and decision["kept_samples_per_second"] == 12.0


def test_a_kept_partition_still_unbalanced_gets_one_more_round_from_its_own_costs(tmp_path):
    _costs(tmp_path / "trial-000", [0, 3, 6], [1, 1, 1, 1, 1, 4])
    _costs(tmp_path / "trial-001", [0, 4, 6], [2, 2, 2, 2, 1, 3])  # stage 0 dearer than predicted
    runner = _runner()
    b = StageBalancer(runner, tmp_path, note=lambda _: None)
    base = Proposal(config=CFG, source="baseline")
    b.after(0, base, True, 10.0, healthy_summary(stage_compute_imbalance=1.4, slowest_stage=1))
    p1 = b.next_proposal()
    b.after(1, p1, True, 12.0, healthy_summary(stage_compute_imbalance=1.3, slowest_stage=0))
    p2 = b.next_proposal()
    assert p2 is not None and p2.source == SOURCE and "trial 1" in p2.reason
    b.before(2, p2)
    second = runner.workload.partition_method
    assert second.startswith("parts:") and second != "parts:0,4,6"
    b.after(2, p2, True, 11.0, healthy_summary(stage_compute_imbalance=1.2, slowest_stage=0))
    assert b.next_proposal() is None  # MAX_ROUNDS spent
    b.before(3, Proposal(config=CFG, source="bayes"))
    assert runner.workload.partition_method == "parts:0,4,6"  # the faster of the two stays


def test_a_slower_partition_is_dropped_and_a_balanced_baseline_is_left_alone(tmp_path):
    _costs(tmp_path / "trial-000", [0, 3, 6], [1, 1, 1, 1, 1, 4])
    runner = _runner()
    b = StageBalancer(runner, tmp_path, note=lambda _: None)
    base = Proposal(config=CFG, source="baseline")
    b.after(0, base, True, 10.0, healthy_summary(stage_compute_imbalance=1.4, slowest_stage=1))
    p = b.next_proposal()
    b.after(1, p, True, 9.0, healthy_summary())
    b.before(2, Proposal(config=CFG, source="bayes"))
    assert runner.workload.partition_method == "uniform"
    decision = json.loads((tmp_path / "partition.json").read_text())
    assert decision["decision"] == "rejected" and decision["parts"] is None

    other = StageBalancer(_runner(), tmp_path / "b", note=lambda _: None)
    (tmp_path / "b").mkdir()
    other.after(0, base, True, 10.0, healthy_summary(stage_compute_imbalance=1.05))
    assert other.next_proposal() is None


def test_a_resume_rebuilds_the_decision_from_the_study(tmp_path):
    from types import SimpleNamespace

    _costs(tmp_path / "trial-000", [0, 3, 6], [1, 1, 1, 1, 1, 4])
    row = lambda n, source, sps: SimpleNamespace(  # noqa: E731 - the study's TrialRow fields used
        number=n, status="ok", source=source, config=CFG, samples_per_second=sps,
        summary=healthy_summary(stage_compute_imbalance=1.4, slowest_stage=1).to_dict())
    runner = _runner()
    b = StageBalancer(runner, tmp_path, note=lambda _: None)
    b.replay([row(0, "baseline", 10.0), row(1, SOURCE, 12.0)], [])
    assert b.next_proposal() is None
    b.before(2, Proposal(config=CFG, source="bayes"))
    assert runner.workload.partition_method == "parts:0,4,6"
    half = StageBalancer(_runner(), tmp_path, note=lambda _: None)
    half.replay([row(0, "baseline", 10.0)], [])
    assert half.next_proposal().source == SOURCE  # baseline done, partition trial not yet


def _gpu_baseline(tmp_path, capacity):
    """Stage 0 of [0, 3, 6] holds 2 micro-batches of activations in flight (1F1B, 2 stages):
    3 x 1 GB x 2 + 1 GB of its own (measured peak 7 GB); stage 1 3 x 1 GB + 1 GB (4 GB)."""
    _costs(tmp_path / "trial-000", [0, 3, 6], [1, 1, 1, 1, 1, 4], activation=10**9,
           peaks=[7e9 + 48, 4e9 + 48], kind="cuda_max_allocated")
    notes: list[str] = []
    b = StageBalancer(_runner(), tmp_path, note=notes.append)
    b.after(0, Proposal(config=CFG, source="baseline"), True, 10.0,
            healthy_summary(stage_compute_imbalance=1.4, slowest_stage=1, memory_capacity_bytes=capacity))
    return b, notes, json.loads((tmp_path / "partition.json").read_text())


def test_on_a_gpu_the_partition_must_fit_the_devices_memory(tmp_path):
    # Unconstrained, layer 3 moves to stage 0 ([0, 4, 6]): 4 x 2 GB + 1 GB = 9 GB there.
    b, _, _ = _gpu_baseline(tmp_path / "roomy", capacity=20e9)
    assert b.next_proposal().reason.count("[0, 4, 6]") == 1
    # With 8.5 GB (7.65 GB usable) it does not fit, and nothing faster that fits exists.
    b, _, decision = _gpu_baseline(tmp_path / "tight", capacity=8.5e9)
    assert b.next_proposal() is None and decision["decision"] == "no better contiguous partition"
    # Below the measured layout's own need nothing fits: said, and the partition stays.
    b, notes, decision = _gpu_baseline(tmp_path / "none", capacity=4e9)
    assert b.next_proposal() is None and decision["decision"] == "no partition fits the device's memory"
    assert any("fits" in n for n in notes)

