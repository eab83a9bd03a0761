"""Balanced stages on the LM-head-heavy preset: DeepSpeed's partitions against the measured one.

Goal (issue 13): after balancing, the measured stage compute imbalance is at most 1.10
and the throughput at least that of the best of DeepSpeed's built-in methods
(`parameters`, `uniform`), all measured in the same run.

Run (CPU, real DeepSpeed processes, one rank per stage):
    nice -n 5 .venv/bin/python benchmarks/partition_balance.py --stages 2 4 --rounds 7 --refine
(`--quick`: 2 stages, one round of few steps: a smoke run whose figures are noise;
`--refine`: also the tuner's second round, parts re-solved from a balanced trial's costs;
`--fresh`: every trial a new DeepSpeed launch, the benchmark's first way.)

The imbalance is of the stages' work (`stage_work_imbalance`: thread CPU time on a CPU, the
time a GPU's events measure); the wall-time figure beside it also holds each rank's wait for
a core when there are fewer cores than ranks (4 stages on 2 cores), which no partition decides.

Per stage count: a first `parameters` trial measures the layer costs (layer-costs-rank*.csv);
autotune.core.partition computes the balanced parts from them; then every round runs each method
once (parameters, uniform, balanced[, refined]), the order rotated from round to round
(A B C, B C A, C A B, ...) so that no method always goes first and drift on a shared machine
hits all alike. Figures are medians over rounds, with each method's min-max, and the
balanced/best-built-in ratio taken round by round (paired) as well as of the medians: the
throughput goal counts as shown only when balanced is at least as fast in every round
(a one-sided sign test gives the chance of that with no real difference: 1/32 at 5 rounds).

Throughput needs the warm mode (the default): fresh launches of one identical
configuration differ by ~29 % (CV) on this machine (benchmarks/launch_noise.py), trials in
one pool of warm workers (autotune/trials/warm_pool.py) by ~4 %. A pool is keyed by the ds_config
only (`workers.pool_key`) and every trial builds a fresh PipelineModule from its own trial
description (autotune/rank/workload/train.py), so all the partitions of one stage count run one
after the other in ONE pool, as the tuner's partition step runs them (autotune/tuning/balance.py
swaps the runner's workload the same way); a pool is recycled after MAX_JOBS_PER_POOL trials,
never in the middle of a round, so both sides of a paired ratio ran in one pool. In warm
mode the rounds run without the layer-cost hooks (the throughput a user gets); `--fresh`
keeps them on in every trial and prints their overhead from one extra pair (noisy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from autotune.core.dsconfig import DsConfig
from autotune.core.options import WorkloadOptions
from autotune.core.partition import balanced_parts, describe_moves, imbalance, stage_times
from autotune.core.space import TrialConfig
from autotune.core.summary import summarize_trial
from autotune.loaders.metrics import read_records as read_metrics_csv
from autotune.rank.layer_costs import read_trial_layer_costs
from autotune.rank.pipeline_parts import method_for
from autotune.rank.workload.trial_spec import SPEC_NAME, TrialSpec
from autotune.trials.builtin import builtin_runner
from autotune.trials.contract import TrialRequest
from autotune.trials.launcher import LaunchSpec, run_trial_process
from autotune.trials.warm_pool import MAX_JOBS_PER_POOL
from autotune.tuning.balance import partition_uniform

BUILT_IN = ("parameters", "uniform")
TIMEOUT = 900.0
Trials = Callable[[str, str, bool], tuple[Path, dict]]
"""(name, partition method, layer-cost hooks) -> the trial folder and its figures."""


def ds_config(micro: int, gas: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "train_batch_size": micro * gas, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "steps_per_print": 10**9}


def figures(s) -> dict:
    """The figures of one trial's summary this benchmark compares (`work`: the stages' summed work
    per step; with more ranks than cores, throughput follows it, not the slowest stage)."""
    return {"samples_per_second": s.samples_per_second,
            "imbalance": s.stage_work_imbalance if s.stage_work_imbalance is not None else s.stage_compute_imbalance,
            "wall_imbalance": s.stage_compute_imbalance,
            "work": sum(s.stage_work_seconds) if s.stage_work_seconds else math.nan}


class FreshTrials:
    """Every trial a new DeepSpeed launch (its folder: ROOT/s{stages}-{name})."""

    def __init__(self, root: Path, stages: int, args: argparse.Namespace) -> None:
        self.root, self.stages, self.args = root, stages, args

    def __call__(self, name: str, method: str, layer_costs: bool) -> tuple[Path, dict]:
        a = self.args
        folder = self.root / f"s{self.stages}-{name}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        cfg = folder / "ds_config.json"
        cfg.write_text(json.dumps(ds_config(a.micro, a.gas)))
        wl = WorkloadOptions(preset=a.preset, pipeline_stages=self.stages, data_parallel_size=1, steps=a.steps,
                             warmup_steps=a.warmup, partition_method=method, layer_costs=layer_costs)
        spec = TrialSpec(workload=wl, trial=-1, ds_config=str(cfg), metrics_csv=str(folder / "metrics-rank{rank}.csv"))
        launch = LaunchSpec(num_ranks=self.stages, log_path=folder / "launcher.log", timeout=TIMEOUT,
                            script_args=["--trial-spec", str(spec.write(folder / SPEC_NAME))])
        if run_trial_process(launch).returncode != 0:
            raise SystemExit(f"trial {name} ({self.stages} stages) failed, see {folder / 'launcher.log'}")
        records = [r for p in sorted(folder.glob("metrics-rank*.csv")) for r in read_metrics_csv(p)]
        return folder, figures(summarize_trial(records))

    def round_starts(self, trials: int) -> None:
        pass  # a launch per trial: no pool to recycle

    def close(self) -> None:
        pass


class WarmTrials:
    """Every trial a job of one pool of warm workers, through the tuner's own warm runner: the
    partition (and the hooks) change by swapping the runner's workload, as autotune/tuning/balance.py does."""

    def __init__(self, root: Path, stages: int, args: argparse.Namespace) -> None:
        self.folder = root / f"s{stages}-warm"  # the pool lives in its workers/ folder
        self.stages = stages
        wl = WorkloadOptions(preset=args.preset, pipeline_stages=stages, data_parallel_size=1, steps=args.steps,
                             warmup_steps=args.warmup, adaptive_steps=False, workers="warm")
        self.runner = builtin_runner(wl, DsConfig.from_dict(ds_config(args.micro, args.gas), source="benchmark"),
                                  note=lambda text: print(text, flush=True))
        self.config = TrialConfig(micro_batch_size=args.micro, gradient_accumulation_steps=args.gas)
        self.number = 0

    def __call__(self, name: str, method: str, layer_costs: bool) -> tuple[Path, dict]:
        self.runner.workload = dataclasses.replace(self.runner.workload, partition_method=method,
                                                   layer_costs=layer_costs)
        folder = self.folder / name
        shutil.rmtree(folder, ignore_errors=True)
        outcome = self.runner.run(TrialRequest(number=self.number, config=self.config, trial_dir=folder, timeout=TIMEOUT))
        self.number += 1
        if not outcome.result.ok or outcome.summary is None:
            raise SystemExit(f"trial {name} ({self.stages} stages) failed: {outcome.result.failure_reason}: "
                             f"{outcome.failure_detail}; see {folder / 'launcher.log'}")
        return folder.resolve(), figures(outcome.summary)

    def round_starts(self, trials: int) -> None:
        """A round's trials run in one pool: recycled now if it would be recycled during the round
        (a new pool can read 10-20 % faster than an old one, which would bias the paired ratios)."""
        warm = self.runner.warm
        if warm is not None and warm.pool is not None and warm.pool.jobs + trials > MAX_JOBS_PER_POOL:
            print(f"      warm workers: {warm.pool.jobs} trials in this pool; the next round starts a new one",
                  flush=True)
            warm.close()

    def close(self) -> None:
        warm = self.runner.warm
        pools = warm.pools_started if warm is not None else 0
        self.runner.close()
        print(f"{self.stages} stages: {self.number} trials in {pools} pool(s) of warm workers", flush=True)


def rotated(names: list[str], r: int) -> list[str]:
    """Round r's order: A B C, B C A, C A B, ..."""
    k = r % len(names)
    return names[k:] + names[:k]


def sign_test_p(wins: int, n: int) -> float:
    """One-sided: the chance of at least `wins` of `n` rounds faster if neither partition were."""
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n


def spread(xs: list[float]) -> float:
    """(max - min) / median."""
    return (max(xs) - min(xs)) / statistics.median(xs)


def verdict(ratios: list[float]) -> str:
    """What the per-round ratios (balanced / best built-in, paired) support."""
    if len(ratios) < 2:
        return "not shown (one round)"
    if all(x >= 1.0 for x in ratios):
        return "shown (balanced at least as fast in every round)"
    if all(x < 1.0 for x in ratios):
        return "NOT met (balanced slower in every round)"
    return "not shown (within noise: the per-round ratios straddle 1)"


def run_stage_count(stages: int, args: argparse.Namespace, root: Path) -> tuple[bool, list[str]]:
    """Measure, solve, run the rounds; print the figures. (goal met, markdown table rows)."""
    trials: FreshTrials | WarmTrials = (FreshTrials if args.fresh else WarmTrials)(root, stages, args)
    hooks_in_rounds = args.fresh  # fresh: the old way (hooks on everywhere); warm: the user's throughput
    try:
        measured, _ = trials("measure", "parameters", True)
        lc = read_trial_layer_costs(measured)
        parts = balanced_parts(lc.costs, stages, stage_fixed=lc.stage_fixed_seconds)
        predicted = stage_times(lc.costs, parts, lc.stage_fixed_seconds)
        print(f"{stages} stages: measured parts (parameters) {lc.parts}, balanced {parts} "
              f"(predicted imbalance {imbalance(predicted):.2f}); moves: {describe_moves(lc.parts, parts, lc.names)}",
              flush=True)
        methods = {"parameters": "parameters", "uniform": "uniform", "balanced": method_for(parts)}
        method_parts = {"parameters": lc.parts, "uniform": partition_uniform(lc.parts[-1], stages), "balanced": parts}
        if args.refine:  # the tuner's second round (autotune/tuning/balance.py): re-solve from the balanced trial
            first, _ = trials("balanced-measure", method_for(parts), True)
            lc2 = read_trial_layer_costs(first)
            refined = balanced_parts(lc2.costs, stages, stage_fixed=lc2.stage_fixed_seconds)
            print(f"{stages} stages: refined from the balanced trial's costs (it ran parts {lc2.parts}): {refined}",
                  flush=True)
            if refined != parts:
                methods["refined"] = method_for(refined)
                method_parts["refined"] = refined
        got: dict[str, list[dict]] = {name: [] for name in methods}
        for r in range(args.rounds):
            trials.round_starts(len(methods))
            for name in rotated(list(methods), r):
                _, fig = trials(f"{name}-{r}", methods[name], hooks_in_rounds)
                got[name].append(fig)
                print(f"  round {r + 1} {name:10s} {fig['samples_per_second']:.1f} samples/s, "
                      f"imbalance {fig['imbalance']:.2f}", flush=True)
        hooks_off = trials("hooks-off", "parameters", False)[1]["samples_per_second"] if args.fresh else None
    finally:
        trials.close()
    return report(stages, got, method_parts, hooks_off)


def report(stages: int, got: dict[str, list[dict]], method_parts: dict[str, list[int]],
           hooks_off_sps: float | None) -> tuple[bool, list[str]]:
    sps = {name: [x["samples_per_second"] for x in runs] for name, runs in got.items()}
    med = {name: {k: statistics.median(x[k] for x in runs)
                  for k in ("samples_per_second", "imbalance", "wall_imbalance", "work")}
           for name, runs in got.items()}
    for name, m in med.items():
        print(f"  {name:10s} {str(method_parts[name]):20s} imbalance {m['imbalance']:.2f} "
              f"(wall time {m['wall_imbalance']:.2f}), stages' work {m['work']:.3f} s/step  "
              f"samples/s {m['samples_per_second']:.1f} "
              f"(min-max {min(sps[name]):.1f}-{max(sps[name]):.1f}, spread {100 * spread(sps[name]):.0f} %)")
    best = max(BUILT_IN, key=lambda n: med[n]["samples_per_second"])
    ratio = med["balanced"]["samples_per_second"] / med[best]["samples_per_second"]
    paired = [b / x for b, x in zip(sps["balanced"], sps[best], strict=True)]
    wins = sum(x >= 1.0 for x in paired)
    throughput = verdict(paired)
    if method_parts["parameters"] == method_parts["uniform"]:  # the same parts twice: the noise itself
        same = [p / u for p, u in zip(sps["parameters"], sps["uniform"], strict=True)]
        noise = (f"noise: parameters and uniform build the same parts, their per-round ratio reads "
                 f"{min(same):.2f}-{max(same):.2f}")
    else:
        noise = ("noise: each method's own spread over rounds (above); "
                 "parameters and uniform build different parts here")
    for name in [n for n in ("refined",) if n in med]:
        rp = [b / x for b, x in zip(sps[name], sps[best], strict=True)]
        print(f"{stages} stages: refined imbalance {med[name]['imbalance']:.2f}; throughput vs best built-in "
              f"{med[name]['samples_per_second'] / med[best]['samples_per_second']:.2f}x "
              f"(per round {min(rp):.2f}-{max(rp):.2f})")
    imbalance_met = med["balanced"]["imbalance"] <= 1.10
    print(f"{stages} stages: balanced / best built-in ({best}) per round: median {statistics.median(paired):.2f}, "
          f"range {min(paired):.2f}-{max(paired):.2f}, at least as fast in {wins} of {len(paired)} rounds "
          f"(sign test, one-sided p = {sign_test_p(wins, len(paired)):.2f}); {noise}")
    # the stricter reading: against whichever built-in was faster in that round (biased up: a max of two noisy values)
    strict = [b / max(p, u) for b, p, u in zip(sps["balanced"], sps["parameters"], sps["uniform"], strict=True)]
    print(f"{stages} stages: balanced / the faster built-in of each round: median {statistics.median(strict):.2f}, "
          f"range {min(strict):.2f}-{max(strict):.2f}, at least as fast in {sum(x >= 1.0 for x in strict)} "
          f"of {len(strict)} rounds")
    print(f"{stages} stages: balanced imbalance {med['balanced']['imbalance']:.2f} "
          f"(parameters {med['parameters']['imbalance']:.2f}, uniform {med['uniform']['imbalance']:.2f}); "
          f"throughput vs best built-in {ratio:.2f}x; imbalance goal {'met' if imbalance_met else 'NOT met'}; "
          f"throughput goal {throughput}", flush=True)
    if hooks_off_sps is not None:
        on = med["parameters"]["samples_per_second"]
        print(f"{stages} stages: layer-cost hooks overhead {100 * (hooks_off_sps / on - 1):+.1f} % "
              f"(parameters, hooks off {hooks_off_sps:.1f} vs on {on:.1f} samples/s; one pair, noisy)")
    rows = [f"| {stages} | {name} | `{method_parts[name]}` | {med[name]['imbalance']:.2f} "
            f"| {med[name]['samples_per_second']:.1f} | {min(sps[name]):.1f}-{max(sps[name]):.1f} |"
            for name in med]
    rows.append(f"| {stages} | balanced / {best} | | | {ratio:.2f}x | per round {min(paired):.2f}-{max(paired):.2f} "
                f"(median {statistics.median(paired):.2f}, {wins}/{len(paired)} rounds >= 1) |")
    return imbalance_met and throughput.startswith("shown"), rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="wide-vocab")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of every method, order rotated (5: the fewest "
                    "for which all rounds alike is a one-sided sign test below 5 %%)")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--gas", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per trial (fixed)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--refine", action="store_true",
                    help="also a second round, as the tuner does: parts solved from a balanced trial's own costs")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--warm", dest="fresh", action="store_false",
                      help="all trials of one stage count in one pool of warm workers (default)")
    mode.add_argument("--fresh", dest="fresh", action="store_true",
                      help="every trial a new DeepSpeed launch (launch-to-launch noise ~29 %% CV here)")
    ap.set_defaults(fresh=False)
    ap.add_argument("--quick", action="store_true", help="2 stages, 1 round, 2 steps: a smoke run")
    ap.add_argument("--out", default=None, help="folder for the trial folders (default: a temporary one)")
    args = ap.parse_args()
    if args.quick:
        args.stages, args.rounds, args.steps, args.warmup, args.gas = [2], 1, 2, 1, 4
    root = Path(args.out or tempfile.mkdtemp(prefix="partition-balance-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    print(f"mode: {'fresh launches' if args.fresh else 'warm workers, one pool per stage count'}; "
          f"{args.rounds} rounds, {args.steps} measured steps after {args.warmup} warm-up, micro {args.micro} "
          f"x GAS {args.gas}", flush=True)
    ok, rows = True, []
    for stages in args.stages:
        met, mine = run_stage_count(stages, args, root)
        ok, rows = ok and met, rows + mine
    print("\n| stages | method | parts | stage work imbalance | samples/s (median) | min-max |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"trial folders: {root}")
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
