"""What one trial's ranks are told: a single JSON trial description, not a hand-built argv.

The controller writes `trial-NNN/trial.json`; the rank script reads it
(`train.py --trial-spec PATH`). The workload part is `autotune.options.WorkloadOptions`
itself, so a default or a new field is written once and reaches the ranks without a
parser on either side having to learn it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from autotune.noise import NOISE_MARGIN
from autotune.options import WorkloadOptions

SPEC_NAME = "trial.json"


@dataclass(kw_only=True, slots=True)
class TrialSpec:
    """Everything a rank of one trial needs to know."""

    workload: WorkloadOptions
    trial: int
    """The trial number (-1 outside a study)."""
    ds_config: str
    """Path of the trial's ds_config.json."""
    metrics_csv: str
    """Path of the per-rank metrics CSV; `{rank}` is replaced by the global rank."""
    fault: str | None = None
    """Testing seam (autotune/faults.py): the rank fault of this trial, if any."""
    fault_rank: int = 1
    """Testing seam: the rank that injects `fault`."""
    step_sleep: float = 0.0
    """Testing seam: seconds every rank sleeps after each step (keeps a trial running)."""
    incumbent_samples_per_second: float | None = None
    """The best trial's samples/s so far: with adaptive steps, a trial that cannot plausibly beat it
    (by more than `noise`) stops early (autotune/step_budget.py). None: never stopped early."""
    noise: float = NOISE_MARGIN
    """The between-launch noise margin of that comparison (the tuner's, HybridProposer.noise)."""
    limits: dict | None = None
    """How long start-up and a step may take before the rank counts as stalled
    (autotune/watchdog.py StallLimits as a dict); None: no watchdog."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrialSpec:
        d = dict(d)
        workload = WorkloadOptions(**d.pop("workload"))
        return cls(**d, workload=workload)

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def read(cls, path: str | Path) -> TrialSpec:
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))
