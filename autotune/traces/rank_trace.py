"""One rank's trace as columns: what the breakdown needs, kept compact while the file streams.

Kept from the events (the rest is dropped as it is read):
- the steps: `ProfilerStep#N` annotations on the host (torch.profiler's `prof.step()`);
- the device's work: every event on a device stream (kernels, memcpy, memset), by kind, with
  the correlation id that ties it to the host call that launched it;
- the launches: the CUDA runtime/driver calls' correlation ids and start times, so a device
  event is counted in the step that launched it (HTA does the same);
- the host operators (`cpu_op`): start, duration, thread, and whether they communicate
  (`c10d::*`, `gloo:*`, `nccl:*`): the whole story of a CPU-only trace;
- the collectives with their sizes: `record_param_comms` (collective name, element counts),
  NCCL kernels' arguments, and with `record_shapes` the c10d/gloo operators' input shapes and
  their peer (`c10d::send`'s destination, `c10d::recv_`'s source);
- `distributedInfo`: rank, world size, backend, process groups;
- the pipeline instructions where autotune's recorder labelled them (`deepspeed:ForwardPass`, ...),
  or torch.distributed.pipelining did (`PP:0F1`, `Forward 1`: autotune/core/trace_labels.py).

Kernel kinds follow HTA's (`hta/utils/utils.py`), so the breakdown can be checked against it:
communication `^nccl.*Kernel`; memory `^Memcpy|^Memset|^dma`; compute: neither, nor a name
holding Memcpy or ending in Sync; the rest is "other".
"""

from __future__ import annotations

import math
import re
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from autotune.core.errors import InputFileError
from autotune.core.trace_labels import pipeline_instruction
from autotune.traces.reader import TraceFile

COMPUTE, COMMUNICATION, MEMORY, OTHER = 0, 1, 2, 3
KIND_NAMES = ("compute", "communication", "memory", "other")
_COMM_KERNEL = re.compile(r"^nccl.*Kernel")
_MEMORY_KERNEL = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
_STEP = re.compile(r"^ProfilerStep\s*#\s*(\d+)")
COMM_OP_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms")
BACKWARD_OP_PREFIX = "autograd::engine::evaluate_function"
OP_COMPUTE, OP_COMMUNICATION, OP_BACKWARD = 0, 1, 2
"""Host operator kinds: a backward operator is compute too (it marks where backward ends)."""
DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})

def kernel_kind(name: str) -> int:
    if _COMM_KERNEL.match(name):
        return COMMUNICATION
    if _MEMORY_KERNEL.match(name):
        return MEMORY
    if not _NOT_COMPUTE.match(name):
        return COMPUTE
    return OTHER


@dataclass(frozen=True, slots=True)
class Collective:
    """One communication call and its size, as far as the trace says."""

    name: str
    """allreduce, send, recv, broadcast, all_gather, ..."""
    ts: float
    dur: float
    elements: int | None
    peer: int | None = None
    """send: the destination, recv: the source (global ranks), where the trace says."""


@dataclass(frozen=True, slots=True)
class Instruction:
    """One pipeline instruction under its `deepspeed:` range (autotune's own traces), or under
    torch's own label (a torch.distributed.pipelining job: autotune/core/trace_labels.py)."""

    name: str
    ts: float
    dur: float
    micro: int | None = None
    """The micro-batch it works on, where the label says (torch's labels do)."""


@dataclass(frozen=True, slots=True)
class Step:
    number: int
    ts: float
    dur: float

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass(kw_only=True)
class RankTrace:
    path: Path
    rank: int | None
    world_size: int | None
    backend: str | None
    process_groups: list[dict[str, Any]]
    steps: list[Step]
    host_thread: int | None
    """The thread the steps ran on (the training loop's)."""
    dev_ts: np.ndarray
    dev_dur: np.ndarray
    dev_kind: np.ndarray
    dev_corr: np.ndarray
    launch_corr: np.ndarray
    launch_ts: np.ndarray
    cpu_ts: np.ndarray
    cpu_dur: np.ndarray
    cpu_tid: np.ndarray
    cpu_kind: np.ndarray
    """OP_COMMUNICATION for c10d, gloo, nccl and record_param_comms operators; OP_BACKWARD for
    autograd's per-function backward; OP_COMPUTE for the rest."""
    collectives: list[Collective] = field(default_factory=list)
    instructions: list[Instruction] = field(default_factory=list)
    """The pipeline instructions, where the trace labels them (a trial's, autotune/core/trace_labels.py)."""

    @property
    def has_device(self) -> bool:
        return len(self.dev_ts) > 0

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else self.path.name


def read_rank_trace(path: str | Path) -> RankTrace:
    """Stream one trace file into its columns (one-line InputFileError for what is not a trace)."""
    tf = TraceFile(path)
    try:
        cols = _Columns()
        for ev in tf.events():
            cols.add(ev)
    finally:
        tf.close()
    return cols.finish(tf)


class _Columns:
    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.step_tids: dict[int, int] = {}
        self.dev_ts, self.dev_dur, self.dev_corr = array("d"), array("d"), array("q")
        self.dev_kind = array("b")
        self.launch_corr, self.launch_ts = array("q"), array("d")
        self.cpu_ts, self.cpu_dur, self.cpu_tid = array("d"), array("d"), array("q")
        self.cpu_kind = array("b")
        self.kinds: dict[str, int] = {}
        self.collectives: list[Collective] = []
        self.kernel_collectives: list[Collective] = []
        self.instructions: list[Instruction] = []

    def add(self, ev: dict[str, Any]) -> None:
        if ev.get("ph") != "X":
            return
        cat = ev.get("cat")
        try:
            ts, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            return
        name = ev.get("name", "")
        if cat in DEVICE_CATS:
            args = ev.get("args") or {}
            kind = self.kinds.get(name)
            if kind is None:
                kind = self.kinds[name] = kernel_kind(str(name))
            self.dev_ts.append(ts)
            self.dev_dur.append(dur)
            self.dev_kind.append(kind)
            self.dev_corr.append(int(args.get("correlation", -1)))
            if kind == COMMUNICATION and "Collective name" in args:
                self.kernel_collectives.append(_collective_from_args(args, ts, dur))
        elif cat in LAUNCH_CATS:
            corr = (ev.get("args") or {}).get("correlation")
            if corr is not None:
                self.launch_corr.append(int(corr))
                self.launch_ts.append(ts)
        elif cat == "cpu_op":
            comm = name.startswith(COMM_OP_PREFIXES)
            self.cpu_ts.append(ts)
            self.cpu_dur.append(dur)
            self.cpu_tid.append(_int(ev.get("tid")))
            self.cpu_kind.append(OP_COMMUNICATION if comm else
                                 OP_BACKWARD if name.startswith(BACKWARD_OP_PREFIX) else OP_COMPUTE)
            if comm:
                c = _collective_from_op(name, ev.get("args") or {}, ts, dur)
                if c is not None:
                    self.collectives.append(c)
        elif cat == "user_annotation" and isinstance(name, str) and (found := pipeline_instruction(name)):
            self.instructions.append(Instruction(found[0], ts, dur, found[1]))
        elif cat == "user_annotation" and isinstance(name, str) and name.startswith("ProfilerStep"):
            m = _STEP.match(name)
            if m:
                self.steps.append(Step(int(m.group(1)), ts, dur))
                tid = _int(ev.get("tid"))
                self.step_tids[tid] = self.step_tids.get(tid, 0) + 1

    def finish(self, tf: TraceFile) -> RankTrace:
        info = tf.meta.get("distributedInfo") or {}
        if not isinstance(info, dict):
            info = {}
        rank = info.get("rank")
        steps = sorted({s.number: s for s in self.steps}.values(), key=lambda s: s.ts)
        return RankTrace(
            path=tf.path, rank=int(rank) if isinstance(rank, int) else None,
            world_size=int(info["world_size"]) if isinstance(info.get("world_size"), int) else None,
            backend=info.get("backend") if isinstance(info.get("backend"), str) else None,
            process_groups=[g for g in info.get("pg_config") or [] if isinstance(g, dict)],
            steps=steps,
            host_thread=max(self.step_tids, key=self.step_tids.__getitem__) if self.step_tids else None,
            dev_ts=np.frombuffer(self.dev_ts, dtype=np.float64), dev_dur=np.frombuffer(self.dev_dur, dtype=np.float64),
            dev_kind=np.frombuffer(self.dev_kind, dtype=np.int8), dev_corr=np.frombuffer(self.dev_corr, dtype=np.int64),
            launch_corr=np.frombuffer(self.launch_corr, dtype=np.int64),
            launch_ts=np.frombuffer(self.launch_ts, dtype=np.float64),
            cpu_ts=np.frombuffer(self.cpu_ts, dtype=np.float64), cpu_dur=np.frombuffer(self.cpu_dur, dtype=np.float64),
            cpu_tid=np.frombuffer(self.cpu_tid, dtype=np.int64), cpu_kind=np.frombuffer(self.cpu_kind, dtype=np.int8),
            # record_param_comms sits on the host for every backend; the kernels' copy only where it lacks
            collectives=sorted(self.collectives or self.kernel_collectives, key=lambda c: c.ts),
            instructions=sorted(self.instructions, key=lambda i: i.ts))


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def _collective_from_args(args: dict[str, Any], ts: float, dur: float) -> Collective:
    n = args.get("In msg nelems")
    elements = int(n) if isinstance(n, int | float) else None
    return Collective(name=str(args.get("Collective name", "")), ts=ts, dur=dur, elements=elements)


_C10D_NAMES = {"allreduce_": "allreduce", "send": "send", "recv_": "recv", "broadcast_": "broadcast",
               "allgather_": "all_gather", "_allgather_base_": "all_gather", "reduce_scatter_": "reduce_scatter",
               "_reduce_scatter_base_": "reduce_scatter", "alltoall_base_": "all_to_all", "barrier": "barrier",
               "reduce_": "reduce"}


def _collective_from_op(name: str, args: dict[str, Any], ts: float, dur: float) -> Collective | None:
    """A host communication operator as a collective: `record_param_comms` carries the sizes;
    `c10d::*` carries them as input shapes (with record_shapes), and send/recv their peer."""
    if name == "record_param_comms":
        return _collective_from_args(args, ts, dur) if "Collective name" in args else None
    if not name.startswith("c10d::"):
        return None  # gloo:* / nccl:* run the c10d call they belong to: counted once, there
    op = _C10D_NAMES.get(name[len("c10d::"):])
    if op is None:
        return None
    elements = _elements(args.get("Input Dims"))
    peer = None
    if op in ("send", "recv"):
        concrete = args.get("Concrete Inputs") or []
        if len(concrete) > 2:
            try:
                peer = int(concrete[2])
            except (TypeError, ValueError):
                peer = None
    return Collective(name=op, ts=ts, dur=dur, elements=elements, peer=peer)


def _elements(dims: Any) -> int | None:
    """Elements of the first input: `[[[1000]], [], ...]` (a tensor list) or `[[256, 256]]`."""
    if not isinstance(dims, list) or not dims:
        return None
    first = dims[0]
    if isinstance(first, list) and first and isinstance(first[0], list):
        first = first[0]
    if not isinstance(first, list) or not all(isinstance(d, int) for d in first):
        return None
    return math.prod(first) if first else 1


def require_steps(t: RankTrace) -> None:
    if not t.steps:
        raise InputFileError(
            f"{t.path}: the trace holds no ProfilerStep marker: the profiler's schedule recorded no step. "
            "Record with torch.profiler.profile(schedule=torch.profiler.schedule(wait=1, warmup=1, active=3), "
            "...) and call prof.step() after every training step")
