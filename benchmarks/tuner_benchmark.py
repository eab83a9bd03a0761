"""Tuner benchmark: every proposer on simulated pipeline-training landscapes.

`model` (`--tuner model`) calibrates the performance model on the run's simulated study
(benchmarks/sim_study.py: each trial's observation, the baseline's layer costs), as
`autotune run --tuner model` does on a real one.

    .venv/bin/python -m benchmarks.tuner_benchmark            # the reported table
    .venv/bin/python -m benchmarks.tuner_benchmark --quick    # a smoke run
    .venv/bin/python -m benchmarks.tuner_benchmark --seed-offset 1000   # development seeds
    .venv/bin/python -m benchmarks.tuner_benchmark --tuners hybrid --cap   # the budget as a cap
    .venv/bin/python -m benchmarks.tuner_benchmark --tuners hybrid --capacity   # OOM model with/without capacity

`--cap`: every run twice, same seed, with and without the early stop
(`Proposer.converged`, asked before each trial as `autotune run` does): trials used
and the final pick's score in both.
`--capacity`: every run twice, same seed, with and without the device's memory capacity in
the trials' summaries (the out-of-memory model's prior limit): OOM trials and pick score.

Each run: trial 1 is the scenario's baseline configuration (told to the tuner,
as `autotune run` does), then the tuner proposes `budget - 1` trials through
the same `make_proposer` interface `autotune run` uses. After every trial the
"pick" is the configuration with the best mean measured samples/s (never one
that failed); its score is its TRUE noise-free expected value
(`Scenario.true_value`) divided by the exhaustive optimum.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # two shared cores: one BLAS thread per worker
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from multiprocessing import Pool  # noqa: E402

from autotune.tuning.proposers.history import History  # noqa: E402
from autotune.tuning.proposers.registry import default_moves, make_proposer, names  # noqa: E402
from benchmarks.sim_landscape import SimRun, calibration, scenarios  # noqa: E402
from benchmarks.sim_study import SimStudy  # noqa: E402

TUNERS = ["hybrid", "model", "bayes", "optuna-gp", "optuna-tpe", "ds-autotuner", "random", "grid"]


def moves_fn():
    """The rule engine's moves, as `autotune run` uses them."""
    return default_moves(), "autotune.tuning.proposers.rule_moves.propose_moves"


@dataclass
class RunResult:
    tuner: str
    scenario: str
    seed: int
    scores: list[float] = field(default_factory=list)
    """Score of the pick after trial 1..budget."""
    oom: int = 0
    sources: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    cap: bool = False
    capacity: bool = True
    stopped: str | None = None
    """Why the capped run stopped before its budget (None: it ran the budget)."""

    @property
    def trials(self) -> int:
        return len(self.scores)


_OPTIMA: dict[str, float] = {}


def run_one(job: tuple) -> RunResult:
    tuner, sc_idx, seed, budget, cap, capacity = (*job, False, True)[:6]
    sc = replace(scenarios()[sc_idx], reports_capacity=capacity)
    if sc.name not in _OPTIMA:
        _OPTIMA[sc.name] = sc.optimum()[1]
    opt = _OPTIMA[sc.name]
    sim = SimRun(sc, seed * 7919 + sc_idx)
    moves = moves_fn()[0] if tuner == "hybrid" else None
    study = SimStudy(sc) if tuner == "model" else None
    if study is not None:  # the performance model calibrates on the simulated study's observations
        from autotune.tuning.proposers.model_guided import ModelGuidedProposer

        prop = ModelGuidedProposer(sc.space, seed=seed, models=study.model)
    else:
        prop = make_proposer(tuner, sc.space, seed=seed, moves=moves, budget=budget)
    hist = History(sc.space)
    out = RunResult(tuner=tuner, scenario=sc.name, seed=seed, cap=cap, capacity=capacity)
    t0 = time.perf_counter()
    for t in range(budget):
        if t == 0:
            cfg, source = sc.baseline, "baseline"
        else:
            if cap and (why := prop.converged()):
                out.stopped = why
                break
            p = prop.ask()
            cfg, source = p.config, p.source
        result = sim(cfg, t)
        if study is not None:
            study.record(t, cfg, result)
        prop.tell(cfg, result)
        hist.record(cfg, result)
        out.sources[source] += 1
        out.oom += result.failure_reason == "oom"
        best = hist.best()
        out.scores.append(sc.true_value(best) / opt if best is not None else 0.0)
    out.seconds = time.perf_counter() - t0
    return out


def trials_to(scores: list[float], target: float = 0.95) -> float:
    return next((i + 1 for i, s in enumerate(scores) if s >= target), float("inf"))


def table(results: list[RunResult], tuners: list[str], budget: int) -> str:
    k = min(5, budget)
    lines = [f"| tuner | score @{k} | mean @{budget} | runs >= 95 % | median trials to 95 % | worst @{budget} "
             "| OOM trials / run | s / run |",
             "|---|---|---|---|---|---|---|---|"]
    for name in tuners:
        rs = [r for r in results if r.tuner == name]
        if not rs:
            continue
        final = [r.scores[-1] for r in rs]
        med = statistics.median(trials_to(r.scores) for r in rs)
        med_s = f">{budget}" if med == float("inf") else f"{med:g}"
        lines.append(
            f"| {name} | {statistics.fmean(r.scores[k - 1] for r in rs):.3f} | {statistics.fmean(final):.3f} "
            f"| {sum(f >= 0.95 for f in final) / len(final):.0%} | {med_s} | {min(final):.3f} "
            f"| {statistics.fmean(r.oom for r in rs):.2f} | {statistics.fmean(r.seconds for r in rs):.2f} |")
    return "\n".join(lines)


def per_scenario(results: list[RunResult], tuner: str) -> str:
    lines = [f"| scenario ({tuner}) | mean | runs >= 95 % | worst | median trials to 95 % | OOM / run |",
             "|---|---|---|---|---|---|"]
    for sc in scenarios():
        rs = [r for r in results if r.tuner == tuner and r.scenario == sc.name]
        if not rs:
            continue
        final = [r.scores[-1] for r in rs]
        med = statistics.median(trials_to(r.scores) for r in rs)
        lines.append(f"| {sc.name} | {statistics.fmean(final):.3f} | {sum(f >= .95 for f in final) / len(final):.0%} "
                     f"| {min(final):.3f} | {med:g} | {statistics.fmean(r.oom for r in rs):.2f} |")
    return "\n".join(lines)


def cap_table(results: list[RunResult], tuner: str, budget: int) -> str:
    """Capped vs full runs of the same seeds: trials used and the final pick's score."""
    lines = [f"| scenario ({tuner}) | trials used, cap (mean) | stopped early | score, cap | score, full budget "
             "| runs where the cap lost > 2 % | worst loss |",
             "|---|---|---|---|---|---|---|"]
    pairs = {}
    for r in results:
        if r.tuner == tuner:
            pairs.setdefault((r.scenario, r.seed), {})[r.cap] = r
    rows = [(sc.name, [p for (name, _), p in pairs.items() if name == sc.name and len(p) == 2])
            for sc in scenarios()]
    rows.append(("all", [p for p in pairs.values() if len(p) == 2]))
    for name, ps in rows:
        if not ps:
            continue
        loss = [p[False].scores[-1] - p[True].scores[-1] for p in ps]
        lines.append(f"| {name} | {statistics.fmean(p[True].trials for p in ps):.1f} of {budget} "
                     f"| {sum(p[True].stopped is not None for p in ps) / len(ps):.0%} "
                     f"| {statistics.fmean(p[True].scores[-1] for p in ps):.3f} "
                     f"| {statistics.fmean(p[False].scores[-1] for p in ps):.3f} "
                     f"| {sum(x > 0.02 for x in loss)} of {len(ps)} | {max(loss):+.3f} |")
    return "\n".join(lines)


def capacity_table(results: list[RunResult], tuner: str) -> str:
    """The same seeds with and without the capacity prior: OOM trials per run and the pick's score."""
    lines = [f"| scenario ({tuner}) | OOM / run, no capacity | OOM / run, capacity | score, no capacity "
             "| score, capacity |", "|---|---|---|---|---|"]
    for name in [sc.name for sc in scenarios()] + ["all"]:
        rs = [r for r in results if r.tuner == tuner and name in ("all", r.scenario)]
        off, on = [r for r in rs if not r.capacity], [r for r in rs if r.capacity]
        if not off or not on:
            continue
        lines.append(f"| {name} | {statistics.fmean(r.oom for r in off):.2f} | {statistics.fmean(r.oom for r in on):.2f} "
                     f"| {statistics.fmean(r.scores[-1] for r in off):.3f} "
                     f"| {statistics.fmean(r.scores[-1] for r in on):.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=20, help="seeds per scenario (default 20)")
    ap.add_argument("--seed-offset", type=int, default=0,
                    help="first seed; the reported table uses 0, development used 1000")
    ap.add_argument("--budget", type=int, default=20, help="trials per run, baseline included (default 20)")
    ap.add_argument("--tuners", default=None,
                    help="comma-separated proposer names [default: all; --quick: all but model, whose "
                         "calibration after every trial takes seconds]")
    ap.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--scenarios", default=None, help="comma-separated scenario names [default: all]")
    ap.add_argument("--quick", action="store_true", help="3 seeds, budget 12: a smoke run")
    ap.add_argument("--calibration", action="store_true", help="print the calibration check and exit")
    ap.add_argument("--cap", action="store_true",
                    help="run every seed with and without the early stop (the budget as a cap)")
    ap.add_argument("--capacity", action="store_true",
                    help="run every seed with and without the device capacity in the trials' summaries")
    args = ap.parse_args(argv)
    if args.calibration:
        print("| setting | measured | model |\n|---|---|---|")
        for name, real, model in calibration():
            print(f"| {name} | {real:.2f} | {model:.2f} |")
        return 0
    if args.quick:
        args.seeds, args.budget = 3, 12
    if args.tuners is None:
        args.tuners = ",".join(t for t in TUNERS if not (args.quick and t == "model"))
    available = set(names())
    tuners = [t for t in args.tuners.split(",") if t in available]
    skipped = [t for t in args.tuners.split(",") if t not in available]
    if skipped:
        print(f"skipped (not installed): {', '.join(skipped)}", file=sys.stderr)
    names_all = [sc.name for sc in scenarios()]
    wanted = args.scenarios.split(",") if args.scenarios else names_all
    unknown = [n for n in wanted if n not in names_all]
    if unknown:
        print(f"--scenarios: unknown {', '.join(unknown)} (known: {', '.join(names_all)})", file=sys.stderr)
        return 2
    picked = [i for i, n in enumerate(names_all) if n in wanted]
    n_sc = len(picked)
    caps = (False, True) if args.cap else (False,)
    capacities = (False, True) if args.capacity else (True,)
    jobs = [(t, i, args.seed_offset + s, args.budget, c, m) for t in tuners for i in picked
            for s in range(args.seeds) for c in caps for m in capacities]
    t0 = time.perf_counter()
    if args.workers > 1:
        with Pool(args.workers) as pool:
            results = pool.map(run_one, jobs, chunksize=1)
    else:
        results = [run_one(j) for j in jobs]
    print(f"{len(jobs)} runs ({n_sc} scenarios x {args.seeds} seeds x {len(tuners)} tuners{' x 2 modes' if args.cap or args.capacity else ''}), budget {args.budget}, "
          f"seeds {args.seed_offset}..{args.seed_offset + args.seeds - 1}, {time.perf_counter() - t0:.0f} s; "
          f"hybrid moves: {moves_fn()[1]}\n")
    if args.capacity:
        for name in tuners:
            print(capacity_table(results, name) + "\n")
    full = [r for r in results if not r.cap and r.capacity]
    print(table(full, tuners, args.budget))
    if args.cap:
        for name in tuners:
            print()
            print(cap_table(results, name, args.budget))
        reasons = Counter(r.stopped.split(" (")[0].split(" is ")[0] for r in results if r.cap and r.stopped)
        if reasons:
            print("\ncapped runs stopped because: " + "; ".join(f"{k} ({v})" for k, v in reasons.most_common()))
    results = full
    if "model" in tuners:
        print()
        print(per_scenario(results, "model"))
    if "hybrid" in tuners:
        print()
        print(per_scenario(results, "hybrid"))
        src = sum((r.sources for r in results if r.tuner == "hybrid"), Counter())
        print("\nhybrid proposals by source: " + ", ".join(f"{k} {v}" for k, v in src.most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
