"""Our metrics CSV, read column-wise: the one reader, with the one validation.

pandas' C parser reads the file; a file it refuses goes through the standard
csv module, which names the bad line. `autotune.core.summary.summarize_columns`
summarises what this returns; `read_records` gives StepRecords for the callers
that want rows (the live exporter's tests, the report's per-step plots).
"""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

import numpy as np

from autotune.core.errors import InputFileError
from autotune.core.schema import (
    CSV_COLUMNS,
    REQUIRED_COLUMNS,
    TEXT_COLUMNS,
    StepRecord,
    record_from_values,
)
from autotune.core.summary import Columns, TrialSummary, summarize_columns
from autotune.loaders.detect import read_header

NUMERIC_COLUMNS = tuple(c for c in CSV_COLUMNS if c not in TEXT_COLUMNS)
NEEDED_COLUMNS = tuple(
    f.name for f in dataclasses.fields(StepRecord)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)
"""Columns without a default: every row must have a number there."""
INT_COLUMNS = ("trial", "rank", "stage", "step", "warmup", "micro_batch_size",
               "gradient_accumulation_steps", "pipeline_stages", "data_parallel_size")


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


def read_trial_columns(paths: list[Path]) -> Columns:
    """One trial's per-rank CSVs as one table (each file read and validated on its own)."""
    parts = [read_columns(p) for p in paths]
    names = set.intersection(*(set(p) for p in parts)) if parts else set()
    return {n: np.concatenate([p[n] for p in parts]) for n in names}


def read_records(path: str | Path) -> list[StepRecord]:
    """The file as StepRecords, through the same reader and validation as the summaries."""
    cols = read_columns(path)
    text = read_text_columns(path, [c for c in TEXT_COLUMNS if c in read_header(path)])
    names = list(cols)
    out = []
    for i in range(len(cols["time"])):
        values: dict[str, object] = {n: cols[n][i] for n in names}
        values.update({n: v[i] for n, v in text.items()})
        out.append(record_from_values(values))
    return out


def read_text_columns(path: str | Path, names: list[str]) -> dict[str, list[str]]:
    """The text columns (device, host) that the numeric reader leaves out."""
    if not names:
        return {}
    with open(path, newline="", encoding="utf-8-sig") as fh:
        rows = list(csv.DictReader(fh))
    return {n: [(r.get(n) or "").strip() for r in rows] for n in names}

