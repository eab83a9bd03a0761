"""Trial-level metrics of `autotune run`, served by the controller process.

The ranks of a trial come and go with each launch; the controller lives for
the whole study, so it owns the tuning history: which trial runs with which
configuration, how each ended, the best throughput so far and which advisor
rules fired. Like the rank exporter it is a custom Collector over a small
state guarded by a lock, registered on its own registry.

Usage (what the tuning loop does)::

    ctl = ControllerExporter(job="gpt-pipe")
    ctl.serve()                       # prints "controller metrics: http://127.0.0.1:9700/metrics"
    ctl.trial_started(3, config)
    ctl.trial_finished(3, config, status="ok", samples_per_second=41.2,
                       summary=trial_summary, rules_fired=["bubble-above-ideal"])
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from autotune.core.space import TrialConfig
from autotune.core.summary import TrialSummary
from exporters.endpoint import Endpoint, serve_registry

DEFAULT_CONTROLLER_PORT = 9700

_SIGNALS: tuple[tuple[str, str, str], ...] = (
    # (metric name, TrialSummary field, help)
    ("autotune_last_trial_samples_per_second", "samples_per_second",
     "Median samples/s of the last finished trial."),
    ("autotune_last_trial_device_utilization_ratio", "device_utilization_mean",
     "Mean device utilization of the last trial, 0-1."),
    ("autotune_last_trial_device_utilization_fluctuation_ratio", "device_utilization_fluctuation",
     "Worst per-rank utilization fluctuation (population std) of the last trial."),
    ("autotune_last_trial_comm_compute_ratio", "comm_compute_ratio",
     "Worst per-rank comm (transfer only) / compute of the last trial."),
    ("autotune_last_trial_memory_fragmentation_ratio", "memory_fragmentation_ratio",
     "Worst rank's 1 - allocated/reserved of the last trial; absent on CPU."),
    ("autotune_last_trial_bubble_measured_ratio", "bubble_fraction_measured",
     "Mean over ranks of the idle share 1 - compute/step in the last trial."),
    ("autotune_last_trial_bubble_ideal_ratio", "bubble_fraction_ideal",
     "Ideal 1F1B bubble (p-1)/(m+p-1) of the last trial."),
    ("autotune_last_trial_stage_compute_imbalance", "stage_compute_imbalance",
     "max / mean of per-stage compute seconds in the last trial (1 = balanced)."),
    ("autotune_last_trial_step_time_jitter", "step_time_jitter",
     "Coefficient of variation of step time in the last trial."),
)


@dataclass(frozen=True, slots=True)
class _Finished:
    trial: int
    config: TrialConfig
    status: str
    samples_per_second: float
    best_so_far: float


class ControllerExporter:
    """Collector of the tuning loop's state; every series carries the `job` label."""

    def __init__(self, *, job: str = "autotune", registry: CollectorRegistry | None = None) -> None:
        self.job = job
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._current: tuple[int, TrialConfig] | None = None
        self._started = 0
        self._status: Counter[str] = Counter()
        self._rules: Counter[str] = Counter()
        self._history: dict[int, _Finished] = {}
        self._best: tuple[int, float] | None = None
        self._last: tuple[int, TrialSummary | None] | None = None
        self.endpoint: Endpoint | None = None
        self.registry.register(self)

    # --- events from the tuning loop --------------------------------------------------------
    def trial_started(self, trial: int, config: TrialConfig) -> None:
        with self._lock:
            self._current = (trial, config)
            self._started += 1

    def trial_finished(
        self, trial: int, config: TrialConfig, status: str, samples_per_second: float,
        summary: TrialSummary | None = None, rules_fired: Iterable[str] = (),
    ) -> None:
        """Record a finished trial (also for trials told back after a resume).

        Failed trials count in the status counter and history but never become best.
        """
        with self._lock:
            self._status[status] += 1
            self._rules.update(rules_fired)
            if status == "ok" and (self._best is None or samples_per_second > self._best[1]):
                self._best = (trial, samples_per_second)
            best = self._best[1] if self._best else 0.0
            self._history[trial] = _Finished(trial, config, status, samples_per_second, best)
            self._last = (trial, summary)

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    def serve(self, addr: str = "127.0.0.1", port: int = DEFAULT_CONTROLLER_PORT, *,
              tries: int = 8) -> str | None:
        """Serve on addr:port (fallback port+1, +2, ... on conflict); URL or None. Never raises."""
        self.endpoint = serve_registry(self.registry, addr=addr, port=port, tries=tries,
                                       what="controller metrics")
        return self.endpoint.url if self.endpoint else None

    # --- collector ------------------------------------------------------------------------------
    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            current, started = self._current, self._started
            status, rules = dict(self._status), dict(self._rules)
            history = sorted(self._history.values(), key=lambda f: f.trial)
            best, last = self._best, self._last
        job = [self.job]

        c = CounterMetricFamily("autotune_trials", "Trials started in this study run.",
                                labels=["job"])
        c.add_metric(job, started)
        yield c
        c = CounterMetricFamily("autotune_trials_finished", "Finished trials by status.",
                                labels=["job", "status"])
        for s, n in sorted(status.items()):
            c.add_metric([self.job, s], n)
        yield c
        c = CounterMetricFamily("autotune_rules_fired", "Advisor rule findings by rule id.",
                                labels=["job", "rule"])
        for rule, n in sorted(rules.items()):
            c.add_metric([self.job, rule], n)
        yield c

        if current is not None:
            trial, cfg = current
            lab, vals = ["job", "trial"], [self.job, str(trial)]
            g = GaugeMetricFamily("autotune_current_trial", "Trial number now running (or last run).",
                                  labels=["job"])
            g.add_metric(job, trial)
            yield g
            for name, value, doc in _config_values(cfg):
                if value is not None:
                    g = GaugeMetricFamily(f"autotune_current_{name}", doc, labels=lab)
                    g.add_metric(vals, value)
                    yield g

        if best is not None:
            g = GaugeMetricFamily("autotune_best_samples_per_second",
                                  "Best samples/s of any successful trial so far.", labels=["job"])
            g.add_metric(job, best[1])
            yield g
            g = GaugeMetricFamily("autotune_best_trial", "Trial number of the best trial so far.",
                                  labels=["job"])
            g.add_metric(job, best[0])
            yield g

        if history:
            tp = GaugeMetricFamily("autotune_trial_samples_per_second",
                                   "Median samples/s of each finished trial (0 when failed).",
                                   labels=["job", "trial"])
            bs = GaugeMetricFamily("autotune_trial_best_samples_per_second",
                                   "Best samples/s among trials finished up to this one.",
                                   labels=["job", "trial"])
            info = GaugeMetricFamily(
                "autotune_trial_config_info", "Configuration and status of each finished trial (value 1).",
                labels=["job", "trial", "status", "micro_batch_size", "gradient_accumulation_steps",
                        "reduce_bucket_size"])
            for f in history:
                t = str(f.trial)
                tp.add_metric([self.job, t], f.samples_per_second)
                bs.add_metric([self.job, t], f.best_so_far)
                bucket = "" if f.config.reduce_bucket_size is None else str(f.config.reduce_bucket_size)
                info.add_metric([self.job, t, f.status, str(f.config.micro_batch_size),
                                 str(f.config.gradient_accumulation_steps), bucket], 1)
            yield tp
            yield bs
            yield info

        if last is not None and last[1] is not None:
            trial, summary = last
            for name, fieldname, doc in _SIGNALS:
                value = getattr(summary, fieldname)
                if value is not None:
                    g = GaugeMetricFamily(name, doc, labels=["job", "trial"])
                    g.add_metric([self.job, str(trial)], float(value))
                    yield g


def _config_values(cfg: TrialConfig) -> list[tuple[str, float | None, str]]:
    return [
        ("micro_batch_size", cfg.micro_batch_size, "Micro-batch size of the current trial."),
        ("gradient_accumulation_steps", cfg.gradient_accumulation_steps,
         "Gradient accumulation steps of the current trial."),
        ("reduce_bucket_size", cfg.reduce_bucket_size,
         "reduce_bucket_size (elements) of the current trial; absent when not searched."),
    ]
