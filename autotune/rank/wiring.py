"""The rank side of a trial, written once: from the rank plan to a wired engine.

Given the plan (autotune/core/rank_plan.py) and the rank's engine, `wire` sets up the
probe (autotune/rank/instrument.py) with its CSV records and live endpoint (exporters/),
the layer-cost hooks (autotune/rank/layer_costs.py) and the step budget
(autotune/core/step_budget.py) that decides, alike on every rank, when the steps end, and
the traced steps (autotune/rank/trace_recorder.py);
`rank_watchdog` is the plan's stall watchdog (autotune/rank/watchdog.py).

Used by a built-in rank (autotune/rank/workload/train.py, fresh or warm through
autotune/rank/workload/worker.py) and by a rank of the user's own script
(autotune/rank/hook.py). What differs stays with them: the built-in loop calls
`train_batch` itself and asks the budget after every step, the hook wraps the
script's `train_batch` and ends the rank when the budget says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune.core.rank_plan import RankPlan

if TYPE_CHECKING:
    from autotune.core.step_budget import StepBudget
    from autotune.rank.instrument import PipelineProbe
    from autotune.rank.watchdog import Watchdog


def process_rank() -> int:
    """This process's global rank, as DeepSpeed's launcher set it."""
    return int(os.environ.get("RANK", "0"))


def rank_watchdog(plan: RankPlan, rank: int | None = None) -> Watchdog | None:
    """This rank's stall watchdog for the trial, writing in its folder; None when the controller
    set no limits (a runner called directly, outside a study, or a watched job)."""
    if plan.limits is None:
        return None
    from autotune.rank.watchdog import StallLimits, Watchdog

    return Watchdog(plan.trial_dir, process_rank() if rank is None else rank, StallLimits.from_dict(plan.limits))


def global_batch(engine: object) -> int:
    """Samples per optimizer step over every data-parallel rank."""
    from autotune.rank.engine_face import layout_of

    return layout_of(engine).global_batch


@dataclass(kw_only=True, slots=True)
class RankWiring:
    """What `wire` set up on one rank's engine."""

    plan: RankPlan
    probe: PipelineProbe
    """The engine's probe (autotune/rank/instrument.py), its sinks open."""
    budget: StepBudget | None = None
    """When the steps end (autotune/core/step_budget.py StepBudget); None: the job's own loop decides."""

    def watch_steps(self, engine: object, watchdog: Watchdog | None) -> None:
        """Time every step with the watchdog, if any: call it after every other wrapper of
        `train_batch`, so that it sees the whole step, the budget's decision too."""
        if watchdog is not None:
            from autotune.rank.watchdog import watch_steps

            watch_steps(engine, watchdog)

    def write_step_record(self, rank: int) -> None:
        """Rank 0: how the steps ended (the step record beside the metrics CSVs)."""
        if self.budget is not None and rank == 0:
            from autotune.core.step_budget import write_record

            write_record(self.budget, self.plan.trial_dir)

    def close(self) -> None:
        """The CSV written out, the layer costs too, the endpoint gone."""
        self.probe.close_sinks()


def wire(engine: object, plan: RankPlan, *, seq_length: int | None = None, budget: bool = True) -> RankWiring:
    """Instrument `engine` as `plan` says. `seq_length`: the tokens per sample where the caller
    knows it (else the probe reads it from the first stage's input); `budget=False`: no step
    budget (a watched job runs as long as it runs)."""
    from autotune.rank.instrument import instrument

    labels = None
    if plan.trace_steps:  # before the probe: it times the labelled instructions (trace_recorder.py)
        from autotune.rank.trace_recorder import label_instructions

        labels = label_instructions(engine)
    probe = instrument(engine, csv_path=plan.metrics_csv, metrics_port=plan.metrics_port,
                       metrics_addr=plan.metrics_addr, trial=plan.trial, job=plan.job,
                       warmup_steps=plan.unmeasured_steps, seq_length=seq_length)
    if plan.trace_steps:  # outside the probe's timing: writing the trace counts in no step
        from autotune.rank.trace_recorder import record_trace

        record_trace(engine, plan, process_rank(), labels)
    if plan.layer_costs:  # a sink of the probe: written beside the metrics CSV when it closes
        from autotune.rank.layer_costs import attach

        attach(probe, plan.trial_dir)
    wiring = RankWiring(plan=plan, probe=probe)
    if budget:
        from autotune.core.step_budget import follow_probe, rank_budget

        wiring.budget = rank_budget(
            steps=plan.steps, warmup_steps=plan.unmeasured_steps, adaptive=plan.adaptive_steps,
            precision=plan.step_precision, cap=plan.step_cap, global_batch=global_batch(engine),
            incumbent_samples_per_second=plan.incumbent_samples_per_second, noise=plan.noise)
        follow_probe(probe, wiring.budget)  # the CSV's step times
    return wiring


def force_parts(plan: RankPlan) -> None:
    """Every PipelineModule this process builds from now on gets the plan's parts (none forced:
    the module's own partition method, recorded for the advice; autotune/rank/pipeline_parts.py)."""
    from autotune.rank.pipeline_parts import force, install

    if plan.parts is not None:
        force(plan.parts)
    else:
        install()
