"""The metrics CSV schema: one row per rank per optimizer step.

This is the stable contract between the instrumentation (writer), the
summaries, `autotune advise` (reader) and the Prometheus exporter. Adding a
column at the end is backwards compatible; renaming or removing one is not.
An empty cell means "not available" (for example fragmentation on CPU),
never zero.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

SCHEMA_VERSION = 2
"""2: comm_seconds is transfer only and wait_seconds every wait for a peer (issue 24); 1: sends
were comm, receives wait. A CSV without the `schema_version` column was written with 1."""


@dataclass(kw_only=True, slots=True)
class StepRecord:
    """What one rank measured in one optimizer step (one `train_batch()`)."""

    time: float
    """Unix time at the end of the step."""
    trial: int
    """Trial number within the study (0 = baseline); -1 outside a study."""
    rank: int
    """Global rank."""
    stage: int
    """Pipeline stage id of this rank."""
    step: int
    """Optimizer step index within the trial, from 0."""
    warmup: int
    """1 for warm-up steps (recorded, excluded from summaries), else 0."""
    step_seconds: float
    """Wall time of the whole `train_batch()` on this rank."""
    samples_per_second: float
    """Global samples in the step / step_seconds (micro x GAS x dp / step)."""
    tokens_per_second: float | None = None
    """samples_per_second x sequence length; None (empty) when not a token model or the length
    is not known on this rank (autotune/rank/token_input.py). CSVs written before wrote 0.0 there."""
    compute_seconds: float
    """Forward + backward + optimizer-step instruction time."""
    comm_seconds: float
    """Transfer only: the point-to-point transfers (sends and receives without their wait for
    the peer, autotune/rank/p2p_split.py) + data-parallel and tied gradient reduction. Schema 1
    (before): every send's whole time + the reductions."""
    wait_seconds: float
    """Waiting for the peer stage in point-to-point instructions (sends and receives). Schema 1
    (before): every receive's whole time, its transfer included."""
    data_seconds: float
    """LoadMicroBatch instruction time (the data loader)."""
    device_utilization: float
    """0-1. GPU: mean NVML utilization over the step. CPU: busy fraction compute/step."""
    memory_allocated_bytes: float | None = None
    """CUDA caching allocator: allocated bytes at step end. None on CPU."""
    memory_reserved_bytes: float | None = None
    """CUDA caching allocator: reserved bytes at step end. None on CPU."""
    memory_fragmentation_ratio: float | None = None
    """1 - allocated/reserved on CUDA. None ("not available") on CPU."""
    loss: float | None = None
    """Mean loss of the step; only the last stage has it."""
    micro_batch_size: int
    gradient_accumulation_steps: int
    reduce_bucket_size: int | None = None
    """None when the config does not set it (or it cannot act)."""
    pipeline_stages: int
    data_parallel_size: int
    seq_length: int | None = None
    """Tokens per sample: the built-in workload's, or a user script's first-stage input length
    (batch x seq integer ids). None (empty) when not a token model, and on a user script's later
    stages, which never see the input. CSVs written before wrote 0 there."""
    memory_peak_bytes: float | None = None
    """CUDA peak allocated bytes in the step; on CPU the process peak RSS."""
    memory_inactive_split_bytes: float | None = None
    """CUDA inactive split bytes (second fragmentation view). None on CPU."""
    loss_scale: float | None = None
    """fp16 dynamic loss scale where used."""
    device: str = "cpu"
    """Device name, e.g. cpu or cuda:0."""
    host: str = ""
    optimizer_seconds: float | None = None
    """OptimizerStep instruction time (already inside compute_seconds). Outside the
    pipeline schedule, so the bubble and stage balance leave it out."""
    utilization_from_device: int | None = None
    """1: device_utilization is the device's own counter (NVML: share of time a kernel
    ran). 0: it is the busy fraction compute/step (CPU, or a GPU without NVML).
    Empty in CSVs written before the column existed."""
    compute_cpu_seconds: float | None = None
    """CPU devices: thread CPU seconds of the forward and backward instructions, the stage's
    work without the wait for a core (autotune/rank/timing.py WallAndCpuTimer; the optimizer step
    left out, as the stage balance leaves it out). None on CUDA, where compute_seconds is
    already the device's own time, and in CSVs written before the column existed."""
    memory_capacity_bytes: float | None = None
    """The device's total memory (CUDA: cudaMemGetInfo's total, else NVML's). None on CPU:
    the ranks share the host's memory, so no per-device limit is known."""
    p2p_seconds: float | None = None
    """All point-to-point instruction time (sends and receives): transfer + waiting for the
    peer. None in CSVs written before schema 2, where sends counted as comm_seconds and
    receives as wait_seconds."""
    p2p_fastest_seconds: float | None = None
    """The fastest single point-to-point instruction this rank ran in the trial so far: the
    transfer that instance had with no wait (autotune/rank/p2p_split.py). None before schema 2."""
    schema_version: int = SCHEMA_VERSION
    """The definitions this row was written with (SCHEMA_VERSION); empty before schema 2 (read as 1)."""
    zero_stage: int | None = None
    """The engine's ZeRO stage (0-3, `engine.zero_optimization_stage()`). None where the engine
    has none (torch.distributed.pipelining) and in CSVs written before the column existed."""
    collective_calls: int | None = None
    """A plain engine's collective calls in the step (every all-reduce, reduce-scatter and
    all-gather of ZeRO's reducer and gatherer, each counted once, autotune/rank/collectives.py).
    None on a pipeline engine, whose reduction is one timed instruction, and in older CSVs."""
    gather_seconds: float | None = None
    """The step's all-gathers on a plain engine, as counted in comm_seconds: each call's transfer
    (the split of autotune/rank/p2p_split.py) plus the `wait()` of an async one (ZeRO-3 starts
    its parameter gathers async); ZeRO-1/2 gather the updated parameters after the optimizer
    step. None where collective_calls is."""


CSV_COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(StepRecord))
"""Column order of the metrics CSV (the field order above)."""

REQUIRED_COLUMNS: tuple[str, ...] = (
    "time", "trial", "rank", "stage", "step", "step_seconds", "samples_per_second",
    "tokens_per_second", "compute_seconds", "comm_seconds", "device_utilization",
    "memory_allocated_bytes", "memory_reserved_bytes", "memory_fragmentation_ratio",
    "loss", "micro_batch_size", "gradient_accumulation_steps", "reduce_bucket_size",
    "pipeline_stages", "data_parallel_size",
)

_INT_COLUMNS = {
    f.name for f in dataclasses.fields(StepRecord) if f.type in ("int", "int | None")
}
TEXT_COLUMNS = ("device", "host")
"""The only non-numeric columns."""


def format_cell(value: object) -> str:
    """CSV cell text: empty for None/NaN ("not available"), repr-exact floats."""
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return repr(value)
    return str(value)


def record_to_row(record: StepRecord) -> list[str]:
    return [format_cell(getattr(record, name)) for name in CSV_COLUMNS]


def record_from_values(values: dict[str, object]) -> StepRecord:
    """A StepRecord from parsed cells (floats, NaN or None for empty; text for device/host)."""
    out: dict[str, object] = {}
    for name, v in values.items():
        if name not in _FIELDS:
            continue
        if name in TEXT_COLUMNS:
            out[name] = "" if v is None else str(v)
        elif v is None or (isinstance(v, float) and math.isnan(v)):
            if _optional(name):
                out[name] = None
        elif name in _INT_COLUMNS:
            out[name] = int(v)  # type: ignore[call-overload]
        else:
            out[name] = float(v)  # type: ignore[arg-type]
    out.setdefault("schema_version", 1)  # no such column (or empty): written before schema 2
    return StepRecord(**out)  # type: ignore[arg-type]


def _optional(name: str) -> bool:
    f = _FIELDS[name]
    return f.default is not dataclasses.MISSING


_FIELDS = {f.name: f for f in dataclasses.fields(StepRecord)}
