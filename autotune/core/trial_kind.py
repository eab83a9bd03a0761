"""What a trial is for: its kind, a typed value read from the label a study stores.

The study stores a trial's kind as text (its `source` column: `baseline`, `bayes`,
`rule:<id>`, `partition-costs`, `knob:layers=4`, ...), the text the reports show. Code asks
the typed value (`TrialKind.of(label)`) what the kind means instead of comparing strings:
which step proposed it, whether it is the reference, whether it is measured in full, which
knob value it runs. Every label the tuner writes is defined here, so that the store, the
steps and the reports depend on this module and not on one another.
"""

from __future__ import annotations

import enum


class Step(enum.Enum):
    """Which part of the tuner proposed a trial."""

    BASELINE = "baseline"
    """The starting configuration, measured as the reference."""
    SEARCH = "search"
    """The proposer (Bayesian, rules, random, grid, ...), re-measurements included."""
    PARTITION = "partition"
    """The partition step (autotune/tuning/balance.py)."""
    CHECKPOINT = "checkpoint"
    """The checkpoint step (autotune/tuning/checkpoint_step.py)."""
    KNOB = "knob"
    """The knob sweep of the model settings (autotune/tuning/knob_sweep.py)."""


class TrialKind(str):
    """A trial's kind: the label the study stores and the reports show, typed. A `str`, so it
    is stored, written to JSON, shown and compared as its label; `step` and the other
    properties say what it means."""

    __slots__ = ()

    @property
    def label(self) -> str:
        return str.__str__(self)

    @classmethod
    def of(cls, label: str) -> TrialKind:
        return label if isinstance(label, TrialKind) else cls(label)

    @classmethod
    def knob(cls, name: str, value: str) -> TrialKind:
        return cls(f"{KNOB_PREFIX}{name}={value}")

    @classmethod
    def knob_at_best(cls, name: str, value: str) -> TrialKind:
        return cls(f"{KNOB_AT_BEST_PREFIX}{name}={value}")

    @classmethod
    def rule(cls, rule_id: str) -> TrialKind:
        return cls(f"{RULE_PREFIX}{rule_id}")

    @classmethod
    def optuna(cls, sampler: str) -> TrialKind:
        return cls(f"{OPTUNA_PREFIX}{sampler}")

    @property
    def step(self) -> Step:
        if self.label == BASELINE:
            return Step.BASELINE
        if self.label in PARTITION_LABELS:
            return Step.PARTITION
        if self.label == CHECKPOINT:
            return Step.CHECKPOINT
        if self.label.startswith((KNOB_PREFIX, KNOB_AT_BEST_PREFIX)):
            return Step.KNOB
        return Step.SEARCH

    @property
    def is_baseline(self) -> bool:
        return self.step is Step.BASELINE

    @property
    def measured_in_full(self) -> bool:
        """Never stopped early: the reference and the proposer's re-measurements."""
        return self.is_baseline or self.label in REMEASURE_LABELS

    @property
    def hooked(self) -> bool:
        """Runs with the layer-cost hooks on when the partition step is on (each round's trials
        cost the same to measure)."""
        return self.is_baseline or self.step is Step.PARTITION

    @property
    def knob_setting(self) -> tuple[str, str] | None:
        """(name, value) of a knob trial; None for any other kind."""
        if self.step is not Step.KNOB:
            return None
        name, _, value = self.label.partition(":")[2].partition("=")
        return name, value

    @property
    def at_best(self) -> bool:
        """A knob trial at the best trial's layout, not the baseline's (`KNOB_AT_BEST_PREFIX`)."""
        return self.label.startswith(KNOB_AT_BEST_PREFIX)


BASELINE = TrialKind("baseline")
PARTITION = TrialKind("partition")
"""A partition round's candidate parts, hooks on."""
PARTITION_COSTS = TrialKind("partition-costs")
"""The best trial's configuration again with the hooks on: the layer costs and the reference of a round."""
PARTITION_RECHECK = TrialKind("partition-recheck")
"""The candidate again, when the round's pair lies within the noise margin."""
PARTITION_REFERENCE = TrialKind("partition-reference")
"""The partition in force again, after the recheck (the pair in the order A B B A)."""
PARTITION_LABELS = (PARTITION, PARTITION_COSTS, PARTITION_RECHECK, PARTITION_REFERENCE)
CHECKPOINT = TrialKind("checkpoint")
"""An out-of-memory micro-batch again with activation checkpointing."""
KNOB_PREFIX = "knob:"
"""`knob:NAME=VALUE`: the baseline's layout with one of the user's model settings changed."""
KNOB_AT_BEST_PREFIX = "knob-at-best:"
"""`knob-at-best:NAME=VALUE`: the best trial's layout with a knob decided at the baseline's tried
again before the search ends (the ZeRO stage: which stage wins changes with the micro-batch)."""
BAYES, EXPLORE, CLIMB = TrialKind("bayes"), TrialKind("explore"), TrialKind("climb")
"""The hybrid proposer's own proposals (autotune/tuning/proposers/hybrid.py): the surrogate's
pick, a random point before any rule fired, a step from the best along one axis. A rule's
proposal is labelled by its rules' ids joined with "+"."""
REMEASURE, CONFIRM, RECHECK = TrialKind("remeasure"), TrialKind("confirm"), TrialKind("recheck")
REMEASURE_LABELS = (REMEASURE, CONFIRM, RECHECK)
"""The proposer's re-measurements of a configuration measured before."""
RULE_PREFIX, RULE_JOIN = "rule:", "+"
"""`rule:<id>`: a rule's move (autotune/tuning/proposers/rule_moves.py); the hybrid proposer
labels a move several rules proposed by their labels joined with "+"."""
RANDOM, GRID, DS_AUTOTUNER, MODEL = (TrialKind("random"), TrialKind("grid"), TrialKind("ds-autotuner"),
                                     TrialKind("model"))
"""The other proposers' points (autotune/tuning/proposers/): uniform random, the grid, DeepSpeed's
own autotuner's order, the performance model's pick."""
OPTUNA_PREFIX = "optuna-"
"""`optuna-<sampler>`: an Optuna sampler's point (autotune/tuning/proposers/optuna_backend.py)."""
