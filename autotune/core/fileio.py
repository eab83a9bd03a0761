"""Writing a file so that readers see the old or the new one, never half of either.

The one atomic writer: the study's outputs, `advise --write-config`, the HTML report.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from autotune.core.faults import crash_point

_writes = 0
"""Atomic writes so far in this process (the kill-and-resume tests crash inside the K-th)."""


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write `data` (text as UTF-8) to a temporary file beside `path`, fsync it, then rename it
    over `path`. OSError reaches the caller, which says what could not be written."""
    global _writes
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the file it replaces was readable
        _writes += 1
        crash_point("write", _writes)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    """The rename itself survives a power cut only once the folder is synced."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
