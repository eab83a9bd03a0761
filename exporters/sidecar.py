"""A rank's metrics endpoint served from a child process, off the training process's GIL.

In the training process an endpoint's HTTP handling costs about 1 ms of CPU per
scrape under the GIL (benchmarks/scrape_load.py: 2-4 % step time with 50
scrapers a second on a CPU workload). Here the training process only writes
each step's record as one JSON line into a pipe; a child process runs the same
`RankExporter` on those records and serves it. Same metrics, same labels, same
port rules (the child inherits LOCAL_RANK / LOCAL_WORLD_SIZE).

Side-channel rules hold: the pipe is non-blocking, so a slow or dead child
drops records (counted in `dropped`) instead of stalling a step; when the
training process exits or dies, the pipe closes and the child ends with it.

    exporter = start_sidecar_exporter(port=9710, labels={"job": "gpt-pipe"})
    for record in steps: exporter.write(record)
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import select
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from autotune.core.schema import StepRecord
from exporters.endpoint import warn
from exporters.prometheus_rank import DEFAULT_BUCKETS, DEFAULT_WINDOW, RankExporter

START_TIMEOUT = 20.0
"""Seconds to wait for the child to say where it serves (import + bind)."""
_ROOT = Path(__file__).resolve().parent.parent


class SidecarExporter:
    """The training-process half: a sink (`write`, `close`) whose endpoint lives in a child."""

    def __init__(self, *, labels: Mapping[str, object] | None = None, window: int = DEFAULT_WINDOW,
                 buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        self.labels = {k: str(v) for k, v in (labels or {}).items()}
        self.window, self.buckets = window, list(buckets)
        self.url: str | None = None
        self.dropped = 0
        self._proc: subprocess.Popen | None = None
        self._fd: int | None = None

    def serve(self, addr: str = "127.0.0.1", port: int | None = None, *, tries: int = 8) -> str | None:
        """Start the child; return its URL, or None (with a warning) when it could not serve."""
        spec = json.dumps({"labels": self.labels, "window": self.window, "buckets": self.buckets,
                           "addr": addr, "port": port, "tries": tries})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "exporters.sidecar", spec], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, env=env)  # stderr: the rank's own (warnings land in its log)
        except OSError as exc:
            warn(f"metrics endpoint disabled: cannot start its process ({exc.strerror or exc})")
            return None
        self.url = self._read_url()
        if self.url is None:
            self.close()
            return None
        print(f"metrics: {self.url}", flush=True)
        self._fd = self._proc.stdin.fileno()
        os.set_blocking(self._fd, False)
        return self.url

    def _read_url(self) -> str | None:
        """The child's first line: `metrics: URL`, or `disabled` (it warned why on stderr)."""
        out = self._proc.stdout
        ready, _, _ = select.select([out], [], [], START_TIMEOUT)
        line = out.readline().decode(errors="replace").strip() if ready else ""
        if line.startswith("metrics: "):
            return line.removeprefix("metrics: ")
        if not line.startswith("disabled"):
            warn(f"metrics endpoint disabled: its process did not start within {START_TIMEOUT:g} s")
        return None

    def write(self, record: StepRecord) -> None:
        """One step's record into the pipe; never blocks, never raises into training.

        A pipe write of at most PIPE_BUF bytes is atomic: it lands whole or not at
        all, so a line never arrives half-written (a record line is under 1 KB).
        """
        if self._fd is None:
            return
        data = (json.dumps(dataclasses.asdict(record)) + "\n").encode()
        if len(data) > select.PIPE_BUF:  # could land in pieces: not worth a stall
            self.dropped += 1
            return
        try:
            os.write(self._fd, data)
        except BlockingIOError:
            self.dropped += 1  # the child is behind: the next record carries the state on
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise
            warn("metrics endpoint process ended; training continues without live metrics")
            self._fd = None

    def close(self) -> None:
        """End the child (closing its stdin ends it) and free the port."""
        self._fd = None
        if self._proc is None:
            return
        for pipe in (self._proc.stdin, self._proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None


def start_sidecar_exporter(*, addr: str = "127.0.0.1", port: int | None = None,
                           labels: Mapping[str, object] | None = None) -> SidecarExporter | None:
    """Create and serve a SidecarExporter; None when no endpoint could be served."""
    exporter = SidecarExporter(labels=labels)
    return exporter if exporter.serve(addr=addr, port=port) else None


def _child(spec: dict) -> int:
    """The child: a RankExporter fed from stdin, serving until stdin closes."""
    exporter = RankExporter(labels=spec["labels"], window=spec["window"], buckets=spec["buckets"])
    url = exporter.serve(addr=spec["addr"], port=spec["port"], tries=spec["tries"])  # prints its URL
    if url is None:
        print("disabled", flush=True)
        return 0
    fields = {f.name for f in dataclasses.fields(StepRecord)}
    for line in sys.stdin.buffer:
        try:
            values = json.loads(line)
            exporter.write(StepRecord(**{k: v for k, v in values.items() if k in fields}))
        except (ValueError, TypeError):
            continue  # a damaged line costs one step of metrics, never the endpoint
    exporter.close()
    return 0


if __name__ == "__main__":
    sys.exit(_child(json.loads(sys.argv[1])))
