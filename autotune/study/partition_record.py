"""The partition step's record, STUDY/partition.json (written by autotune/tuning/balance.py),
read back and said in one line for the end of a run, summary.json and report.md.

The reader lives with the study, so the study's outputs need nothing of the step itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULT_NAME = "partition.json"


def read_result(study_root: str | Path) -> dict[str, Any] | None:
    """partition.json of a study (None: no partition step ran, or the file is unreadable)."""
    try:
        info = json.loads((Path(study_root) / RESULT_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def describe_result(info: dict[str, Any] | None) -> str | None:
    """One line for the end of a run and report.md: the decision and what to write in the code."""
    if not info:
        return None
    if not info.get("rounds"):  # no round ran: say why, where the layer costs said so
        return f"partition: {info['no_round']}" if info.get("no_round") else None
    line = _describe_rounds(info)
    shared = info.get("cores_shared")
    if line and shared:
        line += (f" ({shared['ranks']} ranks shared {shared['cores']} cores: throughput followed the stages' "
                 "summed work, not the slowest stage)")
    return line


def _describe_rounds(info: dict[str, Any]) -> str | None:
    if info.get("parts") is not None:
        last = next(r for r in reversed(info["rounds"]) if r.get("kept"))
        advice = info.get("in_your_code") or {}
        code = advice.get("text") or f"PARTS = {info['parts']} (docs/partition.md)"
        needs = "" if advice.get("method") == "own" else "the best configuration needs it: "
        return (f"partition: parts {info['parts']} kept (trial {last.get('trial')}{at_config(last)}, work imbalance "
                f"{_from_imbalance(info, last):.2f} -> {last.get('measured_imbalance') or 0:.2f}, "
                f"{_reference_sps(info, last):.1f} -> {last.get('samples_per_second') or 0:.1f}"
                f" samples/s{_runs(last)}); {needs}{code}")
    tried = info["rounds"][-1]
    if tried.get("trial") is None:
        return None
    return (f"partition: parts {tried['parts']} measured {tried.get('samples_per_second') or 0:.1f} against "
            f"{_reference_sps(info, tried):.1f} samples/s{at_config(tried)}{_runs(tried)} (work imbalance "
            f"{_from_imbalance(info, tried):.2f} -> {tried.get('measured_imbalance') or 0:.2f}); not kept: "
            f"{info.get('method', 'the script')} partition stays, nothing to change in the code")


def at_config(r: dict[str, Any]) -> str:
    """The phrase ', at micro M GAS G' for a round's configuration (empty without one)."""
    c = r.get("config")
    return f", at micro {c['micro_batch_size']} GAS {c['gradient_accumulation_steps']}" if c else ""


def _runs(r: dict[str, Any]) -> str:
    n = len(r.get("trials") or [])
    return f", means of {n} runs each" if n > 1 else ""


def _from_imbalance(info: dict[str, Any], r: dict[str, Any]) -> float:
    return float(r.get("from_imbalance") or info.get("measured_imbalance") or 0.0)


def _reference_sps(info: dict[str, Any], r: dict[str, Any]) -> float:
    return float(r.get("reference_samples_per_second") or info.get("baseline_samples_per_second") or 0.0)
