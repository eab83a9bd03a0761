"""Input loaders for `autotune advise`: the format is detected from the header.

Each loader returns subjects the rule engine understands: TrialSummaries for
our metrics CSV, SignalSets for device logs and Prometheus exports (which
carry fewer signals; the missing ones are reported, not invented).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from autotune.advisor.signals import SignalSet
from autotune.loaders.detect import METRICS, NVIDIA_SMI, PROMETHEUS, detect_format
from autotune.summary import TrialSummary


@dataclass(kw_only=True, slots=True)
class LoadedInput:
    format: str
    subjects: list[TrialSummary | SignalSet]
    notes: list[str] = field(default_factory=list)
    """Things the user should know about this input (e.g. which signals it cannot carry)."""


def load_input(path: str | Path) -> LoadedInput:
    fmt = detect_format(path)
    if fmt == METRICS:
        from autotune.loaders.metrics import load_summaries
        return LoadedInput(format=fmt, subjects=list(load_summaries(path)))
    if fmt == NVIDIA_SMI:
        from autotune.loaders.nvidia_smi import NOTE, load_nvidia_smi
        return LoadedInput(format=fmt, subjects=[load_nvidia_smi(path)], notes=[NOTE])
    assert fmt == PROMETHEUS
    from autotune.loaders.prometheus import NOTE as PROM_NOTE
    from autotune.loaders.prometheus import load_prometheus
    return LoadedInput(format=fmt, subjects=list(load_prometheus(path)), notes=[PROM_NOTE])


__all__ = ["LoadedInput", "detect_format", "load_input"]
