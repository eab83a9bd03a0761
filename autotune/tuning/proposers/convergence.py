"""When the search has converged: the budget as a cap, not a quota.

On the simulated landscapes the hybrid sits within a fraction of a percent of the
optimum after a handful of trials and then spends the rest of the budget on bucket
sizes that differ by 2 % or less. Each of those trials is a full start-up on a GPU
cluster. So the search stops once no candidate can plausibly beat the incumbent by
more than a measurement can even resolve:

- the GP's constrained expected improvement (EI x P(fits in memory)) of every
  unseen, un-vetoed candidate, relative to the incumbent, in log(samples/s) (so 0.01
  is about 1 %), is below ``ratio x noise``;
- the incumbent is the best configuration by its mean measured throughput; its value
  is the GP's posterior mean there, not its (possibly lucky) single reading;
- the noise is the proposer's assumed relative noise (`autotune.core.noise.NOISE_MARGIN`, 0.10:
  real CPU trials repeat within about 14 %), or, once repeated measurements give at least `MIN_DOF` degrees
  of freedom, their pooled relative spread (never below `NOISE_FLOOR`: a few lucky
  repeats must not make every difference look significant).

The proposer decides whether the rule phase and the final re-measurement are done
(autotune/tuning/proposers/hybrid.py `converged`); this module only measures.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autotune.core.space import TrialConfig
from autotune.tuning import preload
from autotune.tuning.proposers.history import History

MIN_DOF = 3
"""Degrees of freedom of repeated measurements before their spread replaces the assumed noise."""
NOISE_FLOOR = 0.02
"""Smallest relative noise a measured estimate may claim."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """Why the search may stop: the best candidate's expected gain against the noise."""

    expected_gain: float
    """Best constrained expected improvement, relative (0.006 = 0.6 %)."""
    noise: float
    """Relative measurement noise used."""
    noise_source: str
    """"assumed" or "measured over N repeats"."""
    threshold: float
    candidate: TrialConfig | None
    """The candidate with that gain (None when no candidate is left)."""

    def reason(self) -> str:
        if self.candidate is None:
            return "every configuration of the space has run or is predicted not to fit in memory"
        return (f"the best expected improvement is {self.expected_gain:.1%} < "
                f"{'noise' if self.threshold == self.noise else 'threshold'} {self.threshold:.0%}"
                f" ({self.noise_source} noise {self.noise:.0%})")


def measured_noise(history: History) -> tuple[float | None, int]:
    """Pooled std of log(samples/s) over configurations measured more than once, and its dof."""
    runs: dict[tuple, list[float]] = {}
    bad = {o.config.key() for o in history.failed}
    for o in history.ok:
        if o.result.samples_per_second > 0 and o.config.key() not in bad:
            runs.setdefault(o.config.key(), []).append(math.log(o.result.samples_per_second))
    ss, dof = 0.0, 0
    for v in runs.values():
        if len(v) > 1:
            ss += sum((x - statistics.fmean(v)) ** 2 for x in v)
            dof += len(v) - 1
    return (math.sqrt(ss / dof) if dof else None), dof


def noise_estimate(history: History, assumed: float) -> tuple[float, str]:
    sigma, dof = measured_noise(history)
    if sigma is None or dof < MIN_DOF:
        return assumed, "assumed"
    return max(NOISE_FLOOR, math.expm1(sigma)), f"measured over {dof} repeat(s)"


def expected_improvement(mu: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    """EI of a maximisation (mu, sd in log units) over `best`; exact where sd is 0."""
    imp = mu - best
    sd = np.maximum(sd, 1e-12)
    z = imp / sd
    phi = np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    preload.wait()  # SciPy is imported in the background (autotune/tuning/preload.py)
    from scipy.special import erfc

    cdf = 0.5 * erfc(-z / math.sqrt(2))
    return np.maximum(imp * cdf + sd * phi, 0.0)


def verdict(surrogate, incumbent: TrialConfig, candidates: Sequence[TrialConfig],
            p_ok: Callable[[TrialConfig], float], noise: float, noise_source: str,
            ratio: float = 1.0) -> Verdict:
    """The best candidate's constrained EI over the incumbent, against `ratio x noise`.

    `surrogate.predict(configs)` gives the mean and std of log(samples/s)
    (autotune/tuning/proposers/bayes.py `Surrogate`)."""
    threshold = ratio * noise
    if not candidates:
        return Verdict(expected_gain=0.0, noise=noise, noise_source=noise_source, threshold=threshold,
                       candidate=None)
    mu, sd = surrogate.predict([incumbent, *candidates])
    # The incumbent's worth counts its own risk of running out of memory, as the
    # candidates' does: a config that fits only on lucky days is worth less.
    best = float(mu[0]) + math.log(max(p_ok(incumbent), 1e-6))
    ei = expected_improvement(mu[1:], sd[1:], best) * np.array([p_ok(c) for c in candidates])
    i = int(np.argmax(ei))
    return Verdict(expected_gain=math.expm1(float(ei[i])), noise=noise, noise_source=noise_source,
                   threshold=threshold, candidate=candidates[i])
