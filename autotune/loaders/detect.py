"""Recognise an input file's format from its header line (a trace from its name: .json, .json.gz).

Reads only the first block of the file, so a 1 GB CSV costs nothing here;
binary and empty files are refused with one line.
"""

from __future__ import annotations

import csv
from pathlib import Path

from autotune.core.errors import InputFileError

METRICS = "metrics"
NVIDIA_SMI = "nvidia-smi"
PROMETHEUS = "prometheus"
TRACE = "trace"
"""A torch.profiler (Kineto) Chrome-trace JSON, .json or .json.gz (autotune/traces/)."""
FORMATS = (METRICS, NVIDIA_SMI, PROMETHEUS, TRACE)


def read_header(path: str | Path) -> list[str]:
    """The first line as CSV cells, stripped; InputFileError for missing/empty/binary files."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            head = fh.read(65536)
    except FileNotFoundError:
        raise InputFileError(f"{p}: no such file") from None
    except OSError as exc:
        raise InputFileError(f"{p}: cannot open ({exc.strerror})") from None
    if not head.strip():
        raise InputFileError(f"{p}: the file is empty")
    if b"\x00" in head:
        raise InputFileError(f"{p}: a binary file, not a CSV")
    try:
        text = head.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not just a multi-byte char cut at the block end
            raise InputFileError(f"{p}: not a UTF-8 text file") from None
        text = head[:exc.start].decode("utf-8-sig")
    first = text.splitlines()[0] if text.splitlines() else ""
    try:
        cells = next(csv.reader([first]), [])
    except csv.Error:
        raise InputFileError(f"{p}: the first line is not a CSV header") from None
    return [c.strip() for c in cells]


def detect_format(path: str | Path) -> str:
    from autotune.traces.reader import is_trace_path

    if is_trace_path(path):  # JSON, not a CSV: its content is checked as it is read
        if not Path(path).is_file():
            raise InputFileError(f"{path}: no such file")
        return TRACE
    header = read_header(path)
    names = {h.split(" [")[0] for h in header}
    if {"step_seconds", "rank", "trial"} <= names:
        return METRICS
    if "utilization.gpu" in names:
        return NVIDIA_SMI
    if "value" in names and ({"metric", "__name__"} & names):
        return PROMETHEUS
    shown = ",".join(header)[:80]
    raise InputFileError(
        f"{path}: unrecognised header {shown!r}; expected an autotune metrics CSV, nvidia-smi "
        "--format=csv output, a Prometheus export with metric,...,value columns, or a torch.profiler "
        "trace (.json, .json.gz)")


def read_rows(path: str | Path, what: str) -> list[list[str]]:
    """All rows of a small CSV (nvidia-smi, Prometheus export); one-line errors."""
    p = Path(path)
    try:
        with open(p, newline="", encoding="utf-8-sig") as fh:
            rows = list(csv.reader(fh))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise InputFileError(f"{p}: unreadable {what} CSV ({exc.__class__.__name__})") from None
    if not rows:
        raise InputFileError(f"{p}: the file is empty")
    return rows
