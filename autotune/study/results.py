"""A study's results, derived once: its trials, the counted ones, the baseline, the best and the
speed-up, with the job and what the steps around the search recorded.

`read_results(study)` reads them from one snapshot of the trial rows; `run`'s closing lines
(cli/main.py), summary.json and report.md (study/outputs.py) and report.html
(report_html/gather.py) all show this one object. `StudyResults.to_dict()` is summary.json's
content, a user-facing file: its keys and values do not change with this object's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autotune.core.jsonvalue import JsonObject, JsonValue, json_object
from autotune.study.store import STATUS_FAILED, STATUS_OK, Study, TrialRow, counted_of

SUMMARY_FORMAT = 1
"""summary.json's `format`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StudyResults:
    """What a study has found so far (a whole study, unlike `autotune.core.summary.TrialSummary`,
    one trial's signals)."""

    trials: tuple[TrialRow, ...]
    """Every row, interrupted attempts included, in the order they started."""
    counted: tuple[TrialRow, ...]
    """Finished trials (ok or failed), one per number: what the budget counts."""
    baseline: TrialRow | None
    """Trial 0 once it finished (ok or failed)."""
    best: TrialRow | None
    """The best configuration's latest trial; samples_per_second is its mean, `repeats` its count."""
    speedup: float | None
    """The best's mean samples/s over the baseline's; None unless the baseline succeeded with a throughput."""
    job: str
    """The job in words (autotune/study/job_record.py `describe_job`)."""
    user_command: JsonObject | None
    """The user's command and what its start-up check read (meta `user_command`); None: built-in."""
    workload: JsonObject | None
    """The workload options; with a user's command its `preset` is None (the command ran, not a preset)."""
    budget: int | None
    space: JsonObject | None
    """The search space as the tuner stored it (`description` and its values)."""
    stopped: JsonObject | None
    """Why the search stopped before the budget (autotune/tuning/search_stop.py); None: it did not."""
    partition: JsonObject | None
    """--balance-stages: the parts the best needs (autotune/study/partition_record.py `read_result`)."""

    @property
    def ok(self) -> list[TrialRow]:
        """Counted trials that succeeded with a throughput."""
        return [t for t in self.counted if t.status == STATUS_OK and t.samples_per_second]

    @property
    def failed(self) -> list[TrialRow]:
        return [t for t in self.counted if t.status == STATUS_FAILED]

    @property
    def trainer_args(self) -> str | None:
        """The best's batch as the HF Trainer's arguments, where the job is a Trainer's (its batch
        lives there, autotune/usercmd/hf_trainer.py); None otherwise."""
        from autotune.core.trainer_args import HF_TRAINER, trainer_args

        if not self.best or not self.user_command or self.user_command.get("built_by") != HF_TRAINER:
            return None
        return trainer_args(self.best.config.micro_batch_size, self.best.config.gradient_accumulation_steps)

    def to_dict(self) -> JsonObject:
        """summary.json's content, key for key."""
        return {
            "format": SUMMARY_FORMAT,
            "job": self.job,
            "user_command": self.user_command,  # the command and what its start-up check read; null: built-in
            "budget": self.budget,
            "space": self.space,
            "workload": self.workload,
            "trials": [trial_entry(t) for t in self.trials],
            "counted_trials": len(self.counted),
            "failed_trials": len(self.failed),
            "baseline": trial_entry(self.baseline) if self.baseline else None,
            "best": ({**trial_entry(self.best), "measurements": self.best.repeats} if self.best else None),
            "best_trainer_args": self.trainer_args,  # an HF Trainer job: the best's batch as its arguments
            "speedup_over_baseline": self.speedup,
            "stopped": self.stopped,
            "partition": self.partition,
        }


def read_results(study: Study, *, meta: Callable[[str], JsonValue] | None = None) -> StudyResults:
    """The study's results now. `meta(key)` reads a stored value (default `study.get_meta_json`,
    which raises on a damaged one; the report passes a reader that answers None instead)."""
    from autotune.core.measurements import best_of
    from autotune.study.job_record import META_KEY, describe_job
    from autotune.study.partition_record import read_result

    read = meta or study.get_meta_json
    trials = study.trials()  # one snapshot: a live run may finish a trial meanwhile
    counted = counted_of(trials)
    baseline = next((t for t in counted if t.number == 0), None)
    best = best_of(trials)
    speedup = None
    if best and baseline and baseline.status == STATUS_OK and baseline.samples_per_second:
        speedup = (best.samples_per_second or 0.0) / baseline.samples_per_second
    workload, user_command = json_object(read("workload")), json_object(read(META_KEY))
    if user_command and workload is not None:
        workload = {**workload, "preset": None}  # the user's command ran, not a built-in preset
    budget = read("budget")
    return StudyResults(
        trials=tuple(trials), counted=tuple(counted), baseline=baseline, best=best, speedup=speedup,
        job=describe_job(user_command, workload), user_command=user_command, workload=workload,
        budget=budget if isinstance(budget, int) and not isinstance(budget, bool) else None,
        space=json_object(read("space")), stopped=json_object(read("stopped")), partition=read_result(study.root),
    )


def trial_entry(t: TrialRow) -> JsonObject:
    """One trial as summary.json lists it."""
    return {
        "trial": t.number, "status": t.status, "source": t.source, "reason": t.reason,
        "micro_batch_size": t.config.micro_batch_size,
        "gradient_accumulation_steps": t.config.gradient_accumulation_steps,
        "reduce_bucket_size": t.config.reduce_bucket_size,
        "activation_checkpoint_interval": t.config.activation_checkpoint_interval,
        "samples_per_second": t.samples_per_second, "failure_reason": t.failure_reason,
        "failure_detail": t.failure_detail, "rules_fired": [r for r in t.rules_fired],
        "wall_seconds": t.wall_seconds,
    }
