"""DeepSpeed's pipeline schedule, replayed on modelled durations: the time of one step.

`TrainSchedule` (deepspeed/runtime/pipe/schedule.py, 0.19.8) gives each stage 2(m + p - 1)
instruction steps; stage s alternates forwards and backwards so that it holds at most
min(p - s, m) micro-batches in flight (1F1B). A step's sends are issued at the start of the
next instruction step (SendActivation after RecvGrad, SendGrad before RecvActivation), and
each point-to-point pair is a rendezvous on gloo and NCCL alike: both sides wait until the
other is there, then the transfer takes its time on both. `step_time` replays exactly that
order with the durations it is given, so the fill and drain bubble and the waits an
unbalanced partition causes come out of the replay, not out of a formula.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FWD, BWD, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "F", "B", "SA", "RA", "SG", "RG"


def _micro_batch(step: int, stage: int, stages: int) -> tuple[int, bool]:
    """TrainSchedule._step_to_micro_batch: (micro-batch id, is forward) of one instruction step."""
    even_step, even_stage = step % 2 == 0, stage % 2 == 0
    if even_step and even_stage:
        return step // 2 - stage // 2, True
    if not even_step and not even_stage:
        return (step - 1) // 2 - stage // 2, True
    if even_step and not even_stage:
        return step // 2 - stages + (stage + 1) // 2, False
    return (step - 1) // 2 - stages + 1 + stage // 2, False


def instructions(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """Stage `stage`'s compute and point-to-point instructions in TrainSchedule's order."""
    out: list[tuple[str, int]] = []
    valid = range(micro_batches).__contains__
    prev = -1
    for step in range(2 * (micro_batches + stages - 1)):
        mb, forward = _micro_batch(step, stage, stages)
        if forward:
            if valid(prev) and stage > 0:
                out.append((SEND_GRAD, prev))
            if valid(mb) and stage > 0:
                out.append((RECV_ACT, mb))
        else:
            if valid(mb) and stage < stages - 1:
                out.append((RECV_GRAD, mb))
            if valid(prev) and stage < stages - 1:
                out.append((SEND_ACT, prev))
        if valid(mb):
            out.append((FWD if forward else BWD, mb))
        prev = mb
    return out


@dataclass(frozen=True, slots=True)
class StageTimes:
    """One stage's modelled durations for one micro-batch."""

    forward: float
    backward: float
    """Backward, with the recompute of checkpointed layers where checkpointing is on."""


@dataclass(frozen=True, slots=True)
class Replay:
    """What the replay of one step's schedule gives."""

    pipeline_seconds: float
    """From the first instruction to the last stage's last backward: the schedule's span."""
    stage_end_seconds: list[float]
    """When each stage's last instruction ended."""
    stage_busy_seconds: list[float]
    """Each stage's forward and backward time (its compute)."""
    stage_wait_seconds: list[float]
    """Each stage's time waiting for a peer at a point-to-point rendezvous."""
    stage_transfer_seconds: list[float]

    @property
    def bubble_fraction(self) -> float:
        """Mean over stages of the idle share of the span: 1 - busy / span."""
        span = self.pipeline_seconds
        return sum(1 - b / span for b in self.stage_busy_seconds) / len(self.stage_busy_seconds) if span else 0.0


def replay(times: Sequence[StageTimes], micro_batches: int, transfer_seconds: Sequence[float], *,
           replicas: int = 1, cores: float | None = None) -> Replay:
    """Replay TrainSchedule for len(times) stages and `micro_batches` micro-batches.

    `transfer_seconds[s]` is one point-to-point transfer between stage s and s + 1 (an
    activation forward or a gradient back; both have the shape of stage s's output).

    `cores`: where the ranks share fewer cores than there are ranks (a CPU), each computing
    rank runs at min(1, cores / computing ranks) of a core (processor sharing over the
    `replicas` data-parallel copies of the pipeline, which run the same schedule in step), so
    a forward takes longer when every stage computes at once than in the fill and drain.
    `times` are then each rank's own work (thread CPU seconds); None: one device per rank."""
    stages = len(times)
    if stages < 1 or micro_batches < 1:
        raise ValueError("a schedule needs at least one stage and one micro-batch")
    if len(transfer_seconds) < stages - 1:
        raise ValueError("one transfer time per pair of neighbouring stages")
    program = [instructions(s, stages, micro_batches) for s in range(stages)]
    pos = [0] * stages
    clock = 0.0
    busy = [0.0] * stages
    wait = [0.0] * stages
    moved = [0.0] * stages
    end = [0.0] * stages
    left: list[float | None] = [None] * stages  # work left of the compute instruction running now
    blocked_since: list[float | None] = [None] * stages
    transfer_until: list[float | None] = [None] * stages
    partner = {SEND_ACT: (1, RECV_ACT), RECV_ACT: (-1, SEND_ACT), SEND_GRAD: (-1, RECV_GRAD),
               RECV_GRAD: (1, SEND_GRAD)}

    def start_next(s: int) -> None:
        """Stage s takes its next instruction: a compute starts; a point-to-point waits for its peer."""
        while pos[s] < len(program[s]) and left[s] is None and transfer_until[s] is None:
            kind, mb = program[s][pos[s]]
            if kind in (FWD, BWD):
                left[s] = times[s].forward if kind == FWD else times[s].backward
                return
            step, want = partner[kind]
            peer = s + step
            if (pos[peer] < len(program[peer]) and program[peer][pos[peer]] == (want, mb)
                    and blocked_since[peer] is not None):
                t = transfer_seconds[min(s, peer)]
                for r in (s, peer):
                    since = blocked_since[r]
                    wait[r] += clock - (since if since is not None else clock)
                    blocked_since[r] = None
                    moved[r] += t
                    transfer_until[r] = clock + t
                return
            if blocked_since[s] is None:
                blocked_since[s] = clock
            return

    for s in range(stages):
        start_next(s)
    while any(pos[s] < len(program[s]) for s in range(stages)):
        computing = [s for s in range(stages) if left[s] is not None]
        rate = 1.0 if cores is None or not computing else min(1.0, cores / (len(computing) * replicas))
        events = [clock + (left[s] or 0.0) / rate for s in computing]
        events += [t for t in transfer_until if t is not None]
        if not events:
            raise RuntimeError("pipeline schedule replay deadlocked")  # a schedule TrainSchedule never produces
        now = min(events)
        # Ends within a rounding error of `now` are at `now`: an absolute tolerance fails once the
        # clock is large (a residual of 1e-15 s no longer moves a clock of 30 s, and the replay
        # spun in place: a long step of many micro-batches never ended).
        eps = 1e-12 * max(1.0, abs(now))
        ended = {s for s, t in zip(computing, events, strict=False) if t <= now + eps}
        for s in computing:
            done = (now - clock) * rate
            busy[s] += now - clock
            left[s] = max(0.0, (left[s] or 0.0) - done)
        clock = now
        for s in range(stages):
            finished = False
            if s in ended:
                left[s] = None
                finished = True
            tu = transfer_until[s]
            if tu is not None and tu <= clock + eps:
                transfer_until[s] = None
                finished = True
            if finished:
                pos[s] += 1
                end[s] = clock
        for _ in range(2):  # a transfer that starts may let its peer's next instruction start too
            for s in range(stages):
                start_next(s)
    return Replay(pipeline_seconds=max(end), stage_end_seconds=end, stage_busy_seconds=busy,
                  stage_wait_seconds=wait, stage_transfer_seconds=moved)
