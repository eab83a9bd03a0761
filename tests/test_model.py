"""The performance model (autotune/model/, docs/model.md): its schedule against DeepSpeed's own,
its fits, and `autotune predict` / `autotune plan` on the shared reference studies.

The studies are the session's shared ones (tests/shared_studies.py): the built-in workload
with layer costs in its baseline only (2 stages x 2 dp) and the user's script with layer costs in every trial (2 stages x 1 dp);
no test here runs a trial of its own. How well the model predicts configurations no study ran
is measured by benchmarks/model_accuracy.py (real trials), not asserted here.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from launch_helpers import autotune_cli

from autotune.core.errors import UserError
from autotune.model.fits import fit_growth
from autotune.model.hardware import load_hardware, preset_names
from autotune.model.schedule import (
    BWD,
    FWD,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    StageTimes,
    instructions,
    replay,
)

DEEPSPEED_NAMES = {"ForwardPass": FWD, "BackwardPass": BWD, "SendActivation": SEND_ACT,
                   "RecvActivation": RECV_ACT, "SendGrad": SEND_GRAD, "RecvGrad": RECV_GRAD}


@pytest.mark.parametrize(("stages", "micro"), [(2, 1), (2, 5), (3, 4), (4, 8), (5, 2)])
def test_the_replayed_order_is_deepspeeds_train_schedule(stages, micro):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    for stage in range(stages):
        theirs = [DEEPSPEED_NAMES[type(c).__name__] for step in TrainSchedule(micro, stages, stage).steps()
                  for c in step if type(c).__name__ in DEEPSPEED_NAMES]
        assert [kind for kind, _ in instructions(stage, stages, micro)] == theirs


@pytest.mark.parametrize(("stages", "micro"), [(2, 4), (4, 8), (4, 2), (3, 7)])
def test_balanced_stages_give_1f1b_ideal_bubble(stages, micro):
    run = replay([StageTimes(1.0, 2.0)] * stages, micro, [0.0] * stages)
    assert run.pipeline_seconds == pytest.approx((micro + stages - 1) * 3.0)
    assert run.bubble_fraction == pytest.approx((stages - 1) / (micro + stages - 1))


@pytest.mark.parametrize(("stages", "micro"), [(2, 1024), (8, 256)])
def test_a_long_schedule_replays_to_its_end(stages, micro):
    """Many micro-batches of short instructions: the clock grows large against each duration
    (the replay once spun in place there, its ends lost to rounding; `plan` hung on such layouts)."""
    f, b, t = 0.01, 0.02, 0.001
    run = replay([StageTimes(f, b)] * stages, micro, [t] * (stages - 1))
    assert (micro + stages - 1) * (f + b) <= run.pipeline_seconds <= (micro + stages - 1) * (f + b + 4 * t)
    assert run.stage_busy_seconds == pytest.approx([micro * (f + b)] * stages)
    shared = replay([StageTimes(f, b)] * stages, micro, [t] * (stages - 1), cores=2.0, replicas=4)
    assert shared.pipeline_seconds > run.pipeline_seconds


def test_a_slow_stage_makes_the_others_wait_and_transfers_add_up():
    even = replay([StageTimes(1, 2), StageTimes(1, 2)], 8, [0.0])
    slow = replay([StageTimes(1, 2), StageTimes(2, 4)], 8, [0.0])
    assert slow.pipeline_seconds > even.pipeline_seconds * 1.8
    assert slow.stage_wait_seconds[0] > 5 * slow.stage_wait_seconds[1]
    linked = replay([StageTimes(1, 2), StageTimes(1, 2)], 8, [0.5])
    assert linked.stage_transfer_seconds[0] == pytest.approx(16 * 0.5)  # 8 activations out, 8 gradients back
    assert linked.pipeline_seconds > even.pipeline_seconds


def test_processor_sharing_slows_compute_only_while_more_ranks_than_cores_compute():
    times = [StageTimes(1, 2)] * 2
    own = replay(times, 16, [0.0], replicas=2)
    shared = replay(times, 16, [0.0], replicas=2, cores=2)
    enough = replay(times, 16, [0.0], replicas=2, cores=4)
    assert enough.pipeline_seconds == pytest.approx(own.pipeline_seconds)
    # 4 ranks on 2 cores: the steady state runs at half speed, the fill and drain faster than that
    assert 1.7 * own.pipeline_seconds < shared.pipeline_seconds < 2.0 * own.pipeline_seconds


def test_growth_fit_recovers_a_fixed_cost_and_exponent():
    sizes = [1, 2, 4, 8, 16, 32]
    fit = fit_growth(sizes, [0.003 + 0.001 * b ** 0.8 for b in sizes])
    assert fit.exponent == pytest.approx(0.8)
    assert fit.fixed == pytest.approx(0.003, rel=0.02)
    assert fit(64) == pytest.approx(0.003 + 0.001 * 64 ** 0.8, rel=0.01)
    one = fit_growth([4], [0.02])
    assert one(8) == pytest.approx(0.04) and "in proportion" in one.how


def test_hardware_presets_load_and_bad_files_are_refused(tmp_path):
    assert {"a100", "h100", "h200"} <= set(preset_names())
    for name in preset_names():
        hw = load_hardware(name)
        assert hw.sources and hw.peak_flops > 1e14 and hw.memory_bytes >= 40e9
    text = (tmp_path / "x.toml")
    good = load_hardware("h100").file
    assert good == "preset h100"
    base = ('name = "x"\npeak_flops = 1e15\nmemory_bytes = 8e10\nmemory_bandwidth = 3e12\nnvlink_bandwidth = 4e11\n'
            'network_bandwidth = {net}\n[assumed]\nmodel_flops_utilization = 0.4\nnvlink_latency = 1e-5\n'
            'network_latency = 2e-5\ncontext_bytes = {ctx}\n')
    text.write_text(base.format(net="5e10", ctx="2e9"))
    assert load_hardware(str(text)).network_bandwidth == 5e10
    for net, ctx, said in (("-5e10", "2e9", "network_bandwidth = -5"), ("5e10", "0", "context_bytes = 0")):
        text.write_text(base.format(net=net, ctx=ctx))
        with pytest.raises(UserError, match=said):
            load_hardware(str(text))
    text.write_text("peak_flops = 1e15\n")
    with pytest.raises(UserError, match="missing memory_bytes"):
        load_hardware(str(text))


def _cli(*args: str, cwd):
    return autotune_cli(*args, cwd=cwd, timeout=300)


def _one_line_error(proc, *words: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error:"), proc.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_predict_the_builtin_study_matches_its_own_trials(builtin_study, tmp_path):
    """The default study measured its layers once, in its baseline (no --layer-costs): the model
    predicts the study's own layout, each trial within a quarter of its measured samples/s, and
    from those costs other stage counts and a cluster's plan, with no run of its own."""
    study = builtin_study.study
    hooked = {f.parent.name for f in study.glob("trial-*/layer-costs-rank*.csv")}
    assert hooked == {"trial-000"} and len(list(study.glob("trial-*/metrics-rank0.csv"))) > 1
    proc = _cli("predict", str(study), "--format", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["measured"] is not None
    assert abs(out["samples_per_second"] / out["measured"]["samples_per_second"] - 1) < 0.25
    assert out["calibration"]["layer_costs"] is True and out["stage_peak_memory_bytes"] is not None
    assert sum(out["terms_seconds"].values()) == pytest.approx(out["step_seconds"], rel=0.02)
    assert not any("no layer costs" in n for n in out["notes"])
    text = _cli("predict", str(study), "--micro", "64", cwd=tmp_path)
    assert text.returncode == 0 and "extrapolated: micro-batch 64 is" in text.stdout
    four = json.loads(_cli("predict", str(study), "--stages", "4", "--dp", "1", "--format", "json", cwd=tmp_path).stdout)
    assert len(four["layout"]["parts"]) == 5
    plan = _cli("plan", str(study), "--gpus", "8", "--hardware", "h100", "--format", "json", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["ranked"]


def test_a_study_without_layer_costs_says_how_to_get_them(builtin_study, tmp_path):
    """A study run with --no-layer-costs (here: the default study's costs taken away) predicts its
    own layout with the forward taken as a third, and refuses what needs the layers, in one line."""
    from shared_studies import copy_study

    study = copy_study(builtin_study, tmp_path)
    for f in study.glob("trial-*/layer-costs-rank*.csv"):
        f.unlink()
    out = json.loads(_cli("predict", str(study), "--format", "json", cwd=tmp_path).stdout)
    assert out["calibration"]["layer_costs"] is False and out["stage_peak_memory_bytes"] is None
    assert any("no layer costs" in n and "--no-layer-costs" in n for n in out["notes"])
    _one_line_error(_cli("predict", str(study), "--stages", "4", cwd=tmp_path), "its baseline", "--no-layer-costs")
    _one_line_error(_cli("plan", str(study), "--gpus", "8", "--hardware", "h100", cwd=tmp_path), "its baseline")


def test_predict_other_partitions_and_stages_from_layer_costs(usercmd_study, tmp_path):
    study = usercmd_study.study
    base = json.loads(_cli("predict", str(study), "--format", "json", cwd=tmp_path).stdout)
    assert base["calibration"]["layer_costs"] is True and base["layout"]["parts"] == [0, 2, 6]
    moved = json.loads(_cli("predict", str(study), "--parts", "0,3,6", "--format", "json", cwd=tmp_path).stdout)
    assert moved["layout"]["parts"] == [0, 3, 6] and any("partition [0, 3, 6]" in e for e in moved["extrapolated"])
    assert moved["step_seconds"] != pytest.approx(base["step_seconds"], rel=1e-6)
    four = json.loads(_cli("predict", str(study), "--stages", "4", "--format", "json", cwd=tmp_path).stdout)
    assert len(four["layout"]["parts"]) == 5 and len(four["stage_peak_memory_bytes"]) == 4
    ckpt = json.loads(_cli("predict", str(study), "--checkpoint-interval", "1", "--format", "json",
                           cwd=tmp_path).stdout)
    assert ckpt["terms_seconds"]["recompute"] > 0 and ckpt["step_seconds"] > base["step_seconds"]
    assert ckpt["stage_peak_memory_bytes"] is not None
    _one_line_error(_cli("predict", str(study), "--parts", "0,2,5", cwd=tmp_path), "partition", "layer count 6")
    _one_line_error(_cli("predict", str(study), "--stages", "9", cwd=tmp_path), "9 stages for 6 layers")


def test_plan_ranks_layouts_and_lists_the_ones_that_overflow(usercmd_study, tmp_path):
    study = usercmd_study.study
    proc = _cli("plan", str(study), "--gpus", "16", "--hardware", "h100", "--format", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ranked"] and out["notes"][0].startswith("extrapolation: the study ran on a CPU")
    speeds = [x["samples_per_second"] for x in out["ranked"]]
    assert speeds == sorted(speeds, reverse=True)
    for x in out["ranked"]:
        lay = x["layout"]
        assert lay["stages"] * lay["data_parallel_size"] == 16
        assert lay["micro_batch_size"] * lay["gradient_accumulation_steps"] * lay["data_parallel_size"] == out["global_batch"]
    # a device too small for the context the preset assumes: nothing fits, and each says by how much
    small = json.loads(_cli("plan", str(study), "--gpus", "16", "--hardware", "h100", "--device-memory", "2.1e9",
                            "--format", "json", cwd=tmp_path).stdout)
    assert small["ranked"] == [] and small["do_not_fit"]
    over = small["do_not_fit"][0]
    assert over["overflow_bytes"] > 0
    assert over["stage_peak_memory_bytes"][over["overflow_stage"]] == max(over["stage_peak_memory_bytes"])
    text = _cli("plan", str(study), "--gpus", "16", "--hardware", "h100", "--device-memory", "2.1e9", cwd=tmp_path)
    assert "no layout fits" in text.stdout and "GiB over the" in text.stdout
    _one_line_error(_cli("plan", str(study), "--gpus", "16", "--stages", "4", "--dp", "2", "--hardware", "a100",
                         cwd=tmp_path), "= 8 GPUs, not the --gpus 16")
    _one_line_error(_cli("plan", str(study), "--gpus", "16", "--global-batch", "12", "--dp", "16", "--hardware", "a100",
                         cwd=tmp_path), "global batch 12")
    _one_line_error(_cli("plan", str(study), "--gpus", "16", cwd=tmp_path), "needs --hardware")
    bad = tmp_path / "hw.toml"
    bad.write_text("peak_flops = -1\n")
    _one_line_error(_cli("plan", str(study), "--gpus", "8", "--hardware", str(bad), cwd=tmp_path), str(bad))


def test_a_study_with_nothing_to_calibrate_from_is_refused(tmp_path):
    from autotune.study.store import Study

    empty = tmp_path / "empty"
    Study.open(empty, create=True, meta={}).close()
    def files():  # SQLite's own -wal and -shm files come with any reader of a WAL database
        return sorted(p.name for p in empty.iterdir() if not p.name.endswith(("-wal", "-shm")))

    before = files()
    _one_line_error(_cli("predict", str(empty), cwd=tmp_path), "no finished trial", "--budget 3")
    assert files() == before  # nothing written
    _one_line_error(_cli("predict", str(tmp_path / "nowhere"), cwd=tmp_path), "not an autotune study")
    _one_line_error(_cli("plan", str(empty), "--gpus", "8", "--hardware", "h100", cwd=tmp_path), "no finished trial")


def test_plan_on_a_study_whose_trials_all_failed_says_which_run_gives_one(fault_study, tmp_path):
    """The shared fault study (tests/shared_studies.py: a fault in most trials) without its
    successful ones: every trial left failed for real, and `plan` and `predict` say in one line what
    run gives a trial to calibrate from, writing nothing."""
    import sqlite3

    from shared_studies import copy_study

    study = copy_study(fault_study, tmp_path)
    with sqlite3.connect(study / "study.db") as db:
        assert db.execute("DELETE FROM trials WHERE status = 'ok'").rowcount >= 1
        assert db.execute("SELECT COUNT(*) FROM trials").fetchone()[0] >= 3
    before = sorted(p.name for p in study.rglob("*") if not p.name.endswith(("-wal", "-shm")))
    _one_line_error(_cli("plan", str(study), "--gpus", "8", "--hardware", "h100", cwd=tmp_path),
                    "no finished trial", "`autotune run --study")
    _one_line_error(_cli("predict", str(study), cwd=tmp_path), "no finished trial")
    assert sorted(p.name for p in study.rglob("*") if not p.name.endswith(("-wal", "-shm"))) == before


def test_predict_and_plan_have_help():
    import subprocess

    for cmd in ("predict", "plan"):
        out = subprocess.run([sys.executable, "-m", "autotune", cmd, "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "docs/model.md" in out.stdout


def _space():
    from autotune.core.space import SearchSpace

    return SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1, global_batch=64,
                             micro_max=16, bucket_max=240_000, model_parameters=234_048)


def test_the_model_tuner_explores_a_second_micro_batch_before_it_trusts_the_model():
    from autotune.core.space import TrialConfig
    from autotune.core.trial_result import TrialResult
    from autotune.tuning.proposers.model_guided import ModelGuidedProposer

    prop = ModelGuidedProposer(_space(), study_root=None)
    prop.tell(TrialConfig(micro_batch_size=1, gradient_accumulation_steps=32, reduce_bucket_size=240_000), TrialResult(status="ok", samples_per_second=150.0))
    first = prop.ask()
    assert first.config.micro_batch_size == 16 and first.config.reduce_bucket_size == 240_000
    assert "second micro-batch size" in first.reason and first.source == "model"
    assert prop.converged() is None  # no model yet: no reason to stop


def test_the_model_tuner_ranks_untried_points_by_prediction(builtin_study):
    """On the shared study (three micro-batch sizes measured), every proposal is an untried point
    with the samples/s it is predicted to reach, and a point it is told back scores its error."""
    from autotune.core.trial_result import TrialResult
    from autotune.study.store import open_study_readonly
    from autotune.tuning.proposers.model_guided import ModelGuidedProposer

    study = open_study_readonly(builtin_study.study)
    try:
        rows = study.trials()
    finally:
        study.close()
    space = _space()
    prop = ModelGuidedProposer(space, study_root=builtin_study.study)
    for r in rows:
        prop.tell(r.config, TrialResult(status=r.status, samples_per_second=r.samples_per_second or 0.0))
    proposal = prop.ask()
    tried = {r.config.key() for r in rows}
    assert proposal.config.key() not in tried and space.contains(proposal.config)
    if "the model predicts" in proposal.reason:
        predicted = prop.predicted[proposal.config.key()]
        prop.tell(proposal.config, TrialResult(status="ok", samples_per_second=predicted * 1.1))
        assert prop.running_error() == pytest.approx(0.1)
    else:  # the study measured one bucket count: the bucket is what it asks to measure
        assert "bucket count only" in proposal.reason


def test_the_model_tuner_runs_a_point_only_while_its_interval_overlaps_the_bests(tmp_path):
    """With an interval (q: a prediction times e^-q..e^q), a point predicted below the best still
    runs while its interval reaches the best's, and the search stops once the fastest untried
    point's lies wholly below; without one, the margin rule stands (no point predicted 10 %
    better: converged)."""
    import math

    from autotune.tuning.proposers.model_guided import ModelGuidedProposer

    prop = ModelGuidedProposer(_space(), study_root=tmp_path)
    cands = prop._candidates()
    prop.micro_seen, prop.best = {1, 2}, 100.0

    def ranked_at(speed: float) -> None:
        prop._cache = (len(prop.seen), [(speed, cands[0])])
        prop._buckets_measured = [1, 2]

    ranked_at(80.0)
    prop.half_width = None
    assert "by more than 10 %" in prop.converged()
    prop.half_width = 0.15  # 80 x e^0.15 = 93 > 100 x e^-0.15 = 86: they overlap
    assert prop.converged() is None
    assert "(68.9-92.9)" in prop.ask().reason and "(86.1-116.2)" in prop.ask().reason
    prop.half_width = 0.1  # 80 x e^0.1 = 88.4 < 90.5
    assert math.exp(0.1) * 80 < 100 * math.exp(-0.1)
    why = prop.converged()
    assert why is not None and "80 % interval overlaps the best's" in why and "(72.4-88.4)" in why


def test_the_model_reads_the_bucket_rule_so_a_zero0_bucket_costs_what_deepspeeds_fixed_one_does(builtin_study):
    """core/dsconfig.py's rule: the bucket acts with ZeRO-1 and dp > 1 only; ZeRO-0 reduces in
    DeepSpeed's fixed 5e8 bucket whatever the config says (deepspeed-facts.md)."""
    import dataclasses

    from autotune.model.step_model import Layout, bucket_in_effect, predict
    from autotune.model.study_model import model_of_study

    cal = model_of_study(builtin_study.study).calibration
    assert cal.zero_stage == 1 and cal.data_parallel_size == 2  # read from the trials' ds_config.json
    cal = dataclasses.replace(cal, reduce_per_bucket=0.01)  # a bucket's cost the prediction can show

    def reduce(bucket: int, zero: int | None) -> float:
        return predict(cal, Layout(micro_batch_size=4, gradient_accumulation_steps=4, stages=cal.stages,
                                   data_parallel_size=2, reduce_bucket_size=bucket, zero_stage=zero)).terms["reduce"]

    assert reduce(1_000, 1) > reduce(500_000_000, 1)  # ZeRO-1: a small bucket is more buckets
    assert reduce(1_000, None) == reduce(1_000, 1)  # None: the calibrating study's stage
    assert reduce(1_000, 0) == reduce(500_000_000, 0) == reduce(500_000_000, 1)
    assert bucket_in_effect(1_000, 1, 1) is None and bucket_in_effect(1_000, None, 2) == 1_000
