"""Where the noise of a trial is: between the steps of one launch, or between launches?

Issue 11, "Beware what the noise is made of": three launches of one configuration read
292, 439 and 264 samples/s while the steps inside each trial stayed within ~5 %. An
interval built from one trial's steps then overstates what is known. This measures it:

    .venv/bin/python benchmarks/launch_noise.py [--n 4] [--pools 2] [--stages 2 --dp 1] [--out DIR]
    .venv/bin/python benchmarks/launch_noise.py --quick    # CI smoke run: n 1, 1 pool, 6 steps

ONE configuration of the default demo (its default config's global batch, at `--micro`
and the chosen stages x dp), measured with a fixed number of steps (the same n for every
interval):
- fresh: `--n x --pools` trials, each a new DeepSpeed launch;
- warm: `--pools` pools of warm workers (autotune/trials/warm_pool.py), `--n` trials in each;
alternated trial by trial (fresh, warm, fresh, warm, ...), so drift of a shared machine
touches both modes alike. An idle warm pool polls its job folder while a fresh trial runs
(every 20 ms: negligible CPU).

Per mode it prints the within-trial spread (median over trials of the median step time's
95 % interval half-width, autotune/core/step_budget.py) against the between-launch spread (the
coefficient of variation of the trials' median step times). For warm it also splits the
between-trial spread into within a pool and between pools: a pool that "freezes" the
launch noise shows a small within-pool CV and a large between-pool difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from autotune.core.options import RunOptions, WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.trials.builtin import BuiltinRunner, builtin_runner
from autotune.trials.contract import TrialRequest
from autotune.tuning.starting_point import load_base_config


def cv(xs: list[float]) -> float:
    """Coefficient of variation (sample std / mean); 0 for fewer than two values."""
    return statistics.stdev(xs) / statistics.mean(xs) if len(xs) > 1 else 0.0


def measure(runner: BuiltinRunner, n: int, cfg: TrialConfig, folder: Path) -> dict:
    o = runner.run(TrialRequest(number=n, config=cfg, trial_dir=folder, timeout=900))
    if not o.result.ok:
        raise SystemExit(f"trial {folder} failed: {o.result.failure_reason}: {o.failure_detail}")
    s = o.summary
    return {"median": s.step_seconds, "hw": s.step_seconds_rel_half_width, "sps": s.samples_per_second,
            "wall": o.wall_seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4, help="trials per pool (and fresh trials per pool)")
    ap.add_argument("--pools", type=int, default=2, help="warm pools, each launched once")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--micro", type=int, default=16, help="micro-batch (GAS: the default config's global "
                    "batch / micro / dp; micro 16 is the issue's example configuration)")
    ap.add_argument("--steps", type=int, default=12, help="measured steps per trial (fixed)")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="n 1, 1 pool, 6 steps, 1 warm-up")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.pools, args.steps, args.warmup_steps = 1, 1, 6, 1
    out = Path(args.out or tempfile.mkdtemp(prefix="autotune-launch-noise-"))
    out.mkdir(parents=True, exist_ok=True)
    wl = dict(pipeline_stages=args.stages, data_parallel_size=args.dp, steps=args.steps,
              warmup_steps=args.warmup_steps, adaptive_steps=False)
    base = load_base_config(RunOptions(workload=WorkloadOptions(**wl)))
    layout = base.resolve_batch(args.dp)
    per_replica = layout.micro_batch_size * layout.gradient_accumulation_steps
    if per_replica % args.micro:
        raise SystemExit(f"--micro {args.micro} does not divide the per-replica batch {per_replica}")
    cfg = TrialConfig(micro_batch_size=args.micro, gradient_accumulation_steps=per_replica // args.micro)
    print(f"configuration: {cfg.describe()}, {args.stages} stages x {args.dp} dp, {args.steps} fixed steps "
          f"after {args.warmup_steps} warm-up; {args.n * args.pools} fresh launches, {args.pools} warm "
          f"pool(s) x {args.n} trials, alternated", flush=True)
    fresh_runner = builtin_runner(WorkloadOptions(**wl, workers="fresh"), base)
    fresh: list[dict] = []
    warm: list[list[dict]] = []
    k = 0
    for p in range(args.pools):
        pool = builtin_runner(WorkloadOptions(**wl, workers="warm"), base)
        warm.append([])
        try:
            for i in range(args.n):
                for mode in (("fresh", "warm") if (p * args.n + i) % 2 == 0 else ("warm", "fresh")):
                    runner = fresh_runner if mode == "fresh" else pool
                    r = measure(runner, k, cfg, out / f"{mode}-{k:03d}")
                    (fresh if mode == "fresh" else warm[p]).append(r)
                    print(f"  {mode:5} {'pool ' + str(p + 1) if mode == 'warm' else 'launch':7} trial {k:3}: "
                          f"median step {1e3 * r['median']:7.1f} ms, within ±{100 * (r['hw'] or 0):.1f} %, "
                          f"{r['sps']:7.1f} samples/s, wall {r['wall']:.1f} s", flush=True)
                    k += 1
        finally:
            pool.close()

    all_warm = [r for pool in warm for r in pool]
    print("\n| mode | trials | within-trial ± (median) | between-trial CV of medians | samples/s range |")
    print("|---|---|---|---|---|")
    figures = {}
    for mode, rs in (("fresh", fresh), ("warm", all_warm)):
        within = statistics.median(r["hw"] or 0.0 for r in rs)
        between = cv([r["median"] for r in rs])
        figures[mode] = (within, between)
        print(f"| {mode} | {len(rs)} | ±{100 * within:.1f} % | {100 * between:.1f} % | "
              f"{min(r['sps'] for r in rs):.1f}-{max(r['sps'] for r in rs):.1f} |")
    for mode, (within, between) in figures.items():
        print(f"{mode}: within-trial ±{100 * within:.1f} %, between launches CV {100 * between:.1f} %")
    if args.pools > 1:
        in_pool = statistics.median(cv([r["median"] for r in pool]) for pool in warm)
        pool_medians = [statistics.median(r["median"] for r in pool) for pool in warm]
        print(f"warm: within a pool CV {100 * in_pool:.1f} % (median over pools), between pools' medians "
              f"CV {100 * cv(pool_medians):.1f} %")
    print(f"(trials in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
