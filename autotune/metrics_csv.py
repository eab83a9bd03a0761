"""Read and write the project's own metrics CSV (schema in autotune.schema)."""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from autotune.errors import InputFileError
from autotune.schema import CSV_COLUMNS, REQUIRED_COLUMNS, StepRecord, record_to_row, row_to_record


class CsvSink:
    """Appends StepRecords to a CSV file, one row per step, flushed so a crash loses at most one row."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._fh: TextIO = open(self.path, "a", newline="", encoding="utf-8")
        self._writer = csv.writer(self._fh)
        if new:
            self._writer.writerow(CSV_COLUMNS)
            self._fh.flush()

    def write(self, record: StepRecord) -> None:
        self._writer.writerow(record_to_row(record))
        self._fh.flush()

    def close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()


def read_metrics_csv(path: str | Path) -> list[StepRecord]:
    return list(iter_metrics_csv(path))


def iter_metrics_csv(path: str | Path) -> Iterator[StepRecord]:
    p = Path(path)
    try:
        fh = open(p, newline="", encoding="utf-8")
    except OSError as exc:
        raise InputFileError(f"{p}: cannot open ({exc.strerror})") from None
    with fh:
        reader = csv.DictReader(fh)
        try:
            header = reader.fieldnames or []
        except (UnicodeDecodeError, csv.Error):
            raise InputFileError(f"{p}: not a UTF-8 CSV file") from None
        missing = [c for c in REQUIRED_COLUMNS if c not in header]
        if missing:
            raise InputFileError(f"{p}: not an autotune metrics CSV, missing columns: {', '.join(missing)}")
        line = 1
        try:
            for line, row in enumerate(reader, start=2):  # noqa: B007 - used in the error
                yield row_to_record(row)
        except (ValueError, TypeError, OverflowError) as exc:
            raise InputFileError(f"{p}: line {line}: bad value ({exc})") from None
        except (UnicodeDecodeError, csv.Error) as exc:
            raise InputFileError(f"{p}: line {line}: unreadable ({exc.__class__.__name__})") from None
