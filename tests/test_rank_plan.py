"""The rank plan (autotune/core/rank_plan.py): one set of fields every rank reads, one JSON form,
and both rank descriptions (the built-in trial.json, the bootstrap's settings) made of it."""

from __future__ import annotations

import dataclasses
import json
import os

from autotune.core.dsconfig import DsConfig
from autotune.core.options import WorkloadOptions
from autotune.core.rank_plan import RankPlan
from autotune.core.space import TrialConfig
from autotune.rank.hook import MODE_PROBE, BootstrapSettings
from autotune.rank.watchdog import StallLimits
from autotune.rank.wiring import rank_watchdog
from autotune.rank.workload.train import parse_args
from autotune.rank.workload.trial_spec import SPEC_NAME, TrialSpec, describe_workload
from autotune.trials.builtin import BuiltinRunner
from autotune.trials.contract import Incumbent, TrialRequest

PLAN_FIELDS = {f.name for f in dataclasses.fields(RankPlan)}


def a_plan(trial_dir: str) -> RankPlan:
    """Every field away from its default, so a field the form drops shows."""
    return RankPlan(trial_dir=trial_dir, trial=7, warmup_steps=3, steps=9, adaptive_steps=True,
                    step_precision=0.05, max_steps=20, incumbent_samples_per_second=123.5, noise=0.2,
                    metrics_port=9400, metrics_addr="0.0.0.0", job="j", layer_costs=True, parts=[0, 3, 6],
                    trace_steps=2, limits=StallLimits(startup_seconds=30.0, step_seconds=4.0).to_dict())


def test_the_plan_round_trips_through_its_file_and_env_forms(tmp_path):
    plan = a_plan(str(tmp_path))
    assert {k for k, v in plan.to_dict().items() if v == getattr(RankPlan(trial_dir=""), k)} == set()
    assert RankPlan.from_json(plan.to_json()) == plan
    assert RankPlan.read(plan.write(tmp_path / "plan.json")) == plan
    assert plan.metrics_csv == os.path.join(str(tmp_path), "metrics-rank{rank}.csv")
    # warm-up 3, then the profiler's warm-up, 2 traced steps and the settling step, then 9 measured
    assert (plan.step_cap, plan.unmeasured_steps, plan.total_steps) == (20, 7, 16)
    assert RankPlan(trial_dir="", warmup_steps=3, steps=9).total_steps == 12  # no trace: no extra step
    assert RankPlan(trial_dir="", steps=9, max_steps=0).step_cap == 9  # 0: the measured steps


def test_the_built_in_description_is_the_plan_plus_the_workload(tmp_path):
    assert PLAN_FIELDS.isdisjoint(f.name for f in dataclasses.fields(TrialSpec))  # nothing twice
    wl = WorkloadOptions(preset="small", pipeline_stages=3, steps=5, warmup_steps=1, adaptive_steps=True,
                         step_precision=0.04, max_steps=12, layer_costs=True, partition_method="parts:0,2,5,8",
                         metrics_port=9500, job="study", workers="fresh")
    runner = BuiltinRunner(wl, DsConfig.from_dict({"train_micro_batch_size_per_gpu": 1}))
    request = TrialRequest(number=4, config=TrialConfig(micro_batch_size=1, gradient_accumulation_steps=1),
                           trial_dir=tmp_path, timeout=60.0, incumbent=Incumbent(80.0, 0.15),
                           stall=StallLimits(startup_seconds=60.0), trace_steps=2)
    spec = runner.describe(request, tmp_path)
    assert spec.plan == RankPlan(trial_dir=str(tmp_path), trial=4, warmup_steps=1, steps=5, adaptive_steps=True,
                                 step_precision=0.04, max_steps=12, incumbent_samples_per_second=80.0,
                                 noise=0.15, metrics_port=9500, job="study", layer_costs=True,
                                 parts=[0, 2, 5, 8], limits=StallLimits(startup_seconds=60.0).to_dict(),
                                 trace_steps=2)
    path = spec.write(tmp_path / SPEC_NAME)
    on_disk = json.loads(path.read_text())
    assert on_disk["plan"] == spec.plan.to_dict()
    assert on_disk["workload"]["partition_method"] == "parts:0,2,5,8"  # the advice reads it back
    assert parse_args(["--trial-spec", str(path)]) == spec  # what the rank script reads
    fixed = describe_workload(dataclasses.replace(wl, adaptive_steps=False, partition_method="uniform"),
                              trial=0, trial_dir="/t", ds_config="/t/ds.json")
    assert (fixed.plan.step_cap, fixed.plan.parts, fixed.plan.limits, fixed.plan.noise) == (5, None, None, 0.10)


def test_one_request_to_plan_mapping_for_every_runner(tmp_path):
    """The built-in runner and the user's command tell their ranks the same plan for the same
    request and the same own settings (trials/contract.py `plan_for`), the request's asks
    (parts, layer-cost hooks, trace steps, the incumbent, the limits) included."""
    from autotune.trials.user_command import UserCommandRunner
    from autotune.usercmd.command import parse_command

    wl = WorkloadOptions(steps=5, warmup_steps=1, adaptive_steps=True, step_precision=0.04, max_steps=12,
                         metrics_port=9500, job="study", workers="fresh")
    base = DsConfig.from_dict({"train_micro_batch_size_per_gpu": 1})
    builtin = BuiltinRunner(wl, base)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "ds.json").write_text(json.dumps(base.to_dict()))
    command = parse_command(["deepspeed", "train.py", "--deepspeed_config", "ds.json"], cwd=tmp_path)
    user = UserCommandRunner(command, base, cwd=tmp_path,
                             data_parallel_size=1, steps=5, warmup_steps=1, job="study", metrics_port=9500,
                             step_length=(True, 0.04, 12))
    for asks in ({}, {"parts": [0, 3, 6], "layer_costs": True, "trace_steps": 2}):
        request = TrialRequest(number=3, config=TrialConfig(micro_batch_size=1, gradient_accumulation_steps=1),
                               trial_dir=tmp_path, timeout=60.0, incumbent=Incumbent(80.0, 0.15),
                               stall=StallLimits(startup_seconds=60.0), **asks)
        plan = builtin.describe(request, tmp_path).plan
        assert user.settings_for(request, tmp_path).plan == plan
        assert (plan.parts, plan.layer_costs, plan.trace_steps) == (asks.get("parts"), asks.get("layer_costs", False),
                                                                    asks.get("trace_steps", 0))
        assert (plan.incumbent_samples_per_second, plan.noise, plan.max_steps) == (80.0, 0.15, 12)


def test_the_bootstrap_settings_are_the_plan_plus_the_mode(tmp_path):
    assert (PLAN_FIELDS & {f.name for f in dataclasses.fields(BootstrapSettings)}) == set()
    settings = BootstrapSettings(plan=a_plan(str(tmp_path)), mode=MODE_PROBE)
    assert BootstrapSettings.from_env(settings.to_env()) == settings
    assert BootstrapSettings.read(settings.write(tmp_path / "bootstrap-settings.json")) == settings
    assert json.loads(settings.to_env())["plan"] == settings.plan.to_dict()
    assert settings.total_steps == settings.plan.total_steps == 16


def test_the_watchdog_follows_the_plans_limits(tmp_path):
    assert rank_watchdog(RankPlan(trial_dir=str(tmp_path))) is None
    dog = rank_watchdog(a_plan(str(tmp_path)), rank=3)
    try:
        assert dog is not None and (dog.folder, dog.rank) == (tmp_path, 3)
        assert dog.limits == StallLimits(startup_seconds=30.0, step_seconds=4.0)
    finally:
        dog.stop()
