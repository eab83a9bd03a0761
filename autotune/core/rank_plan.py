"""What every training rank of a trial is told, written once: the rank plan.

A rank of the built-in workload reads it inside `trial-NNN/trial.json`
(autotune/rank/workload/trial_spec.py: the plan plus the workload's model and test
seams); a rank of the user's own script reads it from the bootstrap's settings
(autotune/rank/hook.py: the plan plus the bootstrap's mode), given by an
environment variable or a file. Both controller sides build a `RankPlan`, and
both rank sides hand it to autotune/rank/wiring.py, which sets up the probe, the
step budget, the records and the endpoint from it.

The JSON form (`to_dict`, `from_dict`, and `JsonForm` for a description holding a
plan) is internal between a controller and ranks of the same version. Data model
only: this module imports nothing but the standard library.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.core.noise import NOISE_MARGIN

METRICS_CSV = "metrics-rank{rank}.csv"
"""The per-rank metrics CSV in the trial folder; `{rank}` is replaced by the global rank."""


class JsonForm:
    """The one JSON form of a rank's description (the plan, or a description holding one): as
    text (an environment variable) and as a file, from the `to_dict`/`from_dict` each defines."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Any:
        return cls.from_dict(json.loads(text))

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def read(cls, path: str | Path) -> Any:
        with open(path, encoding="utf-8") as fh:
            return cls.from_json(fh.read())


@dataclass(kw_only=True, slots=True)
class RankPlan(JsonForm):
    """What every rank of one trial (or one watched job) does around its training steps."""

    trial_dir: str
    """The trial folder: the metrics CSV, layer costs, the step record and the watchdog's files."""
    trial: int = -1
    """The trial number (-1 outside a study)."""
    warmup_steps: int = 2
    """Steps excluded from every summary."""
    steps: int = 6
    """Measured steps: the minimum with adaptive steps, the exact count without."""
    adaptive_steps: bool = False
    """Measure between `steps` and `step_cap` until the median is known (autotune/core/step_budget.py)."""
    step_precision: float = 0.03
    """With adaptive steps: the median's relative 95 % half-width at which a trial stops."""
    max_steps: int = 0
    """The cap of measured steps with adaptive steps (0, or less than `steps`: `steps`)."""
    incumbent_samples_per_second: float | None = None
    """The best trial's samples/s so far: with adaptive steps, a trial that cannot plausibly beat it
    (by more than `noise`) stops early. None: never stopped early."""
    noise: float = NOISE_MARGIN
    """The between-launch noise margin of that comparison (the tuner's, HybridProposer.noise)."""
    metrics_port: int | None = None
    """Base port of the rank endpoints (each rank adds its global rank); None: no endpoint."""
    metrics_addr: str = "127.0.0.1"
    """Bind address of the rank endpoints."""
    job: str = "autotune"
    """The `job` label of every metric."""
    layer_costs: bool = False
    """Time every layer of the PipelineModule (layer-costs-rankR.csv, autotune/rank/layer_costs.py)."""
    parts: list[int] | None = None
    """Stage boundaries the trial's PipelineModule is built with (autotune/rank/pipeline_parts.py);
    None: the module's own partition method. The bootstrap forces them on the user's module;
    the built-in workload builds its module itself from its `parts:` partition method."""
    trace_steps: int = 0
    """Steps to record a torch.profiler trace of on every rank, into `traces/` of the trial folder
    (autotune/rank/trace_recorder.py); 0: none. They run after the warm-up and before the
    measured steps, and are excluded from every summary like the warm-up (`unmeasured_steps`)."""
    limits: dict | None = None
    """How long start-up and a step may take before the rank counts as stalled
    (autotune/rank/watchdog.py StallLimits as a dict); None: no watchdog."""

    @property
    def step_cap(self) -> int:
        """The most measured steps a rank runs."""
        return max(self.max_steps, self.steps)

    @property
    def unmeasured_steps(self) -> int:
        """The steps before the measured ones: the warm-up, then the traced steps with the
        profiler's own warm-up step before them and one step after them, which absorbs the
        ranks' different times writing their trace (the first measured step waited for the
        slowest writer without it)."""
        return self.warmup_steps + (self.trace_steps + 2 if self.trace_steps > 0 else 0)

    @property
    def total_steps(self) -> int:
        """Warm-up, traced steps and the minimum of measured steps: what a trial needs to count."""
        return self.unmeasured_steps + self.steps

    @property
    def metrics_csv(self) -> str:
        """The per-rank metrics CSV path, `{rank}` still to be replaced."""
        return os.path.join(self.trial_dir, METRICS_CSV)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankPlan:
        return cls(**d)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankSettings:
    """A runner's own settings of what its ranks do around their steps (the built-in workload's
    options, rank/workload/trial_spec.py `workload_settings`; the user-command runner's), which a
    trial's request completes (trials/contract.py `plan_for`): the one mapping to a `RankPlan`."""

    warmup_steps: int
    steps: int
    adaptive_steps: bool = False
    step_precision: float = 0.03
    max_steps: int = 0
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    job: str = "autotune"
    layer_costs: bool = False
    parts: list[int] | None = None

    def plan(self, *, trial_dir: str, trial: int, incumbent: tuple[float, float] | None = None,
             limits: dict[str, Any] | None = None, trace_steps: int = 0, layer_costs: bool | None = None,
             parts: list[int] | None = None) -> RankPlan:
        """The plan of one trial; `incumbent` (samples/s, noise), `layer_costs` and `parts` (None:
        these settings') are the trial's own."""
        return RankPlan(
            trial_dir=trial_dir, trial=trial, warmup_steps=self.warmup_steps, steps=self.steps,
            adaptive_steps=self.adaptive_steps, step_precision=self.step_precision, max_steps=self.max_steps,
            incumbent_samples_per_second=incumbent[0] if incumbent else None,
            noise=incumbent[1] if incumbent else NOISE_MARGIN,
            metrics_port=self.metrics_port, metrics_addr=self.metrics_addr, job=self.job,
            layer_costs=self.layer_costs if layer_costs is None else layer_costs,
            parts=self.parts if parts is None else parts, trace_steps=trace_steps, limits=limits)


def plan_fields(d: dict[str, Any]) -> tuple[RankPlan, dict[str, Any]]:
    """A description's dict split into its plan and the rest (its own fields)."""
    rest = dict(d)
    return RankPlan.from_dict(rest.pop("plan")), rest
