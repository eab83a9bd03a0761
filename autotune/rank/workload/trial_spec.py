"""What one trial's ranks of the built-in workload are told: a single JSON trial description.

The controller writes `trial-NNN/trial.json`; the rank script reads it
(`train.py --trial-spec PATH`). It is the rank plan every rank follows
(autotune/core/rank_plan.py: steps, records, endpoint, limits), the workload it builds
(`autotune.core.options.WorkloadOptions` itself, so a default or a new field is written
once and reaches the ranks without a parser on either side having to learn it; the
advice reads its `partition_method` back), and the built-in workload's own test seams.
The rank's wiring reads the plan only; the workload is what the model and data are
built from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autotune.core.options import WorkloadOptions
from autotune.core.rank_plan import JsonForm, RankPlan, RankSettings, plan_fields

SPEC_NAME = "trial.json"


@dataclass(kw_only=True, slots=True)
class TrialSpec(JsonForm):
    """Everything a rank of one built-in trial needs to know."""

    plan: RankPlan
    """What the rank does around its steps (autotune/core/rank_plan.py)."""
    workload: WorkloadOptions
    """What the rank builds: the model preset (or the user's --model), stages, partition, data, seed."""
    ds_config: str
    """Path of the trial's ds_config.json."""
    fault: str | None = None
    """Testing seam (autotune/core/faults.py): the rank fault of this trial, if any."""
    fault_rank: int = 1
    """Testing seam: the rank that injects `fault`."""
    step_sleep: float = 0.0
    """Testing seam: seconds every rank sleeps after each step (keeps a trial running)."""

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "workload": dataclasses.asdict(self.workload),
                "ds_config": self.ds_config, "fault": self.fault, "fault_rank": self.fault_rank,
                "step_sleep": self.step_sleep}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialSpec:
        plan, rest = plan_fields(d)
        workload = WorkloadOptions(**rest.pop("workload"))
        return cls(plan=plan, workload=workload, **rest)


def describe_workload(workload: WorkloadOptions, *, trial: int, trial_dir: str, ds_config: str,
                      fault: str | None = None, incumbent: tuple[float, float] | None = None,
                      limits: dict | None = None) -> TrialSpec:
    """The description of one trial of `workload`: its plan from the workload's own settings.
    `incumbent`: (samples/s, noise) a trial must plausibly beat not to be stopped early;
    `limits`: the watchdog's (StallLimits as a dict), None for none."""
    plan = workload_settings(workload).plan(trial_dir=trial_dir, trial=trial, incumbent=incumbent, limits=limits)
    return TrialSpec(plan=plan, workload=workload, ds_config=ds_config, fault=fault)


def workload_settings(workload: WorkloadOptions) -> RankSettings:
    """The workload's own rank settings (its `parts:` partition method as the plan's parts)."""
    from autotune.core.partition import parse_parts
    from autotune.rank.pipeline_parts import PREFIX

    method = workload.partition_method
    return RankSettings(warmup_steps=workload.warmup_steps, steps=workload.steps,
                        adaptive_steps=workload.adaptive_steps, step_precision=workload.step_precision,
                        max_steps=workload.step_cap, metrics_port=workload.metrics_port,
                        metrics_addr=workload.metrics_addr, job=workload.job, layer_costs=workload.layer_costs,
                        parts=parse_parts(method[len(PREFIX):]) if method.startswith(PREFIX) else None)
