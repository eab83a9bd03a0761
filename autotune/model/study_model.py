"""A study's model: its observations calibrated, with what the study itself recorded (the
host's cores, the workload, the measured sequence length), and the layout a user asks for."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from autotune.core.errors import StudyError, UserError
from autotune.model.observations import Observation, observe_study
from autotune.model.step_model import Calibration, Layout, calibrate
from autotune.model.zero_step import is_plain, same_settings


@dataclass(frozen=True, slots=True)
class StudyModel:
    root: Path
    calibration: Calibration
    observations: list[Observation]
    workload: dict | None
    """The built-in workload's options (None: the user's own command)."""


def model_of_study(root: str | Path) -> StudyModel:
    """Calibrate the model on the study at `root`; a UserError where it cannot."""
    from autotune.study.store import open_study_readonly

    root = Path(root)
    if not (root / "study.db").is_file():
        raise StudyError(f"{root}: not an autotune study (no study.db); `autotune run --study {root}` makes one")
    study = open_study_readonly(root)
    try:
        host = study.get_meta_json("host") if study.get_meta("host") else None
        workload = study.get_meta_json("workload") if study.get_meta("workload") else None
        command = study.get_meta("user_command")
        space = study.get_meta_json("space") if study.get_meta("space") else None
    finally:
        study.close()
    obs = observe_study(root)
    notes: list[str] = []
    if is_plain(obs):  # a plain engine's knob trials ran other ZeRO settings than the rest
        obs, other = same_settings(obs)
        notes += [other] if other else []
    if not obs:
        raise StudyError(f"{root}: no finished trial with metrics to calibrate the model from; a study needs at "
                         "least one successful trial (`autotune run --study ... --budget 3` gives one "
                         "with every layer measured)")
    cores = None
    if obs[0].device == "cpu":
        if isinstance(host, dict) and isinstance(host.get("cores"), int):
            cores = float(host["cores"])
        else:
            cores = float(len(os.sched_getaffinity(0)))
            notes.append(f"the study did not record its host's cores: taken as this machine's {cores:g}")
    params = space.get("model_parameters") if isinstance(space, dict) else None
    cal = calibrate(obs, cores=cores, model_parameters=params if isinstance(params, int) else None)
    cal.notes.extend(notes)
    return StudyModel(root=root, calibration=cal, observations=obs, workload=None if command else workload)


def layout_from(model: StudyModel, *, micro: int | None, gas: int | None, bucket: float | None,
                parts: str | None, checkpoint_interval: int | None, stages: int | None, dp: int | None,
                config: str | None = None, zero_stage: int | None = None) -> Layout:
    """The layout the options name; what they leave out is the study's best trial's."""
    from autotune.core.partition import parse_parts

    cal = model.calibration
    best = max(model.observations, key=lambda o: o.samples_per_second)
    if config:
        from autotune.core.dsconfig import checkpoint_interval as ckpt_of
        from autotune.core.dsconfig import load_ds_config

        ds = load_ds_config(config)
        micro = micro or ds.micro_batch_size
        gas = gas or ds.gradient_accumulation_steps
        bucket = bucket if bucket is not None else ds.reduce_bucket_size
        checkpoint_interval = checkpoint_interval if checkpoint_interval is not None else ckpt_of(ds.raw)
        if zero_stage is None and cal.zero is not None:
            zero_stage = ds.zero_stage
    p = stages or cal.stages
    d = dp or cal.data_parallel_size
    m = micro or best.micro_batch_size
    if gas is None:  # keep the study's global batch where it divides
        total = best.global_batch
        gas = total // (m * d) if total % (m * d) == 0 else best.gradient_accumulation_steps
    if bucket is not None and bucket < 1:
        raise UserError(f"--bucket {bucket:g}: reduce_bucket_size must be >= 1 element")
    bounds = None
    if parts:
        text = parts[len("parts:"):] if parts.startswith("parts:") else parts
        bounds = tuple(parse_parts(text))
        if stages is None:
            p = len(bounds) - 1
    return Layout(micro_batch_size=m, gradient_accumulation_steps=gas, stages=p, data_parallel_size=d,
                  reduce_bucket_size=int(bucket) if bucket is not None else best.reduce_bucket_size,
                  parts=bounds, checkpoint_interval=checkpoint_interval or 0, zero_stage=zero_stage)
