"""Which of a study's measurements hold: `superseded()` and `best_of()`, from the trial rows alone.

A model-setting step (the partition step, autotune/tuning/balance.py; the knob sweep,
autotune/tuning/knob_sweep.py) runs a configuration the study has measured before with
another model setting, and the study's history key (micro-batch, GAS, bucket) cannot tell
the two apart. These rules say which runs count: the study's best (`Study.best`), the
report and what the tuner tells its proposer all go through them. Part of the data model
(rules over trial rows, no feature imported), so that the study, the steps and the report use
the same rules without the study reaching up into a step.
"""

from __future__ import annotations

import dataclasses
from statistics import fmean
from typing import Any

from autotune.core.noise import beats
from autotune.core.trial_kind import PARTITION as SOURCE
from autotune.core.trial_kind import PARTITION_COSTS as COSTS
from autotune.core.trial_kind import PARTITION_RECHECK as RECHECK
from autotune.core.trial_kind import PARTITION_REFERENCE as REFERENCE
from autotune.core.trial_kind import Step, TrialKind


def superseded(trials: list[Any]) -> set[int]:
    """Numbers of the trials whose measurement does not hold for the study's partition.

    From the trial rows alone (number, source, status, samples_per_second, config), with the
    rule `StageBalancer._decide` (autotune/tuning/balance.py) applies. A round is a partition trial
    (`SOURCE`) with its `RECHECK` and `REFERENCE` re-runs; its reference is the measurement in force at its
    configuration: the last `baseline` or `COSTS` trial before it, or the runs of the round
    kept before it. The round is kept when none of its candidate runs failed and their mean
    beats the mean of the reference's runs (with `REFERENCE`). Superseded: every candidate
    run of a round not kept (failed ones too: the failure belongs to the parts, not to the
    configuration) and, once one is kept, every earlier trial of its configuration and its
    `REFERENCE` runs (they ran the parts it replaced). Every other trial ran the partition
    in force when it ran.

    A knob trial of a user's script (`--knob`, usercmd/knobs.py: source `knob:NAME=VALUE`)
    is the same case, another model setting at the baseline's key, so each is a round here;
    `KnobSweep` keeps a value only when it beats the measurement in force by more than the
    noise (core/noise.py `beats`: one run each cannot tell a tie apart, while a partition
    round's tie was run again before its means were compared). A knob trial at the best's
    layout (`knob-at-best:`, the ZeRO stage tried again before the search ends) is a round
    whose reference is that configuration's runs in force, not the baseline's.
    """
    def measured(t: Any) -> bool:
        return t.status == "ok" and t.samples_per_second is not None

    rows = sorted((t for t in trials if t.status in ("ok", "failed")), key=lambda t: t.number)
    out: set[int] = set()
    reference: list[Any] = []
    candidate: list[Any] = []
    again: list[Any] = []

    def close() -> None:
        nonlocal reference, candidate, again
        if not candidate:
            return
        refs = [float(t.samples_per_second) for t in reference + again if measured(t)]
        if refs and all(measured(t) for t in candidate) and _kept(candidate, fmean(refs)):
            key, first = candidate[0].config.key(), candidate[0].number
            out.update(t.number for t in rows if t.number < first and t.config.key() == key)
            out.update(t.number for t in again)
            reference = list(candidate)
        else:
            out.update(t.number for t in candidate)
            reference = reference + again
        candidate, again = [], []

    for t in rows:
        kind = TrialKind.of(t.source)
        if kind.is_baseline or t.source == COSTS:
            close()
            reference = [t] if measured(t) else []
        elif kind.at_best:  # its reference: the runs in force of the configuration it re-runs
            close()
            reference = [r for r in rows if r.number < t.number and r.config.key() == t.config.key()
                         and measured(r) and r.number not in out]
            candidate = [t]
        elif t.source == SOURCE or kind.step is Step.KNOB:
            close()
            candidate = [t]
        elif t.source == RECHECK and candidate:
            candidate.append(t)
        elif t.source == REFERENCE and candidate:
            again.append(t)
    close()
    return out


def _kept(candidate: list[Any], reference: float) -> bool:
    """A round's decision: a knob value must beat the reference by more than the noise; a
    partition round (its tie already run again) by its mean."""
    mean = fmean(float(t.samples_per_second) for t in candidate)
    if TrialKind.of(candidate[0].source).step is Step.KNOB:
        return beats(mean, reference)
    return mean > reference


def best_of(trials: list[Any]) -> Any | None:
    """The configuration with the highest mean samples/s over its successful trials.

    Configurations measured more than once (the tuner re-measures close
    contenders) are judged by their mean, not by their luckiest run. The row
    returned is that configuration's latest trial, carrying the mean and the
    number of measurements in `repeats`. Trials whose measurement no longer holds
    (a partition or knob trial not kept, or the runs a kept one replaced: `superseded`) share their configuration's key and are left out.
    A function of the rows alone, so that a resume can ask what the best was after trial N.
    """
    stale = superseded(trials)
    by_config: dict[tuple, list[Any]] = {}
    for t in trials:
        if t.status == "ok" and t.samples_per_second and t.number not in stale:
            by_config.setdefault(t.config.key(), []).append(t)
    if not by_config:
        return None
    runs = max(by_config.values(), key=lambda ts: fmean(t.samples_per_second for t in ts))
    return dataclasses.replace(runs[-1], samples_per_second=fmean(t.samples_per_second for t in runs),
                               repeats=len(runs))
