"""The scikit-optimize adapter: the only module that imports skopt.

scikit-optimize 0.10.x is maintained by a single fork (upstream archived in
2024), so it sits behind this file and can be swapped. What we rely on, and
the tests pin: `Optimizer(dimensions, base_estimator="GP", ...)`, `tell()`
(which fits the surrogate), `ask()`, `models[-1]`, `space.transform()` and
`skopt.acquisition.gaussian_ei`.

Encoding (traps from tuner-facts.md avoided):
- micro-batch: an integer index into `space.micro_batch_sizes` (ordinal);
- GAS: an integer index into `space.gas_values` in free mode; derived from the
  micro-batch with a fixed global batch (never a `space_constraint`, whose
  points cannot be told back). Global-batch bounds in free mode are kept by
  mapping an out-of-bounds point to the nearest valid GAS;
- bucket: log10 of the element count, uniform; rounded with `round_bucket`.
- objective: minimise -log(samples/s). A failed trial is told as a finite
  penalty, log of half the worst successful throughput (skopt raises on
  inf/NaN). Because the penalty depends on what has been seen, the optimizer
  is rebuilt from the history at each model-based ask (one GP fit, as a
  `tell()` would cost anyway).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_kind import BAYES
from autotune.core.trial_result import TrialResult
from autotune.tuning import preload
from autotune.tuning.proposers.base import Proposal
from autotune.tuning.proposers.history import History
from autotune.tuning.proposers.pool import candidate_pool, clamp_bucket, unexplored, valid_pairs

if TYPE_CHECKING:
    from skopt import Optimizer

Veto = Callable[[TrialConfig], bool]


class Encoding:
    """Maps TrialConfig <-> the optimizer's numeric point."""

    def __init__(self, space: SearchSpace) -> None:
        self.space = space
        self.free = space.global_batch is None
        self._pairs = valid_pairs(space)

    @functools.cached_property
    def dimensions(self) -> list:
        """skopt's dimensions; built on first use, since building them imports skopt (2-3 s)."""
        preload.wait()
        from skopt.space import Integer, Real

        space = self.space
        dims = [Integer(0, len(space.micro_batch_sizes) - 1, name="micro_idx")]
        if self.free:
            dims.append(Integer(0, len(space.gas_values) - 1, name="gas_idx"))
        if space.bucket_range is not None:
            lo, hi = space.bucket_range
            dims.append(Real(math.log10(lo), math.log10(hi) + 1e-9, name="log10_bucket"))
        return dims

    def encode(self, cfg: TrialConfig) -> list:
        sp = self.space
        x: list = [sp.micro_batch_sizes.index(cfg.micro_batch_size)]
        if self.free:
            x.append(sp.gas_values.index(cfg.gradient_accumulation_steps))
        if sp.bucket_range is not None:
            x.append(math.log10(cfg.reduce_bucket_size))
        return x

    def decode(self, x: Sequence) -> TrialConfig:
        """The in-space config nearest to a point (global-batch bounds enforced by mapping)."""
        sp = self.space
        mi = int(x[0])
        gi = int(x[1]) if self.free else 0
        bucket = 10 ** float(x[-1]) if sp.bucket_range is not None else None

        def dist(pair: tuple[int, int]) -> tuple[int, int]:
            pm = sp.micro_batch_sizes.index(pair[0])
            pg = sp.gas_values.index(pair[1]) if self.free else 0
            return (abs(pm - mi) + abs(pg - gi), abs(pm - mi))

        m, g = min(self._pairs, key=dist)
        return TrialConfig(micro_batch_size=m, gradient_accumulation_steps=g,
                           reduce_bucket_size=clamp_bucket(sp, bucket))


class Surrogate:
    """A fitted GP over -log(samples/s): predictions and expected improvement for configs."""

    def __init__(self, opt: Optimizer, enc: Encoding, y_best: float) -> None:
        self._opt, self._enc, self.y_best = opt, enc, y_best

    def _X(self, configs: Sequence[TrialConfig]) -> np.ndarray:
        return self._opt.space.transform([self._enc.encode(c) for c in configs])

    def predict(self, configs: Sequence[TrialConfig]) -> tuple[np.ndarray, np.ndarray]:
        """Mean and std of log(samples/s) (higher is better)."""
        mu, sd = self._opt.models[-1].predict(self._X(configs), return_std=True)
        return -np.asarray(mu), np.asarray(sd)

    def expected_improvement(self, configs: Sequence[TrialConfig], xi: float = 0.01) -> np.ndarray:
        from skopt.acquisition import gaussian_ei

        return np.asarray(gaussian_ei(self._X(configs), self._opt.models[-1], y_opt=self.y_best, xi=xi))

    def suggestion(self) -> TrialConfig:
        """skopt's own `ask()`, decoded into the space."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "evaluated at point ... before": we dedupe ourselves
            return self._enc.decode(self._opt.ask())


class BayesProposer:
    """Gaussian-process Bayesian optimisation (scikit-optimize) over the search space.

    Random in-space points until `n_initial_points` trials have been told,
    then expected improvement maximised over the enumerated candidate pool
    (plus skopt's own `ask()` point). Optional `veto` removes candidates (the
    hybrid passes the out-of-memory model). Never re-proposes a told or
    pending point while an unexplored one remains.
    """

    def __init__(self, space: SearchSpace, *, seed: int = 0, n_initial_points: int = 5,
                 base_estimator: str = "GP", acq_func: str = "EI",
                 veto: Veto | None = None, source: str = BAYES, oom_as_penalty: bool = True) -> None:
        if base_estimator not in {"GP", "ET", "RF"}:
            # "GBRT" fails with scikit-learn >= 1.6 ("... has to be a regressor").
            raise ValueError(f"base_estimator {base_estimator!r} unsupported; use GP, ET or RF")
        self.space = space
        self.seed = seed
        self.n_initial_points = n_initial_points
        self.base_estimator = base_estimator
        self.acq_func = acq_func
        self.veto = veto
        self.source = source
        self.oom_as_penalty = oom_as_penalty
        """False when a feasibility model owns out-of-memory trials: the GP then
        models throughput only, and does not see a cliff as a slope."""
        self.history = History(space)
        self.encoding = Encoding(space)
        self._rng = np.random.default_rng(seed)

    # ---- contract ------------------------------------------------------
    def ask(self) -> Proposal:
        seen = self.history.seen
        surrogate = self.fit() if len(self.history.observations) >= self.n_initial_points else None
        if surrogate is not None:
            pick = self.best_candidate(surrogate, seen)
            if pick is not None:
                cfg, ei = pick
                return self._propose(cfg, f"expected improvement {ei:.3g} (GP on {len(self.history.observations)} trials)")
        cfg = self._random_allowed(seen)
        return self._propose(cfg, "initial random point")

    def tell(self, config: TrialConfig, result: TrialResult) -> None:
        self.history.record(config, result)

    def converged(self) -> str | None:
        return None  # no model of what is left to gain: the whole budget runs

    # ---- model ------------------------------------------------------------
    def observations(self) -> tuple[list[list], list[float]]:
        """(X, y) to tell skopt: -log(samples/s); failures as a finite penalty."""
        ok = [o.result.samples_per_second for o in self.history.ok if o.result.samples_per_second > 0]
        if not ok:
            return [], []
        penalty = -math.log(0.5 * min(ok))
        X, y = [], []
        for o in self.history.observations:
            if not o.result.ok and not self.oom_as_penalty and o.result.failure_reason == "oom":
                continue
            sps = o.result.samples_per_second
            X.append(self.encoding.encode(o.config))
            y.append(-math.log(sps) if o.result.ok and sps > 0 else penalty)
        return X, y

    def fit(self) -> Surrogate | None:
        """A surrogate fitted on every told trial, or None with too little data."""
        X, y = self.observations()
        if len(set(map(tuple, X))) < 2:
            return None
        preload.wait()
        from skopt import Optimizer

        opt = Optimizer(self.encoding.dimensions, base_estimator=self.base_estimator,
                        n_initial_points=1, acq_func=self.acq_func, acq_optimizer="sampling",
                        acq_optimizer_kwargs={"n_points": 2000},
                        random_state=self.seed * 1009 + len(X))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sklearn convergence chatter on tiny data
            opt.tell(X, y)
        return Surrogate(opt, self.encoding, min(y))

    def best_candidate(self, surrogate: Surrogate, seen: set[tuple], extra: Sequence[TrialConfig] = (),
                       weight: Callable[[TrialConfig], float] | None = None,
                       ) -> tuple[TrialConfig, float] | None:
        """Highest-EI unseen, un-vetoed config among the pool, skopt's suggestion and `extra`.

        `weight` multiplies EI (e.g. a probability of fitting in memory:
        constrained expected improvement).
        """
        pool = candidate_pool(self.space, self._rng, extra=[surrogate.suggestion(), *extra])
        pool = [c for c in pool if c.key() not in seen and not (self.veto and self.veto(c))]
        if not pool:
            return None
        ei = surrogate.expected_improvement(pool)
        if weight is not None:
            ei = ei * np.array([weight(c) for c in pool])
        i = int(np.argmax(ei))
        return pool[i], float(ei[i])

    # ---- helpers ------------------------------------------------------------
    def _random_allowed(self, seen: set[tuple]) -> TrialConfig:
        for _ in range(50):
            cfg = unexplored(self.space, seen, self._rng)
            if cfg is None:
                break
            if not (self.veto and self.veto(cfg)):
                return cfg
        cfg = unexplored(self.space, seen, self._rng)
        if cfg is not None:
            return cfg
        best = self.history.best()  # space exhausted: re-measure the best
        return best if best is not None else self.encoding.decode([0, 0, 0][: len(self.encoding.dimensions)])

    def _propose(self, cfg: TrialConfig, reason: str) -> Proposal:
        self.history.pending.add(cfg.key())
        return Proposal(config=cfg, source=self.source, reason=reason)
