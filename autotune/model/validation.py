"""The model's error on trials it had not seen: each trial of a study predicted by the model
calibrated on the others (leave-one-out). `autotune predict` says the mean; the HTML report
plots each trial's predicted against its measured throughput."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from autotune.core.errors import AutotuneError
from autotune.model.step_model import calibrate, layout_of, predict
from autotune.model.study_model import StudyModel

MIN_TRIALS = 3
"""Below three trials a leave-one-out model has one trial to fit: no error worth saying."""


@dataclass(frozen=True, slots=True)
class HeldOut:
    trial: int
    measured_samples_per_second: float
    predicted_samples_per_second: float
    measured_step_seconds: float
    predicted_step_seconds: float

    @property
    def step_error(self) -> float:
        return self.predicted_step_seconds / self.measured_step_seconds - 1


def held_out(model: StudyModel) -> list[HeldOut]:
    """Every trial the others can predict (none below MIN_TRIALS trials)."""
    obs = model.observations
    if len(obs) < MIN_TRIALS:
        return []
    out = []
    for i, o in enumerate(obs):
        try:
            cal = calibrate(obs[:i] + obs[i + 1:], cores=model.calibration.cores,
                            model_parameters=model.calibration.model_parameters)
            p = predict(cal, layout_of(o))
        except AutotuneError:  # a layout the rest cannot say (say, its layer costs were the only ones)
            continue
        out.append(HeldOut(trial=o.trial, measured_samples_per_second=o.samples_per_second,
                           predicted_samples_per_second=p.samples_per_second, measured_step_seconds=o.step_seconds,
                           predicted_step_seconds=p.step_seconds))
    return out


def mean_abs_error(points: list[HeldOut]) -> float | None:
    """Step-time mean absolute percentage error (as a fraction) over `points`."""
    return statistics.fmean(abs(p.step_error) for p in points) if points else None
