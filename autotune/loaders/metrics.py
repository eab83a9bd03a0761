"""Our metrics CSV, read column-wise and summarised with numpy.

`autotune advise` must analyse a 1,000,000-row file in at most twice the time
pandas needs just to read it, so this path never builds one object per row.
The signal definitions are those of `autotune.summary.summarize` (tests check
that both give the same TrialSummary); the columnar parser is pandas' C reader
when pandas is installed, else the standard csv module (same results, slower).
"""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

import numpy as np

from autotune.errors import InputFileError
from autotune.loaders.detect import read_header
from autotune.schema import CSV_COLUMNS, REQUIRED_COLUMNS, StepRecord
from autotune.summary import (
    RankSummary,
    TrialSummary,
    bubble_fraction,
    host_bound_fraction,
    ideal_bubble_fraction,
)

NUMERIC_COLUMNS = tuple(c for c in CSV_COLUMNS if c not in ("device", "host"))
NEEDED_COLUMNS = tuple(
    f.name for f in dataclasses.fields(StepRecord)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)
"""Columns without a default: every row must have a number there."""
INT_COLUMNS = ("trial", "rank", "stage", "step", "warmup", "micro_batch_size",
               "gradient_accumulation_steps", "pipeline_stages", "data_parallel_size")

SUMMARY_COLUMNS = frozenset({
    "trial", "rank", "stage", "step", "warmup", "step_seconds", "compute_seconds", "comm_seconds",
    "wait_seconds", "device_utilization", "memory_fragmentation_ratio", "loss", "micro_batch_size",
    "gradient_accumulation_steps", "reduce_bucket_size", "pipeline_stages", "data_parallel_size",
    "seq_length", "memory_peak_bytes", "memory_reserved_bytes", "optimizer_seconds",
    "utilization_from_device",
})
"""The columns summarize reads; the others are only validated."""

Columns = dict[str, np.ndarray]


def load_summaries(path: str | Path) -> list[TrialSummary]:
    """Every trial's summary in a metrics CSV (warm-up rows excluded)."""
    cols = read_columns(path)
    out = summarize_columns(cols, source=str(path))
    if not out:
        raise InputFileError(f"{path}: no measured (non-warm-up) step in the file")
    return out


def read_columns(path: str | Path) -> Columns:
    """The numeric columns as float64 arrays; one-line InputFileError on any bad cell."""
    header = read_header(path)
    missing = [c for c in dict.fromkeys((*REQUIRED_COLUMNS, *NEEDED_COLUMNS)) if c not in header]
    if missing:
        raise InputFileError(f"{path}: not an autotune metrics CSV, missing columns: {', '.join(missing)}")
    if len(set(header)) != len(header):
        raise InputFileError(f"{path}: duplicate column names in the header")
    use = [c for c in NUMERIC_COLUMNS if c in header]
    try:
        import pandas  # noqa: F401  (optional accelerator: its C parser)
    except ImportError:
        cols = _read_stdlib(path, header, use)
    else:
        cols = _read_pandas(path, header, use)
    _validate(path, cols)
    return cols


def _read_pandas(path: str | Path, header: list[str], use: list[str]) -> Columns:
    import pandas as pd

    # Every column, each in the type pandas infers: faster than `usecols` plus a forced
    # float dtype (integers parse faster than floats), and the inferred type doubles as
    # the check: text, or TRUE/false read as booleans, leave a column non-numeric.
    try:
        df = pd.read_csv(path, engine="c", encoding="utf-8", keep_default_na=False, na_values=[""])
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError, OverflowError):
        return _read_stdlib(path, header, use)  # the slow path names the bad line
    if any(df[c].dtype.kind not in "iuf" for c in use):
        return _read_stdlib(path, header, use)  # it refuses the cell with its line number
    return {c: df[c].to_numpy(dtype=np.float64) for c in use}


def _read_stdlib(path: str | Path, header: list[str], use: list[str]) -> Columns:
    idx = [header.index(c) for c in use]
    data: list[list[float]] = [[] for _ in use]
    line = 1
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            next(reader, None)
            for line, row in enumerate(reader, start=2):
                if not row:
                    continue
                if len(row) > len(header):
                    raise InputFileError(f"{path}: line {line}: {len(row)} cells, header has {len(header)}")
                for out, i in zip(data, idx, strict=True):
                    cell = row[i].strip() if i < len(row) else ""
                    out.append(float(cell) if cell else math.nan)
    except ValueError as exc:
        raise InputFileError(f"{path}: line {line}: non-numeric cell ({exc})") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise InputFileError(f"{path}: line {line}: unreadable ({exc.__class__.__name__})") from None
    return {c: np.asarray(v, dtype=np.float64) for c, v in zip(use, data, strict=True)}


def _validate(path: str | Path, cols: Columns) -> None:
    n = len(cols["time"])
    if n == 0:
        raise InputFileError(f"{path}: header only, no data rows")
    for c in NEEDED_COLUMNS:
        bad = ~np.isfinite(cols[c])
        if bad.any():
            raise InputFileError(f"{path}: line {int(np.argmax(bad)) + 2}: column {c} is empty or not a finite number")
    for c in INT_COLUMNS:
        low = -1 if c == "trial" else 0  # trial -1: written outside a study (instrument()'s default)
        bad = (cols[c] != np.floor(cols[c])) | (cols[c] < low)
        if bad.any():
            what = "an integer >= -1" if low else "a non-negative integer"
            raise InputFileError(f"{path}: line {int(np.argmax(bad)) + 2}: column {c} must be {what}")
    for c in ("micro_batch_size", "gradient_accumulation_steps", "pipeline_stages", "data_parallel_size"):
        if (cols[c] < 1).any():
            raise InputFileError(f"{path}: line {int(np.argmax(cols[c] < 1)) + 2}: column {c} must be >= 1")
    for c in NUMERIC_COLUMNS:
        if c in cols and np.isinf(cols[c]).any():
            raise InputFileError(f"{path}: line {int(np.argmax(np.isinf(cols[c]))) + 2}: column {c} is infinite")


def _int_or_zero(value: float) -> int:
    """An optional integer cell: empty (NaN) means not recorded, read as 0 as the row-wise summary does."""
    return int(value) if math.isfinite(value) else 0


def summarize_columns(cols: Columns, source: str = "metrics") -> list[TrialSummary]:
    """Column-wise twin of `autotune.summary.summarize` (same definitions, numpy speed)."""
    cols = {k: v for k, v in cols.items() if k in SUMMARY_COLUMNS}
    order = np.argsort(cols["trial"], kind="stable")
    trials = cols["trial"][order]
    cuts = np.flatnonzero(np.diff(trials)) + 1
    out = []
    for rows in np.split(order, cuts):
        part = {k: v[rows] for k, v in cols.items()}
        s = _summarize_trial(part, source)
        if s is not None:
            out.append(s)
    return out


def _opt(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def _summarize_trial(c: Columns, source: str) -> TrialSummary | None:
    warm = c["warmup"] != 0
    meas = ~warm
    if not meas.any():
        return None
    i0 = int(np.argmax(meas))
    first = {k: v[i0] for k, v in c.items()}
    warm_steps = int(np.count_nonzero(warm & (c["rank"] == first["rank"])))
    m = {k: v[meas] for k, v in c.items()}

    _, sinv = np.unique(m["step"], return_inverse=True)
    step_secs = np.full(int(sinv.max()) + 1, -np.inf)
    np.maximum.at(step_secs, sinv, m["step_seconds"])
    micro, gas, dp = int(first["micro_batch_size"]), int(first["gradient_accumulation_steps"]), int(first["data_parallel_size"])
    stages = int(first["pipeline_stages"])
    sps = (micro * gas * dp) / step_secs[step_secs > 0]
    if sps.size == 0:
        raise InputFileError(f"{source}: trial {int(first['trial'])}: no step with step_seconds > 0")

    ranks, r_first, rinv = np.unique(m["rank"], return_index=True, return_inverse=True)
    n = np.bincount(rinv).astype(np.float64)
    sums = {k: np.bincount(rinv, weights=m[k]) for k in
            ("compute_seconds", "comm_seconds", "wait_seconds", "step_seconds", "device_utilization")}
    util_mean = sums["device_utilization"] / n
    util_std = np.sqrt(np.bincount(rinv, weights=(m["device_utilization"] - util_mean[rinv]) ** 2) / n)
    comp, comm, wait, total = (sums[k] for k in ("compute_seconds", "comm_seconds", "wait_seconds", "step_seconds"))
    opt_col = np.nan_to_num(m["optimizer_seconds"]) if "optimizer_seconds" in m else np.zeros_like(m["step_seconds"])
    opt = np.bincount(rinv, weights=opt_col, minlength=len(n))
    rank_stage = m["stage"][r_first].astype(int)
    # Host-bound share: only over steps whose utilization is the device's own counter.
    dev = (m["utilization_from_device"] == 1) if "utilization_from_device" in m else np.zeros(len(rinv), bool)
    busy = np.where(m["step_seconds"] > 0, np.minimum(1.0, m["compute_seconds"] / np.where(
        m["step_seconds"] > 0, m["step_seconds"], 1.0)), 0.0)
    n_dev = np.bincount(rinv, weights=dev, minlength=len(n))
    util_dev = np.bincount(rinv, weights=m["device_utilization"] * dev, minlength=len(n))
    busy_dev = np.bincount(rinv, weights=busy * dev, minlength=len(n))
    rank_rows = []
    for k, rank in enumerate(ranks):
        rank_rows.append(RankSummary(
            rank=int(rank), stage=int(rank_stage[k]), steps=int(n[k]),
            device_utilization_mean=float(util_mean[k]),
            device_utilization_fluctuation=float(util_std[k]) if n[k] >= 2 else None,
            comm_compute_ratio=float((comm[k] + wait[k]) / comp[k]) if comp[k] > 0 else None,
            compute_seconds_mean=float(comp[k] / n[k]),
            schedule_compute_seconds_mean=float((comp[k] - opt[k]) / n[k]), comm_seconds_mean=float(comm[k] / n[k]),
            wait_seconds_mean=float(wait[k] / n[k]),
            bubble_fraction=bubble_fraction(float(comp[k]), float(total[k]), float(opt[k])),
            wait_fraction=float(wait[k] / total[k]) if total[k] > 0 else 0.0,
            host_bound_fraction=host_bound_fraction(float(util_dev[k] / n_dev[k]), float(busy_dev[k] / n_dev[k]))
            if n_dev[k] else None,
        ))

    stage_ids = sorted(set(rank_stage.tolist()))
    stage_means = [float(np.mean([r.schedule_compute_seconds_mean for r in rank_rows if r.stage == s]))
                   for s in stage_ids]
    mean_comp = float(np.mean(stage_means))
    imbalance = max(stage_means) / mean_comp if mean_comp > 0 else 1.0
    slowest = stage_ids[stage_means.index(max(stage_means))]

    frag = []
    for k in range(len(ranks)):
        v = m["memory_fragmentation_ratio"][rinv == k] if "memory_fragmentation_ratio" in m else np.empty(0)
        v = v[~np.isnan(v)]
        if v.size:
            frag.append(float(np.median(v)))
    losses = m["loss"][np.argsort(m["step"], kind="stable")] if "loss" in m else np.empty(0)
    losses = losses[~np.isnan(losses)]
    ratios = [r.comm_compute_ratio for r in rank_rows if r.comm_compute_ratio is not None]
    transfer = [float(comm[k] / comp[k]) for k in range(len(ranks)) if comp[k] > 0]
    flucts = [r.device_utilization_fluctuation for r in rank_rows if r.device_utilization_fluctuation is not None]
    means = np.array([r.device_utilization_mean for r in rank_rows])
    mean_step = float(np.mean(step_secs))
    try:
        ideal = ideal_bubble_fraction(stages, gas)
    except ValueError as exc:
        raise InputFileError(f"{source}: trial {int(first['trial'])}: {exc}") from None
    median_sps = float(np.median(sps))
    bucket = first.get("reduce_bucket_size", math.nan)
    return TrialSummary(
        trial=int(first["trial"]), steps=int(step_secs.size), warmup_steps=warm_steps,
        micro_batch_size=micro, gradient_accumulation_steps=gas,
        reduce_bucket_size=None if math.isnan(bucket) else int(bucket),
        pipeline_stages=stages, data_parallel_size=dp,
        samples_per_second=median_sps,
        samples_per_second_p10=float(np.quantile(sps, 0.1)),
        samples_per_second_p90=float(np.quantile(sps, 0.9)),
        tokens_per_second=median_sps * _int_or_zero(first.get("seq_length", math.nan)),
        step_seconds=float(np.median(step_secs)),
        step_time_jitter=float(np.std(step_secs) / mean_step) if step_secs.size > 1 and mean_step > 0 else 0.0,
        device_utilization_mean=float(np.mean(means)),
        device_utilization_fluctuation=max(flucts) if flucts else None,
        cross_device_fluctuation=float(np.std(means)) if len(rank_rows) > 1 else None,
        comm_compute_ratio=max(ratios) if ratios else None,
        comm_compute_ratio_mean=float(np.mean(ratios)) if ratios else None,
        transfer_compute_ratio=max(transfer) if transfer else None,
        bubble_fraction_measured=float(np.mean([r.bubble_fraction for r in rank_rows])),
        bubble_fraction_ideal=ideal,
        stage_compute_imbalance=imbalance, slowest_stage=slowest, stage_compute_seconds=stage_means,
        memory_fragmentation_ratio=max(frag) if frag else None,
        memory_peak_bytes=_nanmax(m, "memory_peak_bytes"),
        memory_reserved_bytes=_nanmax(m, "memory_reserved_bytes"),
        loss_first=float(losses[0]) if losses.size else None,
        loss_last=float(losses[-1]) if losses.size else None,
        ranks=rank_rows,
        host_bound_fraction=max(hb) if (hb := [r.host_bound_fraction for r in rank_rows
                                                if r.host_bound_fraction is not None]) else None,
    )


def _nanmax(m: Columns, name: str) -> float | None:
    v = m.get(name)
    if v is None:
        return None
    v = v[~np.isnan(v)]
    return float(v.max()) if v.size else None
