"""torch.distributed.pipelining's schedules on this machine, and what tuning them gains (issue 28).

Goals: on a built-in preset whose 1F1B bubble is large (2 stages, few micro-batches), the
tuned schedule and micro-batch count reach >= 1.15x the samples/s of Schedule1F1B at the
config's own settings, measured side by side in one run; every schedule the installed torch
offers is reported at its best micro-batch count, with its bubble measured against theory.

    .venv/bin/python benchmarks/torch_schedules.py [--preset medium] [--global-batch 8] [--micro 4]
                                                   [--counts 2,4,8] [--budget 12] [--repeats 5] [--out DIR]
    .venv/bin/python benchmarks/torch_schedules.py --quick    # CI smoke run: every step, tiny sizes

Steps, all real torchrun trials on gloo:
1. `autotune run --engine torch --budget B` from the config (1F1B, micro --micro); its pick is
   the kept schedule (knobs.json) and the best micro-batch and count (best_ds_config.json);
2. every installed schedule at every micro-batch count of --counts, one trial each: samples/s, and the measured bubble (mean over ranks of 1 - compute / step, the
   optimizer step left out) against the schedule's ideal (autotune/core/pp_schedules.py);
3. the config's own 1F1B and the pick re-measured alternately `--repeats` times each (a single
   launch varies by 10-30 % here); the verdict uses their medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from autotune.core import pp_schedules
from autotune.core.dsconfig import DsConfig
from autotune.core.options import WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.engines.registry import engine_named
from autotune.trials.builtin import BuiltinRunner
from autotune.trials.contract import TrialRequest

GOAL = 1.15


def config(global_batch: int, micro: int) -> dict:
    return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": global_batch // micro,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10**9}


class Trials:
    """One-trial runs of the torch engine, numbered in one folder."""

    def __init__(self, out: Path, preset: str, global_batch: int, steps: int) -> None:
        self.out, self.preset, self.global_batch, self.steps, self.n = out, preset, global_batch, steps, 0

    def run(self, schedule: str, micro: int) -> tuple[float, float | None]:
        """(samples/s, measured bubble) of one trial; (0, None) when it failed."""
        wl = WorkloadOptions(preset=self.preset, pipeline_stages=2, data_parallel_size=1, steps=self.steps,
                             warmup_steps=2, engine="torch", schedule=schedule, workers="fresh")
        engine = engine_named("torch")  # its launch (torchrun, the torch rank entry) and its schedule knob
        runner = BuiltinRunner(wl, DsConfig.from_dict(config(self.global_batch, micro)), launch=engine.launch,
                               workload_knobs=engine.workload_knobs)
        cfg = TrialConfig(micro_batch_size=micro, gradient_accumulation_steps=self.global_batch // micro)
        self.n += 1
        outcome = runner.run(TrialRequest(number=self.n, config=cfg, trial_dir=self.out / f"trial-{self.n:03d}",
                                          timeout=600))
        if not outcome.result.ok or outcome.summary is None:
            return 0.0, None
        return outcome.result.samples_per_second, outcome.summary.bubble_fraction_measured


def tuned_pick(study: Path) -> tuple[str, int]:
    kept = json.loads((study / "knobs.json").read_text())["kept"]["schedule"]
    best = json.loads((study / "best_ds_config.json").read_text())
    return kept, int(best["train_micro_batch_size_per_gpu"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium", help="compute-bound on a CPU: on tiny and small the per-micro-"
                    "batch overhead, not the bubble, decides")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4, help="the config's own micro-batch (1F1B's baseline)")
    ap.add_argument("--budget", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="measured steps of each landscape and re-measured trial")
    ap.add_argument("--counts", default="2,4,8", help="the micro-batch counts of the landscape (each divides the "
                    "global batch)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny preset, budget 2, two schedules, 1 repeat (CI)")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.budget, args.repeats, args.steps = "tiny", 2, 1, 2
    out = Path(args.out or tempfile.mkdtemp(prefix="torch-schedules-"))
    out.mkdir(parents=True, exist_ok=True)
    base = out / "ds_config.json"
    base.write_text(json.dumps(config(args.global_batch, args.micro)))
    m0 = args.global_batch // args.micro
    print(f"preset {args.preset}, 2 stages x dp 1, global batch {args.global_batch}; the config: 1F1B, "
          f"micro {args.micro} x {m0} micro-batches (ideal bubble {pp_schedules.ideal_bubble('1F1B', 2, m0, 2):.2f})",
          flush=True)

    # 1. the tuner
    study = out / "tuned"
    cmd = [sys.executable, "-m", "autotune", "run", "--engine", "torch", "--dp", "1", "--preset", args.preset,
           "--config", str(base), "--budget", str(args.budget), "--study", str(study), "--no-metrics"]
    if args.quick:
        cmd += ["--steps", "2", "--warmup-steps", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-3000:])
        return 1
    schedule, micro = tuned_pick(study)
    print(f"tuner (budget {args.budget}): {schedule}, micro {micro} x {args.global_batch // micro} micro-batches",
          flush=True)

    # 2. the landscape: every schedule at every count
    trials = Trials(out / "trials", args.preset, args.global_batch, args.steps)
    names = pp_schedules.installed()
    if args.quick:
        names = [n for n in names if n in ("1F1B", "Interleaved1F1B")]
    counts = [int(c) for c in args.counts.split(",") if c.strip()]
    if any(c < 1 or args.global_batch % c for c in counts):
        print(f"--counts {args.counts}: each must divide the global batch {args.global_batch}", file=sys.stderr)
        return 2
    print(f"\n{'schedule':<22} {'m':>3} {'samples/s':>10} {'bubble':>7} {'ideal':>6}")
    best_of: dict[str, tuple[float, int]] = {}
    for name in names:
        for m in ([m0] if args.quick else counts):
            why = pp_schedules.refuses(name, ranks=2, micro_batches=m, virtual_stages=2)
            if why:
                print(f"{name:<22} {m:>3} {'refused':>10}  {why}", flush=True)
                continue
            sps, bubble = trials.run(name, args.global_batch // m)
            ideal = pp_schedules.ideal_bubble(name, 2, m, 2)
            print(f"{name:<22} {m:>3} {sps:>10.1f} {bubble if bubble is not None else float('nan'):>7.2f} "
                  f"{'-' if ideal is None else f'{ideal:.2f}':>6}", flush=True)
            if sps > best_of.get(name, (0.0, 0))[0]:
                best_of[name] = (sps, m)
    print("\nbest micro-batch count of each schedule (one trial each: compare within 10-30 % noise):")
    for name, (sps, m) in sorted(best_of.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:<22} m={m:<3} {sps:.1f} samples/s")

    # 3. side by side: the config's own 1F1B and the pick, alternately
    own, pick = [], []
    for _ in range(args.repeats):
        own.append(trials.run("1F1B", args.micro)[0])
        pick.append(trials.run(schedule, micro)[0])
    own_med, pick_med = statistics.median(own), statistics.median(pick)
    gain = pick_med / own_med if own_med > 0 else float("nan")
    print(f"\nre-measured alternately, {args.repeats} each: 1F1B micro {args.micro}: median {own_med:.1f} samples/s "
          f"({', '.join(f'{x:.0f}' for x in own)}); {schedule} micro {micro}: median {pick_med:.1f} "
          f"({', '.join(f'{x:.0f}' for x in pick)})")
    verdict = "met" if gain >= GOAL else "NOT met"
    print(f"gain of the tuned schedule and count over the config's 1F1B: {gain:.2f}x (goal >= {GOAL}x: {verdict})")
    print(f"folders: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
