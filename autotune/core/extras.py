"""Optional features and the pip extra that brings each one.

The base install (`pip install autotune`) is what `advise` and `check` need. Every
other feature names its extra here, once; a missing one is a one-line error that
says what to install, never an ImportError and never a silently missing command.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from autotune.core.errors import UserError


@dataclass(frozen=True, slots=True)
class Extra:
    name: str
    """The pip extra: `pip install 'autotune[NAME]'`."""
    modules: tuple[str, ...]
    """Top-level modules it brings (checked with importlib, without importing them)."""
    purpose: str
    note: str = ""
    """Said after the install line (e.g. torch, which no extra pins)."""


TORCH_NOTE = ", and a torch build for this machine (autotune pins none: an unpinned torch is a CUDA build)"

EXTRAS = {
    "tune": Extra("tune", ("deepspeed", "torch", "skopt", "sklearn", "scipy"),
                  "tuning runs (real DeepSpeed trials and the Bayesian optimizer)", TORCH_NOTE),
    "live": Extra("live", ("prometheus_client",), "live Prometheus endpoints"),
    "gpu": Extra("gpu", ("pynvml",), "NVML utilization sampling on NVIDIA GPUs"),
    "report": Extra("report", ("matplotlib",), "the HTML report and its figures"),
}


def missing_modules(extra: str) -> list[str]:
    return [m for m in EXTRAS[extra].modules if importlib.util.find_spec(m) is None]


def require(extra: str, *, what: str | None = None) -> None:
    """Raise a one-line UserError naming `pip install 'autotune[extra]'` when a module is missing."""
    spec = EXTRAS[extra]
    missing = missing_modules(extra)
    if missing:
        note = spec.note if "torch" in missing or not spec.note else ""
        raise UserError(f"{what or spec.purpose}: {', '.join(missing)} not installed in this Python; "
                        f"pip install 'autotune[{extra}]'{note}")
