"""Optuna samplers (GP, TPE) behind the proposer contract: a benchmark baseline and a
candidate second backend. Optuna is optional: import this module lazily.

Out-of-memory is a constraint (`constraints_func`), because Optuna's samplers
ignore FAILED trials and would never learn where memory runs out. Trials
proposed by others (the baseline, rules) are injected with `add_trial`.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import optuna
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial

from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_kind import TrialKind
from autotune.core.trial_result import TrialResult
from autotune.tuning.proposers.base import Proposal
from autotune.tuning.proposers.bayes import Encoding
from autotune.tuning.proposers.history import History
from autotune.tuning.proposers.pool import unexplored

_CONSTRAINT = "constraint"
_CONSTRAINTS_KEY = getattr(optuna.samplers._base, "_CONSTRAINTS_KEY", "constraints")


def _constraints(trial: FrozenTrial) -> list[float]:
    return [trial.user_attrs.get(_CONSTRAINT, 0.0)]


class OptunaProposer:
    """Optuna GPSampler or TPESampler; duplicates are answered from history and re-asked."""

    def __init__(self, space: SearchSpace, *, seed: int = 0, sampler: str = "gp", max_retries: int = 8) -> None:
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # e.g. 'greenlet unavailable'
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ExperimentalWarning for constraints_func
            if sampler == "gp":
                s: optuna.samplers.BaseSampler = optuna.samplers.GPSampler(seed=seed, constraints_func=_constraints)
            elif sampler == "tpe":
                s = optuna.samplers.TPESampler(seed=seed, constraints_func=_constraints)
            else:
                raise ValueError(f"unknown optuna sampler {sampler!r}")
        self.space = space
        self.source = TrialKind.optuna(sampler)
        self.study = optuna.create_study(direction="maximize", sampler=s)
        self.encoding = Encoding(space)
        self.history = History(space)
        self.max_retries = max_retries
        self._rng = np.random.default_rng(seed)
        self._open: dict[tuple, optuna.trial.Trial] = {}
        self._dists = {d.name: (IntDistribution(int(d.low), int(d.high)) if d.name != "log10_bucket"
                                else FloatDistribution(float(d.low), float(d.high)))
                       for d in self.encoding.dimensions}

    @staticmethod
    def _value(result: TrialResult) -> tuple[float, float]:
        """(objective, constraint): log samples/s; failures violate the constraint."""
        if result.ok and result.samples_per_second > 0:
            return math.log(result.samples_per_second), 0.0
        return 0.0, 1.0

    def _known(self, cfg: TrialConfig) -> TrialResult | None:
        for o in reversed(self.history.observations):
            if o.config.key() == cfg.key():
                return o.result
        return None

    def ask(self) -> Proposal:
        seen = self.history.seen
        for _ in range(self.max_retries):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trial = self.study.ask(self._dists)
            cfg = self.encoding.decode([trial.params[n] for n in self._dists])
            if cfg.key() not in seen:
                self._open[cfg.key()] = trial
                self.history.pending.add(cfg.key())
                return Proposal(config=cfg, source=self.source, reason=f"{self.source} sampler")
            known = self._known(cfg)
            value, violated = self._value(known) if known else (0.0, 0.0)
            trial.set_user_attr(_CONSTRAINT, violated)
            self.study.tell(trial, value)  # a duplicate: answer from history, ask again
        cfg = unexplored(self.space, seen, self._rng) or self.history.best() or self.encoding.decode([0, 0, 0])
        self.history.pending.add(cfg.key())
        return Proposal(config=cfg, source=self.source, reason="sampler repeated itself: random point")

    def tell(self, config: TrialConfig, result: TrialResult) -> None:
        if not self.history.record(config, result):
            return
        value, violated = self._value(result)
        trial = self._open.pop(config.key(), None)
        if trial is not None:
            trial.set_user_attr(_CONSTRAINT, violated)
            self.study.tell(trial, value)
            return
        x = self.encoding.encode(config)
        params = dict(zip(self._dists, x, strict=True))
        params = {k: (int(v) if isinstance(self._dists[k], IntDistribution) else float(v)) for k, v in params.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.study.add_trial(optuna.trial.create_trial(
                params=params, distributions=self._dists, value=value, user_attrs={_CONSTRAINT: violated},
                # samplers read constraints from here; only `study.tell` fills it itself
                system_attrs={_CONSTRAINTS_KEY: (violated,)}))

    def converged(self) -> str | None:
        return None  # no model of what is left to gain: the whole budget runs
