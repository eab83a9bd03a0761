"""Fuzz the three input loaders: ds_config, metrics CSV, rule file.

Each case mutates a valid seed file (byte flips, truncation, splices, structure-aware
value swaps), writes it to disk and calls the loader directly. A loader may accept
the file or raise AutotuneError (one line for the user); anything else is a bug and
is counted and printed with its traceback head.

    .venv/bin/python benchmarks/fuzz_loaders.py --cases 10000 --seed 0
    .venv/bin/python benchmarks/fuzz_loaders.py --quick     # CI smoke run: 600 cases
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.advisor.rulebook import BUILTIN_RULES, load_rule_file  # noqa: E402
from autotune.core.dsconfig import load_ds_config  # noqa: E402
from autotune.core.errors import AutotuneError  # noqa: E402
from autotune.core.schema import CSV_COLUMNS, StepRecord, record_to_row  # noqa: E402
from autotune.loaders import load_input  # noqa: E402

WEIRD = ["", "-1", "0", "1e309", "-1e309", "nan", "inf", "-inf", "NaN", "1e-400", "9" * 40, "true",
         "null", "auto", "\x00", "é", "\ufeff", "\"", "'", ",", "\n", "[]", "{}", "0x10", "1_000", " 1 ",
         "2.5", "-0", "🙂", "\\", "\r\n"]


def seed_ds_config() -> str:
    return json.dumps({
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 16,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 500000000},
        "fp16": {"enabled": False}, "steps_per_print": 100,
    }, indent=2)


def seed_csv() -> str:
    """A valid file as the product writes it: StepRecords (the schema) through record_to_row."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_COLUMNS)
    for step in range(4):
        for rank in range(2):
            w.writerow(record_to_row(StepRecord(
                time=1000.0, trial=0, rank=rank, stage=rank, step=step, warmup=int(step == 0),
                step_seconds=1.0, samples_per_second=8.0, tokens_per_second=512.0, compute_seconds=0.5,
                comm_seconds=0.1, wait_seconds=0.3, data_seconds=0.0, device_utilization=0.5,
                loss=5.5, micro_batch_size=2, gradient_accumulation_steps=2, pipeline_stages=2,
                data_parallel_size=2, seq_length=64, utilization_from_device=0)))
    return buf.getvalue()


def seed_rules() -> str:
    return BUILTIN_RULES.read_text(encoding="utf-8")


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(5)
        if not b:
            b += bytes([rng.randrange(256)])
            continue
        i = rng.randrange(len(b))
        if op == 0:
            b[i] = rng.randrange(256)
        elif op == 1:
            del b[i:i + rng.randint(1, 16)]
        elif op == 2:
            b[i:i] = rng.choice(WEIRD).encode("utf-8")
        elif op == 3:
            j = rng.randrange(len(b))
            b[i:i] = b[j:j + rng.randint(1, 32)]
        else:
            b = b[: rng.randrange(len(b) + 1)]
    return bytes(b)


def mutate_json(text: str, rng: random.Random) -> str:
    obj = json.loads(text)
    pool = [None, True, -3, 0, 1.5, 10**30, float("nan"), float("inf"), "x", "auto", [], {}, [1, 2], {"stage": 9}]

    def walk(o, depth=0):
        if isinstance(o, dict):
            for k in list(o):
                r = rng.random()
                if r < 0.25:
                    o[k] = rng.choice(pool)
                elif r < 0.35:
                    del o[k]
                else:
                    walk(o[k], depth + 1)
            if rng.random() < 0.1:
                o[rng.choice(["zero_optimization", "train_batch_size", "pipeline", "new"])] = rng.choice(pool)
        return o

    out = walk(obj)
    if rng.random() < 0.1:
        out = rng.choice(pool)
    return json.dumps(out, allow_nan=True)


def mutate_csv(text: str, rng: random.Random) -> str:
    rows = list(csv.reader(io.StringIO(text)))
    for _ in range(rng.randint(1, 6)):
        r = rng.randrange(len(rows))
        op = rng.randrange(4)
        if op == 0 and rows[r]:
            rows[r][rng.randrange(len(rows[r]))] = rng.choice(WEIRD)
        elif op == 1 and rows[r]:
            del rows[r][rng.randrange(len(rows[r]))]
        elif op == 2:
            rows[r].append(rng.choice(WEIRD))
        else:
            rows.insert(r, [rng.choice(WEIRD) for _ in range(rng.randint(0, 5))])
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue()


def mutate_toml(text: str, rng: random.Random) -> str:
    lines = text.splitlines()
    for _ in range(rng.randint(1, 5)):
        i = rng.randrange(len(lines))
        line = lines[i]
        if "=" in line and rng.random() < 0.7:
            key = line.split("=", 1)[0]
            lines[i] = key + "= " + rng.choice(['"x"', "1e400", "-1", "nan", "inf", "[]", "{}", "true",
                                               '"__import__(\'os\').system(\'true\')"', "[1, \"a\"]",
                                               '{ signal = "x" }', "0", '""'])
        elif rng.random() < 0.5:
            del lines[i]
        else:
            lines.insert(i, rng.choice(["[[rule]]", "[[rule.move]]", "[x]", "id = \"dup\"", "op = \"~\""]))
    return "\n".join(lines) + "\n"


def advise_input(path: Path) -> None:
    """What `autotune advise` does with a file: detect, read, summarize (the summary is where an
    empty seq_length once crashed, after the reader had accepted the file)."""
    load_input(path)


LOADERS = {
    "ds_config": (load_ds_config, seed_ds_config, mutate_json, ".json"),
    "metrics_csv": (advise_input, seed_csv, mutate_csv, ".csv"),
    "rule_file": (load_rule_file, seed_rules, mutate_toml, ".toml"),
}


def column_sweep() -> list[tuple[str, bytes]]:
    """Every column of the seed CSV emptied, then made non-numeric, one column at a time."""
    rows = list(csv.reader(io.StringIO(seed_csv())))
    header, body = rows[0], rows[1:]
    cases = []
    for k, col in enumerate(header):
        for cell in ("", "abc"):
            buf = io.StringIO()
            w = csv.writer(buf)
            w.writerow(header)
            w.writerows([*r[:k], cell, *r[k + 1:]] for r in body)
            cases.append((f"{col}={cell or 'empty'}", buf.getvalue().encode()))
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10_000, help="total cases across the three loaders")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="600 cases: a smoke run (CI)")
    args = ap.parse_args(argv)
    if args.quick:
        args.cases = 600
    rng = random.Random(args.seed)
    stats: dict[str, collections.Counter] = {k: collections.Counter() for k in LOADERS}
    bugs: dict[tuple[str, str], str] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        sweep = column_sweep()
        stats["column_sweep"] = collections.Counter()
        for label, data in sweep:  # deterministic, before the random cases
            path = Path(tmp) / "sweep.csv"
            path.write_bytes(data)
            try:
                advise_input(path)
                stats["column_sweep"]["accepted"] += 1
            except AutotuneError:
                stats["column_sweep"]["rejected_cleanly"] += 1
            except Exception as exc:
                stats["column_sweep"]["traceback"] += 1
                bugs[("column_sweep", f"{label}: {type(exc).__name__}: {str(exc)[:80]}")] = \
                    "".join(traceback.format_exception(exc)[-3:])
        for i in range(args.cases):
            name = list(LOADERS)[i % len(LOADERS)]
            loader, seed, structured, suffix = LOADERS[name]
            base = seed()
            data = (structured(base, rng).encode("utf-8", "surrogatepass") if rng.random() < 0.5
                    else mutate_bytes(base.encode(), rng))
            path = Path(tmp) / f"case{suffix}"
            path.write_bytes(data)
            try:
                loader(path)
                stats[name]["accepted"] += 1
            except AutotuneError:
                stats[name]["rejected_cleanly"] += 1
            except Exception as exc:  # a traceback a user would see: the thing we hunt
                stats[name]["traceback"] += 1
                key = (name, f"{type(exc).__name__}: {str(exc)[:80]}")
                if key not in bugs:
                    bugs[key] = "".join(traceback.format_exception(exc)[-3:])
                    (Path(tempfile.gettempdir()) / f"fuzz-{name}-{len(bugs)}{suffix}").write_bytes(data)
    elapsed = time.perf_counter() - t0
    total_tb = sum(s["traceback"] for s in stats.values())
    print(f"fuzz_loaders: {args.cases} random cases and {len(sweep)} column-sweep cases in {elapsed:.1f} s "
          f"(seed {args.seed})")
    for name, s in stats.items():
        n = sum(s.values())
        print(f"  {name:<12} {n:>6} cases: {s['accepted']:>5} accepted, {s['rejected_cleanly']:>5} "
              f"rejected with one line, {s['traceback']:>4} not an AutotuneError")
    for (name, head), tb in bugs.items():
        print(f"\n[{name}] {head}\n{tb}")
    print(f"\ntotal non-AutotuneError exceptions: {total_tb}")
    return 1 if total_tb else 0


if __name__ == "__main__":
    sys.exit(main())
