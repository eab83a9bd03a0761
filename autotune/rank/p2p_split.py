"""A point-to-point instruction's time, split into the transfer and the wait for the peer.

A pipeline send or receive blocks until its peer is there: gloo's send returns once the
receiver has taken the message, and a receive returns once the sender has sent it (on a
GPU, NCCL pairs them the same way). So each instance of SendActivation, SendGrad,
RecvActivation and RecvGrad lasts (waiting for the peer) + (the transfer). Counting all
of it as communication made a job that was merely unbalanced read as "chatty": the fast
stage's sends lasted as long as the slow stage's extra compute (issue 24).

The transfer of one kind of instruction is the same every micro-batch (the same tensor
shapes over the same link), and whichever rank of a matched send/receive pair arrives
second does not wait. So per kind, the fastest instance a rank has run in the trial is
its transfer; each instance's time beyond it is waiting. Its limit: a rank that waits in
every instance of a kind (never the second to arrive) counts the smallest of those waits
as transfer; in the measured runs each kind had instances without a wait (the fastest
0.3-0.4 ms on the CPU preset). `p2p_fastest_seconds` in the CSV keeps the estimate, so
it can be audited. tests/test_signal_truth.py and benchmarks/p2p_split_truth.py check
the split against an injected truth (docs/metrics.md).

Rank-side: no torch.
"""

from __future__ import annotations

import math

P2P_INSTRUCTIONS = ("SendActivation", "SendGrad", "RecvActivation", "RecvGrad")
"""DeepSpeed's point-to-point instructions (deepspeed/runtime/pipe/schedule.py)."""
P2P_PREFIX = "p2p:"
"""Timer category of each: `p2p:SendActivation`, ... (one kind, one transfer size)."""


def p2p_category(instruction: str) -> str:
    return P2P_PREFIX + instruction


class TransferSplit:
    """One rank's estimate, kept over its trial: per kind, the fastest instance seen.

    The same rule splits a plain engine's collectives (autotune/rank/collectives.py): one kind is
    one collective of one size, and the rank that reaches it last waits for no one, so its
    instances' time beyond the fastest is the wait for a slower rank (shared/docs/design.md: a
    collective that waits for a slower rank is waiting, not communication). `prefix` names the
    kinds this split reads."""

    def __init__(self, prefix: str = P2P_PREFIX) -> None:
        self.prefix = prefix
        self.fastest: dict[str, float] = {}

    def split(self, intervals: dict[str, list[float]]) -> tuple[float, float]:
        """(transfer, wait) seconds of one step's instances of this split's kinds."""
        transfer = wait = 0.0
        for kind, seconds in intervals.items():
            if not kind.startswith(self.prefix) or not seconds:
                continue
            fastest = min(self.fastest.get(kind, math.inf), min(seconds))
            self.fastest[kind] = fastest
            moved = fastest * len(seconds)
            transfer += moved
            wait += max(0.0, sum(seconds) - moved)
        return transfer, wait

    def fastest_seconds(self) -> float | None:
        """The fastest instance of any kind so far (the CSV's `p2p_fastest_seconds`); None: none yet."""
        return min(self.fastest.values()) if self.fastest else None
