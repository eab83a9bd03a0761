"""Per-rank instrumentation of a training engine (DeepSpeed's PipelineEngine, the torch engine, a
plain DeepSpeedEngine with ZeRO).

Every instruction the engine executes is timed in its category (the engine's instruction
table, autotune/rank/engine_face.py: for DeepSpeed an instance map over the class's
`_INSTRUCTION_MAP`, so no DeepSpeed code is patched globally; a plain engine's phases and
ZeRO's collectives), and every step becomes one StepRecord handed to each sink (CSV file,
Prometheus endpoint): a `train_batch()` call, or a plain engine's optimizer step in the
script's own loop (autotune/rank/step_boundary.py).

DeepSpeed's `wall_clock_breakdown` is not used: it crashes pipeline runs
(deepspeed-facts.md).

For a production script, one line after `deepspeed.initialize`:

    autotune.rank.instrument.instrument(engine, csv_path="metrics.csv", metrics_port=9400)
"""

from __future__ import annotations

import math
import resource
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from autotune.core.dsconfig import reduce_bucket_acts
from autotune.core.schema import StepRecord
from autotune.core.summary import busy_fraction
from autotune.rank.collectives import (
    COLLECTIVE_PREFIX,
    GATHERS,
    TimedWork,
    collective_calls,
    collective_kind,
    gathers,
)
from autotune.rank.engine_face import (
    COLLECTIVE,
    COMM,
    COMPUTE,
    DATA,
    OPTIMIZER,
    Instruction,
    instructions_of,
    layout_of,
)
from autotune.rank.p2p_split import P2P_INSTRUCTIONS, P2P_PREFIX, TransferSplit, p2p_category
from autotune.rank.step_boundary import has_train_batch, plain_steps
from autotune.rank.timing import CPU_SUFFIX, IntervalTimer, make_timer

P2P_CATEGORIES = frozenset(p2p_category(name) for name in P2P_INSTRUCTIONS)
GATHER_WAIT = "comm:gather-wait"
"""The waits of async all-gathers: communication, counted in `gather_seconds` too."""
INSIDE = "inside:"
"""`inside:<category>`: the seconds of the collectives run inside an interval of that category
(a plain engine's backward and step), taken out of it at the step's end."""


class Sink(Protocol):
    def write(self, record: StepRecord) -> None: ...


class DeviceProbe(Protocol):
    """What the probe asks of the device once per step (see exporters.devices)."""

    def utilization(self, window: float) -> float | None: ...

    def memory(self) -> dict[str, float] | None: ...


class PipelineProbe:
    """Times one engine's instructions and emits a StepRecord per train_batch()."""

    def __init__(self, engine: Any, *, sinks: Sequence[Sink] = (), trial: int = -1,
                 warmup_steps: int = 1, seq_length: int | None = None, device: DeviceProbe | None = None,
                 timer: IntervalTimer | None = None,
                 on_step: Callable[[StepRecord], None] | None = None) -> None:
        self.engine = engine
        self.sinks = list(sinks)
        self.trial = trial
        self.warmup_steps = warmup_steps
        self.seq_length = seq_length or None
        """Tokens per sample; None: not given, read from the first stage's input (autotune/rank/token_input.py)."""
        self.device_type = engine.device.type if hasattr(engine, "device") else "cpu"
        self.device = device
        self.timer = timer or make_timer(self.device_type, (P2P_PREFIX, COLLECTIVE_PREFIX))
        self.transfers = TransferSplit()
        self.collectives = TransferSplit(COLLECTIVE_PREFIX)
        self._open: list[str] = []
        """The categories of the instructions running now, outermost first."""
        self._in_collective = False
        self.on_step = on_step
        self.step = 0
        self.host = socket.gethostname()
        self._installed = False
        self._undo: Callable[[], None] | None = None
        self._inner_train_batch: Callable | None = None
        self._began = time.perf_counter()

    # -- installation -------------------------------------------------------
    def install(self) -> PipelineProbe:
        if self._installed:
            return self
        eng = self.engine

        def timed(instruction: Instruction, fn: Callable) -> Callable:
            if instruction.category is None:
                return fn
            out = (self._wrap_collective(fn, instruction.name) if instruction.category == COLLECTIVE
                   else self._wrap(fn, instruction.category))
            if instruction.category == DATA and self.seq_length is None:  # a user's script: its input tells
                from autotune.rank.token_input import measure_seq_length

                out = measure_seq_length(out, eng, self._found_seq_length)
            return out

        # a wrap another tool already installed (the trace labels) stays underneath ours
        self._undo = instructions_of(eng).wrap(timed)
        self._installed = True
        if not has_train_batch(eng):  # a plain engine in the user's own loop: its optimizer steps
            events = plain_steps(eng)
            events.begun.append(self._step_began)
            events.ended.append(self._step_ended)
            return self
        inner = eng.train_batch

        def train_batch(*args: Any, **kwargs: Any) -> Any:
            return self._measured_step(inner, *args, **kwargs)

        eng.train_batch = train_batch
        self._inner_train_batch = inner
        return self

    def _step_began(self) -> None:
        self._began = time.perf_counter()

    def _step_ended(self, loss: Any) -> None:
        """A plain engine's optimizer step, from its first forward to the boundary's step()."""
        self._close_step(self._began, loss)

    def _found_seq_length(self, length: int | None) -> None:
        self.seq_length = length

    def uninstall(self) -> None:
        """Give the engine back its own instructions and train_batch (overhead benchmark)."""
        if not self._installed:
            return
        if self._undo is not None:
            self._undo()
        if self._inner_train_batch is not None:
            self.engine.train_batch = self._inner_train_batch
        self._installed = False
        self._undo = None

    def _wrap(self, fn: Callable, category: str) -> Callable:
        timer = self.timer

        def timed(*args: Any, **kwargs: Any) -> Any:
            token = timer.begin()
            self._open.append(category)
            try:
                return fn(*args, **kwargs)
            finally:
                self._open.pop()
                timer.end(token, category)

        return timed

    def _wrap_collective(self, fn: Callable, op: str) -> Callable:
        """A collective, timed as its own kind (autotune/rank/collectives.py) and counted inside
        the instruction that runs it, so that it leaves that instruction's compute; one made of
        another collective (a coalesced one) counts once, the outer one."""
        timer = self.timer

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._in_collective:
                return fn(*args, **kwargs)
            inside = INSIDE + self._open[-1] if self._open else None
            token = timer.begin()
            self._in_collective = True
            try:
                out = fn(*args, **kwargs)
            finally:
                self._in_collective = False
                timer.end(token, collective_kind(op, args, kwargs), inside)
            if out is None or not hasattr(out, "wait"):
                return out
            category = GATHER_WAIT if op in GATHERS else COMM
            return TimedWork(out, lambda wait: self._timed_wait(wait, category))

        return timed

    def _timed_wait(self, wait: Callable[[], Any], category: str = COMM) -> Any:
        """An async collective's wait: the rest of its transfer, which the rank waited for (an
        all-gather's apart, `GATHER_WAIT`: ZeRO-3 starts its parameter gathers async)."""
        inside = INSIDE + self._open[-1] if self._open else None
        token = self.timer.begin()
        try:
            return wait()
        finally:
            self.timer.end(token, category, inside)

    # -- one step -----------------------------------------------------------
    def _measured_step(self, inner: Callable, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        loss = inner(*args, **kwargs)
        self._close_step(t0, loss)
        return loss

    def _close_step(self, began: float, loss: Any) -> None:
        """The step that began at `began` (perf_counter) is over: its record, to every sink."""
        if self.device_type == "cuda":
            import torch

            torch.cuda.synchronize()
        step_seconds = time.perf_counter() - began
        parts = self.timer.collect()
        record = self._record(step_seconds, parts, loss)
        self.step += 1
        for sink in self.sinks:
            sink.write(record)
        if self.on_step is not None:
            self.on_step(record)

    def close_sinks(self) -> None:
        """Flush and close every sink (the CSV fsyncs); one that fails does not keep the rest open."""
        for sink in self.sinks:
            try:
                getattr(sink, "close", lambda: None)()
            except Exception as exc:  # noqa: BLE001 - said, then the others still close
                print(f"autotune: closing a metrics sink failed: {exc}", file=sys.stderr, flush=True)

    def _record(self, step_seconds: float, parts: dict[str, float], loss: Any) -> StepRecord:
        eng = self.engine
        layout = layout_of(eng)  # the one reader of the engine's layout (autotune/rank/engine_face.py)
        micro, gas, dp = layout.micro_batch_size, layout.accumulation_steps, layout.data_parallel_size
        stages = layout.stages
        # a plain engine's collectives run inside its backward and step: out of their compute
        optimizer = parts.get(OPTIMIZER, 0.0) - parts.get(INSIDE + OPTIMIZER, 0.0)
        compute = parts.get(COMPUTE, 0.0) - parts.get(INSIDE + COMPUTE, 0.0) + optimizer
        intervals = self.timer.intervals()
        transfer, wait = self.transfers.split(intervals)
        reduced, waited = self.collectives.split(intervals)
        plain = layout.topology is None  # its collectives are timed one call each
        gathered = self.collectives.split(gathers(intervals))[0] + parts.get(GATHER_WAIT, 0.0) if plain else None
        work = parts.get(COMPUTE + CPU_SUFFIX)  # CPU only: the forward/backward work in thread CPU time
        if work is not None:
            work -= parts.get(INSIDE + COMPUTE + CPU_SUFFIX, 0.0)
        samples_per_second = micro * gas * dp / step_seconds if step_seconds > 0 else 0.0
        util = None
        if self.device is not None:
            util = self.device.utilization(step_seconds)
        from_device = util is not None
        if util is None:  # busy fraction: the documented CPU definition
            util = busy_fraction(compute, step_seconds)
        mem = self.device.memory() if self.device is not None else None
        mem = mem or {}
        peak = mem.get("peak_bytes")
        if peak is None and self.device_type == "cpu":
            peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return StepRecord(
            time=time.time(), trial=self.trial, rank=layout.rank, stage=layout.stage,
            step=self.step, warmup=int(self.step < self.warmup_steps),
            step_seconds=step_seconds, samples_per_second=samples_per_second,
            tokens_per_second=samples_per_second * self.seq_length if self.seq_length else None,
            compute_seconds=compute, comm_seconds=parts.get(COMM, 0.0) + parts.get(GATHER_WAIT, 0.0) + transfer + reduced,
            wait_seconds=wait + waited, data_seconds=parts.get(DATA, 0.0),
            device_utilization=util,
            memory_allocated_bytes=mem.get("allocated_bytes"),
            memory_reserved_bytes=mem.get("reserved_bytes"),
            memory_fragmentation_ratio=mem.get("fragmentation_ratio"),
            memory_inactive_split_bytes=mem.get("inactive_split_bytes"),
            memory_peak_bytes=peak,
            loss=_loss_value(eng, loss), loss_scale=_loss_scale(eng),
            micro_batch_size=micro, gradient_accumulation_steps=gas,
            reduce_bucket_size=_acting_bucket(eng, dp, pipeline=layout.topology is not None), pipeline_stages=stages,
            data_parallel_size=dp, seq_length=self.seq_length,
            device=str(eng.device) if hasattr(eng, "device") else "cpu", host=self.host,
            optimizer_seconds=optimizer, utilization_from_device=int(from_device),
            compute_cpu_seconds=work, memory_capacity_bytes=mem.get("capacity_bytes"),
            # a job with no pipeline has no point-to-point: absent, not 0 (shared/docs/design.md)
            p2p_seconds=transfer + wait if layout.topology is not None else None,
            p2p_fastest_seconds=self.transfers.fastest_seconds(),
            zero_stage=_zero_stage(eng), collective_calls=collective_calls(intervals) if plain else None,
            gather_seconds=gathered,
        )


def _loss_value(engine: Any, loss: Any) -> float | None:
    """The loss lives on a pipeline's last stage, other ranks report none; on every replica of a
    plain engine (which has no `is_last_stage`)."""
    last = getattr(engine, "is_last_stage", None)
    if loss is None or (last is not None and not last()):
        return None
    value = float(loss.mean().item()) if hasattr(loss, "mean") else float(loss)
    return value  # NaN/inf kept as-is: the trial runner classifies it


def _loss_scale(engine: Any) -> float | None:
    if not engine.fp16_enabled():
        return None
    scale = getattr(getattr(engine, "optimizer", None), "cur_scale", None)
    return float(scale) if scale is not None and math.isfinite(float(scale)) else None


def _zero_stage(engine: Any) -> int | None:
    stage = getattr(engine, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) else None


def _acting_bucket(engine: Any, dp: int, *, pipeline: bool) -> int | None:
    """The engine's reduce_bucket_size where it acts (autotune/core/dsconfig.py), else None."""
    if not reduce_bucket_acts(engine.zero_optimization_stage(), dp, pipeline=pipeline):
        return None
    return int(engine.zero_reduce_bucket_size())


def instrument(engine: Any, *, csv_path: str | None = None, metrics_port: int | None = None,
               metrics_addr: str = "127.0.0.1", trial: int = -1, job: str = "autotune",
               warmup_steps: int = 1, seq_length: int | None = None, metrics_in_process: bool = False,
               endpoint_file: str | bool = True) -> PipelineProbe:
    """One-liner for any training script: time the engine, write a CSV and/or serve Prometheus.

    `metrics_port` is the base port; each rank serves on base + local rank. The
    endpoint runs in a child process fed through a pipe (exporters/sidecar.py), so
    scrapes cost the training process no GIL time; `metrics_in_process=True`
    serves from a thread of this process instead (no extra process).

    `endpoint_file`: where the rank records the endpoint it actually bound (a taken
    port falls back to another, exporters/file_sd.py); `{rank}` is replaced. True:
    `endpoint-rank{rank}.json` beside the CSV, when there is one; False: nowhere.
    """
    import os

    sinks: list[Sink] = []
    if csv_path is not None:
        from autotune.rank.metrics_csv import CsvSink

        rank = int(os.environ.get("RANK", layout_of(engine).rank))
        path = csv_path.replace("{rank}", str(rank))
        sinks.append(CsvSink(path))
    device = engine_device_probe(engine)
    if metrics_port is not None:
        from exporters.prometheus_rank import start_rank_exporter
        from exporters.sidecar import start_sidecar_exporter

        # default: HTTP served by a child process, off this process's GIL
        start = start_rank_exporter if metrics_in_process else start_sidecar_exporter
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        layout = layout_of(engine)
        labels = {"job": job, "trial": str(trial), "rank": str(layout.rank),
                  "stage": str(layout.stage), "device": str(engine.device), "host": socket.gethostname()}
        exporter = start(addr=metrics_addr, port=metrics_port + local_rank, labels=labels)
        if exporter is not None:
            sinks.append(exporter)
            _record_endpoint(exporter, endpoint_file, csv_path, labels)
    return PipelineProbe(engine, sinks=sinks, trial=trial, warmup_steps=warmup_steps,
                         seq_length=seq_length, device=device).install()


def _record_endpoint(exporter: Any, endpoint_file: str | bool, csv_path: str | None,
                     labels: dict[str, str]) -> None:
    """Say where this rank serves, for the run's Prometheus targets file; never fails the rank."""
    import os

    if endpoint_file is True:
        if csv_path is None:
            return
        endpoint_file = os.path.join(os.path.dirname(csv_path), "endpoint-rank{rank}.json")
    if not endpoint_file:
        return
    url = getattr(exporter, "url", None) or getattr(getattr(exporter, "endpoint", None), "url", None)
    if url is None:
        return
    from autotune.core.nodes import this_node
    from exporters.file_sd import write_rank_endpoint

    try:  # a wildcard bind is listed under the hostfile's name for this node (core/nodes.py)
        write_rank_endpoint(str(endpoint_file).replace("{rank}", labels["rank"]), url=url,
                            labels={**labels, "host": this_node()})
    except OSError as exc:
        print(f"autotune: cannot record this rank's metrics endpoint ({exc}); it serves on {url}",
              file=sys.stderr, flush=True)


def engine_device_probe(engine: Any) -> DeviceProbe | None:
    """NVML + CUDA allocator on GPUs; None on CPU (busy fraction, no allocator)."""
    if getattr(getattr(engine, "device", None), "type", "cpu") != "cuda":
        return None
    from exporters.devices import make_device_probe  # ships with autotune, in every install

    return make_device_probe(engine.device)
