"""Rules as proposers: findings -> in-space TrialConfigs, and findings -> a patched ds_config.

`propose_moves` is what the hybrid proposer and `autotune run` call after
each trial; `patch_config` is what `autotune advise --write-config` writes.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from autotune.advisor.engine import evaluate
from autotune.advisor.findings import Change, Finding
from autotune.advisor.rulebook import Rule
from autotune.advisor.signals import from_summary, layout_values
from autotune.dsconfig import DEEPSPEED_DEFAULT_BUCKET, DsConfig
from autotune.errors import ConfigError
from autotune.proposers.base import Proposal
from autotune.space import SearchSpace, TrialConfig, round_bucket
from autotune.summary import TrialSummary


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
            out.append(Proposal(config=cfg, source=f"rule:{f.rule_id}", reason=_reason(f, change, cfg)))
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


def patch_config(ds_config: DsConfig, findings: Sequence[Finding]) -> dict[str, Any]:
    """ds_config with the fired findings' changes applied, checked to be one DeepSpeed accepts.

    All config changes of a finding apply; of its trial changes (alternatives)
    only the first. A target already changed by a higher-impact finding is
    left alone. train_batch_size is rewritten as micro x GAS x dp.
    """
    raw = ds_config.to_dict()
    touched: set[str] = set()
    trial: dict[str, int] = {}
    dp = next((f.data_parallel_size for f in findings if f.data_parallel_size), None)
    for f in findings:
        if not f.fired:
            continue
        took_trial = False
        for c in f.changes:
            if c.kind == "advice" or c.target in touched:
                continue
            if c.kind == "trial":
                if took_trial:
                    continue
                took_trial = True
                trial[c.target] = int(c.new)  # type: ignore[call-overload]
            else:
                _apply_config(raw, c)
            touched.add(c.target)
    if trial:
        _apply_trial(raw, ds_config, trial, dp)
    patched = DsConfig.from_dict(raw, source="patched ds_config")
    patched.check_pipeline()
    if dp is not None:
        patched.resolve_batch(dp)
    return raw


def _apply_config(raw: dict[str, Any], c: Change) -> None:
    *parents, leaf = c.target.split(".")
    node = raw
    for p in parents:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            if c.action != "set":
                return
            nxt = node[p] = {}
        node = nxt
    if c.action == "delete":
        node.pop(leaf, None)
    elif c.action == "keep_only":
        node[leaf] = copy.deepcopy(c.new)
    else:
        node[leaf] = copy.deepcopy(c.new)


def _apply_trial(raw: dict[str, Any], cfg: DsConfig, trial: dict[str, int], dp: int | None) -> None:
    tb, mb, gas = cfg.train_batch_size, cfg.micro_batch_size, cfg.gradient_accumulation_steps
    if dp is None and tb is not None and mb is not None and gas is not None and tb % (mb * gas) == 0:
        dp = tb // (mb * gas)
    if dp is not None:
        layout = cfg.resolve_batch(dp)
        mb, gas = layout.micro_batch_size, layout.gradient_accumulation_steps
    if "reduce_bucket_size" in trial and cfg.zero_stage == 1:
        raw.setdefault("zero_optimization", {})["reduce_bucket_size"] = trial["reduce_bucket_size"]
    mb = trial.get("micro_batch_size", mb)
    gas = trial.get("gradient_accumulation_steps", gas)
    if mb is None or gas is None:
        raise ConfigError("cannot rewrite the batch: set train_micro_batch_size_per_gpu and "
                          "gradient_accumulation_steps in the config, or give --stages/--world-size")
    raw["train_micro_batch_size_per_gpu"] = mb
    raw["gradient_accumulation_steps"] = gas
    if dp is not None:
        raw["train_batch_size"] = mb * gas * dp
    else:
        raw.pop("train_batch_size", None)  # DeepSpeed derives it from micro x GAS x dp
