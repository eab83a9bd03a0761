"""Proposers by name: the one place `autotune run --proposer` and the benchmark build them."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from autotune.core.errors import UserError
from autotune.core.space import SearchSpace
from autotune.tuning.proposers.base import Proposer
from autotune.tuning.proposers.baselines import DSAutotunerProposer, GridProposer, RandomProposer
from autotune.tuning.proposers.bayes import BayesProposer
from autotune.tuning.proposers.hybrid import HybridProposer, MovesFn
from autotune.tuning.proposers.model_guided import ModelGuidedProposer

DEFAULT = "hybrid"


def default_moves() -> MovesFn | None:
    """The rule engine's `propose_moves` (the advisor ships with every install)."""
    from autotune.tuning.proposers.rule_moves import propose_moves

    return propose_moves


def optuna_available() -> bool:
    return importlib.util.find_spec("optuna") is not None


OPTUNA = ("optuna-gp", "optuna-tpe")


def names() -> list[str]:
    """Every proposer name usable here (the Optuna ones only when optuna is installed)."""
    base = ["hybrid", "bayes", "random", "grid", "ds-autotuner", "model"]
    return base + (list(OPTUNA) if optuna_available() else [])


def check_name(name: str) -> None:
    """One line for an unknown name, and for an Optuna one without optuna (not 'unknown')."""
    if name in OPTUNA and not optuna_available():
        raise UserError(f"--tuner {name} needs optuna, which this Python lacks: pip install optuna")
    if name not in names():
        raise UserError(f"unknown proposer {name!r}; choose one of {', '.join(names())}")


def make_proposer(name: str, space: SearchSpace, *, seed: int, moves: MovesFn | None = None,
                  budget: int | None = None, study_root: str | None = None) -> Proposer:
    """Build the proposer called `name`.

    `moves` (hybrid only) defaults to the rule engine's `propose_moves`;
    `budget` (hybrid only) enables re-measuring the best point at the end;
    `study_root` (model only): the study the performance model calibrates on after each trial.
    """
    builders: dict[str, Callable[[], Proposer]] = {
        "hybrid": lambda: HybridProposer(space, seed=seed, moves=moves or default_moves(), budget=budget),
        "bayes": lambda: BayesProposer(space, seed=seed),
        "random": lambda: RandomProposer(space, seed=seed),
        "grid": lambda: GridProposer(space, seed=seed),
        "ds-autotuner": lambda: DSAutotunerProposer(space, seed=seed),
        "model": lambda: ModelGuidedProposer(space, seed=seed, study_root=study_root),
    }
    check_name(name)
    if name in OPTUNA:
        from autotune.tuning.proposers.optuna_backend import OptunaProposer

        return OptunaProposer(space, seed=seed, sampler=name.removeprefix("optuna-"))
    return builders[name]()
