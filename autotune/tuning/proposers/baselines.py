"""Baseline proposers the hybrid is measured against: random, grid, DeepSpeed-autotuner style.

They implement the same contract as every proposer so the benchmark and
`autotune run --proposer NAME` can use them interchangeably.
"""

from __future__ import annotations

import numpy as np

from autotune.core.dsconfig import DEEPSPEED_DEFAULT_BUCKET
from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_kind import DS_AUTOTUNER, GRID, RANDOM
from autotune.core.trial_result import TrialResult
from autotune.tuning.proposers.base import Proposal
from autotune.tuning.proposers.history import History
from autotune.tuning.proposers.pool import clamp_bucket, unexplored, valid_pairs


class RandomProposer:
    """Uniform over valid (micro, GAS) pairs, log-uniform bucket; no repeats while points remain."""

    def __init__(self, space: SearchSpace, *, seed: int = 0) -> None:
        self.space = space
        self.history = History(space)
        self._rng = np.random.default_rng(seed)

    def ask(self) -> Proposal:
        cfg = unexplored(self.space, self.history.seen, self._rng) or self.history.best()
        if cfg is None:  # one-point space, nothing told yet
            cfg = _first(self.space)
        self.history.pending.add(cfg.key())
        return Proposal(config=cfg, source=RANDOM, reason="uniform random point")

    def tell(self, config: TrialConfig, result: TrialResult) -> None:
        self.history.record(config, result)

    def converged(self) -> str | None:
        return None  # no model of what is left to gain: the whole budget runs


class GridProposer:
    """A coarse grid (3 log-spaced buckets) visited in a seeded random order.

    A lexicographic sweep would spend a 20-trial budget on the smallest
    micro-batches; a shuffled grid is the fair version of "try the grid".
    """

    def __init__(self, space: SearchSpace, *, seed: int = 0, bucket_points: int = 3) -> None:
        self.space = space
        self.history = History(space)
        self._rng = np.random.default_rng(seed)
        grid = space.grid(bucket_points)
        self._order = [grid[i] for i in self._rng.permutation(len(grid))]

    def ask(self) -> Proposal:
        seen = self.history.seen
        for cfg in self._order:
            if cfg.key() not in seen:
                self.history.pending.add(cfg.key())
                return Proposal(config=cfg, source=GRID, reason="next grid point")
        cfg = unexplored(self.space, seen, self._rng) or self.history.best() or _first(self.space)
        self.history.pending.add(cfg.key())
        return Proposal(config=cfg, source=GRID, reason="grid exhausted: random point")

    def tell(self, config: TrialConfig, result: TrialResult) -> None:
        self.history.record(config, result)

    def converged(self) -> str | None:
        return None  # no model of what is left to gain: the whole budget runs


class DSAutotunerProposer:
    """DeepSpeed's autotuner, fast mode, transplanted to our space (tuner-facts.md).

    - micro-batch: start at the largest allowed (DeepSpeed's estimated
      maximum); on out-of-memory, binary-search down for the largest that
      runs; then step to the neighbours (the 0.95x / 1.05x probes) while the
      gain is at least 5 %;
    - bucket (ZeRO-1 only): the grid {5e7, 5e8, 1e9} clipped to the range,
      at the best micro-batch;
    - GAS is never tuned: derived with a fixed global batch, otherwise kept
      at the starting configuration's value (or the smallest >= stages);
    - failed runs score 0. When the plan is done, it tries random points.
    """

    def __init__(self, space: SearchSpace, *, seed: int = 0) -> None:
        self.space = space
        self.history = History(space)
        self._rng = np.random.default_rng(seed)
        self._gas: int | None = None
        self._buckets = sorted({clamp_bucket(space, b) for b in (5e7, DEEPSPEED_DEFAULT_BUCKET, 1e9)}) if space.bucket_range else [None]

    def tell(self, config: TrialConfig, result: TrialResult) -> None:
        if self.history.record(config, result) and self._gas is None and self.space.global_batch is None:
            self._gas = config.gradient_accumulation_steps  # the user's GAS, kept from then on

    def converged(self) -> str | None:
        return None  # no model of what is left to gain: the whole budget runs

    def _pair(self, micro_idx: int) -> tuple[int, int] | None:
        m = self.space.micro_batch_sizes[micro_idx]
        pairs = [p for p in valid_pairs(self.space) if p[0] == m]
        if not pairs:
            return None
        if self.space.global_batch is not None:
            return pairs[0]
        want = self._gas or min(self.space.gas_values, key=lambda g: abs(g - self.space.pipeline_stages))
        return min(pairs, key=lambda p: abs(p[1] - want))

    def _cfg(self, micro_idx: int, bucket: int | None) -> TrialConfig | None:
        pair = self._pair(micro_idx)
        if pair is None:
            return None
        return TrialConfig(micro_batch_size=pair[0], gradient_accumulation_steps=pair[1], reduce_bucket_size=bucket)

    def _score(self, cfg: TrialConfig) -> float | None:
        """Mean samples/s of a config, 0 when it failed, None when not run."""
        vals = [0.0 if not o.result.ok else o.result.samples_per_second
                for o in self.history.observations if o.config.key() == cfg.key()]
        return sum(vals) / len(vals) if vals else None

    def _plan(self) -> tuple[TrialConfig | None, str]:
        """The next step of the fast-mode plan, recomputed from the history each time."""
        micros = self.space.micro_batch_sizes
        b0 = clamp_bucket(self.space, DEEPSPEED_DEFAULT_BUCKET)
        cfgs = {i: c for i in range(len(micros)) if (c := self._cfg(i, b0)) is not None}
        if not cfgs:
            return None, ""
        scores = {i: self._score(c) for i, c in cfgs.items()}
        # 1. the largest micro-batch that runs: try the top, then binary search below a failure.
        top = max(cfgs)
        if scores[top] is None:
            return cfgs[top], f"micro-batch search: estimated maximum micro {micros[top]}"
        failed = [i for i, s in scores.items() if s == 0.0]
        upper = min(failed) if failed else top + 1
        ran = [i for i, s in scores.items() if s and i < upper]
        lower = max(ran) if ran else -1
        untried = [i for i in cfgs if lower < i < upper and scores[i] is None]
        if untried:
            mid = min(untried, key=lambda i: abs(i - (lower + upper) / 2))
            return cfgs[mid], f"micro-batch search: binary step to micro {micros[mid]}"
        if not ran:
            return None, ""
        # 2. smaller neighbours while each step gains >= 5 %.
        i = lower
        while i - 1 in cfgs and scores[i - 1] is not None and scores[i - 1] >= 1.05 * (scores[i] or 0):
            i -= 1
        if i - 1 in cfgs and scores[i - 1] is None:
            return cfgs[i - 1], f"micro-batch search: neighbour micro {micros[i - 1]}"
        best_idx = max((j for j in scores if scores[j]), key=lambda j: scores[j] or 0.0)
        # 3. the bucket grid at the best micro-batch.
        for b in self._buckets:
            c = self._cfg(best_idx, b)
            if c is not None and self._score(c) is None and c.key() not in self.history.pending:
                return c, f"bucket grid: reduce_bucket_size {b:.0e}"
        return None, ""

    def ask(self) -> Proposal:
        cfg, reason = self._plan()
        seen = self.history.seen
        if cfg is None or cfg.key() in seen:
            cfg = unexplored(self.space, seen, self._rng) or self.history.best() or _first(self.space)
            reason = "plan done: random point"
        self.history.pending.add(cfg.key())
        return Proposal(config=cfg, source=DS_AUTOTUNER, reason=reason)


def _first(space: SearchSpace) -> TrialConfig:
    m, g = valid_pairs(space)[0]
    return TrialConfig(micro_batch_size=m, gradient_accumulation_steps=g,
                       reduce_bucket_size=clamp_bucket(space, None))
