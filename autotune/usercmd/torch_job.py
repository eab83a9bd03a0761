"""A study of the user's own torch.distributed.pipelining script (`autotune run -- torchrun train.py`).

The script builds its `PipelineStage`s and one `Schedule*` object and calls `schedule.step(...)`
in its own loop; it has no DeepSpeed config. Its start-up check (autotune/trials/user_command.py
`probe_shape`) reads what it builds: the schedule class, `n_microbatches`, the stages each rank
holds, the step's batch and the parameters. That is the baseline. Each trial runs the script
unchanged with the trial's schedule class and `n_microbatches` built in place of the script's on
the same stages (autotune/rank/torch_schedule_probe.py `substitute`), the step's batch fixed:

- the schedule: a knob swept once at the baseline's count (autotune/tuning/knob_sweep.py), over
  the installed schedules whose stage placement is the script's (one stage per rank: GPipe,
  1F1B, and the looped ones with one stage; rank r holding r, r + p, ...: the looped ones; r and
  2p - 1 - r: the V ones);
- `n_microbatches`: the search's GAS, the micro-batch the step's batch over it (the space's fixed
  global batch: every trial trains the same samples per step);
- the script's own flags (`--knob`: virtual stages, activation checkpointing), as for a
  DeepSpeed script (autotune/usercmd/knobs.py).

The result is `best_schedule.json` (the schedule, `n_microbatches`, the knobs' values and the
command with them), not a ds_config: the script reads none.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from autotune.core import pp_schedules
from autotune.core.dsconfig import DsConfig
from autotune.core.errors import UserError
from autotune.core.knob import Knob
from autotune.trials.user_command import BootstrapSettings, UserCommandRunner, read_markers
from autotune.usercmd.job import UserJob

if TYPE_CHECKING:
    from autotune.core.options import RunOptions
    from autotune.core.space import SearchSpace, TrialConfig
    from autotune.study.store import Study, TrialRow
    from autotune.trials.contract import TrialRequest
    from autotune.trials.judge import TrialOutcome
    from autotune.trials.multinode import Cluster
    from autotune.trials.user_command import PipelineShape
    from autotune.tuning.steps import SettingStep

TORCH = "torch_pipelining"
"""The job record's `engine` for such a script (a DeepSpeed script's record has none)."""
SCHEDULE_KNOB = "schedule"
RESULT_FILE = "best_schedule.json"
SCHEDULE_REFUSES = "schedule_refuses"
"""A trial's failure: its schedule class refuses its n_microbatches (found before launching it)."""
FROM_SCHEDULE = "the script's schedule, read at its first step"
NOT_FOR_TORCH = {
    "--free-batch": "free_batch", "--global-batch": "global_batch", "--layer-costs": "layer_costs",
    "--balance-stages": "balance_stages", "--trace-steps": "trace_steps", "--zero-stages": "zero_stages",
}
"""Options a torch pipelining script's study cannot honour (the option: its RunOptions or
WorkloadOptions field): its step's batch is the script's, it has no PipelineModule whose layers
are timed or partitioned, no ZeRO, and no trace recorder for its schedule yet."""


class TorchScriptRunner(UserCommandRunner):
    """Trials of a torch pipelining script: each trial's schedule class and n_microbatches are
    built in place of the script's (the bootstrap's settings), its flags as `--knob` maps them."""

    script_job: TorchScriptJob
    """The job whose trials it runs (set by `TorchScriptJob.runner`)."""

    def settings_for(self, request: TrialRequest, trial_dir: Path) -> BootstrapSettings:
        settings = super().settings_for(request, trial_dir)
        chosen = request.knob_values.get(SCHEDULE_KNOB)
        settings.schedule = chosen if chosen and chosen != self.script_job.schedule else None
        settings.n_microbatches = int(request.config.gradient_accumulation_steps)
        settings.ds_config = None  # the script builds no DeepSpeed engine
        return settings

    def run(self, request: TrialRequest) -> TrialOutcome:
        """The trial; one whose schedule refuses its count (its constructor would raise in every
        rank) fails at once, unlaunched, with torch's reason (autotune/core/pp_schedules.py)."""
        job = self.script_job
        why = job.refuses(request.knob_values.get(SCHEDULE_KNOB) or job.schedule,
                          request.config.gradient_accumulation_steps)
        if why:
            from autotune.trials.judge import failed

            return failed(SCHEDULE_REFUSES, f"{why} (not launched)", 0.0)
        return UserCommandRunner.run(self, request)

    def ds_config_for(self, config: TrialConfig) -> dict[str, object]:
        """The trial's batch layout (ds_config.json in its folder says what it ran; nothing reads it)."""
        return {"train_micro_batch_size_per_gpu": config.micro_batch_size,
                "gradient_accumulation_steps": config.gradient_accumulation_steps}

    def result_file(self, study: Study, best: TrialRow) -> tuple[str, dict[str, Any]]:
        """best_schedule.json: what the best trial ran, and how to run it."""
        from autotune.usercmd.knobs import TRIAL_FILE, apply_knobs

        folder = study.trial_dir(best.number)
        try:
            values = json.loads((folder / TRIAL_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            values = {}
        schedule = values.pop(SCHEDULE_KNOB, None) or self.script_job.schedule
        ran = read_markers(folder, "engine")  # what the ranks built: the script's own where the class did not fit
        if ran and isinstance(ran[0].get("engine"), str):
            schedule = pp_schedules.name_of_class(ran[0]["engine"])
        n = best.config.gradient_accumulation_steps
        command = apply_knobs(self.command, values, self.knobs) if values and self.knobs else self.command
        torch_class = f"Schedule{schedule}" if schedule in pp_schedules.SCHEDULES else schedule
        return RESULT_FILE, {
            "schedule": schedule, "schedule_class": f"torch.distributed.pipelining.schedules.{torch_class}",
            "n_microbatches": n, "micro_batch_size": best.config.micro_batch_size,
            "step_batch": self.script_job.step_batch, "knobs": values,
            "samples_per_second": best.samples_per_second, "trial": best.number,
            "script_own": {"schedule": self.script_job.schedule, "n_microbatches": self.script_job.gradient_accumulation_steps},
            "in_the_script": f"{torch_class}(stage(s), n_microbatches={n}, ...)",
            "command": shlex.join([*command.prefix, *command.launcher_args, command.script, *command.script_args]),
        }


@dataclass(kw_only=True, slots=True)
class TorchScriptJob(UserJob):
    """The user's torch pipelining command as a study stores it (what its start-up check read)."""

    RUNNER: ClassVar[type[UserCommandRunner]] = TorchScriptRunner
    engine: str = TORCH
    schedule: str = ""
    """The class the script builds: autotune's name (the torch class without `Schedule`), or the
    class's own name where autotune has none (a schedule read from a CSV)."""
    step_batch: int = 0
    """Samples one `step()` call trains on one pipeline (its first stage's input)."""
    stage_sets: list[list[int]] = field(default_factory=list)
    """The stages each pipeline rank holds (one list per rank, as the start-up check read them)."""

    # -- the workload contract (autotune/tuning/job.py) ------------------------------------------
    def validate(self, opts: RunOptions) -> None:
        UserJob.validate(self, opts)  # explicit: a slots dataclass's methods have no zero-argument super()
        refuse_for_torch(opts)

    def base_config(self, opts: RunOptions) -> DsConfig:
        """The script's batch layout as a config the search reads: micro-batch x `n_microbatches`
        (GAS) x data-parallel; no trial hands it to anything."""
        return DsConfig.from_dict({"train_micro_batch_size_per_gpu": self.micro_batch_size,
                                   "gradient_accumulation_steps": self.gradient_accumulation_steps,
                                   "train_batch_size": self.step_batch * (self.data_parallel_size or 1)},
                                  source=FROM_SCHEDULE)

    def space(self, opts: RunOptions, base: DsConfig) -> SearchSpace:
        """The step's batch fixed; n_microbatches (GAS) over the micro-batches that divide it; no bucket."""
        from autotune.core.space import SearchSpace

        space = SearchSpace.build(pipeline_stages=self.pipeline_stages or 2,
                                  data_parallel_size=self.data_parallel_size or 1, zero_stage=0,
                                  global_batch=self.step_batch * (self.data_parallel_size or 1),
                                  micro_min=opts.micro_min, micro_max=opts.micro_max,
                                  powers_of_two_only=not opts.integer_micro, model_parameters=self.parameters)
        return dataclasses.replace(space, bucket_range=None, bucket_saturation=None,
                                   bucket_note="reduce_bucket_size not searched: a torch pipelining script "
                                               "has no ZeRO bucket")

    def runner(self, opts: RunOptions, base: DsConfig, *, note: Callable[[str], None] | None = None,
               cluster: Cluster | None = None) -> UserCommandRunner:
        runner = UserJob.runner(self, opts, base, note=note, cluster=cluster)
        assert isinstance(runner, TorchScriptRunner)  # RUNNER
        runner.script_job = self
        return runner

    def steps(self, opts: RunOptions, base: DsConfig, space: SearchSpace, *, root: Path, note: Callable[[str], None],
              noise: float, cluster: Cluster | None) -> list[SettingStep]:
        """One sweep: the schedule first (the classes that fit the script's stages, at its count),
        then the script's own knobs."""
        from autotune.tuning.knob_sweep import KnobSweep
        from autotune.usercmd.knobs import own_values, parse_knobs

        knobs = parse_knobs(opts.knobs) if opts.knobs else []
        own: dict[str, str | None] = dict(own_values(knobs, self.command().script_args))
        own[SCHEDULE_KNOB] = self.schedule
        values = self.sweepable(note)
        sweep = [Knob(name=SCHEDULE_KNOB, flag="class", joined=True, values=tuple(values))]  # "class=1F1B"
        return [KnobSweep(sweep + knobs if len(values) > 1 else knobs, own, root, note)]

    def sweepable(self, note: Callable[[str], None]) -> list[str]:
        """The installed schedules this script's stages fit, the script's own first; one that
        refuses its n_microbatches is left out, with why."""
        values = [self.schedule]
        for name in fitting(self.stage_sets, self.pipeline_stages or 2, pp_schedules.installed()):
            if name == self.schedule:
                continue
            why = self.refuses(name, self.gradient_accumulation_steps or 1)
            if why:
                note(f"      schedule {name} not swept: {why} (the script's n_microbatches)")
            else:
                values.append(name)
        return values

    def refuses(self, name: str, n_microbatches: int) -> str | None:
        """Why torch's schedule `name` refuses `n_microbatches` on this script's stages (None: it
        builds; a class autotune has no name for is the script's own, which built)."""
        if name not in pp_schedules.SCHEDULES:
            return None
        return pp_schedules.refuses(name, ranks=self.pipeline_stages or 2, micro_batches=n_microbatches,
                                    virtual_stages=len(self.stage_sets[0]) if self.stage_sets else 1)


def fitting(stage_sets: list[list[int]], ranks: int, installed: list[str]) -> list[str]:
    """The installed schedules whose placement of stages on ranks is the script's: each rank's
    stages are those the schedule puts on some rank (`pp_schedules.places`)."""
    held = [sorted(s) for s in stage_sets]
    return [name for name in installed
            if len(held) == ranks and all(any(pp_schedules.places(name, h, r, ranks) for r in range(ranks))
                                          for h in held)]


def refuse_for_torch(opts: RunOptions) -> None:
    """An option a torch pipelining script's study cannot honour: one line, exit 2."""
    from autotune.core.options import RunOptions as Defaults
    from autotune.core.options import WorkloadOptions

    defaults, wl_defaults = Defaults(), WorkloadOptions()
    for flag, name in NOT_FOR_TORCH.items():
        holder, default = ((opts.workload, wl_defaults) if hasattr(wl_defaults, name) else (opts, defaults))
        if getattr(holder, name) != getattr(default, name):
            raise UserError(f"{flag}: not available for a torch.distributed.pipelining script (its step's batch, "
                            "stages and schedule are the script's; docs/torch-pipelining.md)")
    if opts.knobs:
        from autotune.usercmd.knobs import parse_knobs

        if any(k.name == SCHEDULE_KNOB for k in parse_knobs(opts.knobs)):
            raise UserError(f"--knob {SCHEDULE_KNOB}: autotune sweeps a torch script's schedule class itself (built in "
                            "place of the script's); name the knob otherwise, or leave the schedule to autotune")
    if opts.tuner == "model":
        raise UserError("--tuner model: not available for a torch.distributed.pipelining script (the performance "
                        "model replays DeepSpeed's TrainSchedule)")


def torch_job(argv: list[str], cwd: Path, shape: PipelineShape, note: Callable[[str], None]) -> TorchScriptJob:
    """The job its start-up check read; one line (exit 2) where it cannot be tuned."""
    read = shape.torch_pipelining or {}
    batch, n = read.get("step_batch"), int(read.get("n_microbatches") or 0)
    if not batch:
        raise UserError("the start-up check could not read the step's batch (no rank's step() got a tensor input "
                        "or a target); autotune needs it to keep each trial's batch the script's")
    if not n or batch % n:
        raise UserError(f"the script's n_microbatches {n} does not divide its step's batch {batch}")
    name = pp_schedules.name_of_class(read.get("schedule") or "")
    job = TorchScriptJob(argv=list(argv), cwd=str(cwd), parameters=shape.parameters,
                         pipeline_stages=shape.stages, data_parallel_size=shape.data_parallel_size,
                         micro_batch_size=batch // n, gradient_accumulation_steps=n, schedule=name,
                         step_batch=int(batch),
                         stage_sets=[list(s) for s in read.get("stage_sets") or []])
    note(f"the job: a torch.distributed.pipelining script; {read.get('text', '')}")
    return job
