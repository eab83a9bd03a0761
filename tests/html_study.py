"""Studies built through the real Study API (and real metrics CSVs) for the HTML report tests."""

from __future__ import annotations

import json
from pathlib import Path

from builders import SMALL_STEP, record

from autotune.core.space import TrialConfig
from autotune.core.summary import summarize_trial
from autotune.rank.metrics_csv import CsvSink
from autotune.study.store import Study

SPACE = {"description": "global batch 32 fixed; micro in [1, 2, 4, 8], GAS derived", "bucket_range": [10_000, 240_000]}
WORKLOAD = {"preset": "tiny", "pipeline_stages": 2, "data_parallel_size": 2, "steps": 4, "warmup_steps": 1}


def rec(**kw):
    return record(**{**SMALL_STEP, **kw})


def new_study(root: Path, budget: int = 4) -> Study:
    return Study.open(root, create=True, meta={"budget": budget, "space": SPACE, "workload": WORKLOAD,
                                               "settings": {"budget": budget, "tuner": "hybrid", "seed": 0}})


def write_csvs(study: Study, number: int, cfg: TrialConfig, speed: float) -> list:
    """Real per-rank CSVs (1 warm-up + 4 steps, 2 stages x 2 dp) through the project's own sink."""
    folder = study.trial_dir(number)
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for rank in range(4):
        sink = CsvSink(folder / f"metrics-rank{rank}.csv")
        for step in range(5):
            step_s = 1.0 / speed + 0.01 * step
            r = rec(trial=number, rank=rank, stage=rank // 2, step=step, warmup=int(step == 0),
                    step_seconds=step_s, compute_seconds=0.55 * step_s, comm_seconds=0.1 * step_s,
                    wait_seconds=0.25 * step_s, data_seconds=0.02 * step_s,
                    device_utilization=0.5 + 0.05 * rank + 0.02 * step,
                    micro_batch_size=cfg.micro_batch_size,
                    gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                    reduce_bucket_size=cfg.reduce_bucket_size, optimizer_seconds=0.05 * step_s)
            sink.write(r)
            records.append(r)
        sink.close()
    (folder / "ds_config.json").write_text(json.dumps({
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "zero_optimization": {"stage": 1, "reduce_bucket_size": cfg.reduce_bucket_size}}, indent=2))
    return records


def ok_trial(study: Study, number: int, cfg: TrialConfig, speed: float, source: str = "bayes",
             csvs: bool = True) -> None:
    records = write_csvs(study, number, cfg, speed)
    summary = summarize_trial(records)
    if not csvs:
        for p in study.trial_dir(number).glob("metrics-rank*.csv"):
            p.unlink()
    tid = study.start_trial(number, cfg, source if number else "baseline", f"reason {number}")
    study.finish_trial(tid, status="ok", samples_per_second=summary.samples_per_second, failure_reason=None,
                       failure_detail=None, summary=summary.to_dict(), rules_fired=["bubble-above-ideal"],
                       wall_seconds=12.0)


def failed_trial(study: Study, number: int, cfg: TrialConfig, reason: str = "oom") -> None:
    tid = study.start_trial(number, cfg, "baseline" if number == 0 else "bayes", "")
    study.finish_trial(tid, status="failed", samples_per_second=None, failure_reason=reason,
                       failure_detail=f"{reason} <b>detail</b>", summary=None, rules_fired=[], wall_seconds=3.0)


CFGS = [TrialConfig(micro_batch_size=1, gradient_accumulation_steps=16, reduce_bucket_size=240_000),
        TrialConfig(micro_batch_size=2, gradient_accumulation_steps=8, reduce_bucket_size=240_000),
        TrialConfig(micro_batch_size=8, gradient_accumulation_steps=2, reduce_bucket_size=50_000),
        TrialConfig(micro_batch_size=4, gradient_accumulation_steps=4, reduce_bucket_size=20_000)]


def full_study(root: Path) -> Path:
    """Baseline, two improvements (one re-measured), an OOM failure."""
    s = new_study(root, budget=5)
    ok_trial(s, 0, CFGS[0], 20.0)
    ok_trial(s, 1, CFGS[1], 35.0, source="climb")
    failed_trial(s, 2, CFGS[2], "oom")
    ok_trial(s, 3, CFGS[3], 50.0)
    ok_trial(s, 4, CFGS[3], 48.0, source="remeasure")
    s.close()
    return root
