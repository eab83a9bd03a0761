"""Does a pool of warm workers slow down the longer it lives?

One configuration of the tiny demo (4 stages x 1 dp, micro 2, GAS 8) run `--trials` times in
one pool of warm workers (autotune/trials/warm_pool.py), the pool recycled after MAX_JOBS_PER_POOL
trials as in a run. Before autotune/rank/workload/groups.py each trial left its process groups,
and their gloo threads, alive: 30 trials read 96.8 samples/s at first and 50-65 after 20; and
the last rank kept every trial's engine until train.drop_autograd_graphs (docs/warm-workers.md).

    .venv/bin/python benchmarks/pool_drift.py [--trials 30] [--repeats 2]
    .venv/bin/python benchmarks/pool_drift.py --preset wide-vocab --stages 2 --trials 5 --repeats 1
    .venv/bin/python benchmarks/pool_drift.py --quick    # CI smoke run: 3 trials

Per run it prints every trial's samples/s, the first pool's threads, open files, RSS and
process groups per rank after its first and its last trial (worker-memory.json), and the
ratio of the last third's median to the first third's. A ratio near 1 with groups constant is a pool that does not age; this
shared 2-core machine moves by +-30 % between runs, so read the trend, not one trial.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from autotune.core.dsconfig import DsConfig  # noqa: E402
from autotune.core.options import WorkloadOptions  # noqa: E402
from autotune.core.space import TrialConfig  # noqa: E402
from autotune.trials.builtin import builtin_runner  # noqa: E402
from autotune.trials.contract import TrialRequest  # noqa: E402
from autotune.trials.warm_pool import MAX_JOBS_PER_POOL  # noqa: E402

CONFIG = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10**9}


def one_run(trials: int, steps: int, root: Path, preset: str = "tiny", stages: int = 4) -> list[float]:
    wl = WorkloadOptions(preset=preset, pipeline_stages=stages, data_parallel_size=1, steps=steps, warmup_steps=2)
    runner = builtin_runner(wl, DsConfig.from_dict(CONFIG))
    cfg = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=8)
    out = []
    try:
        for i in range(trials):
            o = runner.run(TrialRequest(number=i, config=cfg, trial_dir=root / f"t{i:03d}", timeout=900))
            if not o.result.ok:
                raise SystemExit(f"trial {i} failed: {o.failure_detail}")
            out.append(o.result.samples_per_second)
    finally:
        runner.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2, help="runs, each in new pools")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="3 trials, 1 run, 3 steps: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.trials, args.repeats, args.steps = 3, 1, 3
    for rep in range(args.repeats):
        root = Path(tempfile.mkdtemp(prefix="pool-drift-"))
        sps = one_run(args.trials, args.steps, root, args.preset, args.stages)
        print(f"run {rep + 1}: " + " ".join(f"{x:.1f}" for x in sps))
        last = min(args.trials, MAX_JOBS_PER_POOL)  # the first pool's last trial
        for n in sorted({1, last}):
            ranks = json.loads((root / f"t{n - 1:03d}" / "worker-memory.json").read_text())["ranks"]
            print(f"run {rep + 1}: after {n} trial(s) in one pool, per rank: threads {[r['threads'] for r in ranks]}, "
                  f"open files {[r['open_fds'] for r in ranks]}, RSS MB {[round(r['rss_after_bytes'] / 2**20) for r in ranks]}, "
                  f"process groups per rank {[r['process_groups'] for r in ranks]}")
        third = max(1, len(sps) // 3)
        ratio = statistics.median(sps[-third:]) / statistics.median(sps[:third])
        print(f"run {rep + 1}: last third / first third (medians): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
