"""Inside a rank of the user's own torch.distributed.pipelining script: what its schedule is.

The start-up check of `autotune run -- torchrun train.py` (autotune/usercmd/job.py) runs the
script once with the bootstrap in probe mode. A script that pipelines with torch builds its
`PipelineStage`s and one `Schedule*` object, then calls `schedule.step(...)` in its own loop,
and never calls `deepspeed.initialize`. The bootstrap (autotune/rank/hook.py `install`)
patches the two schedule bases of `torch.distributed.pipelining.schedules` as the script
imports them (`on_schedule_built`, which `autotune watch` uses too: autotune/rank/hook.py), and at
each schedule object's first `step` call, before any work, the rank writes what it read (`pipeline-schedule-rankR.json`) and
ends: the class, `n_microbatches`, this rank's stages (their index, the stage count, their
parameters, the pipeline group's size) and the step's batch where this rank holds it (the
first stage's input, the last stage's target).

A trial of such a script (`autotune run -- torchrun train.py`) builds, right after the script's
own schedule object, the trial's (`substitute`): the trial's schedule class and `n_microbatches`
on the same stages, with the script's loss function and chunking specs; the script's object then
runs the trial's `step`. Nothing of the script changes: it keeps the object it built. Imported
only where the script imports torch's pipelining: this module itself imports no torch.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any

MARKER = "pipeline-schedule"
"""The marker's kind: `pipeline-schedule-rankR.json` in the probe's folder."""
EXIT_TORCH_PIPELINE = 46
"""A probed rank that reached its torch schedule's first step exits with this."""
MODULE = "torch.distributed.pipelining.schedules"
BASES = ("PipelineScheduleSingle", "PipelineScheduleMulti")
"""Every torch schedule class derives from one of these (torch 2.13: GPipe, 1F1B, Interleaved1F1B,
LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, and a schedule read from a CSV)."""


def on_schedule_built(schedules: Any, built: Any) -> None:
    """Wrap the bases' __init__ so that `built(schedule)` runs once for each schedule object the
    script builds, right after its own __init__."""
    for name in BASES:
        cls = getattr(schedules, name, None)
        if cls is None or getattr(cls.__init__, "_autotune_wrapped", False):
            continue
        cls.__init__ = _calling_init(cls.__init__, built)


_building = False
"""True while `substitute` builds the trial's schedule: that object is autotune's, not the script's."""


def _calling_init(init: Any, built: Any) -> Any:
    @functools.wraps(init)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if _building:
            return
        if not self.__dict__.get("_autotune_seen"):  # a subclass's __init__ that ran a base's: once
            self.__dict__["_autotune_seen"] = True
            built(self)

    wrapped._autotune_wrapped = True  # type: ignore[attr-defined]
    return wrapped


def patch(schedules: Any, write_marker: Any) -> None:
    """The start-up check: each schedule object's first `step` reports what it holds and ends the rank."""
    def built(schedule: Any) -> None:
        def first_step(*step_args: Any, **step_kwargs: Any) -> Any:
            write_marker(MARKER, describe(schedule, step_args, step_kwargs))
            print(f"autotune: the start-up check read a torch.distributed.pipelining schedule "
                  f"({type(schedule).__name__}); this rank stops before its first step", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(EXIT_TORCH_PIPELINE)  # nothing of the script may run on (it would train for days)

        schedule.step = first_step

    on_schedule_built(schedules, built)


def substitute(schedule: Any, name: str | None, n_microbatches: int | None) -> Any:
    """The trial's schedule on the script's stages: torch's `Schedule<name>` (None: the script's
    class) with `n_microbatches` (None: the script's count); the script's own object where both
    are its own. The controller chose `name` to fit the stages this rank holds
    (autotune/usercmd/torch_job.py): one for a single-stage class, the list for the others."""
    global _building
    from torch.distributed.pipelining import schedules as torch_schedules

    stages = schedule_stages(schedule)
    if name and not places_as(name, stages):  # a knob of the script's changed its stages per rank
        print(f"autotune: Schedule{name} does not place this rank's stages "
              f"{[int(s.stage_index) for s in stages]}; the script's {type(schedule).__name__} runs them",
              file=sys.stderr, flush=True)
        name = None
    cls = getattr(torch_schedules, f"Schedule{name}") if name else type(schedule)
    n = int(n_microbatches or schedule._n_microbatches)
    if cls is type(schedule) and n == schedule._n_microbatches:
        return schedule
    first = stages[0] if issubclass(cls, torch_schedules.PipelineScheduleSingle) else stages
    accepted = inspect.signature(cls.__init__).parameters  # LoopedBFS takes no chunk specs
    # the script's arguments, where torch 2.13's _PipelineSchedule.__init__ keeps them
    own = {"loss_fn": schedule._loss_fn, "args_chunk_spec": schedule._args_chunk_spec,
           "kwargs_chunk_spec": schedule._kwargs_chunk_spec, "output_merge_spec": schedule._output_merge_spec,
           "scale_grads": schedule.scale_grads}
    _building = True
    try:
        return cls(first, n, **{k: v for k, v in own.items() if k in accepted})
    finally:
        _building = False


def places_as(name: str, stages: list[Any]) -> bool:
    """Whether torch's schedule `name` places stages as this rank holds them (one for a single-stage
    class; r, r + p, ... for a looped one; r and 2p - 1 - r for a V one: core/pp_schedules.py)."""
    from autotune.core import pp_schedules

    if name not in pp_schedules.SCHEDULES or not stages:
        return True  # a class autotune has no placement for: the controller chose it as the script's
    return pp_schedules.places(name, [int(s.stage_index) for s in stages],
                               int(getattr(stages[0], "group_rank", 0)), int(getattr(stages[0], "group_size", 1)))


def schedule_stages(schedule: Any) -> list[Any]:
    """The stages a schedule object runs on this rank: `_stages` (Multi) or `_stage` (Single)."""
    found = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    return [s for s in found if s is not None]


def step_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The step's batch where this rank holds it: the first stage's input, the last stage's target
    (a middle stage's `step()` gets neither)."""
    if args and hasattr(args[0], "shape") and len(args[0].shape) > 0:
        return int(args[0].shape[0])
    target = kwargs.get("target")
    return int(target.shape[0]) if hasattr(target, "shape") and len(target.shape) > 0 else None


def describe(schedule: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the schedule object says about the job, as plain JSON."""
    stages = schedule_stages(schedule)
    first = stages[0] if stages else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = int(getattr(first, "group_size", world)) if first is not None else world
    return {
        "schedule": type(schedule).__name__,
        "n_microbatches": int(getattr(schedule, "_n_microbatches", 0)),
        "stage_indices": [int(s.stage_index) for s in stages],
        "num_stages": int(first.num_stages) if first is not None else None,
        "stage_parameters": {str(int(s.stage_index)): int(sum(p.numel() for p in s.submod.parameters()))
                             for s in stages},
        "pipeline_group_size": group,
        "world_size": world,
        "step_batch": step_batch(args, kwargs),
    }


def summarize(markers: list[dict[str, Any]]) -> dict[str, Any]:
    """What every rank's marker says together: the schedule, `n_microbatches`, the step's batch
    (where a rank holds it), the stage count, each rank's stages, the pipeline's ranks, the
    data-parallel size and the parameters (each stage once)."""
    first = markers[0]
    params: dict[str, int] = {}
    for m in markers:
        params.update(m.get("stage_parameters") or {})
    group = int(first.get("pipeline_group_size") or 1)
    world = int(first.get("world_size") or group)
    return {"schedule": first.get("schedule"), "n_microbatches": int(first.get("n_microbatches") or 0),
            "step_batch": next((int(m["step_batch"]) for m in markers if m.get("step_batch")), None),
            "num_stages": first.get("num_stages"), "pipeline_ranks": group,
            "data_parallel": max(1, world // max(1, group)), "parameters": sum(params.values()),
            "stage_sets": [list(s) for s in sorted({tuple(sorted(m.get("stage_indices") or [])) for m in markers})]}


def job_text(markers: list[dict[str, Any]]) -> str:
    """The job in words, from every rank's marker: stages, per rank, schedule, micro-batches,
    micro-batch, data-parallel size and parameters."""
    job = summarize(markers)
    batch, n = job["step_batch"], job["n_microbatches"]
    micro = f", micro-batch {batch // n} (the step's batch {batch} over {n})" if batch and n and batch % n == 0 else ""
    return (f"{job['num_stages']} stages ({len(markers[0].get('stage_indices') or [])} per rank), schedule "
            f"{job['schedule']}, n_microbatches {n}{micro}, data-parallel {job['data_parallel']}, "
            f"{job['parameters']:,} parameters")
