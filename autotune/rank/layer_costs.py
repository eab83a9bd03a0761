"""Per-layer cost of a PipelineEngine's stage: forward and backward seconds of every layer.

A trial that asks for them (the study's baseline by default; every trial with
`--layer-costs`) measures them in a block of steps after its measured steps, outside
every figure (autotune/rank/wiring.py `LAYER_COST_STEPS`): the hooks add a call per layer
per micro-batch. The sink rides on the PipelineProbe (autotune/rank/instrument.py): the
probe hands it every step's record (so warm-up steps are known) and closes it at the end,
when it writes `layer-costs-rank{R}.csv` (format: docs/partition.md).

How a layer is timed, with the probe's clock (autotune/rank/timing.py: CUDA events on
a GPU; on a CPU the thread's CPU time, so a layer's cost is its work and not the
wait for a core, which on a machine with fewer cores than ranks depends on what the
other ranks do at that moment):
- forward: a forward pre-hook and a forward hook on each layer module of the stage
  (`module.forward_funcs`; a plain function layer is not timed and costs 0);
- backward: a hook on each layer's output tensor fires when the gradient of that
  output is ready, which is when that layer's backward starts; the layer's
  backward ends when the next such hook fires (the layer below), or when the
  BackwardPass instruction returns (the stage's first layer);
- the rest of each ForwardPass/BackwardPass instruction is the stage's overhead:
  on the last stage that is the loss (forward and backward), which always stays
  with the last stage whatever the partition, so it is a fixed cost of that stage.
Activation bytes are counted once per layer, on its first forward: the bytes of
the tensors autograd saves for backward (torch.autograd.graph.saved_tensors_hooks),
parameters excluded. With activation checkpointing, recomputed forwards run inside
the backward and count in both.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import resource
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.core.fileio import write_atomic
from autotune.rank.engine_face import Instruction, instructions_of, layout_of
from autotune.rank.timing import IntervalTimer, make_timer, work_view

FILE_PATTERN = "layer-costs-rank{rank}.csv"
FILE_GLOB = "layer-costs-rank*.csv"
COLUMNS = ("rank", "stage", "stages", "layer", "name", "forward_seconds", "backward_seconds",
           "parameters", "activation_bytes", "stage_overhead_seconds", "stage_peak_memory_bytes",
           "peak_memory_kind", "micro_batch_size", "gradient_accumulation_steps", "steps")
_FWD_PASS, _BWD_PASS, _BWD_PRE = "ForwardPass", "BackwardPass", "bwd-pre"
HOW_TO_MEASURE = ("a new `autotune run` of the job measures them in its baseline (unless --no-layer-costs; "
                  "a budget of 1 is enough)")
"""What to run for layer costs, in every message that needs them (the model's, `plan`'s)."""


class LayerCostSink:
    """Hooks on one stage's layers; a sink of the PipelineProbe (write per step, close at the end)."""

    def __init__(self, engine: Any, path: str | Path, *, timer: IntervalTimer | None = None) -> None:
        self.engine = engine
        self.path = Path(path)
        self.device_type = engine.device.type if hasattr(engine, "device") else "cpu"
        self.timer = timer or make_timer(self.device_type)
        module = engine.module
        start = int(getattr(module, "_local_start", 0))
        self.layers: list[tuple[int, str, Any]] = []  # (global index, name, module or None)
        for i, fn in enumerate(module.forward_funcs):
            name = type(fn).__name__ if hasattr(fn, "register_forward_hook") else getattr(fn, "__name__", "function")
            self.layers.append((start + i, name, fn if hasattr(fn, "register_forward_hook") else None))
        self.last_stage = bool(engine.is_last_stage())
        self.steps: list[dict[str, float]] = []
        self.activation: dict[int, int] = {}
        self._handles: list[Any] = []
        self._open: tuple[Any, str] | None = None  # the backward interval running now
        self._param_ptrs: set[int] = set()
        self._closed = False
        self._undo: Callable[[], None] | None = None
        self._install()

    # -- hooks ------------------------------------------------------------------
    def _install(self) -> None:
        import torch

        self._param_ptrs = {p.data_ptr() for p in self.engine.module.parameters()}
        for index, _name, layer in self.layers:
            if layer is None:
                continue
            tokens: list[Any] = []
            saved: list[Any] = []

            def pre(_mod: Any, _args: Any, index: int = index, tokens: list = tokens, saved: list = saved) -> None:
                if index not in self.activation:
                    ctx = torch.autograd.graph.saved_tensors_hooks(self._pack_counter(index), lambda t: t)
                    ctx.__enter__()
                    saved.append(ctx)
                tokens.append(self.timer.begin())

            def post(_mod: Any, _args: Any, out: Any, index: int = index, tokens: list = tokens,
                     saved: list = saved) -> None:
                self.timer.end(tokens.pop(), f"fwd:{index}")
                if saved:
                    saved.pop().__exit__(None, None, None)
                    self.activation.setdefault(index, 0)
                tensor = _grad_tensor(out)
                if tensor is not None:
                    tensor.register_hook(lambda grad, index=index: self._grad_ready(index))

            self._handles.append(layer.register_forward_pre_hook(pre))
            self._handles.append(layer.register_forward_hook(post))

        def timed(instruction: Instruction, fn: Any) -> Any:
            if instruction.name == _FWD_PASS:
                return self._timed_forward(fn)
            return self._timed_backward(fn) if instruction.name == _BWD_PASS else fn

        self._undo = instructions_of(self.engine).wrap(timed)  # over the probe's timed functions

    def _pack_counter(self, index: int):
        def pack(t: Any) -> Any:
            if t.data_ptr() not in self._param_ptrs:
                self.activation[index] = self.activation.get(index, 0) + t.numel() * t.element_size()
            return t
        return pack

    def _grad_ready(self, index: int) -> None:
        """The gradient of layer `index`'s output exists: its backward starts, the one above ended."""
        last_local = self.layers[-1][0]
        if index == last_local and not self.last_stage:
            return  # the stage's backward starts with this layer (see _timed_backward)
        if self._open is not None:
            token, category = self._open
            self.timer.end(token, category)
        self._open = (self.timer.begin(), f"bwd:{index}")

    def _timed_forward(self, fn: Any) -> Any:
        def run(engine_self: Any, **kwargs: Any) -> Any:
            token = self.timer.begin()
            try:
                return fn(engine_self, **kwargs)
            finally:
                self.timer.end(token, _FWD_PASS)
        return run

    def _timed_backward(self, fn: Any) -> Any:
        def run(engine_self: Any, **kwargs: Any) -> Any:
            token = self.timer.begin()
            first = _BWD_PRE if self.last_stage else f"bwd:{self.layers[-1][0]}"
            self._open = (self.timer.begin(), first)
            try:
                return fn(engine_self, **kwargs)
            finally:
                if self._open is not None:
                    self.timer.end(*self._open)
                    self._open = None
                self.timer.end(token, _BWD_PASS)
        return run

    def detach(self) -> None:
        """Remove every hook and give the engine back the instruction map it had (overhead benchmark)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._undo is not None:
            self._undo()
            self._undo = None
        self.timer.collect()

    # -- sink -------------------------------------------------------------------
    def write(self, record: Any) -> None:
        parts = work_view(self.timer.collect())  # CPU: thread CPU time, not the wait for a core
        if not record.warmup:
            self.steps.append(parts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, rows_to_csv(self.rows()))

    def rows(self) -> list[dict[str, Any]]:
        eng = self.engine
        med = _medians(self.steps)
        fwd_layers = sum(med.get(f"fwd:{i}", 0.0) for i, _, _ in self.layers)
        bwd_layers = sum(med.get(f"bwd:{i}", 0.0) for i, _, _ in self.layers)
        overhead = max(0.0, med.get(_FWD_PASS, 0.0) - fwd_layers) + max(0.0, med.get(_BWD_PASS, 0.0) - bwd_layers)
        peak, kind = _peak_memory(self.device_type)
        layout = layout_of(eng)
        out = []
        for index, name, layer in self.layers:
            params = sum(p.numel() for p in layer.parameters()) if layer is not None else 0
            out.append({
                "rank": layout.rank, "stage": layout.stage, "stages": layout.stages,
                "layer": index, "name": name,
                "forward_seconds": med.get(f"fwd:{index}", 0.0), "backward_seconds": med.get(f"bwd:{index}", 0.0),
                "parameters": params, "activation_bytes": self.activation.get(index, 0),
                "stage_overhead_seconds": overhead, "stage_peak_memory_bytes": peak, "peak_memory_kind": kind,
                "micro_batch_size": layout.micro_batch_size,
                "gradient_accumulation_steps": layout.accumulation_steps, "steps": len(self.steps),
            })
        return out


def _grad_tensor(out: Any) -> Any:
    """The layer output whose gradient marks the layer's backward (the first tensor needing one)."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    for t in items:
        if getattr(t, "requires_grad", False) and hasattr(t, "register_hook"):
            return t
    return None


def _medians(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = {k for s in steps for k in s}
    return {k: float(statistics.median([s.get(k, 0.0) for s in steps])) for k in keys}


def _peak_memory(device_type: str) -> tuple[float, str]:
    """The stage's peak memory and what it means: the CUDA allocator's peak, or on CPU the
    process's peak resident set (everything the process ever touched: torch, DeepSpeed,
    buffers; not the model alone)."""
    if device_type == "cuda":
        import torch

        return float(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), "process_max_rss"


def sink_path(probe: Any, trial_dir: str | Path) -> Path:
    """Where the layer costs of `probe`'s rank are written: `trial_dir/layer-costs-rank{R}.csv`."""
    return Path(trial_dir) / FILE_PATTERN.format(rank=int(probe.engine.global_rank))


def attach(probe: Any, trial_dir: str | Path) -> LayerCostSink:
    """Measure layer costs of `probe`'s engine in every step it records from now on."""
    sink = LayerCostSink(probe.engine, sink_path(probe, trial_dir))
    probe.sinks.append(sink)
    return sink


def rows_to_csv(rows: Sequence[dict[str, Any]]) -> str:
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.9g}" if isinstance(v, float) else v) for k, v in r.items()})
    return buf.getvalue()


# --- reading ----------------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class LayerCosts:
    """One trial's per-layer costs, all stages merged (ranks of one stage averaged)."""

    names: list[str]
    forward_seconds: list[float]
    backward_seconds: list[float]
    parameters: list[int]
    activation_bytes: list[int]
    parts: list[int]
    """The partition the costs were measured under."""
    stage_overhead_seconds: list[float]
    """Per stage: forward/backward time outside any layer (the loss on the last stage)."""
    stage_peak_memory_bytes: list[float]
    peak_memory_kind: str
    micro_batch_size: int
    gradient_accumulation_steps: int

    @property
    def costs(self) -> list[float]:
        """Forward + backward seconds per step, per layer."""
        return [f + b for f, b in zip(self.forward_seconds, self.backward_seconds, strict=True)]

    @property
    def stages(self) -> int:
        return len(self.parts) - 1

    @property
    def stage_fixed_seconds(self) -> list[float]:
        """What stays with a stage whatever the partition: its overhead (the loss on the last
        stage; the engine's own tensor handling elsewhere)."""
        return list(self.stage_overhead_seconds)


def read_layer_costs(files: Sequence[str | Path]) -> LayerCosts:
    """Merge the `layer-costs-rank*.csv` files of one trial (every stage must be there)."""
    from autotune.core.errors import InputFileError

    by_layer: dict[int, list[dict[str, str]]] = defaultdict(list)
    stages: set[int] = set()
    n_stages = None
    for f in files:
        with open(f, encoding="utf-8", newline="") as fh:
            reader = csv.DictReader(fh)
            missing = set(COLUMNS) - set(reader.fieldnames or ())
            if missing:
                raise InputFileError(f"{f}: not a layer-costs file (missing {', '.join(sorted(missing))})")
            for row in reader:
                by_layer[int(row["layer"])].append(row)
                stages.add(int(row["stage"]))
                n_stages = int(row["stages"])
    if not by_layer or n_stages is None:
        raise InputFileError(f"no layer costs in {', '.join(map(str, files)) or 'no files'}")
    if stages != set(range(n_stages)) or sorted(by_layer) != list(range(len(by_layer))):
        raise InputFileError(f"layer costs cover stages {sorted(stages)} of {n_stages} and layers "
                             f"{min(by_layer)}-{max(by_layer)}: every stage's file is needed")
    layers = [by_layer[i] for i in range(len(by_layer))]

    def mean(rows: list[dict[str, str]], key: str) -> float:
        return sum(float(r[key]) for r in rows) / len(rows)

    stage_of = [int(rows[0]["stage"]) for rows in layers]
    parts = [0] + [i for i in range(1, len(layers)) if stage_of[i] != stage_of[i - 1]] + [len(layers)]
    per_stage: dict[int, list[dict[str, str]]] = defaultdict(list)
    for rows in layers:
        per_stage[int(rows[0]["stage"])].extend(rows)
    first = layers[0][0]
    return LayerCosts(
        names=[rows[0]["name"] for rows in layers],
        forward_seconds=[mean(rows, "forward_seconds") for rows in layers],
        backward_seconds=[mean(rows, "backward_seconds") for rows in layers],
        parameters=[int(layers[i][0]["parameters"]) for i in range(len(layers))],
        activation_bytes=[int(round(mean(rows, "activation_bytes"))) for rows in layers],
        parts=parts,
        stage_overhead_seconds=[mean(per_stage[s], "stage_overhead_seconds") for s in range(n_stages)],
        stage_peak_memory_bytes=[max(float(r["stage_peak_memory_bytes"]) for r in per_stage[s])
                                 for s in range(n_stages)],
        peak_memory_kind=first["peak_memory_kind"],
        micro_batch_size=int(first["micro_batch_size"]),
        gradient_accumulation_steps=int(first["gradient_accumulation_steps"]),
    )


def read_trial_layer_costs(trial_dir: str | Path) -> LayerCosts | None:
    """The layer costs of a trial folder, or None where it has none."""
    files = sorted(Path(trial_dir).glob(FILE_GLOB))
    return read_layer_costs(files) if files else None


STATE_BYTES_PER_PARAMETER = 16
"""Weights, gradients and Adam's two moments: 4 + 4 + 8 bytes in fp32; mixed precision holds
about the same (2 + 2 bytes of half weights and gradients, a 4-byte master copy, 8 of moments)."""
HEADROOM = 0.10
"""The share of the device's memory a partition leaves free: the allocator's fragmentation and
workspaces, and the model's own error (16 bytes per parameter is an estimate). The out-of-memory
model needs none (autotune/tuning/proposers/feasibility.py): it compares measured peaks with the
capacity, not a model of the layers."""


def memory_model(lc: LayerCosts, capacity_bytes: float | None, *, headroom: float = HEADROOM) -> Any:
    """The per-stage memory limit for the partition solver, from a trial's layer costs and the
    device's capacity; None where memory cannot be modelled honestly (no capacity: a CPU; or
    peaks that are not the CUDA allocator's, such as a CPU process's resident set).

    Each stage's bytes outside the modelled layer state (context, buffers, the loss's logits)
    are what its measured peak holds beyond the model of its measured layers; they stay with
    the stage whatever layers move."""
    from autotune.core.partition import MemoryModel, stage_memory

    if not capacity_bytes or lc.peak_memory_kind != "cuda_max_allocated":
        return None
    layers = MemoryModel(limit_bytes=math.inf,
                         parameter_bytes=[p * STATE_BYTES_PER_PARAMETER for p in lc.parameters],
                         activation_bytes=[float(a) for a in lc.activation_bytes],
                         micro_batches=lc.gradient_accumulation_steps)
    modelled = stage_memory(lc.parts, layers)
    fixed = [max(0.0, peak - m) for peak, m in zip(lc.stage_peak_memory_bytes, modelled, strict=True)]
    return dataclasses.replace(layers, limit_bytes=float(capacity_bytes) * (1 - headroom), stage_fixed_bytes=fixed)
