"""What a proposer has seen: every told trial, grouped by configuration.

Every proposer needs the same bookkeeping (which points ran, which failed,
which is best, what is still pending), so it lives here once.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_result import TrialResult


@dataclass
class Observation:
    config: TrialConfig
    result: TrialResult


@dataclass
class History:
    space: SearchSpace
    observations: list[Observation] = field(default_factory=list)
    pending: set[tuple] = field(default_factory=set)
    """Keys asked but not told yet (never propose them twice)."""
    ignored: int = 0
    """Told configurations outside the space (e.g. a user's baseline); not modelled."""

    def record(self, config: TrialConfig, result: TrialResult) -> bool:
        """Store a told trial; False (and nothing stored) when it is outside the space.

        A bucket above a saturated range is stored as the range's top, which reduces
        the same way (SearchSpace.canonical)."""
        self.pending.discard(config.key())
        config = self.space.canonical(config)
        if not self.space.contains(config):
            self.ignored += 1
            return False
        self.observations.append(Observation(config, result))
        return True

    @property
    def seen(self) -> set[tuple]:
        return {o.config.key() for o in self.observations} | self.pending

    @property
    def ok(self) -> list[Observation]:
        return [o for o in self.observations if o.result.ok]

    @property
    def failed(self) -> list[Observation]:
        return [o for o in self.observations if not o.result.ok]

    def means(self) -> dict[tuple, tuple[TrialConfig, float, int]]:
        """key -> (config, mean samples/s over ok runs, number of ok runs); configs that ever failed are left out."""
        bad = {o.config.key() for o in self.failed}
        runs: dict[tuple, list[float]] = {}
        cfgs: dict[tuple, TrialConfig] = {}
        for o in self.ok:
            k = o.config.key()
            if k in bad:
                continue
            runs.setdefault(k, []).append(o.result.samples_per_second)
            cfgs[k] = o.config
        return {k: (cfgs[k], statistics.fmean(v), len(v)) for k, v in runs.items()}

    def ranked(self) -> list[tuple[TrialConfig, float, int]]:
        return sorted(self.means().values(), key=lambda t: -t[1])

    def best(self) -> TrialConfig | None:
        r = self.ranked()
        return r[0][0] if r else None

    def latest_summary(self, config: TrialConfig) -> object | None:
        for o in reversed(self.observations):
            if o.config.key() == config.key() and o.result.ok and o.result.summary is not None:
                return o.result.summary
        return None
