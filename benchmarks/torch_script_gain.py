"""The user's own torch.distributed.pipelining script, tuned unchanged (issue 43): the gain and the cost.

Goal: on examples/torch_pipeline_train.py run unchanged, the tuned schedule and n_microbatches
reach at least 1.15x the samples/s of the script's own settings, in one benchmark run.

    .venv/bin/python benchmarks/torch_script_gain.py [--budget 8] [--repeats 3] [--out DIR]
    .venv/bin/python benchmarks/torch_script_gain.py --quick    # smoke run: budget 2, 2 steps, no re-measurement

1. `autotune run --budget B -- torchrun --nproc-per-node 2 examples/torch_pipeline_train.py
   --schedule GPipe --n-microbatches 2 ...`: the study. Printed: its wall time against its
   trials' warm-up and measured step seconds (benchmarks/trial_cost.py `step_seconds`; each
   trial is a torchrun launch: no warm workers for a user's script), and the pick.
2. The neutral measurement: the script's own settings and the pick, each as the script's own
   flags (the example reads its schedule and count from them), measured alternately `--repeats`
   times by a budget-1 study of its own (the baseline trial alone: the start-up check reads what
   the flags built), so the in-study maximum's luck does not count. The ratio of the medians is
   the figure; both sides run on the same machine within the same minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.trial_cost import step_seconds

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "torch_pipeline_train.py"
OWN = ("GPipe", 8)
"""The script's own settings (default): GPipe with 8 micro-batches on 2 stages, the common advice of
m >= 4p to shrink the bubble. `--own GPipe 2` starts from this machine's fastest layout instead."""
MODEL = ["--batch", "64", "--layers", "8", "--hidden", "1024", "--steps", "100000"]
STEPS = ["--steps", "6", "--warmup-steps", "2"]
QUICK_STEPS = ["--steps", "2", "--warmup-steps", "1", "--fixed-steps"]
GOAL = 1.15


def command(schedule: str, n: int) -> list[str]:
    return ["torchrun", "--nproc-per-node", "2", str(SCRIPT), "--schedule", schedule,
            "--n-microbatches", str(n), *MODEL]


def autotune_run(folder: Path, budget: int, argv: list[str], extra: list[str]) -> tuple[dict, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "autotune", "run", "--budget", str(budget), "--study", str(folder),
                           "--no-metrics", *extra, "--", *argv], capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"autotune run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads((folder / "summary.json").read_text()), wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--own", nargs=2, default=list(OWN), metavar=("SCHEDULE", "N"),
                    help="the script's own schedule and n_microbatches (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="budget 2, 1 repeat")
    args = ap.parse_args(argv)
    budget, repeats = (2, 0) if args.quick else (args.budget, args.repeats)
    steps = QUICK_STEPS if args.quick else STEPS
    own_schedule, own_n = args.own[0], int(args.own[1])
    out = Path(args.out or tempfile.mkdtemp(prefix="torch-script-gain-"))
    summary, wall = autotune_run(out / "study", budget, command(own_schedule, own_n), steps)
    stepped = sum(step_seconds(d) for d in sorted((out / "study").glob("trial-*")))
    pick = json.loads((out / "study" / "best_schedule.json").read_text())
    print(f"study: {len(summary['trials'])} trials, wall {wall:.1f} s, warm-up + measured steps {stepped:.1f} s, "
          f"wall / steps {wall / stepped:.1f}x (a torchrun launch per trial)")
    print(f"pick: {pick['schedule']} n_microbatches {pick['n_microbatches']} "
          f"(the script's own: {own_schedule} n_microbatches {own_n}); in the study "
          f"{summary['best']['samples_per_second']:.1f} vs baseline {summary['baseline']['samples_per_second']:.1f} samples/s")
    sides = {"own": command(own_schedule, own_n),
             "tuned": command(pick["schedule"], pick["n_microbatches"])}
    measured: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(repeats):
        for name in (list(sides) if i % 2 == 0 else list(reversed(sides))):  # the order alternated
            s, _ = autotune_run(out / f"{name}-{i}", 1, sides[name], steps)
            measured[name].append(float(s["baseline"]["samples_per_second"]))
    if not repeats:  # --quick: the study's own figures, no neutral re-measurement
        ratio = summary["best"]["samples_per_second"] / summary["baseline"]["samples_per_second"]
        print(f"tuned / own: {ratio:.2f}x (in the study, not re-measured); folders in {out}")
        return 0
    own, tuned = statistics.median(measured["own"]), statistics.median(measured["tuned"])
    for name, values in measured.items():
        print(f"{name:5s}: " + ", ".join(f"{v:.1f}" for v in values) + f" samples/s (median {statistics.median(values):.1f})")
    ratio = tuned / own
    print(f"tuned / own: {ratio:.2f}x (goal >= {GOAL}x: {'met' if ratio >= GOAL else 'NOT met'}); folders in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
