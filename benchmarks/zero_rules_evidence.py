"""The measurements behind the ZeRO rules `zero-chatty-reductions` and `zero3-gathers-dominate`
(docs/zero-facts.md "Per-kind communication on a plain engine"), one fresh `autotune run
--budget 1` per config on the built-in ZeRO engine (tiny decoder, 2 ranks, micro 2 x GAS 4),
the configs alternated `--repeats` times:

    .venv/bin/python benchmarks/zero_rules_evidence.py [--repeats 2] [--only z2-bucket4096,z2-bucket5e8] [--out DIR]

For each launch: samples/s, collective calls per micro-batch, the all-gathers' share of
communication, communication/compute, and the rules the trial fired (the study's own record).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = {
    "z2-bucket4096": {"stage": 2, "reduce_bucket_size": 4096},
    "z2-bucket5e8": {"stage": 2, "reduce_bucket_size": 500_000_000},
    "z3-persist640": {"stage": 3, "stage3_param_persistence_threshold": 640},
    "z3-persist1e5": {"stage": 3, "stage3_param_persistence_threshold": 100_000},
    "z2-offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "z3-offload": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
}


def launch(name: str, folder: Path) -> dict:
    zero = CASES[name]
    folder.mkdir(parents=True)
    cfg = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10**6, "zero_optimization": zero}
    (folder / "ds.json").write_text(json.dumps(cfg))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "autotune", "run", "--engine", "zero", "--preset", "tiny", "--dp", "2",
                           "--config", "ds.json", "--budget", "1", "--zero-stages", str(zero["stage"]), "--steps", "8",
                           "--warmup-steps", "2", "--fixed-steps", "--no-metrics", "--study", "st"],
                          cwd=folder, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"failed": proc.stderr.strip().splitlines()[-1:] or proc.stdout[-500:]}
    with sqlite3.connect(folder / "st" / "study.db") as db:
        sps, summary, fired = db.execute(
            "select samples_per_second, summary_json, rules_fired from trials where number = 0").fetchone()
    s = json.loads(summary)
    return {"samples_per_second": sps, "calls_per_micro_batch": s.get("collective_calls_per_micro_batch"),
            "gather_comm_fraction": s.get("gather_comm_fraction"), "comm_compute_ratio": s.get("comm_compute_ratio"),
            "rules_fired": json.loads(fired or "[]")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"zero_rules_evidence: unknown case {', '.join(unknown)}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="zero-rules-"))
    for rep in range(args.repeats):
        for name in names:
            r = launch(name, out / f"{name}-{rep}")
            print(f"{name:14s} launch {rep + 1}: {json.dumps(r)}", flush=True)
    print(f"(runs in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
