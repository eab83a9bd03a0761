"""The tests' builders, in one place: a StepRecord (`record`), a healthy TrialSummary to
perturb (`healthy_summary`), a grid of records, CSV text as the product writes it, and folders
that are not studies (`not_a_study`)."""

from __future__ import annotations

import csv
import io
import sqlite3
from pathlib import Path

from autotune.core.schema import CSV_COLUMNS, StepRecord, record_to_row
from autotune.core.summary import RankSummary, TrialSummary, ideal_bubble_fraction


def healthy_summary(**overrides: object) -> TrialSummary:
    """Two stages x 2 dp, GAS 8: every built-in metrics rule stays quiet on this."""
    ranks = [RankSummary(rank=r, stage=r // 2, steps=10, device_utilization_mean=0.8,
                         device_utilization_fluctuation=0.05, comm_compute_ratio=0.1,
                         compute_seconds_mean=0.5, schedule_compute_seconds_mean=0.45,
                         comm_seconds_mean=0.03, wait_seconds_mean=0.02,
                         bubble_fraction=0.15, wait_fraction=0.1) for r in range(4)]
    base = dict(
        trial=0, steps=10, warmup_steps=2, micro_batch_size=4, gradient_accumulation_steps=8,
        reduce_bucket_size=100_000, pipeline_stages=2, data_parallel_size=2,
        samples_per_second=50.0, samples_per_second_p10=48.0, samples_per_second_p90=52.0,
        tokens_per_second=0.0, step_seconds=1.28, step_time_jitter=0.02,
        device_utilization_mean=0.8, device_utilization_fluctuation=0.05,
        cross_device_fluctuation=0.01, comm_compute_ratio=0.1, comm_compute_ratio_mean=0.1,
        transfer_compute_ratio=0.06, bubble_fraction_measured=0.15,
        bubble_fraction_ideal=ideal_bubble_fraction(2, 8), stage_compute_imbalance=1.02,
        slowest_stage=1, stage_compute_seconds=[0.49, 0.51], memory_fragmentation_ratio=0.01,
        memory_peak_bytes=1e9, memory_reserved_bytes=1.2e9, loss_first=2.0, loss_last=1.5,
        ranks=ranks,
    )
    base.update(overrides)
    if "gradient_accumulation_steps" in overrides or "pipeline_stages" in overrides:
        base.setdefault("bubble_fraction_ideal", 0.0)
        base["bubble_fraction_ideal"] = ideal_bubble_fraction(base["pipeline_stages"],  # type: ignore[arg-type]
                                                              base["gradient_accumulation_steps"])  # type: ignore[arg-type]
    return TrialSummary(**base)  # type: ignore[arg-type]


SMALL_STEP = dict(time=1000.0, samples_per_second=8.0, tokens_per_second=512.0, compute_seconds=0.5,
                  comm_seconds=0.1, wait_seconds=0.3, data_seconds=0.0, device_utilization=0.5,
                  micro_batch_size=2, gradient_accumulation_steps=2, seq_length=64)
"""Overrides for a small 2 x 2 step with a sequence length (the summary tests' numbers)."""


def record(**overrides: object) -> StepRecord:
    base = dict(time=1.7e9, trial=0, rank=0, stage=0, step=0, warmup=0, step_seconds=1.0,
                samples_per_second=32.0, tokens_per_second=0.0, compute_seconds=0.6,
                comm_seconds=0.05, wait_seconds=0.1, data_seconds=0.01, device_utilization=0.6,
                micro_batch_size=4, gradient_accumulation_steps=4, pipeline_stages=2,
                data_parallel_size=2)
    base.update(overrides)
    return StepRecord(**base)  # type: ignore[arg-type]


def csv_text(records: list[StepRecord]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_COLUMNS)
    for r in records:
        w.writerow(record_to_row(r))
    return buf.getvalue()


def grid_records(trials: int = 1, steps: int = 6, ranks: int = 4, **overrides: object) -> list[StepRecord]:
    out = []
    for t in range(trials):
        for s in range(steps):
            for r in range(ranks):
                out.append(record(trial=t, rank=r, stage=r // 2, step=s, warmup=int(s == 0),
                                  step_seconds=1.0 + 0.01 * ((s * 7 + r) % 5),
                                  compute_seconds=0.6 + 0.02 * (r // 2),
                                  device_utilization=0.6 + 0.01 * ((s + r) % 3), **overrides))
    return out


def not_a_study(root: Path, kind: str) -> None:
    """A folder (or file) at `root` that autotune must refuse as a study, and never write into:
    "plain" (files of someone else's), "file" (not a folder), "garbage-db" (not SQLite),
    "foreign-db" (SQLite of something else), "empty-db" (an empty database)."""
    if kind == "file":
        root.write_text("a file, not a folder")
        return
    root.mkdir()
    if kind == "plain":
        (root / "notes.txt").write_text("mine")
    elif kind == "garbage-db":
        (root / "study.db").write_bytes(b"this is not sqlite" * 100)
    elif kind == "foreign-db":
        db = sqlite3.connect(root / "study.db")
        db.execute("CREATE TABLE users(name TEXT)")
        db.commit()
        db.close()
    elif kind == "empty-db":
        sqlite3.connect(root / "study.db").close()
    else:
        raise ValueError(kind)



class RecordingDisplay:
    """The tuning loop's display for tests that drive a Tuner: notes kept, rows and spinners ignored."""

    budget = 0

    def __init__(self) -> None:
        self.lines: list[str] = []

    def note(self, text: str) -> None:
        self.lines.append(text)

    def running(self, *a, **k):
        from contextlib import nullcontext

        return nullcontext()

    def trial_row(self, *a, **k) -> None:
        pass


class ScriptedRunner:
    """The trial contract's shape (autotune/trials/contract.py) for tests that drive a Tuner without
    processes: a subclass answers `answer(request)`; nothing outlives a trial."""

    cluster = None

    def begin_close(self) -> None:
        pass

    def close(self) -> None:
        pass

    def ds_config_for(self, config) -> dict:
        return {"train_micro_batch_size_per_gpu": config.micro_batch_size,
                "gradient_accumulation_steps": config.gradient_accumulation_steps}

    def run(self, request):
        return self.answer(request)

    def answer(self, request):
        raise NotImplementedError


def run_trial(runner, number: int, config, trial_dir, *, timeout: float, incumbent=None, **request):
    """One trial through the trial contract, the old positional way round (`incumbent`: a
    (samples/s, noise) pair)."""
    from pathlib import Path

    from autotune.trials.contract import Incumbent, TrialRequest

    return runner.run(TrialRequest(number=number, config=config, trial_dir=Path(trial_dir), timeout=timeout,
                                   incumbent=Incumbent(*incumbent) if incumbent else None, **request))
