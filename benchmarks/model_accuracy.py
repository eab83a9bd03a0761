"""How well the performance model predicts configurations its study did not run (issue 26).

    .venv/bin/python benchmarks/model_accuracy.py [--out DIR] [--steps 6]
    .venv/bin/python benchmarks/model_accuracy.py --quick [--calibration STUDY]   # CI smoke run
    .venv/bin/python benchmarks/model_accuracy.py --from-budget 4 [--repeats 3]   # issue 44's small study

Steps, all real DeepSpeed trials on this machine:
1. a calibration study: `autotune run --layer-costs --full-budget --budget 6` on the built-in
   default (2 stages x 2 dp, 4 ranks), which climbs the micro-batch at the fixed global batch;
2. a 2-rank calibration study (2 stages x 1 dp) for the extrapolation figure;
3. targets the studies did not run, each a one-trial `autotune run --budget 1` in its own
   folder: 2 and 4 stages, dp 1 and 2, micro 1-16, three partitions, checkpointing on and off;
4. `autotune predict` (the package's own call) for each target from each calibration study.

It prints predicted against measured step time and peak memory per stage for each target, and
the mean absolute percentage error (MAPE) over targets only: no calibration trial is scored.
Goals: step-time MAPE <= 8 %, peak memory per stage within 10 %, and (issue 44) the 80 %
interval `autotune predict` states holds at least 80 % of the targets' measurements. One launch of a configuration
differs from the next by 10-30 % on these shared cores (README), so the figure holds that noise
too: the script also re-runs one target to show the launch-to-launch spread beside the error.

`--from-budget N` (issue 44: the small-study case) calibrates on what a user has after
`autotune run --budget N` on the built-in default, nothing added (its baseline's layer costs
are the default's), and scores the configurations of `SMALL_TARGETS` it did not run, each
launched `--repeats` times (one launch varies by 10-30 % here): the MAPE against each target's
mean, and how many launches and means lie inside the 80 % interval `autotune predict` states.
Goals: MAPE <= 10 %, every target inside its interval.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

GLOBAL_BATCH = 64


@dataclass(frozen=True)
class Target:
    stages: int
    dp: int
    micro: int
    parts: str | None = None
    checkpoint: int = 0
    bucket: int | None = None

    @property
    def gas(self) -> int:
        return GLOBAL_BATCH // (self.micro * self.dp)

    def label(self) -> str:
        bits = [f"{self.stages}x{self.dp}", f"micro {self.micro}", f"GAS {self.gas}"]
        if self.parts:
            bits.append(f"parts {self.parts}")
        if self.checkpoint:
            bits.append(f"ckpt {self.checkpoint}")
        if self.bucket:
            bits.append(f"bucket {self.bucket:.0e}")
        return ", ".join(bits)


TARGETS = [
    Target(2, 1, 2), Target(2, 1, 8), Target(2, 1, 16, parts="0,2,6"),
    Target(4, 1, 1), Target(4, 1, 4), Target(4, 1, 16), Target(4, 1, 4, parts="0,1,3,5,6"),
    Target(4, 1, 8, checkpoint=1),
    Target(2, 2, 2, parts="0,2,6"), Target(2, 2, 8, parts="0,4,6"), Target(2, 2, 4, checkpoint=1),
    Target(2, 2, 16, checkpoint=1), Target(2, 2, 8, bucket=20000),
]
QUICK_TARGETS = [Target(2, 1, 4, checkpoint=1)]
SMALL_TARGETS = [Target(2, 2, 2, bucket=30000), Target(2, 2, 8, bucket=30000), Target(2, 2, 4, bucket=30000),
                 Target(2, 2, 16, bucket=30000), Target(2, 2, 1, bucket=30000)]
"""issue 44's three configurations (micro 2, 8 and 4 at bucket 3e4, the default layout), and the
two ends of the micro-batch range."""


def autotune(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "autotune", *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(args)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc


def run_target(t: Target, folder: Path, steps: int, warmup: int) -> Path:
    cfg = folder / "ds_config.json"
    zero = {"stage": 1, **({"reduce_bucket_size": t.bucket} if t.bucket else {})}
    cfg.write_text(json.dumps({"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": t.micro,
                               "gradient_accumulation_steps": t.gas, "zero_optimization": zero,
                               "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}))
    args = ["run", "--study", str(folder / "st"), "--budget", "1", "--config", str(cfg), "--stages", str(t.stages),
            "--dp", str(t.dp), "--layer-costs", "--no-metrics", "--fixed-steps", "--steps", str(steps),
            "--warmup-steps", str(warmup), "--activation-checkpoint-interval", str(t.checkpoint)]
    if t.parts:
        args += ["--partition-method", f"parts:{t.parts}"]
    autotune(*args, cwd=folder)
    return folder / "st"


def measured(study: Path) -> tuple[float, list[float] | None]:
    from autotune.model.observations import observe_study

    obs = observe_study(study)
    if not obs:
        raise SystemExit(f"{study}: the target trial did not finish")
    o = obs[0]
    peaks = [s.peak_memory_bytes for s in o.stage]
    return o.step_seconds, (None if any(p is None for p in peaks) else peaks)  # type: ignore[misc]


def predicted(calibration: Path, t: Target):
    from autotune.model.step_model import predict
    from autotune.model.study_model import layout_from, model_of_study

    model = model_of_study(calibration)
    layout = layout_from(model, micro=t.micro, gas=t.gas, bucket=t.bucket, parts=t.parts,
                         checkpoint_interval=t.checkpoint, stages=t.stages, dp=t.dp)
    return predict(model.calibration, layout)


def score(name: str, calibration: Path, rows: list[tuple[Target, float, list[float] | None]]) -> float:
    print(f"\n== predicted from {name} ({calibration})")
    print(f"{'target':44s} {'measured ms':>11s} {'predicted':>10s} {'error':>7s}   memory error per stage")
    from autotune.model.render import leave_one_out
    from autotune.model.study_model import model_of_study

    loo = leave_one_out(model_of_study(calibration))  # the interval `autotune predict` states
    errors, mem_errors, held, stated, elsewhere = [], [], 0, 0, 0
    for t, step, peaks in rows:
        p = predicted(calibration, t)
        err = p.step_seconds / step - 1
        errors.append(abs(err))
        iv = loo.interval(p.samples_per_second, p.layout)
        elsewhere += loo.elsewhere(p.layout)
        if iv is not None:
            stated += 1
            held += iv.low <= GLOBAL_BATCH / step <= iv.high
        mem = ""
        if peaks and p.stage_memory_bytes:
            e = [pm / m - 1 for pm, m in zip(p.stage_memory_bytes, peaks, strict=False)]
            mem_errors += [abs(x) for x in e]
            mem = " ".join(f"{x * 100:+.1f}%" for x in e)
        print(f"{t.label():44s} {step * 1000:11.1f} {p.step_seconds * 1000:10.1f} {err * 100:+6.1f}%   {mem}")
    mape = statistics.fmean(errors) * 100
    print(f"step-time MAPE over {len(errors)} unseen configurations: {mape:.1f} % (goal <= 8 %)")
    if stated:
        print(f"the stated 80 % interval held {held} of {stated} measurements ({held / stated:.0%}; goal >= 80 %)")
    else:
        print(f"no interval stated: {loo.why_no_interval()}")
    if elsewhere:
        print(f"no interval for {elsewhere} target(s) of another stage count or dp than the study's (withheld, as "
              "`autotune predict` does: the study's held-out errors do not cover them)")
    if mem_errors:
        print(f"peak memory per stage: mean error {statistics.fmean(mem_errors) * 100:.1f} %, worst "
              f"{max(mem_errors) * 100:.1f} % (goal within 10 %)")
    return mape


def small_study(out: Path, budget: int, repeats: int, steps: int) -> int:
    """`--from-budget`: the default study of `budget` trials, then each unseen target `repeats` times."""
    from autotune.model.observations import observe_study
    from autotune.model.render import leave_one_out
    from autotune.model.study_model import model_of_study

    t0 = time.monotonic()
    study = out / f"budget-{budget}"
    if not (study / "study.db").exists():
        autotune("run", "--study", str(study), "--budget", str(budget), "--no-metrics", cwd=out)
    ran = {(o.micro_batch_size, o.gradient_accumulation_steps, o.reduce_bucket_size) for o in observe_study(study)}
    loo = leave_one_out(model_of_study(study))
    print(f"calibration: `autotune run --budget {budget}`: {study} ({len(ran)} successful trials)", flush=True)
    errors, launches_in, launches, means_in, stated = [], 0, 0, 0, 0
    print(f"{'target':36s} {'launches samples/s':>28s} {'mean':>7s} {'predicted':>9s} {'error':>7s}  interval")
    for i, t in enumerate(SMALL_TARGETS):
        if (t.micro, t.gas, t.bucket) in ran:
            print(f"{t.label():36s} run by the study: not scored")
            continue
        speeds = []
        for r in range(repeats):
            folder = out / f"small-{i:02d}-{r}"
            folder.mkdir(exist_ok=True)
            st = folder / "st" if (folder / "st" / "study.db").exists() else run_target(t, folder, steps, 2)
            speeds.append(GLOBAL_BATCH / measured(st)[0])
        mean = statistics.fmean(speeds)
        p = predicted(study, t)
        err = p.samples_per_second / mean - 1
        errors.append(abs(err))
        iv = loo.interval(p.samples_per_second, p.layout)
        text = loo.why_no_interval(p.layout)
        if iv is not None:
            stated += 1
            inside = [iv.low <= v <= iv.high for v in speeds]
            launches_in, launches = launches_in + sum(inside), launches + len(speeds)
            means_in += iv.low <= mean <= iv.high
            text = f"{iv.low:,.1f}-{iv.high:,.1f}: {sum(inside)}/{len(speeds)} launches, mean {'in' if iv.low <= mean <= iv.high else 'OUT'}"
        print(f"{t.label():36s} {' '.join(f'{v:8.1f}' for v in speeds):>28s} {mean:7.1f} {p.samples_per_second:9.1f} "
              f"{err * 100:+6.1f}%  {text}", flush=True)
    if not errors:
        print("every target was run by the study: nothing to score")
        return 1
    print(f"\nsmall study (budget {budget}): MAPE {statistics.fmean(errors) * 100:.1f} % over {len(errors)} unseen "
          f"configurations, each the mean of {repeats} launches (goal <= 10 %)")
    if stated:
        print(f"inside the 80 % interval: {means_in}/{stated} means, {launches_in}/{launches} single launches "
              "(goal: every target)")
    print(f"{time.monotonic() - t0:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="1 target, 2 measured steps, a budget-2 2-rank study (CI)")
    ap.add_argument("--calibration", default=None,
                    help="Calibrate on this finished study (run with --layer-costs) instead of running one")
    ap.add_argument("--from-budget", type=int, default=None, metavar="N",
                    help="issue 44: calibrate on the default `autotune run --budget N` study only")
    ap.add_argument("--repeats", type=int, default=3, help="with --from-budget: launches per target")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="model-accuracy-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.from_budget is not None:
        return small_study(out, args.from_budget, args.repeats, args.steps)
    steps, warmup = (2, 1) if args.quick else (args.steps, 2)
    budget = "2" if args.quick else "6"
    t0 = time.monotonic()
    common = ["--layer-costs", "--no-metrics", "--full-budget", "--budget", budget, "--fixed-steps",
              "--steps", str(steps), "--warmup-steps", str(warmup)]
    studies = {"the 4-rank study (2 stages x 2 dp)": out / "calibrate-4"}
    if args.calibration:
        studies = {"the given study": Path(args.calibration)}
    elif args.quick:  # the smoke run's study: 2 ranks, as its target
        studies = {"the 2-rank study (2 stages x 1 dp)": out / "calibrate-2"}
    else:
        studies["the 2-rank study (2 stages x 1 dp): extrapolation"] = out / "calibrate-2"
    for name, folder in studies.items():
        if not (folder / "study.db").exists():
            extra = ["--dp", "1"] if "2-rank" in name else []
            autotune("run", "--study", str(folder), *common, *extra, cwd=out)
        print(f"calibration: {name}: {folder}", flush=True)
    targets = QUICK_TARGETS if args.quick else TARGETS
    rows = []
    for i, t in enumerate(targets):
        folder = out / f"target-{i:02d}"
        folder.mkdir(exist_ok=True)
        study = folder / "st" if (folder / "st" / "study.db").exists() else run_target(t, folder, steps, warmup)
        step, peaks = measured(study)
        rows.append((t, step, peaks))
        print(f"measured {i + 1}/{len(targets)}: {t.label()}: {step * 1000:.1f} ms", flush=True)
    if not args.quick:  # the launch-to-launch spread of one configuration, for scale
        again = out / "target-00-again"
        again.mkdir(exist_ok=True)
        study = again / "st" if (again / "st" / "study.db").exists() else run_target(targets[0], again, steps, warmup)
        step, _ = measured(study)
        print(f"launch-to-launch: {targets[0].label()} measured {rows[0][1] * 1000:.1f} ms and "
              f"{step * 1000:.1f} ms ({(step / rows[0][1] - 1) * 100:+.1f} %)")
    results = {name: score(name, folder, rows) for name, folder in studies.items()}
    print(f"\nmodel accuracy: MAPE {' / '.join(f'{v:.1f} %' for v in results.values())} "
          f"({', '.join(results)}); {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
