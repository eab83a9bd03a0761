"""Balanced stages on the LM-head-heavy preset: DeepSpeed's partitions against the measured one.

Goal (issue 13): after balancing, the measured stage compute imbalance is at most 1.10
and the throughput at least that of the best of DeepSpeed's built-in methods
(`parameters`, `uniform`), all measured in the same run.

Run (CPU, real DeepSpeed processes, one rank per stage):
    .venv/bin/python benchmarks/partition_balance.py --stages 2 4 --rounds 3
(`--quick`: 2 stages, one round of few steps: a smoke run whose figures are noise;
`--refine`: also the tuner's second round, parts re-solved from a balanced trial's costs.)

The imbalance is of the stages' work (`stage_work_imbalance`: thread CPU time on a CPU, the
time a GPU's events measure); the wall-time figure beside it also holds each rank's wait for
a core when there are fewer cores than ranks (4 stages on 2 cores), which no partition decides.

Per stage count: a first `parameters` trial measures the layer costs (layer-costs-rank*.csv);
autotune.partition computes the balanced parts from them; then rounds alternate
parameters / uniform / balanced (so drift on a shared machine hits all alike), each with
the layer-cost hooks on (the same overhead for all). Figures are medians over rounds.
One extra parameters trial without the hooks gives their overhead (a single pair: noise
on a shared machine, read it as a rough figure).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from autotune.launcher import LaunchSpec, run_trial_process
from autotune.layer_costs import read_trial_layer_costs
from autotune.metrics_csv import read_metrics_csv
from autotune.options import WorkloadOptions
from autotune.partition import balanced_parts, describe_moves, imbalance, stage_times
from autotune.pipeline_parts import method_for
from autotune.summary import summarize_trial
from autotune.workload.trial_spec import SPEC_NAME, TrialSpec


def run_trial(folder: Path, *, preset: str, stages: int, method: str, micro: int, gas: int, steps: int,
              warmup: int, layer_costs: bool) -> dict:
    """One real run of the built-in workload; its summary figures."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg = folder / "ds_config.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
                               "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                               "steps_per_print": 10**9}))
    wl = WorkloadOptions(preset=preset, pipeline_stages=stages, data_parallel_size=1, steps=steps,
                         warmup_steps=warmup, partition_method=method, layer_costs=layer_costs)
    spec = TrialSpec(workload=wl, trial=-1, ds_config=str(cfg), metrics_csv=str(folder / "metrics-rank{rank}.csv"))
    launch = LaunchSpec(num_ranks=stages, log_path=folder / "launcher.log", timeout=900,
                        script_args=["--trial-spec", str(spec.write(folder / SPEC_NAME))])
    out = run_trial_process(launch)
    if out.returncode != 0:
        raise SystemExit(f"trial {method} ({stages} stages) failed, see {folder / 'launcher.log'}")
    records = [r for p in sorted(folder.glob("metrics-rank*.csv")) for r in read_metrics_csv(p)]
    s = summarize_trial(records)
    return {"samples_per_second": s.samples_per_second,
            "imbalance": s.stage_work_imbalance if s.stage_work_imbalance is not None else s.stage_compute_imbalance,
            "wall_imbalance": s.stage_compute_imbalance, "stage_seconds": s.stage_compute_seconds,
            "slowest": s.slowest_stage}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="wide-vocab")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--gas", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--refine", action="store_true",
                    help="also a second round, as the tuner does: parts solved from a balanced trial's own costs")
    ap.add_argument("--quick", action="store_true", help="2 stages, 1 round, 2 steps: a smoke run")
    ap.add_argument("--out", default=None, help="folder for the trial folders (default: a temporary one)")
    args = ap.parse_args()
    if args.quick:
        args.stages, args.rounds, args.steps, args.warmup, args.gas = [2], 1, 2, 1, 4
    root = Path(args.out or tempfile.mkdtemp(prefix="partition-balance-"))
    common = dict(preset=args.preset, micro=args.micro, gas=args.gas, steps=args.steps, warmup=args.warmup)
    ok = True
    for stages in args.stages:
        measured = root / f"s{stages}-measure"
        run_trial(measured, stages=stages, method="parameters", layer_costs=True, **common)
        lc = read_trial_layer_costs(measured)
        parts = balanced_parts(lc.costs, stages, stage_fixed=lc.stage_fixed_seconds)
        predicted = stage_times(lc.costs, parts, lc.stage_fixed_seconds)
        print(f"{stages} stages: measured parts (parameters) {lc.parts}, balanced {parts} "
              f"(predicted imbalance {imbalance(predicted):.2f}); moves: {describe_moves(lc.parts, parts, lc.names)}")
        methods = {"parameters": "parameters", "uniform": "uniform", "balanced": method_for(parts)}
        if args.refine:  # the tuner's second round (autotune/balance.py): re-solve from the balanced trial
            first = root / f"s{stages}-balanced-measure"
            run_trial(first, stages=stages, method=method_for(parts), layer_costs=True, **common)
            lc2 = read_trial_layer_costs(first)
            refined = balanced_parts(lc2.costs, stages, stage_fixed=lc2.stage_fixed_seconds)
            print(f"{stages} stages: refined from the balanced trial's costs: {refined}")
            if refined != parts:
                methods["refined"] = method_for(refined)
        got: dict[str, list[dict]] = {name: [] for name in methods}
        for r in range(args.rounds):
            order = list(methods) if r % 2 == 0 else list(reversed(methods))
            for name in order:
                got[name].append(run_trial(root / f"s{stages}-{name}-{r}", stages=stages, method=methods[name],
                                           layer_costs=True, **common))
        med = {name: {k: statistics.median(x[k] for x in runs)
                      for k in ("samples_per_second", "imbalance", "wall_imbalance")}
               for name, runs in got.items()}
        for name, m in med.items():
            print(f"  {name:10s} imbalance {m['imbalance']:.2f} (wall time {m['wall_imbalance']:.2f})  "
                  f"samples/s {m['samples_per_second']:.1f}")
        best_builtin = max(med["parameters"]["samples_per_second"], med["uniform"]["samples_per_second"])
        ratio = med["balanced"]["samples_per_second"] / best_builtin
        goal = med["balanced"]["imbalance"] <= 1.10 and ratio >= 1.0
        if "refined" in med:
            print(f"{stages} stages: refined imbalance {med['refined']['imbalance']:.2f}; throughput vs best "
                  f"built-in {med['refined']['samples_per_second'] / best_builtin:.2f}x")
        ok = ok and goal
        print(f"{stages} stages: balanced imbalance {med['balanced']['imbalance']:.2f} "
              f"(parameters {med['parameters']['imbalance']:.2f}, uniform {med['uniform']['imbalance']:.2f}); "
              f"throughput vs best built-in {ratio:.2f}x; goal {'met' if goal else 'NOT met'}")
        off = run_trial(root / f"s{stages}-hooks-off", stages=stages, method="parameters", layer_costs=False, **common)
        on = statistics.median(x["samples_per_second"] for x in got["parameters"])
        print(f"{stages} stages: layer-cost hooks overhead {100 * (off['samples_per_second'] / on - 1):+.1f} % "
              f"(parameters, hooks off {off['samples_per_second']:.1f} vs on {on:.1f} samples/s; one pair, noisy)")
    print(f"trial folders: {root}")
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
