"""Rules as proposals: the advisor's findings after a trial -> in-space TrialConfigs.

The hybrid proposer calls `propose_moves` after each trial. It lives with the
proposers, not in the advisor: the tuner uses the advisor's findings, the
advisor knows nothing of proposals (`autotune.advisor.patch` turns the same
findings into a patched ds_config for `advise --write-config`).
"""

from __future__ import annotations

from collections.abc import Sequence

from autotune.advisor.engine import evaluate
from autotune.advisor.findings import Change, Finding
from autotune.advisor.rulebook import Rule
from autotune.advisor.signals import from_summary, layout_values
from autotune.core.dsconfig import DEEPSPEED_DEFAULT_BUCKET
from autotune.core.space import SearchSpace, TrialConfig, round_bucket
from autotune.core.summary import TrialSummary
from autotune.core.trial_kind import TrialKind
from autotune.tuning.proposers.base import Proposal


def propose_moves(summary: TrialSummary, current: TrialConfig, space: SearchSpace,
                  rules: Sequence[Rule] | None = None) -> list[Proposal]:
    """In-space configurations the fired rules propose after a trial, best expected impact first."""
    signals = from_summary(summary, oom=False)
    bucket = current.reduce_bucket_size
    if space.bucket_range is not None and bucket is None:
        bucket = DEEPSPEED_DEFAULT_BUCKET
    signals.values.update(layout_values(current.micro_batch_size, current.gradient_accumulation_steps,
                                        space.pipeline_stages, space.data_parallel_size, bucket,
                                        global_batch_fixed=space.global_batch is not None,
                                        bucket_one_call=space.bucket_saturation))
    out: list[Proposal] = []
    seen = {current.key()}
    for f in evaluate([signals], rules=rules):
        if not f.fired:
            continue
        for change in f.changes:
            if change.kind != "trial":
                continue
            cfg = _project(current, change, space)
            if cfg is None or cfg.key() in seen:
                continue
            seen.add(cfg.key())
            out.append(Proposal(config=cfg, source=TrialKind.rule(f.rule_id), reason=_reason(f, change, cfg)))
    return out


def _reason(f: Finding, change: Change, cfg: TrialConfig) -> str:
    return f"{f.evidence[0].describe()} -> {change.target} {change.current}->{change.new} ({cfg.describe()})"


def _toward(options: Sequence[int], cur: int, target: int) -> int | None:
    """The allowed value beyond `cur` in the direction of `target`, closest to `target`."""
    ahead = [v for v in options if (v > cur if target > cur else v < cur)]
    return min(ahead, key=lambda v: (abs(v - target), v)) if ahead else None


def _project(cur: TrialConfig, change: Change, space: SearchSpace) -> TrialConfig | None:
    """Snap a proposed change onto the nearest configuration the space allows, or None."""
    mb, gas, bucket = cur.micro_batch_size, cur.gradient_accumulation_steps, cur.reduce_bucket_size
    new = int(change.new)  # type: ignore[call-overload]
    if change.target == "micro_batch_size":
        m = _toward(space.micro_batch_sizes, mb, new)
        if m is None:
            return None
        mb = m
        if space.global_batch is not None:
            gas = space.gas_for(mb)
    elif change.target == "gradient_accumulation_steps":
        if space.global_batch is not None:
            want = {space.gas_for(m): m for m in space.micro_batch_sizes}
            g = _toward(sorted(want), gas, new)
            if g is None:
                return None
            gas, mb = g, want[g]
        else:
            g = _toward(space.gas_values, gas, new)
            if g is None:
                return None
            gas = g
    elif change.target == "reduce_bucket_size":
        if space.bucket_range is None:
            return None
        lo, hi = space.bucket_range
        bucket = round_bucket(min(hi, max(lo, new)))
    cfg = TrialConfig(micro_batch_size=mb, gradient_accumulation_steps=gas, reduce_bucket_size=bucket)
    return cfg if space.contains(cfg) and cfg != cur else None
