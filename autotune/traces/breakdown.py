"""Per rank: where the step's time went, from one rank's trace (autotune/traces/rank_trace.py).

Device traces (kernels on device streams), as HTA computes them, so the two can be checked
against each other (tests/test_traces.py runs HTA on the same files):
- the steps analysed are every `ProfilerStep` but the last (whose kernels may run past the
  trace's end), and a device event counts when the host call that launched it started
  before the last step did;
- the window is the first such event's start to the last one's end (HTA's "kernel time");
- compute, communication and memory time are the unions of their kernels; the shares of the
  window are compute, then communication not hidden under compute, then memory not hidden
  under either, then other kernels, then idle, so they sum to 1; HTA's "non-compute" is
  communication + memory + other;
- overlap is the share of communication time that ran while a compute kernel did (HTA's
  `get_comm_comp_overlap`).

Host-only traces (a CPU job: gloo, no kernels) have no device time. Every step counts, the
window is the steps' span, compute is the union of the host's non-communication operators
and communication the union of c10d/gloo operators on any thread; a wait for a peer that no
operator covers (gloo's `work.wait()`) is idle time.

Where the trace labels DeepSpeed's pipeline instructions (a trial's trace, autotune/core/trace_labels.py),
a host trace's compute, communication, waits and bubble are the probe's own: compute is the
forward, backward and optimizer instructions, communication the sends, receives and
reductions, and a send's or receive's wait for its peer is its time beyond the fastest of its
kind (autotune/rank/p2p_split.py); the forward passes per step are the micro-batches.

The same per step: utilization (the busy share of the step's wall time: any kernel on a
device, a computing operator on a host, as the probe's samplers measure it), and the bubble:
the idle share between the step's first compute and the end of its last backward (the 1F1B
fill and drain plus the waits imbalance causes; the optimizer step after it is outside).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

from autotune.core.trace_labels import (
    BACKWARD,
    COMPUTE_INSTRUCTIONS,
    FORWARD,
    P2P_INSTRUCTIONS,
    PLAIN_FORWARD,
    PLAIN_PHASES,
    REDUCE_INSTRUCTIONS,
    is_plain_collective,
)
from autotune.traces.intervals import clip, merge, overlap_length, union_length
from autotune.traces.rank_trace import (
    COMMUNICATION,
    COMPUTE,
    MEMORY,
    OP_BACKWARD,
    OP_COMMUNICATION,
    RankTrace,
    Step,
    require_steps,
)

US = 1e-6
"""Trace timestamps are microseconds."""


@dataclass(frozen=True, kw_only=True)
class RankBreakdown:
    label: str
    rank: int | None
    device: bool
    """True: from device kernels; False: a host-only trace (no device time in it)."""
    steps: list[Step]
    """The steps analysed."""
    window_seconds: float
    compute_share: float
    communication_share: float
    """Communication not hidden under compute."""
    memory_share: float | None
    other_share: float | None
    idle_share: float
    compute_seconds: float
    """Compute time in the window (the union), per step."""
    communication_seconds: float
    """Communication time in the window (the union, hidden or not), per step."""
    peer_wait_seconds: float | None = None
    """Of it, the time sends and receives waited for their peer, per step (host traces: each
    one's time beyond the fastest of its kind, the probe's rule, autotune/rank/p2p_split.py);
    None where the trace cannot tell (an NCCL kernel spins until its peer arrives)."""
    overlap: float | None
    """Share of communication time that ran under compute; None without communication."""
    micro_batches: int | None = None
    """Forward passes per step, where the trace labels the instructions."""
    utilization: list[float] = field(default_factory=list)
    """Per analysed step: the busy share of its wall time."""
    bubbles: list[float] = field(default_factory=list)
    """Per analysed step with a backward: idle share from the first compute to the last backward's end."""
    step_seconds: list[float] = field(default_factory=list)

    @property
    def non_compute_share(self) -> float:
        return 1.0 - self.compute_share - self.idle_share

    @property
    def transfer_seconds(self) -> float:
        """Communication less the waits for a peer, where the trace tells them apart."""
        return max(0.0, self.communication_seconds - (self.peer_wait_seconds or 0.0))

    @property
    def comm_compute_ratio(self) -> float | None:
        """Transfer / compute: a wait for a peer is not communication (README "Signals")."""
        return self.transfer_seconds / self.compute_seconds if self.compute_seconds > 0 else None

    @property
    def bubble(self) -> float | None:
        return statistics.median(self.bubbles) if self.bubbles else None


def breakdown(t: RankTrace) -> RankBreakdown:
    require_steps(t)
    return _device(t) if t.has_device else _host(t)


def _launch_times(t: RankTrace) -> np.ndarray:
    """Each device event's launch time (NaN where no host call in the trace launched it)."""
    out = np.full(len(t.dev_corr), np.nan)
    if len(t.launch_corr) == 0:
        return out
    order = np.argsort(t.launch_corr, kind="stable")
    corr, ts = t.launch_corr[order], t.launch_ts[order]
    idx = np.clip(np.searchsorted(corr, t.dev_corr), 0, len(corr) - 1)
    hit = (corr[idx] == t.dev_corr) & (t.dev_corr >= 0)
    out[hit] = ts[idx[hit]]
    return out


def _device(t: RankTrace) -> RankBreakdown:
    steps = t.steps[:-1] if len(t.steps) > 1 else t.steps
    launched = _launch_times(t)
    cutoff = t.steps[-1].ts if len(t.steps) > 1 else t.steps[0].end
    keep = launched < cutoff  # NaN compares False: events no traced host call launched
    ts, end, kind, lts = t.dev_ts[keep], t.dev_ts[keep] + t.dev_dur[keep], t.dev_kind[keep], launched[keep]
    if len(ts) == 0:
        return _empty(t, steps, device=True)
    lo, hi = float(ts.min()), float(end.max())
    window = hi - lo
    comp = (ts[kind == COMPUTE], end[kind == COMPUTE])
    comm = (ts[kind == COMMUNICATION], end[kind == COMMUNICATION])
    mem = (ts[kind == MEMORY], end[kind == MEMORY])
    c = union_length(*comp)
    c_k = union_length(np.concatenate([comp[0], comm[0]]), np.concatenate([comp[1], comm[1]]))
    c_k_m = union_length(np.concatenate([comp[0], comm[0], mem[0]]), np.concatenate([comp[1], comm[1], mem[1]]))
    busy = union_length(ts, end)
    k = union_length(*comm)
    n = len(steps)
    bubbles = []
    for s in steps:
        bwd_end = _last_backward_end(t, s)
        if bwd_end is None:
            continue
        sel = (kind == COMPUTE) & (lts >= s.ts) & (lts <= bwd_end)
        if sel.any():
            bubbles.append(_idle_share(ts[sel], end[sel]))
    return RankBreakdown(
        label=t.label, rank=t.rank, device=True, steps=steps, window_seconds=window * US,
        compute_share=c / window, communication_share=(c_k - c) / window, memory_share=(c_k_m - c_k) / window,
        other_share=(busy - c_k_m) / window, idle_share=(window - busy) / window,
        compute_seconds=c * US / n, communication_seconds=k * US / n,
        overlap=overlap_length(comp, comm) / k if k > 0 else None,
        utilization=[_busy_share(ts, end, s) for s in steps], bubbles=bubbles,
        step_seconds=[s.dur * US for s in steps])


def _host(t: RankTrace) -> RankBreakdown:
    steps = t.steps
    lo, hi = steps[0].ts, steps[-1].end
    window = hi - lo
    ops_end = t.cpu_ts + t.cpu_dur
    is_comm = t.cpu_kind == OP_COMMUNICATION
    comp = clip(t.cpu_ts[~is_comm], ops_end[~is_comm], lo, hi)
    comm = clip(t.cpu_ts[is_comm], ops_end[is_comm], lo, hi)
    c = union_length(*comp)
    k = union_length(*comm)
    busy = union_length(np.concatenate([comp[0], comm[0]]), np.concatenate([comp[1], comm[1]]))
    n = len(steps)
    host = t.cpu_tid == t.host_thread
    bubbles = []
    for s in steps:
        bwd_end = _last_backward_end(t, s)
        if bwd_end is None:
            continue
        sel = host & ~is_comm & (t.cpu_ts >= s.ts) & (ops_end <= bwd_end)
        if sel.any():
            bubbles.append(_idle_share(t.cpu_ts[sel], ops_end[sel]))
    out = RankBreakdown(
        label=t.label, rank=t.rank, device=False, steps=steps, window_seconds=window * US,
        compute_share=c / window if window > 0 else 0.0,
        communication_share=(busy - c) / window if window > 0 else 0.0,
        memory_share=None, other_share=None,
        idle_share=(window - busy) / window if window > 0 else 0.0,
        compute_seconds=c * US / n, communication_seconds=k * US / n,
        peer_wait_seconds=_p2p_waits(t, lo, hi) * US / n,
        overlap=overlap_length(comp, comm) / k if k > 0 else None,
        utilization=[_busy_share(*comp, s) for s in steps], bubbles=bubbles,
        step_seconds=[s.dur * US for s in steps])
    return _with_instructions(out, t) if t.instructions else out


def _with_instructions(b: RankBreakdown, t: RankTrace) -> RankBreakdown:
    """The probe's compute, transfer, wait, bubble and micro-batches, from the labelled instructions."""
    from dataclasses import replace

    steps = b.steps
    ins = [i for i in t.instructions if steps[0].ts <= i.ts < steps[-1].end]
    n = len(steps)
    if any(i.name in PLAIN_PHASES for i in ins):
        return _plain_engine(b, ins)
    compute = sum(i.dur for i in ins if i.name in COMPUTE_INSTRUCTIONS)
    comm = sum(i.dur for i in ins if i.name in P2P_INSTRUCTIONS or i.name in REDUCE_INSTRUCTIONS)
    wait = _beyond_fastest([(i.name, i.dur) for i in ins if i.name in P2P_INSTRUCTIONS])
    bubbles, forwards = [], []
    for s in steps:
        mine = [i for i in ins if s.ts <= i.ts < s.end]
        fwd = [i for i in mine if i.name == FORWARD]
        bwd = [i for i in mine if i.name == BACKWARD]
        micros = {i.micro for i in fwd}  # torch's labels name it: a rank with v stages runs v forwards of each
        forwards.append(len(micros) if None not in micros else len(fwd))
        if fwd and bwd:
            span = max(i.ts + i.dur for i in bwd) - fwd[0].ts
            busy = sum(i.dur for i in fwd + bwd)
            bubbles.append(max(0.0, 1.0 - busy / span) if span > 0 else 0.0)
    return replace(b, compute_seconds=compute * US / n, communication_seconds=comm * US / n,
                   peer_wait_seconds=wait * US / n, bubbles=bubbles or b.bubbles,
                   micro_batches=int(statistics.median(forwards)) if any(forwards) else None)


def _plain_engine(b: RankBreakdown, ins: list) -> RankBreakdown:
    """A plain engine's step as its probe times it: compute is the forward, backward and step
    less the collectives inside them (ZeRO reduces in the backward's hooks and gathers in the
    step), communication those collectives, the wait each one's time beyond the fastest of its
    kind; micro-batches are the forwards of a step. No bubble: not a pipeline job."""
    from dataclasses import replace

    phases = [i for i in ins if i.name in PLAIN_PHASES]
    calls = [i for i in ins if is_plain_collective(i.name)]
    inside = sum(c.dur for c in calls if any(p.ts <= c.ts and c.ts + c.dur <= p.ts + p.dur for p in phases))
    n = len(b.steps)
    forwards = [sum(1 for i in phases if i.name == PLAIN_FORWARD and s.ts <= i.ts < s.end) for s in b.steps]
    return replace(b, compute_seconds=(sum(p.dur for p in phases) - inside) * US / n,
                   communication_seconds=sum(c.dur for c in calls) * US / n,
                   peer_wait_seconds=_beyond_fastest([(c.name, c.dur) for c in calls]) * US / n, bubbles=[],
                   micro_batches=int(statistics.median(forwards)) if any(forwards) else None)


def _p2p_waits(t: RankTrace, lo: float, hi: float) -> float:
    """The sends' and receives' waits for their peer, a kind being a direction and a size (one
    tensor shape over one link)."""
    return _beyond_fastest([((c.name, c.elements), c.dur) for c in t.collectives
                            if c.name in ("send", "recv") and lo <= c.ts < hi])


def _beyond_fastest(timed: list[tuple[object, float]]) -> float:
    """Per kind, the fastest instance is the transfer and each one's time beyond it its wait
    (the probe's rule, autotune/rank/p2p_split.py): the waits' sum."""
    fastest: dict[object, float] = {}
    for kind, dur in timed:
        fastest[kind] = min(fastest.get(kind, dur), dur)
    return sum(dur - fastest[kind] for kind, dur in timed)


def _empty(t: RankTrace, steps: list[Step], *, device: bool) -> RankBreakdown:
    return RankBreakdown(label=t.label, rank=t.rank, device=device, steps=steps, window_seconds=0.0,
                         compute_share=0.0, communication_share=0.0, memory_share=None, other_share=None,
                         idle_share=1.0, compute_seconds=0.0, communication_seconds=0.0, overlap=None,
                         step_seconds=[s.dur * US for s in steps])


def _busy_share(starts: np.ndarray, ends: np.ndarray, s: Step) -> float:
    if s.dur <= 0:
        return 0.0
    return union_length(*clip(starts, ends, s.ts, s.end)) / s.dur


def _last_backward_end(t: RankTrace, s: Step) -> float | None:
    """The end of the step's last autograd backward operator (any thread: CUDA's backward runs
    on the autograd engine's device thread, a CPU's on the training thread)."""
    sel = (t.cpu_kind == OP_BACKWARD) & (t.cpu_ts >= s.ts) & (t.cpu_ts < s.end)
    if not sel.any():
        return None
    return float((t.cpu_ts[sel] + t.cpu_dur[sel]).max())


def _idle_share(starts: np.ndarray, ends: np.ndarray) -> float:
    s, e = merge(starts, ends)
    span = float(e.max() - s.min())
    return 1.0 - float((e - s).sum()) / span if span > 0 else 0.0
