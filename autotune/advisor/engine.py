"""The rule engine: rules x subjects -> ranked findings.

Subjects are trial summaries (or signal sets from other input formats) and,
optionally, a ds_config. A rule whose signals are all `config.*` runs once on
the config; every other rule runs on each measured subject, and on the config
alone (`autotune check`) only when the config provides all its signals.
A rule that cannot be decided for lack of data yields an "insufficient data"
finding that says which signal is missing and why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autotune.advisor.conditions import OPS, Compare
from autotune.advisor.config_rules import config_facts
from autotune.advisor.findings import FIRED, INSUFFICIENT, Change, Evidence, Finding, rank_findings
from autotune.advisor.rulebook import Rule, load_rules
from autotune.advisor.signals import LAYOUT_SIGNALS, SignalSet, from_summary
from autotune.advisor.targets import resolve
from autotune.core.dsconfig import DsConfig
from autotune.core.summary import TrialSummary, ideal_bubble_fraction


@dataclass(kw_only=True, slots=True)
class AdviceContext:
    """What the caller knows beyond the metrics. Built from evaluate's `context` mapping."""

    stages: int | None = None
    world_size: int | None = None
    failure_reason: str | None = None
    """Trial outcome ("oom", ...) when known; sets the `oom` signal."""
    outcome_known: bool = False
    cpu_count: int | None = None
    device_memory_bytes: float | None = None
    config_name: str = "ds_config"

    @classmethod
    def from_mapping(cls, ctx: Mapping[str, Any] | None) -> AdviceContext:
        ctx = dict(ctx or {})
        unknown = set(ctx) - {"stages", "world_size", "failure_reason", "cpu_count",
                              "device_memory_bytes", "config_name"}
        if unknown:
            raise ValueError(f"unknown context key(s): {', '.join(sorted(unknown))}")
        return cls(stages=ctx.get("stages"), world_size=ctx.get("world_size"),
                   failure_reason=ctx.get("failure_reason"), outcome_known="failure_reason" in ctx,
                   cpu_count=ctx.get("cpu_count"), device_memory_bytes=ctx.get("device_memory_bytes"),
                   config_name=ctx.get("config_name", "ds_config"))


def evaluate(summaries: Sequence[TrialSummary | SignalSet], ds_config: DsConfig | None = None,
             rules: Sequence[Rule] | None = None,
             context: Mapping[str, Any] | None = None) -> list[Finding]:
    """Run `rules` (default: the built-ins) on every subject; findings ranked by expected impact.

    context keys (all optional): stages, world_size (layout for config-only checks),
    failure_reason (trial outcome; "oom" fires the out-of-memory rule), cpu_count
    (data-loader advice), device_memory_bytes (memory headroom), config_name.
    """
    ctx = AdviceContext.from_mapping(context)
    rule_list = load_rules() if rules is None else list(rules)
    oom = (ctx.failure_reason == "oom") if ctx.outcome_known else None
    # the device's size: the caller's, else the one the ranks measured (the CSV's memory_capacity_bytes,
    # a GPU's total; none on a CPU)
    subjects = [s if isinstance(s, SignalSet)
                else from_summary(s, oom=oom, device_memory_bytes=ctx.device_memory_bytes or s.memory_capacity_bytes)
                for s in summaries]
    cfg = (config_facts(ds_config, stages=ctx.stages, world_size=ctx.world_size, name=ctx.config_name)
           if ds_config is not None else None)
    seen = {s.values.get("pipeline_stages") for s in subjects} - {None}
    if cfg is not None and cfg.values.get("config.pipeline_job") is None and len(seen) == 1:
        cfg.values["config.pipeline_job"] = float(next(iter(seen)) > 1)  # the measured job says which
    raw = ds_config.raw if ds_config is not None else None
    findings: list[Finding] = []
    for rule in rule_list:
        if rule.scope == "config":
            if cfg is not None:
                findings.extend(_apply(rule, cfg, raw, ctx))
            elif subjects:
                findings.append(_insufficient(rule, "ds_config", None, {
                    s: "needs the ds_config: pass --config" for s in rule.signals()}))
            continue
        targets = [_with_config(s, cfg) for s in subjects]
        if not subjects and cfg is not None and all(s in cfg.values for s in rule.signals()):
            targets = [cfg]
        for subject in targets:
            findings.extend(_apply(rule, subject, raw, ctx))
    return rank_findings(findings)


def _with_config(s: SignalSet, cfg: SignalSet | None) -> SignalSet:
    """A measured subject that can also read the config facts (for moves' `when`)."""
    if cfg is None:
        return s
    extra = {k: v for k, v in cfg.values.items() if k.startswith("config.")}
    # A device log knows no batch layout: the config's (with --stages) gives the moves their numbers.
    extra.update({k: cfg.values[k] for k in (*LAYOUT_SIGNALS, "bubble_fraction_ideal")
                  if s.values.get(k) is None and cfg.values.get(k) is not None})
    measured, ideal = s.values.get("bubble_fraction_measured"), extra.get("bubble_fraction_ideal")
    if s.values.get("bubble_fraction_excess") is None and measured is not None and ideal is not None:
        extra["bubble_fraction_excess"] = measured - ideal  # a trace's bubble against the config's GAS
    return dataclasses.replace(s, values={**s.values, **extra}, details={**cfg.details, **s.details})


def _apply(rule: Rule, s: SignalSet, raw: dict | None, ctx: AdviceContext) -> list[Finding]:
    verdicts = [rule.condition.evaluate(s.values)]
    if rule.also is not None:
        verdicts.append(rule.also.evaluate(s.values))
    if False in verdicts:
        return []
    if None in verdicts:
        missing = {sig: s.why_missing(sig) for sig in rule.signals() if s.get(sig) is None}
        if missing and set(missing) <= s.not_needed:
            return []  # the input answers this through another rule (see SignalSet.not_needed)
        return [_insufficient(rule, s.subject, s.trial, missing)]
    changes = [c for m in rule.moves
               if m.when is None or m.when.evaluate(s.values) is True
               if (c := resolve(m, s, raw, ctx.cpu_count)) is not None]
    evidence = _evidence(rule.condition, s)
    dp = s.get("data_parallel_size")
    return [Finding(
        rule_id=rule.id, title=rule.title, severity=rule.severity, status=FIRED, subject=s.subject,
        trial=s.trial, evidence=[evidence], changes=changes,
        expected_impact=_impact(rule, evidence, changes, s), explanation=rule.explanation,
        data_parallel_size=int(dp) if dp is not None else None,
    )]


def _insufficient(rule: Rule, subject: str, trial: int | None, missing: dict[str, str]) -> Finding:
    return Finding(rule_id=rule.id, title=rule.title, severity=rule.severity, status=INSUFFICIENT,
                   subject=subject, trial=trial,
                   evidence=[Evidence(signal=rule.signal, measured=None, op=rule.condition.op,
                                      threshold=rule.threshold)],
                   changes=[], expected_impact=0.0, explanation=rule.explanation, missing=missing)


def _evidence(cond: Compare, s: SignalSet) -> Evidence:
    """The headline comparison, naming the ranks/stages/devices where it holds."""
    hits = [rv for rv in s.per_rank.get(cond.signal, []) if OPS[cond.op](rv.value, cond.threshold)]
    return Evidence(
        signal=cond.signal, measured=s.get(cond.signal), op=cond.op, threshold=cond.threshold,
        ranks=sorted({rv.rank for rv in hits if rv.rank is not None}),
        stages=sorted({rv.stage for rv in hits if rv.stage is not None}),
        devices=sorted({rv.device for rv in hits if rv.device}),
        detail=s.details.get(cond.signal, ""),
    )


def _impact(rule: Rule, ev: Evidence, changes: list[Change], s: SignalSet) -> float:
    """Rough share of step time recoverable; only used to order findings."""
    measured = ev.measured if ev.measured is not None else 0.0
    if rule.impact_kind == "fixed":
        value = rule.impact_value
    elif rule.impact_kind == "imbalance":
        value = 1.0 - 1.0 / measured if measured > 0 else 0.0
    elif rule.impact_kind == "excess_beyond_imbalance":
        # The idle share the stage imbalance already explains is the imbalance finding's to
        # fix: a symptom does not outrank its cause (issue 24). Nor is the idle that is not a
        # wait for a peer (transfers, data loading, untimed host work: other findings' own):
        # on a CPU that share alone outweighed a 1.28x imbalance on one CI run.
        explained = s.get("imbalance_idle_fraction") or 0.0
        bubble, waiting = s.get("bubble_fraction_measured"), s.get("peer_wait_fraction_mean")
        not_waiting = max(0.0, bubble - waiting) if bubble is not None and waiting is not None else 0.0
        value = (abs(measured - ev.threshold) - explained - not_waiting) * rule.impact_value
    elif rule.impact_kind == "bubble":
        p = s.get("pipeline_stages")
        gas = next((c for c in changes if c.target == "gradient_accumulation_steps"), None)
        if p and gas is not None:
            value = ideal_bubble_fraction(int(p), int(gas.current)) - ideal_bubble_fraction(int(p), int(gas.new))
        else:
            value = abs(measured - ev.threshold)
    else:
        value = abs(measured - ev.threshold) * rule.impact_value
    return round(max(0.0, min(1.0, value)), 4)


def check_config(cfg: DsConfig, *, stages: int | None = None, world_size: int | None = None,
                 rules: Sequence[Rule] | None = None, name: str = "ds_config") -> list[Finding]:
    """The configuration rules alone (plus layout rules when stages/world size are given)."""
    ctx: dict[str, Any] = {"stages": stages, "world_size": world_size, "config_name": name}
    return evaluate([], ds_config=cfg, rules=rules, context=ctx)
