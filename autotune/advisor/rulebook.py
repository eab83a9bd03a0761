"""Load and validate rule files (TOML). Built-ins go through the same path as user files.

A rule file is data, parsed with tomllib and checked field by field; nothing
in it is executed. Every problem becomes a one-line InputFileError naming the
file and the rule, so a user's typo never turns into a traceback.
"""

from __future__ import annotations

import importlib.resources
import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path

from autotune.advisor.conditions import (
    Compare,
    Condition,
    ConditionError,
    parse_compare,
    parse_condition,
)
from autotune.advisor.signals import ALL_SIGNALS
from autotune.core.errors import InputFileError

BUILTIN_RULES = importlib.resources.files("autotune") / "data" / "builtin_rules.toml"
"""Shipped inside the package (wheel and sdist alike); `rules/builtin.toml` at the repository
root, where people read and edit the rules, is a link to this file."""

SEVERITIES = ("critical", "warning", "info")
TRIAL_PARAMS = ("micro_batch_size", "gradient_accumulation_steps", "reduce_bucket_size")
COMPUTES = frozenset({"gas_for_bubble", "next_multiple_of_stages", "bytes_to_elements", "loader_workers",
                      "one_bucket", "other_partition_method", "rebalance_stage", "measured_parts",
                      "type_partition"})
IMPACT_KINDS = ("excess", "fixed", "imbalance", "bubble", "excess_beyond_imbalance")
_ID = re.compile(r"^[a-z0-9][a-z0-9-]{1,63}$")


@dataclass(frozen=True, slots=True)
class Move:
    """One proposed change. `kind` says what it changes: a searched trial parameter,
    a ds_config key, or something outside the config (env var, code, data loader)."""

    kind: str
    """"trial", "config" or "advice"."""
    target: str
    """Trial parameter name, dotted ds_config key, or advice target like env:NAME."""
    scale: float | None = None
    value: object = None
    compute: str | None = None
    delete: bool = False
    keep_only: tuple[str, ...] | None = None
    bubble_target: float | None = None
    note: str = ""
    when: Condition | None = None


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    title: str
    severity: str
    condition: Compare
    """The primary comparison: its signal and threshold are the finding's headline evidence."""
    also: Condition | None
    """Further conditions that must hold too (e.g. pipeline_stages > 1)."""
    explanation: str
    impact_kind: str
    impact_value: float
    moves: tuple[Move, ...]
    source: str

    @property
    def signal(self) -> str:
        return self.condition.signal

    @property
    def threshold(self) -> float:
        return self.condition.threshold

    def signals(self) -> list[str]:
        extra = self.also.signals() if self.also is not None else []
        return list(dict.fromkeys([self.signal, *extra]))

    @property
    def scope(self) -> str:
        """"config" when the rule reads the ds_config alone, else "metrics"."""
        return "config" if all(s.startswith("config.") for s in self.signals()) else "metrics"


def load_rules(paths: Iterable[str | Path] = (), *, builtin: bool = True) -> list[Rule]:
    """Built-in rules (unless `builtin=False`) followed by each user file; a later id replaces an earlier one."""
    files: list[Path | Traversable] = ([BUILTIN_RULES] if builtin else []) + [Path(p) for p in paths]
    rules: dict[str, Rule] = {}
    for f in files:
        for rule in load_rule_file(f):
            rules.pop(rule.id, None)
            rules[rule.id] = rule
    return list(rules.values())


def load_rule_file(path: str | Path | Traversable) -> list[Rule]:
    p = path if isinstance(path, Traversable) else Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputFileError(f"{p}: rule file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputFileError(f"{p}: cannot read rule file ({exc.__class__.__name__})") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputFileError(f"{p}: not valid TOML ({exc})") from None
    entries = data.get("rule")
    extra = set(data) - {"rule"}
    if extra:
        raise InputFileError(f"{p}: unknown top-level key(s) {', '.join(sorted(extra))}; use [[rule]] tables")
    if not isinstance(entries, list) or not entries:
        raise InputFileError(f"{p}: no [[rule]] tables found")
    seen: set[str] = set()
    out = []
    for i, entry in enumerate(entries, start=1):
        try:
            rule = _parse_rule(entry, str(p))
        except (ConditionError, ValueError, TypeError) as exc:
            rid = entry.get("id", f"#{i}") if isinstance(entry, Mapping) else f"#{i}"
            raise InputFileError(f"{p}: rule {rid}: {exc}") from None
        if rule.id in seen:
            raise InputFileError(f"{p}: rule id {rule.id!r} appears twice")
        seen.add(rule.id)
        out.append(rule)
    return out


_RULE_KEYS = {"id", "title", "severity", "signal", "op", "threshold", "when", "explanation",
              "impact", "impact_value", "move"}


def _parse_rule(e: object, source: str) -> Rule:
    if not isinstance(e, Mapping):
        raise ValueError("a rule must be a table")
    unknown = set(e) - _RULE_KEYS
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))}")
    rid = e.get("id")
    if not isinstance(rid, str) or not _ID.match(rid):
        raise ValueError(f"id must be lower-case letters, digits and dashes, got {rid!r}")
    severity = e.get("severity")
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {', '.join(SEVERITIES)}, got {severity!r}")
    title, explanation = e.get("title"), e.get("explanation")
    if not isinstance(title, str) or not title.strip():
        raise ValueError("title must be a non-empty string")
    if not isinstance(explanation, str) or not explanation.strip():
        raise ValueError("explanation must be a non-empty string")
    primary = parse_compare({k: e[k] for k in ("signal", "op", "threshold") if k in e}, ALL_SIGNALS)
    also = parse_condition(e["when"], ALL_SIGNALS) if "when" in e else None
    impact = e.get("impact", "excess")
    if impact not in IMPACT_KINDS:
        raise ValueError(f"impact must be one of {', '.join(IMPACT_KINDS)}, got {impact!r}")
    impact_value = _number(e.get("impact_value", 1.0), "impact_value")
    moves = e.get("move", [])
    if not isinstance(moves, list):
        raise ValueError("move must be an array of tables ([[rule.move]])")
    return Rule(id=rid, title=title.strip(), severity=severity, condition=primary, also=also,
                explanation=" ".join(explanation.split()), impact_kind=impact,
                impact_value=impact_value, moves=tuple(_parse_move(m) for m in moves), source=source)


_MOVE_KEYS = {"param", "config", "advice", "scale", "value", "compute", "delete", "keep_only",
              "bubble_target", "note", "when"}


def _parse_move(m: object) -> Move:
    if not isinstance(m, Mapping):
        raise ValueError("each move must be a table")
    unknown = set(m) - _MOVE_KEYS
    if unknown:
        raise ValueError(f"unknown move key(s) {', '.join(sorted(unknown))}")
    kinds = [k for k in ("param", "config", "advice") if k in m]
    if len(kinds) != 1:
        raise ValueError("a move needs exactly one of param, config, advice")
    kind_key = kinds[0]
    target = m[kind_key]
    if not isinstance(target, str) or not target:
        raise ValueError(f"move {kind_key} must be a non-empty string")
    if kind_key == "param" and target not in TRIAL_PARAMS:
        raise ValueError(f"move param must be one of {', '.join(TRIAL_PARAMS)}, got {target!r}")
    actions = [k for k in ("scale", "value", "compute", "delete", "keep_only") if k in m]
    if len(actions) != 1:
        raise ValueError(f"move on {target} needs exactly one of scale, value, compute, delete, keep_only")
    action = actions[0]
    allowed = {"param": {"scale", "value", "compute"}, "config": {"value", "compute", "delete", "keep_only"},
               "advice": {"value", "compute"}}[kind_key]
    if action not in allowed:
        raise ValueError(f"a {kind_key} move cannot use {action}")
    compute = m.get("compute")
    if compute is not None and compute not in COMPUTES:
        raise ValueError(f"unknown compute {compute!r}; known: {', '.join(sorted(COMPUTES))}")
    keep = m.get("keep_only")
    if keep is not None and (not isinstance(keep, list) or not all(isinstance(k, str) for k in keep)):
        raise ValueError("keep_only must be a list of key names")
    if "delete" in m and m["delete"] is not True:
        raise ValueError("delete must be true")
    note = m.get("note", "")
    if not isinstance(note, str):
        raise ValueError("note must be a string")
    return Move(
        kind={"param": "trial", "config": "config", "advice": "advice"}[kind_key], target=target,
        scale=_positive(m["scale"], "scale") if "scale" in m else None,
        value=_scalar(m["value"]) if "value" in m else None, compute=compute,
        delete="delete" in m, keep_only=tuple(keep) if keep is not None else None,
        bubble_target=_fraction(m["bubble_target"]) if "bubble_target" in m else None,
        note=note, when=parse_condition(m["when"], ALL_SIGNALS) if "when" in m else None,
    )


def _number(v: object, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def _positive(v: object, name: str) -> float:
    x = _number(v, name)
    if x <= 0:
        raise ValueError(f"{name} must be > 0, got {v!r}")
    return x


def _fraction(v: object) -> float:
    x = _number(v, "bubble_target")
    if not 0 < x < 1:
        raise ValueError(f"bubble_target must be between 0 and 1, got {v!r}")
    return x


def _scalar(v: object) -> object:
    if isinstance(v, (bool, int, float, str)):
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("value must be finite")
        return v
    raise ValueError(f"value must be a number, string or boolean, got {type(v).__name__}")
