"""A CSV exported from a Prometheus range query of autotune's own metrics.

Accepted shape (one sample per row, any column order, label columns optional):

    timestamp,metric,job,trial,rank,stage,device,host,value

`__name__` may stand for `metric` (what most exporters write). Rows of other
metric names are ignored. Samples are grouped by the `trial` label (all in
one group when absent) and per rank; the signal definitions follow the
README's: fluctuation = population std of a rank's utilization samples.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from autotune.advisor.signals import (
    ALL_SIGNALS,
    FRAGMENTATION_NOT_AVAILABLE,
    LEAD_SIGNALS,
    RankValue,
    SignalSet,
)
from autotune.core.errors import InputFileError
from autotune.loaders.detect import read_rows

NOTE = ("Prometheus export: signals come from the exported gauges; batch-layout rules need the "
        "metrics CSV or --config")
METRICS = {
    "autotune_device_utilization_ratio": "util",
    "autotune_comm_compute_ratio": "comm",
    "autotune_memory_fragmentation_ratio": "frag",
    "autotune_samples_per_second": "sps",
    "autotune_step_seconds": "step",
    "autotune_bubble_fraction_measured_ratio": "bubble",
    "autotune_bubble_fraction_ideal_ratio": "ideal",
    "autotune_stage_compute_imbalance_ratio": "imbalance",
    "autotune_zero_stage": "zero",
    "autotune_collective_calls_per_micro_batch": "calls",
    "autotune_gather_comm_ratio": "gather",
}
Key = tuple[str, str, str]  # rank, stage, device


def load_prometheus(path: str | Path) -> list[SignalSet]:
    p = Path(path)
    rows = read_rows(p, "Prometheus")
    header = [h.strip() for h in rows[0]]
    name_col = header.index("metric") if "metric" in header else header.index("__name__")
    col = {h: i for i, h in enumerate(header)}
    data: dict[str, dict[str, dict[Key, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for line, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != len(header):
            raise InputFileError(f"{p}: line {line}: {len(row)} cells, header has {len(header)}")
        kind = METRICS.get(row[name_col].strip())
        if kind is None:
            continue
        try:
            v = float(row[col["value"]])
        except ValueError:
            raise InputFileError(f"{p}: line {line}: non-numeric value {row[col['value']]!r}") from None
        if math.isnan(v):
            continue
        if math.isinf(v):
            raise InputFileError(f"{p}: line {line}: infinite value")
        label = {k: row[col[k]].strip() if k in col else "" for k in ("trial", "rank", "stage", "device")}
        data[label["trial"]][kind][(label["rank"], label["stage"], label["device"])].append(v)
    if not data:
        raise InputFileError(f"{p}: no autotune_* samples in the Prometheus export")
    return [_signals(trial, series) for trial, series in sorted(data.items(), key=lambda t: _int(t[0]) or 0)]


def _int(s: str) -> int | None:
    try:
        return int(float(s))
    except ValueError:
        return None


def _rv(key: Key, value: float) -> RankValue:
    return RankValue(value, rank=_int(key[0]), stage=_int(key[1]), device=key[2])


def _signals(trial: str, s: dict[str, dict[Key, list[float]]]) -> SignalSet:
    values: dict[str, float | None] = {}
    per_rank: dict[str, list[RankValue]] = {}
    util = s.get("util", {})
    fl = {k: statistics.pstdev(v) for k, v in util.items() if len(v) >= 2}
    if util:
        means = [statistics.fmean(v) for v in util.values()]
        values["device_utilization_mean"] = statistics.fmean(means)
        values["device_utilization_fluctuation"] = max(fl.values()) if fl else None
        values["cross_device_fluctuation"] = statistics.pstdev(means) if len(means) > 1 else None
        per_rank["device_utilization_fluctuation"] = [_rv(k, v) for k, v in fl.items()]
    for kind, sig, reduce in (("comm", "comm_compute_ratio", statistics.fmean),
                              ("frag", "memory_fragmentation_ratio", statistics.median),
                              ("zero", "zero_stage", max),
                              ("calls", "collective_calls_per_micro_batch", statistics.median),
                              ("gather", "gather_comm_fraction", statistics.fmean)):
        if kind in s:
            by_rank = {k: reduce(v) for k, v in s[kind].items()}
            values[sig] = max(by_rank.values())
            per_rank[sig] = [_rv(k, v) for k, v in by_rank.items()]
    if "sps" in s:
        values["samples_per_second"] = statistics.median([x for v in s["sps"].values() for x in v])
    if "step" in s:
        cvs = [statistics.pstdev(v) / statistics.fmean(v) for v in s["step"].values()
               if len(v) >= 2 and statistics.fmean(v) > 0]
        values["step_time_jitter"] = max(cvs) if cvs else None
    if "bubble" in s:
        by_rank = {k: statistics.fmean(v) for k, v in s["bubble"].items()}
        values["bubble_fraction_measured"] = statistics.fmean(by_rank.values())
        if "ideal" in s:
            ideal = statistics.fmean([x for v in s["ideal"].values() for x in v])
            values["bubble_fraction_ideal"] = ideal
            values["bubble_fraction_excess"] = values["bubble_fraction_measured"] - ideal
            per_rank["bubble_fraction_excess"] = [_rv(k, v - ideal) for k, v in by_rank.items()]
    if "imbalance" in s:
        values["stage_compute_imbalance"] = statistics.median([x for v in s["imbalance"].values() for x in v])
    stages = {k[1] for series in s.values() for k in series if k[1]}
    if stages:
        values["pipeline_stages"] = float(len(stages))
    unavailable = {sig: "not in this Prometheus export" for sig in ALL_SIGNALS if values.get(sig) is None}
    if "frag" not in s:
        unavailable["memory_fragmentation_ratio"] = FRAGMENTATION_NOT_AVAILABLE
    t = _int(trial)
    # The exported stage imbalance answers the bottleneck question; the device lead is for logs without it.
    return SignalSet(subject=f"trial {trial}" if trial else "prometheus export", kind="metrics", trial=t,
                     values=values, per_rank=per_rank, unavailable=unavailable,
                     not_needed=frozenset(LEAD_SIGNALS) if "imbalance" in s else frozenset())
