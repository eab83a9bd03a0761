"""Small builders of StepRecords for unit tests."""

from __future__ import annotations

from autotune.schema import StepRecord


def rec(**kw) -> StepRecord:
    base = dict(
        time=1000.0, trial=0, rank=0, stage=0, step=0, warmup=0, step_seconds=1.0,
        samples_per_second=8.0, tokens_per_second=512.0, compute_seconds=0.5, comm_seconds=0.1,
        wait_seconds=0.3, data_seconds=0.0, device_utilization=0.5, micro_batch_size=2,
        gradient_accumulation_steps=2, pipeline_stages=2, data_parallel_size=2, seq_length=64,
    )
    base.update(kw)
    return StepRecord(**base)
