"""The one testing seam: faults injected on purpose, so the robustness tests break real runs.

Everything here is inert unless a test asks for it, and grants nothing: it only makes
autotune fail in the documented ways. Three hooks, each off by default:

- `--fault KIND[@TRIAL],...` (hidden option of `autotune run`): a trial's ranks (oom, hang,
  kill, nan, nometrics, overflow; starthang: rank 1 never finishes its start-up) or its runner (nolauncher, noscript) fail as asked;
  `parse_faults`, `fault_for`, and `inject_rank_fault` which the rank script calls each step.
- `AUTOTUNE_TEST_CRASH_AT=POINT[:N]`: the controller dies at once, as SIGKILL would, at a
  named point (`crash_point`), for the kill-and-resume tests.
- `AUTOTUNE_TEST_DEVICE_PRECISIONS` (autotune/trials/precision.py): the devices answer as if
  they had only the precisions named, so the refusal path runs on every CPU.
"""

from __future__ import annotations

import os
import time
from typing import Any

from autotune.core.errors import UserError

RANK_FAULTS = ("oom", "hang", "kill", "nan", "nometrics", "overflow", "starthang")
"""Faults a rank injects (autotune/rank/workload/train.py calls `inject_rank_fault`)."""
CONTROLLER_FAULTS = ("nolauncher", "noscript")
"""Faults the runner injects: a launcher or training script that does not exist."""

CRASH_ENV = "AUTOTUNE_TEST_CRASH_AT"
"""`POINT[:N]` makes the controller os._exit(99) at a precise point (see crash_point)."""
DEVICE_PRECISIONS_ENV = "AUTOTUNE_TEST_DEVICE_PRECISIONS"
""""fp32" or "fp32,bf16": autotune/trials/precision.py answers as a device that has only those."""


def parse_faults(spec: str | None) -> dict[int | None, str]:
    """`KIND[@TRIAL],...` -> {trial or None (every trial): KIND}."""
    plan: dict[int | None, str] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        kind, at, num = part.partition("@")
        if kind not in RANK_FAULTS + CONTROLLER_FAULTS:
            raise UserError(f"--fault {part!r}: unknown fault; use one of "
                            f"{', '.join(RANK_FAULTS + CONTROLLER_FAULTS)}, optionally @TRIAL")
        if at and not (num.isascii() and num.isdigit()):
            raise UserError(f"--fault {part!r}: the trial after @ must be a number")
        plan[int(num) if at else None] = kind
    return plan


def fault_for(spec: str | None, trial: int) -> str | None:
    plan = parse_faults(spec)
    return plan.get(trial, plan.get(None))


def crash_point(point: str, number: int | None = None) -> None:
    """Die at once (as SIGKILL would) when AUTOTUNE_TEST_CRASH_AT names this point.

    Points: after-start:N, during-trial:N, before-finish:N, after-finish:N, recover:N
    (N = trial number; recover: a resumed controller about to clean up after trial N,
    which a dead controller left running) and write:K (inside the K-th atomic file write
    of this process, after the temporary file is written and before it replaces the
    real one).
    """
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    want, _, n = spec.partition(":")
    if want == point and (not n or number is None or n == str(number)):
        os._exit(99)


def inject_startup_fault(fault: str | None, *, fault_rank: int, rank: int) -> None:
    """In a trial rank, before its process group: `starthang` waits forever, as a rank stuck in
    its start-up does (the watchdog's case: autotune/rank/watchdog.py)."""
    if fault == "starthang" and rank == fault_rank:
        while True:
            time.sleep(1)


def inject_rank_fault(fault: str | None, *, fault_rank: int, engine: Any, rank: int, step: int,
                      total: int) -> None:
    """In a trial rank, before step `step` of `total`: raise, hang, die or poison as asked."""
    at = 0 if fault == "overflow" else min(2, total - 1)
    if fault is None or rank != fault_rank or step != at:
        return
    import torch

    if fault == "oom":
        raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")
    if fault == "hang":
        while True:
            time.sleep(1)
    if fault == "kill":
        os.kill(os.getpid(), 9)
    if fault == "nan":  # a real NaN: poison a weight, the loss computed from it is NaN
        with torch.no_grad():
            next(p for p in engine.module.parameters() if p.is_floating_point()).fill_(float("nan"))
    if fault == "overflow":  # every gradient overflows from now on (fp16: the loss scale collapses)
        for p in engine.module.parameters():
            if p.requires_grad:
                p.register_hook(lambda g: g * float("inf"))
