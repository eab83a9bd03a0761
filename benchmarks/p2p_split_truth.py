"""The point-to-point split (autotune/rank/p2p_split.py) against an injected truth, in figures.

Two real CPU ranks of the built-in workload (gloo); stage S's forward and backward are
stretched F times on every other step of one run (the workload's hidden --slow-stage,
a sleep that takes no core from the other rank). Slowed and normal steps of one run are
summarized apart, so drift between launches cancels. The neighbour stage's wait should
grow by about the slowed stage's extra compute, less the idle time it had before, and its
transfer should not grow:

    .venv/bin/python benchmarks/p2p_split_truth.py --slow-stage 0 --factor 3 --steps 12
    .venv/bin/python benchmarks/p2p_split_truth.py --quick

Prints one line per stage and kind of step, then the figure line:
`neighbour wait grew X s for Y s of extra compute (ratio R); its transfer A s -> B s`.
tests/test_signal_truth.py runs `figures` on its own slowed-stage run (no launch of its own).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any


def figures(records: list[Any], slow_stage: int) -> list[str]:
    """The lines this benchmark prints, from one run's records whose even steps were slowed."""

    def mean(stage: int, slowed: bool, field: str) -> float:
        rows = [r for r in records if r.stage == stage and not r.warmup and (r.step % 2 == 0) == slowed]
        return statistics.mean(getattr(r, field) for r in rows)

    lines = [f"stage {stage} {'slowed' if slowed else 'normal'} steps: compute "
             f"{mean(stage, slowed, 'compute_seconds'):.3f} s, transfer {mean(stage, slowed, 'comm_seconds'):.4f} s, "
             f"wait {mean(stage, slowed, 'wait_seconds'):.3f} s, all p2p {mean(stage, slowed, 'p2p_seconds'):.3f} s"
             for stage in (0, 1) for slowed in (True, False)]
    other = 1 - slow_stage
    extra = mean(slow_stage, True, "compute_seconds") - mean(slow_stage, False, "compute_seconds")
    grew = mean(other, True, "wait_seconds") - mean(other, False, "wait_seconds")
    lines.append(f"neighbour wait grew {grew:.3f} s for {extra:.3f} s of extra compute (ratio {grew / extra:.2f}); "
                 f"its transfer {mean(other, False, 'comm_seconds'):.4f} s -> {mean(other, True, 'comm_seconds'):.4f} s")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slow-stage", type=int, default=0, choices=(0, 1))
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="6 steps")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from launch_helpers import pipeline_config, run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        records, _, rc = run_ranks(Path(tmp), pipeline_config(4, 4), steps=6 if args.quick else args.steps,
                                   partition_method="uniform", slow_stage=args.slow_stage,
                                   slow_factor=args.factor, slow_every=2)
    if rc != 0 or not records:
        sys.exit(f"the ranks failed (exit {rc})")
    print("\n".join(figures(records, args.slow_stage)))


if __name__ == "__main__":
    main()
