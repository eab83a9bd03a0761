"""One Prometheus endpoint per training rank: a StepRecord sink plus a custom Collector.

Why a custom Collector: the instrumentation already measures everything once
per step (a `StepRecord`); the collector turns the latest snapshot into fresh
metric families at each scrape, so the training thread only swaps a snapshot
under a lock (no per-metric bookkeeping on the hot path). prometheus-client's
multiprocess mode does not support custom collectors, hence one endpoint per
rank on port base + local rank.

Usage (what the instrumentation does)::

    exporter = RankExporter(labels={"job": "gpt-pipe"})
    exporter.serve()                 # prints "metrics: http://127.0.0.1:9710/metrics"
    for record in steps: exporter.write(record)

Signals use the definitions in `autotune.core.summary` (fluctuation, comm/compute
ratio, ideal bubble); docs/metrics.md lists every metric.
"""

from __future__ import annotations

import math
import os
import socket
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from autotune.core.schema import StepRecord
from autotune.core.summary import (
    bubble_fraction,
    comm_compute_ratio,
    fluctuation,
    ideal_bubble_fraction,
    peer_wait_fraction,
)
from exporters.endpoint import Endpoint, serve_registry

DEFAULT_RANK_BASE_PORT = 9710
"""Rank r serves on DEFAULT_RANK_BASE_PORT + local rank unless told otherwise."""
LABEL_NAMES = ("job", "trial", "rank", "stage", "device", "host")
DEFAULT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Step-time histogram bounds in seconds (CPU toy steps to large-model steps)."""
MIN_RENDER_INTERVAL = 0.25
"""Seconds: a scrape may see a rendering this much older than the last step (fast steps only)."""
DEFAULT_WINDOW = 20
"""Fluctuation window: the last N measured (non-warm-up) steps."""


@dataclass(kw_only=True, slots=True)
class RankSnapshot:
    """The latest state of one rank, read by the Prometheus collector at each scrape.

    The exporter's own state: it lives here, beside its only user, not in the CSV schema."""

    last: StepRecord | None = None
    steps_total: int = 0
    samples_total: float = 0.0
    step_seconds_history: list[float] = field(default_factory=list)
    utilization_window: list[float] = field(default_factory=list)


class RankExporter:
    """A rank's metrics sink (`write`) and Prometheus collector (`collect`).

    `labels` must give `job`; `trial`, `rank`, `stage`, `device` and `host` come
    from each record (the record is authoritative for what it measured) and
    fall back to `labels`, then to defaults. Warm-up steps update the gauges and
    `autotune_steps_total` but not the fluctuation window or the histogram, as in
    the advisor's summaries. A record from a new trial starts fresh series.
    """

    def __init__(
        self, *, labels: Mapping[str, object] | None = None,
        registry: CollectorRegistry | None = None, window: int = DEFAULT_WINDOW,
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        self.labels = {k: str(v) for k, v in (labels or {}).items()}
        if unknown := set(self.labels) - set(LABEL_NAMES):
            raise ValueError(f"unknown labels {sorted(unknown)}; allowed: {', '.join(LABEL_NAMES)}")
        self.labels.setdefault("job", "autotune")
        self.labels.setdefault("host", socket.gethostname())
        self.registry = registry if registry is not None else CollectorRegistry()
        self._bounds = tuple(sorted(float(b) for b in buckets if not math.isinf(b)))
        self._lock = threading.Lock()
        self._snap = RankSnapshot(utilization_window=[])
        self._window: deque[float] = deque(maxlen=max(2, window))
        self._bucket_counts = [0] * (len(self._bounds) + 1)
        self._hist_sum = 0.0
        self._version = 0  # bumped by write(): the endpoint renders once per version
        self._owns_registry = registry is None
        self.endpoint: Endpoint | None = None
        self.registry.register(self)

    # --- sink -----------------------------------------------------------------------------
    def write(self, record: StepRecord) -> None:
        """Take one step's record (called by the training thread; O(buckets))."""
        with self._lock:
            self._version += 1
            last = self._snap.last
            if last is not None and (last.trial != record.trial or last.rank != record.rank):
                self._reset()
            self._snap.last = record
            self._snap.steps_total += 1
            if record.warmup:
                return
            self._snap.samples_total += record.samples_per_second * record.step_seconds
            self._window.append(record.device_utilization)
            self._hist_sum += record.step_seconds
            for i, bound in enumerate(self._bounds):
                if record.step_seconds <= bound:
                    self._bucket_counts[i] += 1
                    break
            else:
                self._bucket_counts[-1] += 1

    def close(self) -> None:
        """Stop serving (the collector stays registered)."""
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    def _reset(self) -> None:
        self._snap = RankSnapshot(utilization_window=[])
        self._window.clear()
        self._bucket_counts = [0] * (len(self._bounds) + 1)
        self._hist_sum = 0.0

    # --- endpoint --------------------------------------------------------------------------
    def serve(
        self, addr: str = "127.0.0.1", port: int | None = None, *,
        base_port: int = DEFAULT_RANK_BASE_PORT, local_rank: int | None = None,
        tries: int = 8,
    ) -> str | None:
        """Serve this registry; return the URL, or None when no port could be bound.

        Port = `port` if given, else base_port + local rank (`LOCAL_RANK` env, 0).
        A taken port warns (MetricsEndpointWarning) and falls back to
        port + k * local world size (LOCAL_WORLD_SIZE, or DeepSpeed's LOCAL_SIZE) for k < tries;
        never raises.
        """
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        # torchrun says LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE: without it every local
        # rank's fallback would try the next port up, the one the next local rank asked for
        stride = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
        self.endpoint = serve_registry(
            self.registry, addr=addr, port=base_port + local_rank if port is None else port,
            stride=stride, tries=tries, what="metrics",
            # a shared registry holds collectors whose changes we cannot see: render every scrape
            version=(lambda: self._version) if self._owns_registry else None,
            min_render_interval=MIN_RENDER_INTERVAL)
        return self.endpoint.url if self.endpoint else None

    # --- collector -------------------------------------------------------------------------
    def describe(self) -> list[Metric]:
        """Nothing up front: metrics appear with the first record (no made-up zeros)."""
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            r = self._snap.last
            if r is None:
                return
            steps, samples = self._snap.steps_total, self._snap.samples_total
            window = list(self._window)
            counts, hist_sum = list(self._bucket_counts), self._hist_sum
        yield from self._families(r, steps, samples, window, counts, hist_sum)

    def _label_values(self, r: StepRecord) -> list[str]:
        own = {"trial": r.trial, "rank": r.rank, "stage": r.stage, "device": r.device or None,
               "host": r.host or None}
        return [str(v) if (v := own.get(n)) is not None else self.labels.get(n, "")
                for n in LABEL_NAMES]

    def _families(
        self, r: StepRecord, steps: int, samples: float, window: list[float],
        counts: list[int], hist_sum: float,
    ) -> Iterator[Metric]:
        names = list(LABEL_NAMES)
        values = self._label_values(r)

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
            if value is None or (isinstance(value, float) and math.isnan(value)):
                return  # "not available": omit the sample, never export a made-up 0
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, float(value))
            yield g

        yield from gauge("autotune_device_utilization_ratio",
                         "Device utilization in the last step, 0-1 (GPU: NVML; CPU: compute/step).",
                         r.device_utilization)
        yield from gauge("autotune_device_utilization_fluctuation_ratio",
                         "Population std of per-step utilization over the last measured steps.",
                         fluctuation(window))
        yield from gauge("autotune_comm_compute_ratio",
                         "Communication (transfer only, not the wait for a peer) / compute seconds "
                         "in the last step.",
                         comm_compute_ratio(r.comm_seconds, r.compute_seconds))
        yield from gauge("autotune_peer_wait_ratio",
                         "Share of the last step spent waiting for a peer stage in sends and receives.",
                         peer_wait_fraction(r.wait_seconds, r.step_seconds))
        yield from gauge("autotune_memory_fragmentation_ratio",
                         "1 - allocated/reserved of the CUDA caching allocator; absent on CPU.",
                         r.memory_fragmentation_ratio)
        yield from gauge("autotune_memory_allocated_bytes",
                         "CUDA allocator allocated bytes at step end; absent on CPU.",
                         r.memory_allocated_bytes)
        yield from gauge("autotune_memory_reserved_bytes",
                         "CUDA allocator reserved bytes at step end; absent on CPU.",
                         r.memory_reserved_bytes)
        yield from gauge("autotune_memory_inactive_split_bytes",
                         "CUDA allocator inactive split bytes; absent on CPU.",
                         r.memory_inactive_split_bytes)
        yield from gauge("autotune_memory_peak_bytes",
                         "Peak allocated bytes in the step (CUDA) or process peak RSS (CPU).",
                         r.memory_peak_bytes)
        yield from gauge("autotune_samples_per_second",
                         "Global samples in the step / this rank's step seconds.",
                         r.samples_per_second)
        yield from gauge("autotune_tokens_per_second",
                         "samples_per_second x sequence length; absent when not a token model.",
                         r.tokens_per_second)
        yield from gauge("autotune_step_compute_seconds",
                         "Forward + backward + optimizer seconds in the last step.",
                         r.compute_seconds)
        yield from gauge("autotune_step_schedule_compute_seconds",
                         "Forward + backward seconds in the last step: the work the partition splits "
                         "across stages (stage imbalance input).",
                         r.compute_seconds - (r.optimizer_seconds or 0.0))
        yield from gauge("autotune_step_comm_seconds",
                         "Point-to-point transfer + gradient reduction seconds in the last step "
                         "(without the wait for a peer).", r.comm_seconds)
        yield from gauge("autotune_step_wait_seconds",
                         "Seconds waiting for a peer stage in sends and receives in the last step.",
                         r.wait_seconds)
        yield from gauge("autotune_step_data_seconds", "Data loading seconds in the last step.",
                         r.data_seconds)
        yield from gauge("autotune_bubble_measured_ratio",
                         "This rank's idle share of the pipeline schedule in the last step.",
                         bubble_fraction(r.compute_seconds, r.step_seconds, r.optimizer_seconds or 0.0)
                         if r.step_seconds > 0 and r.pipeline_stages > 1 else None)  # no pipeline: absent
        yield from gauge("autotune_bubble_ideal_ratio",
                         "1F1B ideal bubble (p-1)/(m+p-1), m = gradient accumulation steps.",
                         _ideal(r))
        yield from gauge("autotune_loss", "Mean loss of the last step (last stage only).", r.loss)
        yield from gauge("autotune_loss_scale", "fp16 dynamic loss scale.", r.loss_scale)
        yield from gauge("autotune_micro_batch_size", "Micro-batch size of the running config.",
                         r.micro_batch_size)
        yield from gauge("autotune_gradient_accumulation_steps",
                         "Gradient accumulation steps (= micro-batches per step).",
                         r.gradient_accumulation_steps)
        yield from gauge("autotune_reduce_bucket_size",
                         "zero_optimization.reduce_bucket_size in elements; absent when unset.",
                         r.reduce_bucket_size)
        yield from gauge("autotune_zero_stage", "The engine's ZeRO stage (0-3); absent for an engine without ZeRO.",
                         r.zero_stage)
        yield from gauge("autotune_collective_calls_per_micro_batch",
                         "A plain engine's collective calls (ZeRO's reductions and gathers) in the last step / "
                         "gradient accumulation steps; absent on a pipeline engine.",
                         r.collective_calls / max(1, r.gradient_accumulation_steps)
                         if r.collective_calls is not None else None)
        yield from gauge("autotune_gather_comm_ratio",
                         "The all-gathers' share of a plain engine's communication seconds in the last step "
                         "(transfer only: ZeRO-3's parameter gathers); absent on a pipeline engine.",
                         r.gather_seconds / r.comm_seconds
                         if r.gather_seconds is not None and r.comm_seconds > 0 else None)
        yield from gauge("autotune_last_step_timestamp_seconds",
                         "Unix time at the end of the last step.", r.time)

        c = CounterMetricFamily("autotune_steps", "Optimizer steps seen on this rank (warm-up included).",
                                labels=names)
        c.add_metric(values, steps)
        yield c
        c = CounterMetricFamily("autotune_samples", "Global samples processed in measured steps.",
                                labels=names)
        c.add_metric(values, samples)
        yield c
        cumulative, running = [], 0
        for bound, n in zip((*self._bounds, math.inf), counts, strict=True):
            running += n
            cumulative.append(("+Inf" if math.isinf(bound) else repr(bound), running))
        h = HistogramMetricFamily("autotune_step_seconds",
                                  "Wall seconds of measured (non-warm-up) train_batch() steps.",
                                  labels=names)
        h.add_metric(values, cumulative, hist_sum)
        yield h


def _ideal(r: StepRecord) -> float | None:
    if r.pipeline_stages < 2:  # a plain engine has no bubble: absent, not 0
        return None
    try:
        return ideal_bubble_fraction(r.pipeline_stages, r.gradient_accumulation_steps)
    except ValueError:
        return None


def start_rank_exporter(
    *, addr: str = "127.0.0.1", port: int | None = None, labels: Mapping[str, object] | None = None,
    registry: CollectorRegistry | None = None,
) -> RankExporter | None:
    """Create and serve a RankExporter (what `autotune.rank.instrument.instrument` calls).

    Returns None when no port could be bound (a warning says so); training goes on.
    """
    exporter = RankExporter(labels=labels, registry=registry)
    return exporter if exporter.serve(addr=addr, port=port) else None
