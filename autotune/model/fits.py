"""The small fits the model is made of: how a time grows with the micro-batch, and a
non-negative linear fit for the terms that add up.

A layer's time is not proportional to its micro-batch: each call has a fixed cost (the
kernel launches, the Python of the module, DeepSpeed's instruction), and large batches
use the device better. `GrowthFit` fits t(b) = a + c * b**e, with a, c >= 0 and the
exponent chosen from a grid by the smallest relative error; two micro-batch sizes fit a
straight line (e = 1), one can only be scaled in proportion, and says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

EXPONENTS = tuple(round(0.5 + 0.05 * i, 2) for i in range(21))
"""0.5 to 1.5: from strongly sub-linear (a device far from full) to super-linear (caches overflow)."""


@dataclass(frozen=True, slots=True)
class GrowthFit:
    """t(b) = fixed + per_unit * b ** exponent, fitted over the measured sizes."""

    fixed: float
    per_unit: float
    exponent: float
    measured: tuple[int, ...]
    """The distinct micro-batch sizes the fit saw."""

    def __call__(self, b: float) -> float:
        return self.fixed + self.per_unit * b ** self.exponent

    @property
    def how(self) -> str:
        if len(self.measured) == 1:
            return f"scaled in proportion from the one micro-batch measured ({self.measured[0]})"
        if len(self.measured) == 2:
            return f"a straight line through micro-batches {self.measured[0]} and {self.measured[1]}"
        return f"{self.fixed:.3g} + {self.per_unit:.3g} x b^{self.exponent:g} over micro-batches {list(self.measured)}"


def fit_growth(sizes: Sequence[float], values: Sequence[float]) -> GrowthFit:
    """Fit `values` (seconds or bytes at each micro-batch size) as they grow with the size."""
    b = np.asarray(sizes, dtype=float)
    y = np.asarray(values, dtype=float)
    if len(b) == 0:
        raise ValueError("nothing to fit")
    distinct = tuple(sorted({int(v) for v in b}))
    if len(distinct) == 1:
        return GrowthFit(0.0, float(np.median(y / b)), 1.0, distinct)
    exponents = (1.0,) if len(distinct) == 2 else EXPONENTS
    best: tuple[float, GrowthFit] | None = None
    weight = 1.0 / np.maximum(np.abs(y), 1e-12)  # relative error: small and large sizes count alike
    for e in exponents:
        x = np.column_stack([np.ones_like(b), b ** e]) * weight[:, None]
        coef = nonnegative_least_squares(x, y * weight)
        fit = GrowthFit(float(coef[0]), float(coef[1]), e, distinct)
        err = float(np.sum(((np.array([fit(v) for v in b]) - y) * weight) ** 2))
        if best is None or err < best[0] - 1e-15:
            best = (err, fit)
    assert best is not None
    return best[1]


def nonnegative_least_squares(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """argmin ||x c - y|| with c >= 0 (SciPy's NNLS)."""
    from scipy.optimize import nnls

    coef, _ = nnls(np.asarray(x, dtype=float), np.asarray(y, dtype=float))
    return coef


def relative_spread(values: Sequence[float]) -> float:
    """(max - min) / median of positive values; 0 for fewer than two."""
    v = [x for x in values if x > 0 and math.isfinite(x)]
    if len(v) < 2:
        return 0.0
    return (max(v) - min(v)) / float(np.median(v))
