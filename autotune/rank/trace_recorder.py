"""Record a torch.profiler trace of a few steps on this rank (`--trace-steps N`, issue 27).

The plan's traced steps run after the warm-up and before the measured steps: the profiler
waits out the warm-up, takes one step of its own warm-up, then records N steps
(`torch.profiler.schedule(wait=W, warmup=1, active=N)`), and the probe counts all of them, and
one step after them, as unmeasured (`RankPlan.unmeasured_steps`), so a traced trial's figures
are not slowed by the profiler. The probe's CSV rows of the traced steps are kept (as warm-up
rows): one trial measured both ways, which tests/test_traces.py compares. The trace is written
by `tensorboard_trace_handler` into the trial folder's `traces/` (`rankR.<id>.pt.trace.json.gz`,
the name TensorBoard's plugin, HTA and `autotune advise` read), with the operators' input
shapes (the collectives' sizes and send/receive peers come from them). The wrapper sits
outside the probe's timing, so writing the file does not count in any step. While it records,
each pipeline instruction runs under a `deepspeed:<Instruction>` range (autotune/core/trace_labels.py),
inside the probe's timer: the trace shows the very intervals the probe times. (With the range
outside the timer, the ranges of the tiny preset's forward and backward passes read 13-27 %
longer than the probe's intervals of the same instructions: the profiler's cost at a range's
ends falls in the range; inside, the two agree within 1 %.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.core.rank_plan import RankPlan
from autotune.core.trace_labels import INSTRUCTION_PREFIX
from autotune.rank.engine_face import Instruction, instructions_of

TRACES_DIR = "traces"


def traces_dir(trial_dir: str | Path) -> Path:
    return Path(trial_dir) / TRACES_DIR


def label_instructions(engine: Any) -> InstructionLabels:
    """Run each pipeline instruction under a profiler range (call before the probe installs, so
    the probe times the labelled instruction: the trace's ranges and the probe's intervals are
    then the same intervals, the profiler's cost in both)."""
    return InstructionLabels(engine)


class InstructionLabels:
    """The engine's instruction map, each instruction under a `deepspeed:<Instruction>` range
    while `on` (a plain engine's: `deepspeed:forward`, `backward`, `step` and each collective);
    off, an instruction costs one call more (the traced steps are over by then)."""

    def __init__(self, engine: Any) -> None:
        from torch.profiler import record_function

        self.on = True
        def labelled(instruction: Instruction, fn: Any) -> Any:
            name = INSTRUCTION_PREFIX + instruction.name

            # a pipeline's instruction is called (engine, **kwargs); a plain engine's phase or
            # collective is a bound method called with its own arguments
            def run(*args: Any, **kwargs: Any) -> Any:
                if not self.on:
                    return fn(*args, **kwargs)
                with record_function(name):
                    return fn(*args, **kwargs)
            return run

        instructions_of(engine).wrap(labelled)


def record_trace(engine: Any, plan: RankPlan, rank: int, labels: InstructionLabels | None = None) -> None:
    """Record the plan's traced steps (nothing when there are none) around `engine.train_batch`,
    or a plain engine's optimizer steps in the user's own loop (autotune/rank/step_boundary.py);
    `labels` are turned off once they are recorded."""
    if plan.trace_steps <= 0:
        return
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    out = traces_dir(plan.trial_dir)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    steps = plan.warmup_steps + 1 + plan.trace_steps
    prof = profile(activities=activities, record_shapes=True,
                   schedule=schedule(wait=plan.warmup_steps, warmup=1, active=plan.trace_steps, repeat=1),
                   on_trace_ready=tensorboard_trace_handler(str(out), worker_name=f"rank{rank}", use_gzip=True))
    calls = 0

    def begun() -> None:
        if calls == 0:
            prof.start()

    def ended(*_: Any) -> None:
        nonlocal calls
        calls += 1
        if calls <= steps:
            prof.step()  # after the last active step: the trace is written here
        if calls == steps:
            prof.stop()
            if labels is not None:
                labels.on = False  # the measured steps run without the ranges

    from autotune.rank.step_boundary import has_train_batch, plain_steps

    if not has_train_batch(engine):  # a plain engine in the user's own loop: its optimizer steps
        events = plain_steps(engine)
        events.begun.append(begun)
        events.ended.append(ended)
        return
    inner = engine.train_batch

    def train_batch(*args: Any, **kwargs: Any) -> Any:
        begun()
        result = inner(*args, **kwargs)
        ended()
        return result

    engine.train_batch = train_batch
