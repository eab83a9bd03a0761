"""Findings -> a patched ds_config: what `autotune advise --write-config` writes."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from autotune.advisor.findings import Change, Finding
from autotune.core.dsconfig import DsConfig, reduce_bucket_acts
from autotune.core.errors import ConfigError


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
    if "reduce_bucket_size" in trial and reduce_bucket_acts(cfg.zero_stage, dp):
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
