"""The partition step of a tuning run (autotune/tuning/balance.py), decision by decision, without DeepSpeed.

The layer costs are real layer-cost files in a real study folder; the runner is the built-in
BuiltinRunner (nothing is launched: only the workload a request gives it is read)."""

from __future__ import annotations

import json

from builders import healthy_summary
from step_driver import Driven

from autotune.core.dsconfig import DsConfig
from autotune.core.measurements import superseded
from autotune.core.options import WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.rank.layer_costs import rows_to_csv
from autotune.study.partition_record import describe_result
from autotune.trials.builtin import BuiltinRunner
from autotune.tuning.balance import (
    COSTS,
    RECHECK,
    REFERENCE,
    SOURCE,
    StageBalancer,
)
from autotune.tuning.proposers.base import Proposal

CFG = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4)
BIG = TrialConfig(micro_batch_size=8, gradient_accumulation_steps=1)


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
    return BuiltinRunner(wl, DsConfig.from_dict({"train_micro_batch_size_per_gpu": 2,
                                               "gradient_accumulation_steps": 4}))


def test_unbalanced_baseline_gets_one_partition_trial_kept_when_faster(tmp_path):
    _costs(tmp_path / "trial-000", [0, 3, 6], [1, 1, 1, 1, 1, 4])
    runner = _runner()
    b = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    base = Proposal(config=CFG, source="baseline")
    wl = runner.workload_for(b.before(0, base))
    assert wl.layer_costs and wl.partition_method == "uniform"
    b.after(0, base, True, 10.0, healthy_summary(stage_compute_imbalance=1.4, slowest_stage=1))
    p = b.next_proposal()
    assert p is not None and p.source == SOURCE and p.config == CFG and "stage 1" in p.reason
    assert b.next_proposal() is None  # once
    wl = runner.workload_for(b.before(1, p))
    assert wl.partition_method == "parts:0,4,6" and wl.layer_costs
    b.after(1, p, True, 12.0, healthy_summary())
    later = Proposal(config=CFG, source="bayes")
    wl = runner.workload_for(b.before(2, later))
    assert wl.partition_method == "parts:0,4,6" and not wl.layer_costs
    decision = json.loads((tmp_path / "partition.json").read_text())
    assert decision["decision"] == "kept" and decision["parts"] == [0, 4, 6]
    assert decision["measured_parts"] == [0, 3, 6] and "layer 3" in decision["rounds"][0]["moves"]
    assert decision["rounds"][0]["kept"] is True and decision["kept_samples_per_second"] == 12.0


def test_a_kept_partition_still_unbalanced_gets_one_more_round_from_its_own_costs(tmp_path):
    _costs(tmp_path / "trial-000", [0, 3, 6], [1, 1, 1, 1, 1, 4])
    _costs(tmp_path / "trial-001", [0, 4, 6], [2, 2, 2, 2, 1, 3])  # stage 0 dearer than predicted
    runner = _runner()
    b = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    base = Proposal(config=CFG, source="baseline")
    b.after(0, base, True, 10.0, healthy_summary(stage_compute_imbalance=1.4, slowest_stage=1))
    p1 = b.next_proposal()
    b.after(1, p1, True, 12.0, healthy_summary(stage_compute_imbalance=1.3, slowest_stage=0))
    p2 = b.next_proposal()
    assert p2 is not None and p2.source == SOURCE and "trial 1" in p2.reason
    wl = runner.workload_for(b.before(2, p2))
    second = wl.partition_method
    assert second.startswith("parts:") and second != "parts:0,4,6"
    b.after(2, p2, True, 9.0, healthy_summary(stage_compute_imbalance=1.2, slowest_stage=0))
    assert b.next_proposal() is None  # slower by more than the noise margin: rejected, no recheck
    wl = runner.workload_for(b.before(3, Proposal(config=CFG, source="bayes")))
    assert wl.partition_method == "parts:0,4,6"  # the faster of the two stays


def test_a_slower_partition_is_dropped_and_a_balanced_baseline_is_left_alone(tmp_path):
    _costs(tmp_path / "trial-000", [0, 3, 6], [1, 1, 1, 1, 1, 4])
    runner = _runner()
    b = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    base = Proposal(config=CFG, source="baseline")
    b.after(0, base, True, 10.0, healthy_summary(stage_compute_imbalance=1.4, slowest_stage=1))
    p = b.next_proposal()
    b.after(1, p, True, 8.0, healthy_summary())
    wl = runner.workload_for(b.before(2, Proposal(config=CFG, source="bayes")))
    assert wl.partition_method == "uniform"
    decision = json.loads((tmp_path / "partition.json").read_text())
    assert decision["decision"] == "rejected" and decision["parts"] is None

    other = Driven(StageBalancer(tmp_path / "b", note=lambda _: None, method="uniform"))
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
    b = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    b.replay([row(0, "baseline", 10.0), row(1, SOURCE, 12.0)], [])
    assert b.next_proposal() is None
    wl = runner.workload_for(b.before(2, Proposal(config=CFG, source="bayes")))
    assert wl.partition_method == "parts:0,4,6"
    half = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    half.replay([row(0, "baseline", 10.0)], [])
    assert half.next_proposal().source == SOURCE  # baseline done, partition trial not yet


def _gpu_baseline(tmp_path, capacity):
    """Stage 0 of [0, 3, 6] holds 2 micro-batches of activations in flight (1F1B, 2 stages):
    3 x 1 GB x 2 + 1 GB of its own (measured peak 7 GB); stage 1 3 x 1 GB + 1 GB (4 GB)."""
    _costs(tmp_path / "trial-000", [0, 3, 6], [1, 1, 1, 1, 1, 4], activation=10**9,
           peaks=[7e9 + 48, 4e9 + 48], kind="cuda_max_allocated")
    notes: list[str] = []
    b = Driven(StageBalancer(tmp_path, note=notes.append, method="uniform"))
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



# -- a round at the best trial: imbalance grows with the micro-batch ----------------------------

def _unbalanced(imbalance=1.4):
    return healthy_summary(stage_compute_imbalance=imbalance, slowest_stage=1)


def test_a_balanced_baseline_gets_a_round_at_the_best_trial_when_that_one_is_unbalanced(tmp_path):
    runner = _runner()
    b = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    (tmp_path / "trial-000").mkdir()
    b.after(0, Proposal(config=CFG, source="baseline"), True, 10.0, _unbalanced(1.05))
    assert b.next_proposal() is None and not b.deciding  # balanced at micro 2
    search = Proposal(config=BIG, source="bayes")
    b.after(1, search, True, 20.0, _unbalanced(1.4), is_best=False, room=5)
    assert b.next_proposal() is None  # unbalanced, but not the best: no round
    b.after(2, search, True, 20.0, _unbalanced(1.4), is_best=True, room=1)
    assert b.next_proposal() is None  # the best, but no room for the round's two trials
    b.after(3, search, True, 20.0, _unbalanced(1.4), is_best=True, room=2)
    assert b.deciding  # the tuner holds trial 3's result until the round decides
    costs = b.next_proposal()
    assert costs.source == COSTS and costs.config == BIG and "trial 3 is the best" in costs.reason
    wl = runner.workload_for(b.before(4, costs))
    assert wl.layer_costs and wl.partition_method == "uniform"
    _costs(tmp_path / "trial-004", [0, 3, 6], [1, 1, 1, 1, 1, 4])
    b.after(4, costs, True, 18.0, _unbalanced(1.4), room=1)
    p = b.next_proposal()
    assert p.source == SOURCE and p.config == BIG and "trial 4" in p.reason
    wl = runner.workload_for(b.before(5, p))
    assert wl.partition_method == "parts:0,4,6" and wl.layer_costs
    b.after(5, p, True, 24.0, healthy_summary(stage_compute_imbalance=1.04), room=0)
    assert b.next_proposal() is None and not b.deciding
    b.after(6, search, True, 24.0, _unbalanced(1.4), is_best=True, room=9)
    assert b.next_proposal() is None  # one plan per configuration
    decision = json.loads((tmp_path / "partition.json").read_text())
    r = decision["rounds"][0]
    assert decision["decision"] == "kept" and decision["parts"] == [0, 4, 6]
    assert r["config"]["micro_batch_size"] == 8 and r["from_trial"] == 4 and r["from_imbalance"] == 1.4
    assert r["reference_samples_per_second"] == 18.0 and r["samples_per_second"] == 24.0 and r["kept"]
    assert [(p["trial"], p["work_imbalance"], p["outcome"]) for p in decision["plans"]] == [
        (0, 1.05, "balanced"), (4, 1.4, "round planned")]


def test_a_pair_within_the_noise_margin_is_measured_again_in_the_order_abba(tmp_path):
    _costs(tmp_path / "trial-000", [0, 3, 6], [1, 1, 1, 1, 1, 4])
    runner = _runner()
    b = Driven(StageBalancer(tmp_path, note=lambda _: None, noise=0.10, method="uniform"))
    b.after(0, Proposal(config=CFG, source="baseline"), True, 10.0, _unbalanced())
    p = b.next_proposal()
    b.after(1, p, True, 10.5, healthy_summary(stage_compute_imbalance=1.02), room=5)  # +5 %: within the noise
    assert b.deciding
    again, ref = b.next_proposal(), b.next_proposal()
    assert (again.source, ref.source) == (RECHECK, REFERENCE) and b.deciding
    wl = runner.workload_for(b.before(2, again))
    assert wl.partition_method == "parts:0,4,6" and wl.layer_costs
    b.after(2, again, True, 10.6, healthy_summary(stage_compute_imbalance=1.04), room=4)
    assert b.deciding  # the reference's second run decides
    wl = runner.workload_for(b.before(3, ref))
    assert wl.partition_method == "uniform" and wl.layer_costs
    b.after(3, ref, True, 11.5, _unbalanced(), room=3)
    assert not b.deciding and b.next_proposal() is None
    r = json.loads((tmp_path / "partition.json").read_text())["rounds"][0]
    # candidate 10.55 on average against the reference's 10.75: rejected (one pair would have kept it)
    assert r["trials"] == [1, 2] and r["kept"] is False and abs(r["samples_per_second"] - 10.55) < 1e-9
    assert abs(r["reference_samples_per_second"] - 10.75) < 1e-9 and abs(r["measured_imbalance"] - 1.03) < 1e-9
    rows = [_row(0, "baseline", 10.0), _row(1, SOURCE, 10.5), _row(2, RECHECK, 10.6), _row(3, REFERENCE, 11.5)]
    assert superseded(rows) == {1, 2}  # the rule the study replays
    rows[3] = _row(3, REFERENCE, 9.5)  # 10.55 against 9.75: kept, and the reference's runs give way
    assert superseded(rows) == {0, 3}


def test_the_noise_recheck_needs_room_and_a_failed_recheck_rejects_at_once(tmp_path):
    _costs(tmp_path / "trial-000", [0, 3, 6], [1, 1, 1, 1, 1, 4])
    b = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    b.after(0, Proposal(config=CFG, source="baseline"), True, 10.0, _unbalanced())
    p = b.next_proposal()
    b.after(1, p, True, 10.5, healthy_summary(), room=1)
    assert b.next_proposal() is None and not b.deciding and b.kept == [0, 4, 6]  # decided on the one pair

    c = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    c.after(0, Proposal(config=CFG, source="baseline"), True, 10.0, _unbalanced())
    p = c.next_proposal()
    c.after(1, p, True, 10.5, healthy_summary(), room=5)
    again = c.next_proposal()
    c.after(2, again, False, None, None, room=4)
    assert c.next_proposal() is None and not c.deciding and c.kept is None
    assert superseded([_row(0, "baseline", 10.0), _row(1, SOURCE, 10.5),
                       _row(2, RECHECK, None, "failed")]) == {1, 2}


def _row(n, source, sps, status="ok", config=CFG, imbalance=1.4):
    from autotune.study.store import TrialRow

    return TrialRow(id=n + 1, number=n, status=status, source=source, reason="", config=config,
                    samples_per_second=sps, failure_reason=None, failure_detail=None,
                    summary=_unbalanced(imbalance).to_dict() if status == "ok" else None, rules_fired=[],
                    started=0.0, finished=None, wall_seconds=None, pgid=None)


def test_a_resume_in_the_middle_of_a_round_runs_only_what_is_left(tmp_path):
    _costs(tmp_path / "trial-000", [0, 3, 6], [1, 1, 1, 1, 1, 4])
    done = [_row(0, "baseline", 10.0), _row(1, SOURCE, 10.5, imbalance=1.02)]
    b = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    b.replay(done, [], budget=10)
    assert [b.next_proposal().source, b.next_proposal().source] == [RECHECK, REFERENCE]
    c = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    c.replay(done, [_row(2, RECHECK, None, "interrupted")], budget=10)
    assert c.next_proposal().source == REFERENCE and c.deciding  # the interrupted recheck runs as itself
    d = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    d.replay(done, [], budget=2)  # the budget left no room for the recheck when trial 1 ended
    assert d.next_proposal() is None and d.kept == [0, 4, 6]
    # resumed with a larger budget: trial 2 shows that the run decided on the one pair, and so does the replay
    e = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    e.replay([*done, _row(2, "bayes", 9.0, config=BIG, imbalance=1.05)], [], budget=20)
    assert e.next_proposal() is None and e.kept == [0, 4, 6] and not e.deciding


def test_a_resume_finds_the_round_the_best_trial_started(tmp_path):
    (tmp_path / "trial-000").mkdir()
    _costs(tmp_path / "trial-002", [0, 3, 6], [1, 1, 1, 1, 1, 4])
    done = [_row(0, "baseline", 10.0, imbalance=1.05), _row(1, "bayes", 20.0, config=BIG)]
    b = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    b.replay(done, [], budget=10)
    assert b.next_proposal().source == COSTS  # trial 1 was the best so far, unbalanced
    c = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    c.replay(done + [_row(2, COSTS, 19.0, config=BIG)], [], budget=10)
    p = c.next_proposal()
    assert p.source == SOURCE and p.config == BIG
    # the checkpoint step's trial ran first (it goes before this step's): the round still follows
    bigger = TrialConfig(micro_batch_size=16, gradient_accumulation_steps=1)
    _costs(tmp_path / "trial-003", [0, 3, 6], [1, 1, 1, 1, 1, 4])
    f = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    f.replay(done + [_row(2, "checkpoint", 8.0, config=bigger), _row(3, COSTS, 19.0, config=BIG)], [], budget=10)
    assert f.next_proposal().source == SOURCE
    slower = [_row(0, "baseline", 30.0, imbalance=1.05), _row(1, "bayes", 20.0, config=BIG)]
    e = Driven(StageBalancer(tmp_path, note=lambda _: None, method="uniform"))
    e.replay(slower, [], budget=10)
    assert e.next_proposal() is None  # trial 1 was not the best: no round


def test_the_run_says_when_ranks_share_cores(tmp_path, monkeypatch):
    """4 ranks on 2 cores: a step follows the summed work, and a round can read only a tie."""
    def baseline(folder, cores, kind="process_max_rss"):
        monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(cores)))
        _costs(folder / "trial-000", [0, 3, 6], [1, 1, 1, 1, 1, 4], kind=kind)
        notes: list[str] = []
        b = Driven(StageBalancer(folder, note=notes.append, method="uniform"))
        b.after(0, Proposal(config=CFG, source="baseline"), True, 10.0,
                healthy_summary(stage_compute_imbalance=1.4, data_parallel_size=2))  # 2 stages x 2 dp
        return notes, json.loads((folder / "partition.json").read_text())

    notes, info = baseline(tmp_path / "two", cores=2)
    assert info["cores_shared"] == {"ranks": 4, "cores": 2} and any("4 ranks share 2 cores" in n for n in notes)
    info["rounds"][0].update(trial=1, samples_per_second=9.9, kept=False)
    assert "4 ranks shared 2 cores" in describe_result(info)
    notes, info = baseline(tmp_path / "many", cores=16)
    assert "cores_shared" not in info and not any("share" in n for n in notes)
    notes, info = baseline(tmp_path / "gpu", cores=2, kind="cuda_max_allocated")
    assert "cores_shared" not in info
