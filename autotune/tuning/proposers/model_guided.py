"""`--tuner model`: trials only where the performance model cannot say (issue 26, docs/model.md).

After each trial the model of the step (autotune/model/) is calibrated again on the study's
trials so far, and every untried point of the space is predicted. The next trial is:
- while the study has measured a single micro-batch size, the point whose micro-batch is
  farthest from it (largest first) among those the model's memory predicts fit the device: one
  size cannot tell a step's fixed cost from what grows with the batch, and a wrong split sends a
  model the wrong way;
- while the reduction has been measured at one bucket count per stage (and the bucket acts),
  the fastest predicted micro-batch at the bucket farthest from it: one count cannot tell
  the cost per bucket from the cost per step, so the model predicts every bucket alike;
- then the point predicted fastest, among those the out-of-memory model does not veto
  (`feasibility.py`: the cliff comes from the memory seen, not from stepping over it).
A real trial is needed where the model cannot rule a point out. Once the study has enough
held-out trials for the model's 80 % interval (autotune/model/interval.py: its leave-one-out
errors, launch noise included), a point runs only while its interval overlaps the best's (the
best measured, with the same width): the search stops when the fastest untried point's
interval lies wholly below it. Before that, it stops when no untried point is predicted to
beat the best measured by more than the larger of the noise margin and the model's own
running error on the trials it chose. Both are kept and said: each trial's reason holds the
samples/s it was predicted to reach, and its interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.core.dsconfig import reduce_bucket_acts
from autotune.core.noise import NOISE_MARGIN
from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_kind import MODEL
from autotune.core.trial_result import TrialResult
from autotune.model.interval import LEVEL
from autotune.tuning.proposers.base import Proposal
from autotune.tuning.proposers.feasibility import FeasibilityModel

if TYPE_CHECKING:
    from autotune.model.study_model import StudyModel

SOURCE = MODEL
BUCKET_POINTS = 4


class ModelGuidedProposer:
    def __init__(self, space: SearchSpace, *, seed: int = 0, study_root: str | Path | None = None,
                 models: Callable[[], StudyModel] | None = None) -> None:
        """`study_root`: the study the model calibrates on after each trial; `models`: where the
        study's model comes from instead (benchmarks/tuner_benchmark.py's simulated studies)."""
        self.space = space
        self.seed = seed
        self.root = Path(study_root) if study_root is not None else None
        self.models = models
        self.feasibility = FeasibilityModel(space)
        self.seen: set[tuple] = set()
        self.micro_seen: set[int] = set()
        self.best = 0.0
        self.best_bucket: int | None = None
        self.predicted: dict[tuple, float] = {}
        self.errors: list[float] = []
        """measured / predicted - 1 of every trial this proposer chose by prediction."""
        self.half_width: float | None = None
        """q of the model's interval (a prediction times e^-q..e^q), from the study's held-out
        trials at the last calibration; None: too few of them for one."""

    # -- the contract -------------------------------------------------------------------------
    def tell(self, config: TrialConfig, result: TrialResult) -> None:
        self.feasibility.observe(config, result)
        self.seen.add(config.key())
        if result.ok and result.samples_per_second > 0:
            self.micro_seen.add(config.micro_batch_size)
            if result.samples_per_second > self.best:
                self.best, self.best_bucket = result.samples_per_second, config.reduce_bucket_size
            expected = self.predicted.pop(config.key(), None)
            if expected:
                self.errors.append(result.samples_per_second / expected - 1)

    def ask(self) -> Proposal:
        cands = self._candidates()
        if not cands:  # everything tried: the best again, so the loop still has a trial to run
            cfg = self.space.grid(BUCKET_POINTS)[0]
            return Proposal(config=cfg, source=SOURCE, reason="every point of the space has run")
        ranked = self._ranked(cands)
        if ranked is None:
            return self._explore(cands)
        (speed, cfg), *_ = ranked
        bucket = self._bucket_to_measure(ranked)
        if bucket is not None:
            return bucket
        self.predicted[cfg.key()] = speed
        why = (f"the model predicts {speed:,.1f} samples/s{self._interval_text(speed)} (best measured "
               f"{self.best:,.1f}{self._interval_text(self.best)}){self._error_text()}")
        return Proposal(config=cfg, source=SOURCE, reason=why)

    def converged(self) -> str | None:
        cands = self._candidates()
        if not cands:
            return "every point of the space has run"
        ranked = self._ranked(cands)
        if ranked is None or self.best <= 0 or self._bucket_to_measure(ranked) is not None:
            return None
        speed, cfg = ranked[0]
        q = self.half_width
        if q is not None:  # the interval decides where a real trial is needed
            if speed * math.exp(q) < self.best * math.exp(-q):
                return (f"no untried point's {LEVEL * 100:.0f} % interval overlaps the best's: the fastest untried, "
                        f"{cfg.describe()}, at {speed:,.1f}{self._interval_text(speed)} samples/s against "
                        f"{self.best:,.1f}{self._interval_text(self.best)} measured{self._error_text()}")
            return None
        margin = max(NOISE_MARGIN, self.running_error() or 0.0)
        if speed < self.best * (1 + margin):
            return (f"the model predicts no untried point beats the best by more than {margin * 100:.0f} % "
                    f"(the best untried, {cfg.describe()}, at {speed:,.1f} samples/s against "
                    f"{self.best:,.1f} measured){self._error_text()}")
        return None

    # -- the model ----------------------------------------------------------------------------
    def running_error(self) -> float | None:
        """Mean absolute relative error of the predictions this proposer ran."""
        return statistics.fmean(abs(e) for e in self.errors) if self.errors else None

    def _interval_text(self, speed: float) -> str:
        q = self.half_width
        return "" if q is None else f" ({speed * math.exp(-q):,.1f}-{speed * math.exp(q):,.1f})"

    def _error_text(self) -> str:
        err = self.running_error()
        return f"; its error so far {err * 100:.1f} % over {len(self.errors)} trial(s)" if err is not None else ""

    def _candidates(self) -> list[TrialConfig]:
        return [c for c in self.space.grid(BUCKET_POINTS)
                if c.key() not in self.seen and not self.feasibility.vetoed(c)]

    def _explore(self, cands: list[TrialConfig]) -> Proposal:
        seen = self.micro_seen or {self.space.micro_batch_sizes[0]}
        cands = self._fitting(cands)

        def distance(c: TrialConfig) -> tuple[float, int]:
            return (min(abs(math.log2(c.micro_batch_size) - math.log2(m)) for m in seen), c.micro_batch_size)

        best_bucket = self.best_bucket

        def bucket_gap(c: TrialConfig) -> float:  # the bucket nearest the best's: one thing changes at a time
            if c.reduce_bucket_size is None or best_bucket is None:
                return 0.0
            return abs(math.log10(c.reduce_bucket_size) - math.log10(best_bucket))

        cfg = max(cands, key=lambda c: (*distance(c), -bucket_gap(c)))
        return Proposal(config=cfg, source=SOURCE,
                        reason=f"micro-batch {cfg.micro_batch_size}: the model needs a second micro-batch size to "
                               "fit how the step grows with it")

    def _fitting(self, cands: list[TrialConfig]) -> list[TrialConfig]:
        """The candidates the model's memory says fit the device (its layer costs give each layer's
        activations per sample, so even one measured micro-batch predicts another's peak): the
        farthest micro-batch is then the farthest that fits, not the first out-of-memory trial.
        All of them where the model or the device's capacity cannot say."""
        capacity = self.feasibility.capacity
        model = self._model() if capacity else None
        if model is None or capacity is None:
            return cands
        from autotune.core.errors import AutotuneError
        from autotune.model.step_model import Layout, predict

        cal, limit = model.calibration, capacity * (1 - self.feasibility.headroom)
        fit = []
        for c in cands:
            try:
                peak = predict(cal, Layout(micro_batch_size=c.micro_batch_size,
                                           gradient_accumulation_steps=c.gradient_accumulation_steps,
                                           stages=cal.stages, data_parallel_size=cal.data_parallel_size,
                                           reduce_bucket_size=c.reduce_bucket_size)).stage_memory_bytes
            except AutotuneError:
                return cands
            if peak is None:
                return cands
            if max(peak) <= limit:
                fit.append(c)
        return fit or cands

    def _model(self) -> StudyModel | None:
        from autotune.core.errors import AutotuneError
        from autotune.model.study_model import model_of_study

        try:
            if self.models is not None:
                return self.models()
            return model_of_study(self.root) if self.root is not None else None
        except AutotuneError:
            return None

    def _bucket_to_measure(self, ranked: list[tuple[float, TrialConfig]]) -> Proposal | None:
        """The trial that measures the cost per bucket, while the study has one bucket count."""
        if self.space.bucket_range is None or self._buckets_measured is None or len(self._buckets_measured) > 1:
            return None
        top = ranked[0][1]
        same_pair = [c for _, c in ranked if (c.micro_batch_size, c.gradient_accumulation_steps)
                     == (top.micro_batch_size, top.gradient_accumulation_steps) and c.reduce_bucket_size]
        if not same_pair or self.best_bucket is None:
            return None
        far = max(same_pair, key=lambda c: abs(math.log10(c.reduce_bucket_size or 1) - math.log10(self.best_bucket or 1)))
        return Proposal(config=far, source=SOURCE,
                        reason=f"reduce_bucket_size {far.reduce_bucket_size:.2g}: the reduction was measured at one "
                               "bucket count only, so the model cannot yet tell what a bucket costs")

    _buckets_measured: list[int] | None = None

    _cache: tuple[int, list[tuple[float, TrialConfig]] | None] | None = None

    def _ranked(self, cands: list[TrialConfig]) -> list[tuple[float, TrialConfig]] | None:
        """Untried points by predicted samples/s (weighed by the chance they fit), or None
        while the model cannot rank them (no study, one micro-batch size measured). Calibrated
        once per trial told: `converged()` and `ask()` share it."""
        if (self.root is None and self.models is None) or len(self.micro_seen) < 2:
            return None
        if self._cache is not None and self._cache[0] == len(self.seen):
            return self._cache[1]
        ranked = self._rank(cands)
        self._cache = (len(self.seen), ranked)
        return ranked

    def _rank(self, cands: list[TrialConfig]) -> list[tuple[float, TrialConfig]] | None:
        from autotune.core.errors import AutotuneError
        from autotune.model.step_model import Layout, predict

        model = self._model()
        if model is None:
            return None
        from autotune.model.interval import interval
        from autotune.model.validation import held_out

        cal = model.calibration
        iv = interval(1.0, held_out(model))
        self.half_width = iv.half_width_log if iv is not None else None
        acts = cal.zero_stage is None or reduce_bucket_acts(cal.zero_stage, cal.data_parallel_size,
                                                            pipeline=cal.zero is None)
        self._buckets_measured = cal.buckets_measured if acts else None
        if len(cal.micro_batches_measured) < 2:
            return None
        bucket_of_best = max(model.observations, key=lambda o: o.samples_per_second).reduce_bucket_size
        out = []
        for c in cands:
            layout = Layout(micro_batch_size=c.micro_batch_size, gradient_accumulation_steps=c.gradient_accumulation_steps,
                            stages=cal.stages, data_parallel_size=cal.data_parallel_size,
                            reduce_bucket_size=c.reduce_bucket_size or bucket_of_best,
                            checkpoint_interval=c.activation_checkpoint_interval)
            try:
                speed = predict(cal, layout).samples_per_second
            except AutotuneError:
                continue
            out.append((speed * self.feasibility.p_ok(c), c))
        out.sort(key=lambda x: (-x[0], x[1].key()[:2]))
        return out or None
