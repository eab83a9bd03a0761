"""A torch pipelining script's job (autotune/usercmd/torch_job.py) without a launch: which schedules
fit the script's stages, what its study refuses, and its record read back."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autotune.core import pp_schedules
from autotune.core.errors import UserError
from autotune.core.options import RunOptions
from autotune.trials.user_command import PipelineShape
from autotune.usercmd.job import UserJob
from autotune.usercmd.prepare import record_of
from autotune.usercmd.torch_job import (
    TORCH,
    TorchScriptJob,
    fitting,
    refuse_for_torch,
    torch_job,
)

ALL = list(pp_schedules.SCHEDULES)


@pytest.mark.parametrize(("stage_sets", "ranks", "expected"), [
    ([[0], [1]], 2, ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"]),
    ([[0, 2], [1, 3]], 2, ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"]),  # looped: r, r + p
    ([[0, 3], [1, 2]], 2, ["ZBVZeroBubble", "DualPipeV"]),  # the V: r and 2p - 1 - r
    ([[0, 1], [2, 3]], 2, []),  # two neighbouring stages per rank: no torch schedule places them so
])
def test_the_schedules_that_fit_are_those_placing_stages_as_the_script_does(stage_sets, ranks, expected):
    assert fitting(stage_sets, ranks, ALL) == expected
    assert fitting(stage_sets, ranks, [n for n in ALL if n != "LoopedBFS"]) == [n for n in expected
                                                                               if n != "LoopedBFS"]


def _job(**kw) -> TorchScriptJob:
    base = {"argv": ["torchrun", "train.py"], "cwd": "/tmp", "parameters": 10, "pipeline_stages": 2,
            "data_parallel_size": 1, "micro_batch_size": 4, "gradient_accumulation_steps": 4,
            "schedule": "GPipe", "step_batch": 16, "stage_sets": [[0], [1]]}
    return TorchScriptJob(**{**base, **kw})


def test_the_sweep_leaves_out_a_schedule_that_refuses_the_scripts_count_and_says_why():
    said: list[str] = []
    assert _job(gradient_accumulation_steps=1, micro_batch_size=16).sweepable(said.append) == [
        "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"]
    assert said == ["      schedule 1F1B not swept: 1F1B needs at least 2 micro-batches (one per stage), not 1 "
                    "(the script's n_microbatches)"]


@pytest.mark.parametrize(("change", "flag"), [
    ({"free_batch": True}, "--free-batch"), ({"global_batch": 32}, "--global-batch"),
    ({"trace_steps": 2}, "--trace-steps"), ({"zero_stages": "0,1"}, "--zero-stages"),
    ({"tuner": "model"}, "--tuner model"),
])
def test_options_a_torch_script_cannot_honour_are_refused_in_one_line(change, flag):
    opts = dataclasses.replace(RunOptions(), **change)
    with pytest.raises(UserError) as info:
        refuse_for_torch(opts)
    assert str(info.value).startswith(f"{flag}: not available for a torch.distributed.pipelining script")
    refuse_for_torch(RunOptions())  # the defaults pass


def test_workload_options_a_torch_script_cannot_honour_are_refused():
    opts = RunOptions()
    opts.workload.layer_costs = True
    with pytest.raises(UserError, match="^--layer-costs: not available"):
        refuse_for_torch(opts)


def _shape(**read) -> PipelineShape:
    return PipelineShape(stages=2, data_parallel_size=1, micro_batch_size=0, gradient_accumulation_steps=4,
                         parameters=10, torch_pipelining={"schedule": "ScheduleGPipe", "n_microbatches": 4,
                                                          "step_batch": 16, "num_stages": 2,
                                                          "stage_sets": [[0], [1]], "text": "t", **read})


def test_the_start_up_checks_reading_becomes_the_job_or_one_line():
    job = torch_job(["torchrun", "t.py"], Path("/tmp"), _shape(), lambda _: None)
    assert (job.schedule, job.gradient_accumulation_steps, job.micro_batch_size, job.step_batch) == ("GPipe", 4, 4, 16)
    runtime = torch_job(["t"], Path("/tmp"), _shape(schedule="_PipelineScheduleRuntime"),
                        lambda _: None)
    assert runtime.schedule == "_PipelineScheduleRuntime"  # a schedule read from a CSV keeps its own name
    with pytest.raises(UserError, match="could not read the step's batch"):
        torch_job(["t"], Path("/tmp"), _shape(step_batch=None), lambda _: None)
    with pytest.raises(UserError, match="n_microbatches 5 does not divide its step's batch 16"):
        torch_job(["t"], Path("/tmp"), _shape(n_microbatches=5), lambda _: None)


def test_the_study_record_reads_back_as_the_job_it_was():
    job = _job()
    again = record_of(dataclasses.asdict(job))
    assert isinstance(again, TorchScriptJob) and again == job and again.engine == TORCH
    plain = {k: v for k, v in dataclasses.asdict(job).items() if k in {f.name for f in dataclasses.fields(UserJob)}}
    assert type(record_of(plain)) is UserJob


def test_the_space_keeps_the_steps_batch_and_has_no_bucket():
    job = _job()
    space = job.space(RunOptions(), job.base_config(RunOptions()))
    assert space.global_batch == 16 and space.bucket_range is None
    assert space.micro_batch_sizes == [1, 2, 4, 8]  # n_microbatches >= the 2 stages
    assert all(m * space.gas_for(m) == 16 for m in space.micro_batch_sizes)


def test_a_trial_whose_schedule_refuses_its_count_fails_at_once_unlaunched(tmp_path):
    """1F1B on 2 ranks needs 2 micro-batches: a trial of 1 is refused by torch's constructor in every
    rank; the runner says so without launching anything (no trial folder is made)."""
    from autotune.core.space import TrialConfig
    from autotune.trials.contract import TrialRequest
    from autotune.usercmd.torch_job import SCHEDULE_REFUSES

    (tmp_path / "train.py").write_text("")  # the command must name a script that exists
    job = _job(argv=["torchrun", "--nproc-per-node", "2", "train.py"], cwd=str(tmp_path))
    opts = RunOptions()
    runner = job.runner(opts, job.base_config(opts))
    request = TrialRequest(number=3, config=TrialConfig(micro_batch_size=16, gradient_accumulation_steps=1),
                           trial_dir=tmp_path / "trial-003", timeout=60, knob_values={"schedule": "1F1B"})
    outcome = runner.run(request)
    assert outcome.result.failure_reason == SCHEDULE_REFUSES and outcome.wall_seconds == 0.0
    assert outcome.failure_detail == "1F1B needs at least 2 micro-batches (one per stage), not 1 (not launched)"
    assert not (tmp_path / "trial-003").exists()
    settings = runner.settings_for(dataclasses.replace(request, config=TrialConfig(
        micro_batch_size=4, gradient_accumulation_steps=4)), tmp_path)
    assert (settings.schedule, settings.n_microbatches, settings.ds_config) == ("1F1B", 4, None)
    own = runner.settings_for(dataclasses.replace(request, knob_values={"schedule": "GPipe"}), tmp_path)
    assert own.schedule is None  # the script's own class: nothing substituted


@pytest.mark.parametrize(("name", "held", "rank", "fits"), [
    ("GPipe", [0], 0, True), ("GPipe", [0, 2], 0, False),  # a knob gave the rank two stages
    ("Interleaved1F1B", [1, 3], 1, True), ("Interleaved1F1B", [1, 2], 1, False),
    ("ZBVZeroBubble", [1, 2], 1, True), ("ZBVZeroBubble", [1, 3], 1, False),
    ("_PipelineScheduleRuntime", [0, 5], 0, True),  # no placement known: the script's own
])
def test_a_trial_schedule_is_built_only_where_it_places_the_ranks_stages(name, held, rank, fits):
    from types import SimpleNamespace

    from autotune.rank.torch_schedule_probe import places_as

    stages = [SimpleNamespace(stage_index=i, group_size=2, group_rank=rank) for i in held]
    assert places_as(name, stages) is fits
