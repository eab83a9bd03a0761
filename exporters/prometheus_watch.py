"""The controller endpoint of `autotune watch`: the advisor's current findings on the watched job.

A custom Collector over a small state, like the run's ControllerExporter. Each finding
that holds now is one series of value 1; a finding that no longer holds disappears
(Prometheus marks it stale), so `autotune_watch_finding == 1` alerts and panels follow
the job as it changes.

    ctl = WatchExporter(job="gpt-pipe")
    ctl.serve(port=9700)
    ctl.set_findings([("bubble-above-ideal", "warning")])
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporters.endpoint import Endpoint, serve_registry
from exporters.prometheus_controller import DEFAULT_CONTROLLER_PORT


class WatchExporter:
    """Collector of the watched job's findings; every series carries the `job` label."""

    def __init__(self, *, job: str = "autotune", registry: CollectorRegistry | None = None) -> None:
        self.job = job
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._findings: list[tuple[str, str]] = []
        self._evaluations = 0
        self._last: float | None = None
        self.endpoint: Endpoint | None = None
        self.registry.register(self)

    def set_findings(self, findings: Iterable[tuple[str, str]]) -> None:
        """The (rule id, severity) pairs that hold after this evaluation."""
        with self._lock:
            self._findings = sorted(set(findings))
            self._evaluations += 1
            self._last = time.time()

    def serve(self, addr: str = "127.0.0.1", port: int = DEFAULT_CONTROLLER_PORT, *,
              tries: int = 8) -> str | None:
        """Serve on addr:port (fallback port+1, +2, ... on conflict); URL or None. Never raises."""
        self.endpoint = serve_registry(self.registry, addr=addr, port=port, tries=tries,
                                       what="controller metrics")
        return self.endpoint.url if self.endpoint else None

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            findings, evaluations, last = list(self._findings), self._evaluations, self._last
        g = GaugeMetricFamily("autotune_watch_finding",
                              "An advisor finding that holds on the watched job now (value 1).",
                              labels=["job", "rule", "severity"])
        for rule, severity in findings:
            g.add_metric([self.job, rule, severity], 1)
        yield g
        c = CounterMetricFamily("autotune_watch_evaluations", "Advisor evaluations of the watched job's metrics.",
                                labels=["job"])
        c.add_metric([self.job], evaluations)
        yield c
        if last is not None:
            g = GaugeMetricFamily("autotune_watch_last_evaluation_timestamp_seconds",
                                  "Unix time of the last advisor evaluation.", labels=["job"])
            g.add_metric([self.job], last)
            yield g
