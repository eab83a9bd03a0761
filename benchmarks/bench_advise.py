"""How long `autotune advise` takes on a 1,000,000-row metrics CSV, against pandas.read_csv alone.

Goal (issue 3): the whole analysis in at most 2x the time pandas needs just to
read the file. Run: `.venv/bin/python benchmarks/bench_advise.py [--rows N] [--repeat R]`.
Prints the best of R runs for each. Not a timed test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from autotune.schema import CSV_COLUMNS


def write_csv(path: Path, rows: int, ranks: int = 4, trials: int = 20) -> None:
    """A realistic CPU-run file: 2 stages x 2 dp, empty CUDA-only cells, loss on the last stage."""
    rng = random.Random(0)
    per_trial = rows // trials
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(",".join(CSV_COLUMNS) + "\n")
        for i in range(rows):
            trial, j = divmod(i, per_trial)
            step, rank = divmod(j, ranks)
            st = 0.5 + rng.random() * 0.05
            cells = {
                "time": f"{1.7e9 + i * 0.1:.1f}", "trial": trial, "rank": rank, "stage": rank // 2,
                "step": step, "warmup": int(step < 2), "step_seconds": f"{st:.6f}",
                "samples_per_second": f"{64 / st:.4f}", "tokens_per_second": f"{8192 / st:.2f}",
                "compute_seconds": f"{0.3 + rng.random() * 0.02:.6f}", "comm_seconds": "0.05",
                "wait_seconds": f"{0.08 + rng.random() * 0.04:.6f}", "data_seconds": "0.01",
                "device_utilization": f"{0.6 + rng.random() * 0.1:.5f}",
                "memory_allocated_bytes": "", "memory_reserved_bytes": "",
                "memory_fragmentation_ratio": "", "loss": "2.0" if rank >= 2 else "",
                "micro_batch_size": 4, "gradient_accumulation_steps": 8,
                "reduce_bucket_size": 100000, "pipeline_stages": 2, "data_parallel_size": 2,
                "seq_length": 128, "memory_peak_bytes": "1000000000", "memory_inactive_split_bytes": "",
                "loss_scale": "", "device": "cpu", "host": "n1", "optimizer_seconds": "0.02",
            }
            fh.write(",".join(str(cells[c]) for c in CSV_COLUMNS) + "\n")


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import click
    import pandas as pd
    from click.testing import CliRunner

    from autotune.cli_advise import advise_command

    group = click.Group(commands={"advise": advise_command})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "metrics.csv"
        t = time.perf_counter()
        write_csv(path, args.rows)
        print(f"wrote {args.rows:,} rows ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t:.1f} s")

        def advise() -> None:
            result = CliRunner().invoke(group, ["advise", str(path), "--format", "json"])
            if result.exit_code != 0:
                raise SystemExit(f"advise failed: {result.output}")

        t_pandas = best(lambda: pd.read_csv(path), args.repeat)
        t_advise = best(advise, args.repeat)
    print(f"pandas.read_csv          : {t_pandas:.2f} s")
    print(f"autotune advise (json)   : {t_advise:.2f} s  (read + summarize + rules + output)")
    print(f"ratio advise / read_csv  : {t_advise / t_pandas:.2f}x  (goal <= 2x)")


if __name__ == "__main__":
    main()
