"""What a tuning run costs against what its trials measure: fresh processes vs warm workers.

Goal (issue 11): on the default demo, `autotune run --budget 20` spends at most 2x the
time its trials spend in their warm-up and measured steps (13.5x with a fresh launch
per trial), and picks a configuration as good as the fresh run's.

    .venv/bin/python benchmarks/trial_cost.py [--budget 20] [--rounds 1] [--repeats 3] [--out DIR]
    .venv/bin/python benchmarks/trial_cost.py --quick    # CI smoke run: 2 ranks, budget 2
    .venv/bin/python benchmarks/trial_cost.py --engine zero --budget 8   # issue 42: the ZeRO engine
    .venv/bin/python benchmarks/trial_cost.py --modes no-layer-costs now --budget 8 --rounds 2 --repeats 1

`--engine zero` runs the built-in decoder as a plain DeepSpeedEngine on 2 data-parallel ranks
(its ZeRO sweep among the trials); the picks are re-measured with the ZeRO settings each study
kept (its knobs.json).

Each round runs `autotune run` on the default demo once per mode (`--modes OLD NEW`,
default `before now`: see MODE_ARGS), the order alternated from round to round so a
machine that gets busier or quieter during the benchmark does not favour one mode. For
every run:
- wall: the whole `autotune run` process, start to exit, as a user waits for it;
- steps: the sum over its trials of the warm-up and measured step seconds (per trial the
  slowest rank's sum, from the per-rank CSVs: ranks step in lock-step);
- wall / steps, the trials run (the budget is a cap now), and the speed-up of the whole
  run (OLD wall / NEW wall).
Then the two modes' picks are re-measured alternately `--repeats` times, each in fresh
processes (the neutral measurement), so "as good" compares like with like.
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

from autotune.core.options import RunOptions, WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.loaders.metrics import read_trial_columns
from autotune.trials.builtin import builtin_runner
from autotune.trials.contract import TrialRequest
from autotune.tuning.knob_sweep import kept_values
from autotune.tuning.starting_point import load_base_config

QUICK_ARGS = ["--dp", "1", "--steps", "2", "--warmup-steps", "1"]
MODE_ARGS = {
    "before": ["--workers", "fresh", "--fixed-steps", "--full-budget"],
    "fresh": ["--workers", "fresh"],
    "warm": ["--workers", "warm", "--fixed-steps", "--full-budget"],
    "now": [],
    "no-layer-costs": ["--no-layer-costs"],
}
"""`before`: how autotune ran before issue 11 (a fresh launch per trial, a fixed step count,
every trial of the budget); `now`: today's defaults (warm workers, adaptive trial length with
early stop, the budget as a cap, the baseline's layer costs). `fresh` and `warm` isolate one
change each; `no-layer-costs` is `now` without the baseline's layer-cost block (issue 44: what
that block costs a study, `--modes no-layer-costs now`)."""
MODES = ("before", "now")


def step_seconds(trial_dir: Path) -> float:
    """Warm-up + measured step seconds of one trial: the slowest rank's sum."""
    files = sorted(trial_dir.glob("metrics-rank*.csv"))
    if not files:
        return 0.0
    cols = read_trial_columns(files)
    per_rank: dict[int, float] = {}
    for rank, s in zip(cols["rank"], cols["step_seconds"], strict=True):
        per_rank[int(rank)] = per_rank.get(int(rank), 0.0) + float(s)
    return max(per_rank.values())


def run_study(mode: str, folder: Path, budget: int, extra: list[str]) -> dict:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "autotune", "run", "--budget", str(budget), "--study",
                           str(folder), *MODE_ARGS[mode], *extra], capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"autotune run ({mode}: {' '.join(MODE_ARGS[mode])}) failed ({proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}"
                         f"\n{proc.stderr[-2000:]}")
    summary = json.loads((folder / "summary.json").read_text())
    steps = sum(step_seconds(d) for d in sorted(folder.glob("trial-*")))
    trials_wall = sum(t.get("wall_seconds") or 0.0 for t in summary["trials"])
    best = summary["best"]
    return {"mode": mode, "wall": wall, "steps": steps, "trials_wall": trials_wall, "best": best,
            "failed": summary["failed_trials"], "fallbacks": proc.stdout.count("fresh processes"),
            "trials": len(summary["trials"]), "early": proc.stdout.count("stopped early: ")}  # the note, once per trial


def config_of(best: dict) -> TrialConfig:
    return TrialConfig(micro_batch_size=best["micro_batch_size"],
                       gradient_accumulation_steps=best["gradient_accumulation_steps"],
                       reduce_bucket_size=best["reduce_bucket_size"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1, help="runs per mode, order alternated")
    ap.add_argument("--repeats", type=int, default=3, help="fresh re-measurements of each mode's pick")
    ap.add_argument("--out", default=None)
    ap.add_argument("--modes", nargs=2, default=list(MODES), choices=list(MODE_ARGS), metavar="MODE",
                    help=f"the two ways to run, compared (default: {' '.join(MODES)}; any of {', '.join(MODE_ARGS)})")
    ap.add_argument("--quick", action="store_true", help=f"budget 2, 1 round, 1 repeat, {QUICK_ARGS}")
    ap.add_argument("--engine", default="deepspeed", choices=["deepspeed", "zero"],
                    help="the built-in workload's engine (zero: a plain DeepSpeedEngine, 2 data-parallel ranks)")
    args = ap.parse_args(argv)
    modes = tuple(args.modes)
    extra = list(QUICK_ARGS) if args.quick else []
    if args.engine != "deepspeed":
        extra += ["--engine", args.engine]
    if args.quick:
        args.budget, args.rounds, args.repeats = 2, 1, 1  # the baseline and one more: each code path once
    out = Path(args.out or tempfile.mkdtemp(prefix="autotune-trial-cost-"))
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            print(f"round {r + 1} ({mode}): autotune run --budget {args.budget} {' '.join(MODE_ARGS[mode] + extra)}",
                  flush=True)
            res = run_study(mode, out / f"{mode}-{r + 1}", args.budget, extra)
            runs.append(res)
            print(f"  wall {res['wall']:.1f} s, steps {res['steps']:.1f} s, ratio {res['wall'] / res['steps']:.2f}x, "
                  f"{res['trials']} trials ({res['early']} stopped early), "
                  f"best {config_of(res['best']).describe()} {res['best']['samples_per_second']:.1f} samples/s",
                  flush=True)

    print("\n| mode | runs | run wall (s) | step time (s) | wall / steps | trials' wall (s) | failed trials | trials |")
    print("|---|---|---|---|---|---|---|---|")
    med: dict[str, dict[str, float]] = {}
    for mode in modes:
        mine = [x for x in runs if x["mode"] == mode]
        med[mode] = {k: statistics.median(x[k] for x in mine) for k in ("wall", "steps", "trials_wall")}
        ratio = statistics.median(x["wall"] / x["steps"] for x in mine)
        med[mode]["ratio"] = ratio
        print(f"| {mode} | {len(mine)} | {med[mode]['wall']:.1f} | {med[mode]['steps']:.1f} | {ratio:.2f}x "
              f"| {med[mode]['trials_wall']:.1f} | {sum(x['failed'] for x in mine)} "
              f"| {statistics.median(x['trials'] for x in mine):g} |")
    old, new = modes
    print(f"\nwall / step time: {old} {med[old]['ratio']:.2f}x, {new} {med[new]['ratio']:.2f}x (goal <= 2x)")
    print(f"speed-up of the whole run ({old} wall / {new} wall): {med[old]['wall'] / med[new]['wall']:.2f}x")

    # the picks, re-measured alternately in fresh processes (neutral to the mode under test)
    from autotune.engines.registry import engine_named

    wl = WorkloadOptions(workers="fresh", engine=args.engine)
    engine = engine_named(args.engine)
    engine.validate(RunOptions(workload=wl))  # the engine's shape (the ZeRO engine: one "stage")
    if args.quick:
        wl.data_parallel_size, wl.steps, wl.warmup_steps = 1, 2, 1
    runner = builtin_runner(wl, load_base_config(RunOptions(workload=wl)), launch=engine.launch,
                            config_knobs=engine.config_knobs)
    first = {mode: next(x for x in runs if x["mode"] == mode) for mode in modes}
    picks = {mode: config_of(first[mode]["best"]) for mode in modes}
    knobs = {mode: kept_values(out / f"{mode}-1") for mode in modes}
    again: dict[str, list[float]] = {m: [] for m in modes}
    n = 0
    for _ in range(args.repeats):
        for mode in modes:
            o = runner.run(TrialRequest(number=n, config=picks[mode], trial_dir=out / "remeasure" / f"trial-{n:03d}",
                                        timeout=900, knob_values=dict(knobs[mode])))
            again[mode].append(o.result.samples_per_second if o.result.ok else 0.0)
            n += 1
    for mode in modes:
        if knobs[mode]:
            print(f"{mode} kept: {', '.join(f'{k}={v}' for k, v in knobs[mode].items())}")
        print(f"{mode} pick: {picks[mode].describe()}: re-measured median "
              f"{statistics.median(again[mode]):.1f} samples/s over {len(again[mode])}")
    rel = statistics.median(again[new]) / max(statistics.median(again[old]), 1e-9)
    if picks[new].key() == picks[old].key() and knobs[new] == knobs[old]:
        # one configuration: its two alternated series differ by this machine's noise alone
        print(f"{new} pick / {old} pick: the same configuration (100%); its two re-measured series "
              f"read {statistics.median(again[new]):.1f} and {statistics.median(again[old]):.1f} "
              f"({rel:.1%}: noise)")
    else:
        print(f"{new} pick / {old} pick: {rel:.1%}")
    print(f"(studies in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
