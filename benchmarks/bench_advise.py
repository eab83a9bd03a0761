"""How long `autotune advise` takes on a 1,000,000-row metrics CSV, against pandas.read_csv alone.

Goal (issue 3): the whole analysis in at most 2x the time pandas needs just to
read the file. Run: `.venv/bin/python benchmarks/bench_advise.py [--rows N] [--repeat R]`
(`--quick`: 20,000 rows, one repeat, for CI).
Prints the best of R runs for each. Not a timed test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import csv
import random
import tempfile
import time
from pathlib import Path

from autotune.core.schema import CSV_COLUMNS, StepRecord, record_to_row


def step_record(i: int, per_trial: int, ranks: int, rng: random.Random) -> StepRecord:
    """Row i of a CPU run, 2 stages x 2 dp: a StepRecord, so a new schema column is never missed.

    Fields not set here take the schema's own default ("not available" on CPU).
    Floats are rounded so the cells are as short as a real file's.
    """
    trial, j = divmod(i, per_trial)
    step, rank = divmod(j, ranks)
    st = round(0.5 + rng.random() * 0.05, 6)
    return StepRecord(
        time=round(1.7e9 + i * 0.1, 1), trial=trial, rank=rank, stage=rank // 2, step=step,
        warmup=int(step < 2), step_seconds=st, samples_per_second=round(64 / st, 4),
        tokens_per_second=round(8192 / st, 2), compute_seconds=round(0.3 + rng.random() * 0.02, 6),
        comm_seconds=0.05, wait_seconds=round(0.08 + rng.random() * 0.04, 6), data_seconds=0.01,
        device_utilization=round(0.6 + rng.random() * 0.1, 5), loss=2.0 if rank >= 2 else None,
        micro_batch_size=4, gradient_accumulation_steps=8, reduce_bucket_size=100000,
        pipeline_stages=2, data_parallel_size=2, seq_length=128, memory_peak_bytes=1e9,
        device="cpu", host="n1", optimizer_seconds=0.02, utilization_from_device=0,
    )


def write_csv(path: Path, rows: int, ranks: int = 4, trials: int = 20) -> None:
    """A realistic CPU-run file: header and cells as the product writes them (autotune.core.schema)."""
    rng = random.Random(0)
    per_trial = max(ranks, rows // trials)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS)
        w.writerows(record_to_row(step_record(i, per_trial, ranks, rng)) for i in range(rows))


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="20,000 rows, one repeat: a smoke run (CI)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.repeat = 20_000, 1

    import click
    import pandas as pd
    from click.testing import CliRunner

    from autotune.cli.advise import advise_command

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
