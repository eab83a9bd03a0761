"""The HF Trainer's batch arguments: how a Trainer job's batch is written (the study's reports and
the trials of autotune/usercmd/hf_trainer.py both spell it this way)."""

from __future__ import annotations

HF_TRAINER = "hf_trainer"
"""The start-up check's name for a job whose engine the HF Trainer builds (rank/hook.py `engine_builder`)."""
MICRO_FLAG, GAS_FLAG = "--per_device_train_batch_size", "--gradient_accumulation_steps"


def trainer_args(micro: int, gas: int) -> str:
    """A batch as the Trainer's arguments (the best result is given this way too)."""
    return f"{MICRO_FLAG} {micro} {GAS_FLAG} {gas}"
