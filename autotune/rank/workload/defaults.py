"""The built-in workload's starting ds_config: a plausible hand-written first config.

micro-batch 1 with the global batch reached by gradient accumulation, ZeRO-1
and DeepSpeed's default 5e8-element bucket: the common starting point that
tuning improves on.
"""

from __future__ import annotations

from typing import Any

from autotune.core.dsconfig import DEEPSPEED_DEFAULT_BUCKET


def default_ds_config(data_parallel_size: int, global_batch: int = 64) -> dict[str, Any]:
    micro = 1
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": global_batch // (micro * data_parallel_size),
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": DEEPSPEED_DEFAULT_BUCKET},
        "steps_per_print": 1_000_000_000,
    }
