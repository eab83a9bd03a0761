"""Ground-truth fault: one stage's compute made slower by a known factor.

The signal tests need a stage that is slower by exactly `factor` (issue 2,
"the signals must be true"). Slowing single layers is not enough: a stage's
forward and backward instructions also run the loss, autograd and the engine's
own tensor handling. So the whole ForwardPass and BackwardPass instructions are
stretched: each call sleeps (factor - 1) x what it took. A sleep, like a slow
device kernel, costs the stage wall time without taking a core from the other
ranks on a small machine.

Applied through the engine's instance instruction map, before `instrument()`,
so the probe times the stretched instructions exactly as it times real ones.
With `every=2` only even steps are stretched: a test can then compare slow and
normal steps of one run, so drift between runs on a shared machine cancels.
On a GPU an instruction returns before its kernels finish, so there the factor
stretches host time only: a CPU ground-truth tool, not a GPU one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def stretch_layer(module: Any, layer: int, factor: float) -> bool:
    """Make global layer `layer`'s forward take `factor` times as long, if this stage holds it.

    A per-layer ground truth for the layer-cost tests (autotune/rank/layer_costs.py): hooks
    registered here run before the measuring ones, so the extra time falls inside the
    layer's measured forward. It is work, not a sleep: the thread spins until it has
    used `factor` times the forward's CPU time, because a slow layer does more work and
    the layer costs are timed in thread CPU time on a CPU. Returns whether this stage
    holds the layer.
    """
    local = layer - int(getattr(module, "_local_start", 0))
    if factor == 1 or not 0 <= local < len(module.forward_funcs):
        return False
    target = module.forward_funcs[local]
    started: list[float] = []

    def burn(_m: Any, _a: Any, _o: Any) -> None:
        until = time.thread_time() + (factor - 1) * (time.thread_time() - started.pop())
        while time.thread_time() < until:
            pass

    target.register_forward_pre_hook(lambda _m, _a: started.append(time.thread_time()))
    target.register_forward_hook(burn)
    return True


def stretch_compute(engine: Any, factor: float, every: int = 1) -> None:
    """Make this rank's forward and backward instructions take `factor` times as long.

    Only on steps whose number (the engine's `global_steps`) is a multiple of `every`.
    """
    from autotune.rank.engine_face import Instruction, instructions_of

    if factor == 1:
        return

    def stretched(instruction: Instruction, fn: Callable) -> Callable:
        return _stretched(fn, factor, every) if instruction.name in ("ForwardPass", "BackwardPass") else fn

    instructions_of(engine).wrap(stretched)


def _stretched(fn: Callable, factor: float, every: int) -> Callable:
    def run(engine_self: Any, **kwargs: Any) -> Any:
        if engine_self.global_steps % every:
            return fn(engine_self, **kwargs)
        start = time.perf_counter()
        try:
            return fn(engine_self, **kwargs)
        finally:
            time.sleep((factor - 1) * (time.perf_counter() - start))

    return run
