"""The rank side of a trial, written once: from the rank plan to a wired engine.

Given the plan (autotune/core/rank_plan.py) and the rank's engine, `wire` sets up the
probe (autotune/rank/instrument.py) with its CSV records and live endpoint (exporters/),
the step budget (autotune/core/step_budget.py) that decides, alike on every rank, when the
measured steps end, the layer-cost block after them (autotune/rank/layer_costs.py), and the
traced steps (autotune/rank/trace_recorder.py);
`rank_watchdog` is the plan's stall watchdog (autotune/rank/watchdog.py).

Used by a built-in rank (autotune/rank/workload/train.py, fresh or warm through
autotune/rank/workload/worker.py) and by a rank of the user's own script
(autotune/rank/hook.py). What differs stays with them: the built-in loop calls
`train_batch` itself and asks `RankWiring.go_on` after every step, the hook wraps the
script's `train_batch` and ends the rank when `go_on` says so.

The layer costs are measured outside every figure: the hooks cost a Python call per layer
per micro-batch (+4 % step time, docs/partition.md), so they go on only once the budget has
ended the measured steps, for `LAYER_COST_STEPS` more steps that only the layer-cost sink
sees (no CSV row, no live gauge, no step the budget counts). A watched job has no end to
put them after: there they are on from the start, as the user asked (`--layer-costs`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune.core.rank_plan import RankPlan

if TYPE_CHECKING:
    from collections.abc import Callable

    from autotune.core.schema import StepRecord
    from autotune.core.step_budget import StepBudget
    from autotune.rank.instrument import PipelineProbe
    from autotune.rank.layer_costs import LayerCostSink
    from autotune.rank.watchdog import Watchdog

LAYER_COST_STEPS = 3
"""Steps of the layer-cost block after the measured steps: its costs are medians over them (a
trial's steps agree within a few %; three outvote one that a peer's start-up slowed)."""


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
    cost_steps: int = 0
    """Steps of the layer-cost block still to run after the measured ones (0: none)."""
    _costing: tuple[LayerCostSink, list, Callable[[StepRecord], None] | None] | None = None
    """The block in progress: its sink, and the probe's sinks and step listener held aside meanwhile."""

    def go_on(self) -> bool:
        """After each step: run another? The budget's measured steps (the same decision on every
        rank), then the layer-cost block's fixed count (alike on every rank as well)."""
        if self._costing is None:
            if self.budget is not None and self.budget.go_on():
                return True
            if self.cost_steps <= 0:
                return False
            self._begin_costs()
            return True
        self.cost_steps -= 1
        if self.cost_steps > 0:
            return True
        self._end_costs()
        return False

    def _begin_costs(self) -> None:
        """The hooks on, and every step from now seen by their sink alone (outside every figure)."""
        from autotune.rank.layer_costs import LayerCostSink, sink_path

        sink = LayerCostSink(self.probe.engine, sink_path(self.probe, self.plan.trial_dir))
        self._costing = (sink, list(self.probe.sinks), self.probe.on_step)
        self.probe.sinks[:] = [sink]
        self.probe.on_step = None

    def _end_costs(self) -> None:
        """The probe's own sinks and listener back (they close with it), the layer-cost sink among them."""
        if self._costing is None:
            return
        sink, held, listener = self._costing
        self._costing = None
        self.probe.sinks[:] = [*held, sink]
        self.probe.on_step = listener

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
        self._end_costs()  # a block cut short (a failed step): its costs so far, and the CSV, still written
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
    wiring = RankWiring(plan=plan, probe=probe)
    if plan.layer_costs and budget:  # after the measured steps (see the module docstring)
        wiring.cost_steps = LAYER_COST_STEPS
    elif plan.layer_costs:  # a watched job: a sink of the probe from the start, written when it closes
        from autotune.rank.layer_costs import attach

        attach(probe, plan.trial_dir)
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
