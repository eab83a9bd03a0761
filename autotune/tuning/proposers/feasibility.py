"""Out-of-memory model: keeps the optimizer away from the memory cliff.

Telling an out-of-memory trial to a GP as a bad value teaches it little: the
cliff is a wall, not a slope, and the best configurations usually sit right
next to it. So failures are modelled separately, with what we know about
pipeline memory (deepspeed-facts.md, tuner-facts.md):

- activation memory grows linearly with the micro-batch size;
- under 1F1B, stage 0 keeps ``min(m, max(2, p))`` micro-batches in flight
  (p stages, m = GAS micro-batches), so GAS barely matters once m >= p;
- a ZeRO-1 gradient bucket adds a buffer that grows with reduce_bucket_size.

Two vetoes, both conservative:
1. Dominance (always on, needs no memory readings, e.g. on CPU): a config
   whose activation load ``micro x in-flight`` is at least that of a
   configuration that ran out of memory, with a bucket not ten times smaller,
   is vetoed.
2. Memory regression (when trials report peak memory): fit
   ``mem = a + b * micro x in-flight + c * bucket`` (non-negative) on the
   successful trials; the limit is estimated from the lowest predicted
   memory among out-of-memory trials. A config predicted above
   ``limit x (1 - margin)`` is vetoed; `p_ok` gives a smooth probability the
   hybrid uses to weigh its acquisition.
3. Before any out-of-memory trial (when trials report the device's memory,
   `memory_capacity_bytes`: GPUs), the limit is ``capacity x (1 - headroom)``,
   raised to the largest peak a trial has fitted in (it fitted, so the limit
   is at least there); an out-of-memory trial then lowers it as in 2. So the
   regression predicts the cliff before the first trial steps over it. Without
   a capacity (CPU: the ranks share the host's memory) this prior is absent and
   the model behaves as 1 and 2 alone.
Non-memory failures (timeouts, crashes) are not modelled here.
"""

from __future__ import annotations

import math

import numpy as np

from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_result import TrialResult
from autotune.tuning import preload

OOM_REASONS = frozenset({"oom", "out_of_memory", "cuda_oom"})


def in_flight(stages: int, gas: int) -> int:
    """Micro-batches whose activations stage 0 holds at once under 1F1B."""
    return min(gas, max(2, stages))


class FeasibilityModel:
    """Learns where trials run out of memory; vetoes candidates near or past the cliff."""

    def __init__(self, space: SearchSpace, *, margin: float = 0.0, jitter: float = 0.03,
                 headroom: float = 0.0) -> None:
        self.space = space
        self.headroom = headroom
        """Share of the device's capacity assumed unusable (CUDA context, buffers, fragmentation).
        0 by default: a guessed headroom vetoes the best configurations, which sit right
        below the real limit (10 % cut the simulated benchmark's 13B score from 0.97 to
        0.76); the capacity alone already vetoes what cannot fit at all, the climb's
        doubling past the cliff, and out-of-memory trials find the usable limit below it."""
        self.capacity: float | None = None
        """The smallest device memory any trial reported; None when none did (CPU)."""
        self.margin = margin
        """Relative safety distance below the estimated limit."""
        self.jitter = jitter
        """Assumed relative run-to-run spread of the usable memory (p_ok's width)."""
        self.bucket_slack = 10.0
        """A bucket this many times smaller than an out-of-memory trial's escapes its dominance."""
        self._oom: list[TrialConfig] = []
        self._fits: list[tuple[TrialConfig, float]] = []
        self._coef: np.ndarray | None = None

    # ---- learning ---------------------------------------------------------
    def observe(self, config: TrialConfig, result: TrialResult) -> None:
        if not self.space.contains(config):
            return
        if not result.ok:
            if (result.failure_reason or "").lower() in OOM_REASONS:
                self._oom.append(config)
            return
        capacity = getattr(result.summary, "memory_capacity_bytes", None)
        if capacity is not None and capacity > 0:
            self.capacity = capacity if self.capacity is None else min(self.capacity, capacity)
        peak = getattr(result.summary, "memory_peak_bytes", None)
        if peak is not None and peak > 0:
            self._fits.append((config, float(peak)))
            self._coef = None

    @property
    def oom_count(self) -> int:
        return len(self._oom)

    def _features(self, cfg: TrialConfig) -> list[float]:
        load = cfg.micro_batch_size * in_flight(self.space.pipeline_stages, cfg.gradient_accumulation_steps)
        return [1.0, float(load), float(cfg.reduce_bucket_size or 0)]

    def _coefficients(self) -> np.ndarray | None:
        if self._coef is None and len({c.key() for c, _ in self._fits}) >= 2:
            A = np.array([self._features(c) for c, _ in self._fits])
            y = np.array([m for _, m in self._fits])
            scale = A.max(axis=0)
            scale[scale == 0] = 1.0
            preload.wait()  # SciPy is imported in the background (autotune/tuning/preload.py)
            from scipy.optimize import nnls

            coef, _ = nnls(A / scale, y)
            self._coef = coef / scale
        return self._coef

    def predicted_memory(self, cfg: TrialConfig) -> float | None:
        coef = self._coefficients()
        return None if coef is None else float(np.dot(coef, self._features(cfg)))

    def limit(self) -> float | None:
        """Estimated usable memory: the lowest predicted peak among out-of-memory trials, and
        before any, ``capacity x (1 - headroom)`` but at least the largest peak that fitted."""
        preds = [self.predicted_memory(c) for c in self._oom]
        preds = [p for p in preds if p is not None]
        from_oom = min(preds) if preds else None
        if self.capacity is None:
            return from_oom
        # A config that fitted is under the limit, as measured and as the regression sees it
        # (limits and predictions are compared like with like, as for out-of-memory trials).
        fits = [max(m, self.predicted_memory(c) or 0.0) for c, m in self._fits]
        prior = max([self.capacity * (1 - self.headroom), *fits])
        return prior if from_oom is None else min(from_oom, prior)

    # ---- decisions --------------------------------------------------------
    def dominated(self, cfg: TrialConfig) -> bool:
        """At least the activation load of some out-of-memory trial, and a bucket not 10x smaller.

        Only a much smaller bucket is trusted to free enough memory: trying
        the same load with a slightly smaller bucket is the classic way to
        collect a second out-of-memory trial.
        """
        f = self._features(cfg)
        return any(f[1] >= (o := self._features(bad))[1] and f[2] * self.bucket_slack >= o[2]
                   for bad in self._oom)

    def p_ok(self, cfg: TrialConfig) -> float:
        """Estimated probability the config fits in memory (1.0 without evidence)."""
        if self.dominated(cfg):
            return 0.0
        limit, mem = self.limit(), self.predicted_memory(cfg)
        if limit is None or mem is None:
            return 1.0
        z = (limit - mem) / (self.jitter * limit)
        return 0.5 * math.erfc(-z / math.sqrt(2))

    def vetoed(self, cfg: TrialConfig) -> bool:
        if self.dominated(cfg):
            return True
        limit, mem = self.limit(), self.predicted_memory(cfg)
        return limit is not None and mem is not None and mem > limit * (1 - self.margin)

    __call__ = vetoed
