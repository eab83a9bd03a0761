"""The process groups one trial creates, destroyed when a warm worker releases the trial.

Every engine's PipelineModule builds its topology's groups with `new_group` (pipeline pairs,
data- and model-parallel groups), and DeepSpeed never destroys them. In a fresh rank that
does not matter: the process exits. In a warm worker (autotune/rank/workload/worker.py) each
trial left its groups alive, and with them gloo's threads: measured on the 4-rank tiny
demo, 15 threads per rank per trial (79 threads in the pool after one trial, 1,459 after
24) and idle CPU rising from 0.08 to 0.7 of a core, so a pool's trials read slower the
longer it lived (about 2x after 30 trials). `existing()` before and after a trial names
the groups it added; `destroy` takes them down once its engine is gone (torch's own
registry, `distributed_c10d._world.pg_map`; the default group stays).
"""

from __future__ import annotations

from typing import Any


def existing() -> set[Any]:
    """The process groups alive now (empty where torch.distributed has none)."""
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    return set(getattr(world, "pg_map", {}) or {})


def destroy(groups: set[Any]) -> int:
    """Destroy the groups of `groups` still registered, never the default one; returns how many."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    default = c10d.GroupMember.WORLD
    alive = existing()
    gone = []
    for pg in groups:
        if pg is default or pg not in alive:
            continue
        try:
            dist.destroy_process_group(pg)
        except (RuntimeError, ValueError):  # left as it was: MAX_JOBS_PER_POOL bounds what stays
            continue
        gone.append(pg)
    forget_in_deepspeed(gone)
    return len(gone)


def forget_in_deepspeed(gone: list[Any]) -> None:
    """Drop DeepSpeed's own references to destroyed groups.

    A plain engine's data-parallel group is DeepSpeed's clone of the world group, made once and
    kept in `deepspeed.utils.groups` (`_WORLD_GROUP`, read by `_get_data_parallel_group`): the
    next trial's engine in the same warm worker asked for it after it was destroyed, and
    `deepspeed.initialize` failed with "Group ... is not registered" (measured, `--engine zero`).
    With the reference gone, the next engine makes its own."""
    from deepspeed.utils import groups as ds_groups

    def is_gone(value: Any) -> bool:
        return any(value is pg for pg in gone)

    for name, value in list(vars(ds_groups).items()):
        if is_gone(value):
            setattr(ds_groups, name, None)
        elif isinstance(value, dict) and any(is_gone(v) for v in value.values()):
            setattr(ds_groups, name, {k: v for k, v in value.items() if not is_gone(v)})
