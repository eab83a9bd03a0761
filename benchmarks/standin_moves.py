"""STAND-IN for `autotune.advisor.moves.propose_moves`, used by the tuner benchmark only
while the rule engine's module does not exist.

It mirrors a few of issue 3's built-in rules with their documented thresholds
(no knowledge of the simulator): bubble above target -> more micro-batches;
utilization fluctuation above 15 % -> larger micro-batch; comm/compute above
25 % -> smaller reduce_bucket_size and more gradient accumulation.
"""

from __future__ import annotations

from dataclasses import replace

from autotune.proposers.base import Proposal
from autotune.space import SearchSpace, TrialConfig
from autotune.summary import TrialSummary

BUBBLE_TARGET = 0.10
FLUCTUATION_MAX = 0.15
COMM_RATIO_MAX = 0.25


def propose_moves(summary: TrialSummary, current: TrialConfig, space: SearchSpace,
                  rules: object | None = None) -> list[Proposal]:
    out: list[Proposal] = []
    p = space.pipeline_stages
    if summary.bubble_fraction_ideal > BUBBLE_TARGET and p > 1:
        need = (p - 1) * (1 - BUBBLE_TARGET) / BUBBLE_TARGET  # m with (p-1)/(m+p-1) <= target
        if space.global_batch is None:
            bigger = [g for g in space.gas_values if g > current.gradient_accumulation_steps]
            good = [g for g in bigger if g >= need] or bigger[-1:]
            for g in good[:1]:
                cfg = replace(current, gradient_accumulation_steps=g)
                if space.contains(cfg):
                    out.append(Proposal(config=cfg, source="rule:pipeline-bubble",
                                        reason=f"ideal bubble {summary.bubble_fraction_ideal:.0%} > {BUBBLE_TARGET:.0%}: "
                                               f"GAS {current.gradient_accumulation_steps} -> {g}"))
        else:
            smaller = [m for m in space.micro_batch_sizes if m < current.micro_batch_size]
            if smaller:
                m = smaller[-1]
                cfg = replace(current, micro_batch_size=m, gradient_accumulation_steps=space.gas_for(m))
                out.append(Proposal(config=cfg, source="rule:pipeline-bubble",
                                    reason=f"ideal bubble {summary.bubble_fraction_ideal:.0%} > {BUBBLE_TARGET:.0%}: "
                                           f"micro {current.micro_batch_size} -> {m} for more micro-batches"))
    fl = summary.device_utilization_fluctuation
    if fl is not None and fl > FLUCTUATION_MAX:
        bigger_m = [m for m in space.micro_batch_sizes if m > current.micro_batch_size]
        if bigger_m:
            m = bigger_m[0]
            gas = space.gas_for(m) if space.global_batch is not None else current.gradient_accumulation_steps
            cfg = replace(current, micro_batch_size=m, gradient_accumulation_steps=gas)
            if space.contains(cfg):
                out.append(Proposal(config=cfg, source="rule:utilization-fluctuation",
                                    reason=f"utilization fluctuation {fl:.0%} > {FLUCTUATION_MAX:.0%}: micro -> {m}"))
    ratio = summary.transfer_compute_ratio
    if ratio is not None and ratio > COMM_RATIO_MAX and space.bucket_range is not None and current.reduce_bucket_size:
        lo, _ = space.bucket_range
        b = max(lo, current.reduce_bucket_size // 10)
        if b != current.reduce_bucket_size:
            out.append(Proposal(config=replace(current, reduce_bucket_size=b), source="rule:comm-ratio",
                                reason=f"comm/compute {ratio:.2f} > {COMM_RATIO_MAX}: reduce_bucket_size -> {b:.0e}"))
    return out
