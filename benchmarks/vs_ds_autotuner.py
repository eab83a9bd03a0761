"""autotune beside DeepSpeed's own autotuner, on the same ZeRO job in one run (issue 42).

    .venv/bin/pip install tabulate            # DeepSpeed's `autotuning` extra: its autotuner needs it
    .venv/bin/python benchmarks/vs_ds_autotuner.py [--budget 20] [--repeats 3] [--max-batch 64] [--out DIR]

The job is benchmarks/zero_job.py (the built-in tiny decoder as a plain module, ZeRO-1, 2 gloo
ranks on CPU), run unchanged by both:
- DeepSpeed's autotuner: `deepspeed --autotuning tune --num_gpus 2 zero_job.py --deepspeed
  --deepspeed_config ds.json` with `"autotuning": {"enabled": true, "fast": true,
  "max_train_batch_size": MAX}`. It tunes the ZeRO stage and the micro-batch, and changes
  `train_batch_size` (micro-batch x dp, up to MAX).
- autotune, with the global batch freed the same way: DeepSpeed's fast mode keeps the config's
  GAS and bounds micro-batch x dp by MAX (measured: with MAX 32 and GAS 4 its best had batch 128),
  so autotune gets `--free-batch --max-global-batch MAX x GAS`, the same ceiling; and at the fixed
  global batch (its default), beside it. Both through the user-script path (a fresh launch per
  trial, as DeepSpeed's autotuner launches each experiment).
- autotune's built-in ZeRO engine on the same model (`--engine zero --preset tiny --dp 2`, the
  batch freed as above): zero_job.py is that decoder under the usual loop, and where autotune owns
  the loop its trials run in warm workers (docs/warm-workers.md).

For each: the wall time of the whole tuning run, the trials (experiments) it ran, and its best
configuration re-measured the same way for all three, alternately, `--repeats` times: one
`autotune run --budget 1` of that config (fresh processes, 8 measured steps), its samples/s.
Each autotune run also says when its best was found: the run's start-up (wall minus its trials)
plus the trials up to and including the best. Goal: autotune's best (freed batch) >= DeepSpeed's,
found in <= 1/3 of DeepSpeed's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB = HERE / "zero_job.py"
BASE = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
        "steps_per_print": 10**6}


def env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "DS_ACCELERATOR": "cpu",
            "LOCAL_SIZE": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}


def timed(cmd: list[str], cwd: Path, log: Path) -> tuple[int, float]:
    t0 = time.monotonic()
    with log.open("w") as fh:
        rc = subprocess.run(cmd, cwd=cwd, env=env(), stdout=fh, stderr=subprocess.STDOUT).returncode
    return rc, time.monotonic() - t0


def deepspeed_autotuner(out: Path, max_batch: int) -> dict:
    """DeepSpeed's autotuner on the job: its wall time, experiments and optimal config."""
    folder = out / "deepspeed"
    folder.mkdir(parents=True)
    # without train_batch_size: its model-info run sets micro 1 and keeps the rest, and DeepSpeed then
    # refuses a stated batch ("train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step *
    # world_size 16 != 1 * 4 * 2", measured; docs/zero-facts.md)
    own = {k: v for k, v in BASE.items() if k != "train_batch_size"}
    cfg = {**own, "autotuning": {"enabled": True, "fast": True, "max_train_batch_size": max_batch,
                                 "results_dir": "results", "exps_dir": "exps", "overwrite": True}}
    (folder / "ds.json").write_text(json.dumps(cfg, indent=2))
    rc, wall = timed(["deepspeed", "--autotuning", "tune", "--num_gpus", "2", str(JOB), "--deepspeed",
                      "--deepspeed_config", "ds.json"], folder, folder / "autotuner.log")
    # one exps/NAME.json per experiment (DeepSpeed 0.19.8), besides the model-info profile's;
    # results/NAME/metrics.json for each that measured
    exps = sorted(p for p in (folder / "exps").glob("*.json") if p.name != "profile_model_info.json")
    measured = [p for p in exps if (folder / "results" / p.stem / "metrics.json").is_file()]
    best = folder / "results" / "ds_config_optimal.json"
    return {"tuner": "DeepSpeed autotuner (fast)", "rc": rc, "wall": wall, "trials": len(exps),
            "measured": len(measured), "best": best if best.is_file() else None, "log": folder / "autotuner.log"}


def autotune(out: Path, name: str, label: str, budget: int, extra: list[str], *, engine: bool = False) -> dict:
    """One autotune run: through the user-script path, or (`engine`) its built-in ZeRO engine."""
    folder = out / name
    folder.mkdir(parents=True)
    (folder / "ds.json").write_text(json.dumps(BASE, indent=2))
    how = (["--engine", "zero", "--preset", "tiny", "--dp", "2", "--config", "ds.json"] if engine else
           ["--", "deepspeed", "--num_gpus", "2", str(JOB), "--deepspeed_config", "ds.json"])
    rc, wall = timed([sys.executable, "-m", "autotune", "run", "--budget", str(budget), "--study", "st",
                      "--no-metrics", *extra, *how], folder, folder / "run.log")
    summary_path = folder / "st" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    trials = summary.get("trials", [])
    best = folder / "st" / "best_ds_config.json"
    return {"tuner": label, "rc": rc, "wall": wall, "trials": len(trials), "measured": len(trials),
            "best": best if best.is_file() else None, "log": folder / "run.log",
            "found": found_after(wall, trials, (summary.get("best") or {}).get("trial"))}


def found_after(wall: float, trials: list[dict], best: int | None) -> float | None:
    """When the run's best was found: its start-up (the wall outside its trials) plus the trials
    up to and including the best's (in the order they ran)."""
    if best is None:
        return None
    spent = [t.get("wall_seconds") or 0.0 for t in trials]
    upto = next((i for i, t in enumerate(trials) if t["trial"] == best), len(trials) - 1)
    return max(0.0, wall - sum(spent)) + sum(spent[:upto + 1])


def remeasure(out: Path, name: str, best: Path, k: int) -> float | None:
    """One fresh `autotune run --budget 1` of `best`: its samples/s (None: it failed)."""
    folder = out / "remeasure" / f"{name}-{k}"
    folder.mkdir(parents=True)
    cfg = json.loads(best.read_text())
    cfg.pop("autotuning", None)
    (folder / "ds.json").write_text(json.dumps(cfg, indent=2))
    rc, _ = timed([sys.executable, "-m", "autotune", "run", "--budget", "1", "--steps", "8", "--warmup-steps", "2",
                   "--fixed-steps", "--study", "st", "--no-metrics", "--", "deepspeed", "--num_gpus", "2",
                   str(JOB), "--deepspeed_config", "ds.json"], folder, folder / "run.log")
    summary = folder / "st" / "summary.json"
    if rc != 0 or not summary.is_file():
        return None
    base = json.loads(summary.read_text()).get("baseline") or {}
    return base.get("samples_per_second")


def describe(best: Path | None) -> str:
    if best is None:
        return "none"
    c = json.loads(best.read_text())
    zero = (c.get("zero_optimization") or {}).get("stage", 0)
    return (f"ZeRO-{zero}, micro {c.get('train_micro_batch_size_per_gpu')} x GAS "
            f"{c.get('gradient_accumulation_steps', '-')}, batch {c.get('train_batch_size', '-')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=20, help="autotune's trials (a cap)")
    ap.add_argument("--repeats", type=int, default=3, help="fresh re-measurements of each best, alternated")
    ap.add_argument("--max-batch", type=int, default=64,
                    help="DeepSpeed's max_train_batch_size (autotune's --max-global-batch: this x the config's GAS)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if shutil.which("deepspeed", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}") is None:
        raise SystemExit("deepspeed not found next to this Python")
    try:
        import tabulate  # noqa: F401  (DeepSpeed's autotuner imports it)
    except ImportError:
        raise SystemExit("DeepSpeed's autotuner needs tabulate: .venv/bin/pip install tabulate") from None
    out = Path(args.out or tempfile.mkdtemp(prefix="autotune-vs-ds-"))
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    freed = ["--free-batch", "--max-global-batch", str(args.max_batch * BASE["gradient_accumulation_steps"])]
    for step in (lambda: deepspeed_autotuner(out, args.max_batch),
                 lambda: autotune(out, "autotune-free", "autotune, global batch freed", args.budget, freed),
                 lambda: autotune(out, "autotune-fixed", "autotune, global batch fixed", args.budget, []),
                 lambda: autotune(out, "autotune-engine", "autotune, built-in ZeRO engine, batch freed",
                                  args.budget, freed, engine=True)):
        r = step()
        runs.append(r)
        found = f", best found after {r['found']:.0f} s" if r.get("found") is not None else ""
        print(f"{r['tuner']}: rc {r['rc']}, wall {r['wall']:.0f} s{found}, {r['trials']} trials "
              f"({r['measured']} measured), best {describe(r['best'])} (log {r['log']})", flush=True)
    again: dict[str, list[float]] = {r["tuner"]: [] for r in runs}
    for k in range(args.repeats):
        for i, r in enumerate(runs):
            if r["best"] is not None:
                sps = remeasure(out, f"{i}", r["best"], k)
                if sps is not None:
                    again[r["tuner"]].append(sps)
    print("\n| tuner | best config | best re-measured (samples/s, median) | trials | wall (s) | best found after (s) |")
    print("|---|---|---|---|---|---|")
    med = {}
    for r in runs:
        xs = again[r["tuner"]]
        med[r["tuner"]] = statistics.median(xs) if xs else None
        shown = f"{med[r['tuner']]:.1f} over {len(xs)}" if xs else "n/a (no best, or its re-measure failed)"
        found = f"{r['found']:.0f}" if r.get("found") is not None else "-"
        print(f"| {r['tuner']} | {describe(r['best'])} | {shown} | {r['trials']} | {r['wall']:.0f} | {found} |")
    ds = runs[0]
    for mine in (runs[1], runs[3]):
        if med[ds["tuner"]] and med[mine["tuner"]] and mine.get("found") is not None:
            print(f"\n{mine['tuner']}: best / DeepSpeed's {med[mine['tuner']] / med[ds['tuner']]:.2f}x (goal >= 1); "
                  f"found after {mine['found'] / ds['wall']:.2f} of DeepSpeed's wall (goal <= 0.33); "
                  f"whole run {mine['wall'] / ds['wall']:.2f} of it")
        else:
            print(f"\nno comparison for {mine['tuner']}: a tuner found no best or its re-measure failed (see its log)")
    print(f"(runs in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
