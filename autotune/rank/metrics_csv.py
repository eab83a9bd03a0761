"""Write the project's own metrics CSV (schema in autotune.core.schema), one row per step.

Reading it is `autotune.loaders.metrics`' job (`read_records`): a rank never reads one back.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import TextIO

from autotune.core.schema import CSV_COLUMNS, StepRecord, record_to_row


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
