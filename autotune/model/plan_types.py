"""What a plan is made of: the cluster it is for and each layout ranked on it (autotune/model/plan.py
for a pipeline, autotune/model/zero_plan.py for a plain engine)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autotune.model.hardware import Hardware
from autotune.model.step_model import Layout

HEADROOM = 0.10
"""Share of the device's memory a plan leaves free (fragmentation, workspaces, the model's error)."""


@dataclass(frozen=True, slots=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    hardware: Hardware | None
    """None: the study's own device (a GPU study planned onto more of the same GPUs)."""
    global_batch: int
    device_memory: float | None = None
    """Bytes per GPU where no preset gives them (a GPU study planned onto its own device)."""


@dataclass(frozen=True, slots=True)
class PlannedLayout:
    layout: Layout
    parts: list[int]
    samples_per_second: float
    step_seconds: float
    bubble_fraction: float | None
    """None: not a pipeline job."""
    stage_memory_bytes: list[float]
    memory_limit_bytes: float | None
    terms: dict[str, float]

    @property
    def fits(self) -> bool:
        return (self.memory_limit_bytes is None or not all(map(math.isfinite, self.stage_memory_bytes))
                or max(self.stage_memory_bytes) <= self.memory_limit_bytes)

    @property
    def overflow(self) -> tuple[int, float]:
        """(the stage that needs the most, by how many bytes it is over the limit)."""
        s = max(range(len(self.stage_memory_bytes)), key=lambda i: self.stage_memory_bytes[i])
        return s, self.stage_memory_bytes[s] - (self.memory_limit_bytes or math.inf)


@dataclass(frozen=True, slots=True)
class Plan:
    cluster: Cluster
    ranked: list[PlannedLayout]
    """Layouts that fit, fastest first."""
    too_big: list[PlannedLayout]
    """Layouts that do not fit, least over first."""
    notes: list[str] = field(default_factory=list)
    scaled: list[str] = field(default_factory=list)
    """What every time and byte of the plan took from the preset rather than a measurement."""
