"""Stream a Kineto Chrome-trace JSON: its metadata, then its events one at a time.

Why streamed: a trace of a few steps of a large job is gigabytes of JSON, and `json.load`
holds it as Python objects at 5-10x its size. Here the file is read in 4 MB blocks and each
value is decoded where it starts with the standard library's C scanner, so only one block
and one event are held at a time (benchmarks/bench_traces.py measures this reader against
ijson, the streaming parser one would reach for, and against HTA's loader).

The top level is an object with `traceEvents` (the events) and metadata keys around it
(`distributedInfo`, `deviceProperties`, `schemaVersion`, ...), in any order. What is not a
trace is refused in one line naming the file: a 0-byte file, a truncated or corrupt gzip
stream, JSON that is not an object with `traceEvents`.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from autotune.core.errors import InputFileError

BLOCK = 4 << 20
"""Characters read at a time."""
LOOKAHEAD = 1 << 20
"""Characters kept ahead of the decoder, so a number or a name is never cut at a block's end."""
MAX_EVENT = 64 << 20
"""An event larger than this is not an event: the file is corrupt."""
TRACE_SUFFIXES = (".json", ".json.gz")

_SKIP = re.compile(r"[\s,]*")
_SCAN: Callable[[str, int], tuple[Any, int]] = json.decoder.JSONDecoder().scan_once  # type: ignore[attr-defined]
"""The C scanner: (value, end) for the JSON value starting at an index; StopIteration if none."""


def is_trace_path(path: str | Path) -> bool:
    name = str(path).lower()
    return name.endswith(TRACE_SUFFIXES)


class TraceFile:
    """One trace file. `events()` streams the events (once); `meta` holds every top-level key
    but `traceEvents`, the ones after the events too once `events()` has run to its end."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.meta: dict[str, Any] = {}
        self._fh: TextIO | None = None
        self._buf = ""
        self._pos = 0
        self._eof = False
        self._open()
        try:
            self._read_to_events()
        except BaseException:
            self.close()
            raise

    # -- reading ------------------------------------------------------------------------------
    def _error(self, what: str) -> InputFileError:
        return InputFileError(f"{self.path}: {what}")

    def _open(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise self._error("no such file") from None
        except OSError as exc:
            raise self._error(f"cannot open ({exc.strerror})") from None
        if size == 0:
            raise self._error("the file is empty (0 bytes)")
        raw = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        gz = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        stream: Any = gzip.GzipFile(fileobj=raw) if gz else raw
        self._gz = gz
        self._fh = io.TextIOWrapper(stream, encoding="utf-8", errors="strict")

    def _more(self) -> bool:
        """Read a block onto the buffer (dropping what was decoded); False at the end."""
        if self._eof or self._fh is None:
            return False
        try:
            block = self._fh.read(BLOCK)
        except (gzip.BadGzipFile, EOFError, zlib.error, OSError) as exc:
            kind = "a truncated or corrupt gzip stream" if self._gz else "unreadable"
            raise self._error(f"{kind} ({exc})") from None
        except UnicodeDecodeError:
            raise self._error("not UTF-8 text: not a trace") from None
        if not block:
            self._eof = True
            return False
        self._buf = self._buf[self._pos:] + block
        self._pos = 0
        return True

    def _ahead(self) -> None:
        while not self._eof and len(self._buf) - self._pos < LOOKAHEAD:
            self._more()

    def _skip(self) -> None:
        self._ahead()
        self._pos = _SKIP.match(self._buf, self._pos).end()  # type: ignore[union-attr]

    def _peek(self) -> str:
        self._skip()
        return self._buf[self._pos] if self._pos < len(self._buf) else ""

    def _expect(self, ch: str, what: str) -> None:
        if self._peek() != ch:
            raise self._error(what)
        self._pos += 1

    def _value(self) -> Any:
        """The JSON value at the cursor, read whole (more blocks if it runs past the buffer)."""
        self._skip()
        start_len = len(self._buf) - self._pos
        while True:
            try:
                value, end = _SCAN(self._buf, self._pos)
            except StopIteration:
                value, end = None, -1
            except ValueError:  # json.JSONDecodeError: cut at the buffer's end, or corrupt
                value, end = None, -1
            if end >= 0 and (end < len(self._buf) or self._eof):
                self._pos = end
                return value
            if len(self._buf) - self._pos > start_len + MAX_EVENT or not self._more():
                raise self._error("the JSON is truncated or corrupt (a value does not end)")

    def _read_to_events(self) -> None:
        self._skip()
        if not self._buf[self._pos:]:
            raise self._error("no JSON in the file")
        if self._peek() != "{":
            raise self._error("not a trace: the JSON is not an object with traceEvents")
        self._pos += 1
        while True:
            ch = self._peek()
            if ch == "}" or ch == "":
                raise self._error("not a trace: no traceEvents in the JSON "
                                  "(record one with torch.profiler and tensorboard_trace_handler)")
            key = self._value()
            if not isinstance(key, str):
                raise self._error("not a trace: the JSON is corrupt")
            self._expect(":", "the JSON is corrupt (':' expected)")
            if key == "traceEvents":
                self._expect("[", "not a trace: traceEvents is not a list")
                return
            self.meta[key] = self._value()

    def events(self) -> Iterator[dict[str, Any]]:
        """Each event of `traceEvents`, in file order; then the metadata after them is read."""
        scan, skip = _SCAN, _SKIP
        while True:
            if len(self._buf) - self._pos < LOOKAHEAD:
                self._ahead()
            pos = skip.match(self._buf, self._pos).end()  # type: ignore[union-attr]
            self._pos = pos
            if pos >= len(self._buf):
                raise self._error("the JSON is truncated (traceEvents does not end)")
            if self._buf[pos] == "]":
                self._pos = pos + 1
                break
            try:  # an event is an object: once it decodes, it is whole
                event, end = scan(self._buf, pos)
            except (StopIteration, ValueError):
                event = self._value()  # cut at the block's end: the slow path reads more, or says what is wrong
                end = self._pos
            self._pos = end
            if isinstance(event, dict):
                yield event
        self._read_rest()

    def _read_rest(self) -> None:
        while True:
            ch = self._peek()
            if ch == "}":
                return
            if ch == "":
                raise self._error("the JSON is truncated (the top-level object does not end)")
            key = self._value()
            self._expect(":", "the JSON is corrupt (':' expected)")
            self.meta[str(key)] = self._value()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> TraceFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
