"""The condition language of rule files: small, total and safe (no eval).

A condition is either a comparison `{signal = "name", op = ">", threshold = 0.25}`
or a combination `{all = [...]}` / `{any = [...]}` of conditions. Evaluation is
three-valued: True, False, or None when a signal it needs is missing, so the
engine can tell "did not fire" from "insufficient data".
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
    "==": operator.eq, "!=": operator.ne,
}
MAX_DEPTH = 4


class ConditionError(ValueError):
    """A condition in a rule file is malformed; the message names the problem."""


@dataclass(frozen=True, slots=True)
class Compare:
    signal: str
    op: str
    threshold: float

    def signals(self) -> list[str]:
        return [self.signal]

    def evaluate(self, values: Mapping[str, float | None]) -> bool | None:
        v = values.get(self.signal)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return None
        return OPS[self.op](v, self.threshold)

    def describe(self) -> str:
        return f"{self.signal} {self.op} {self.threshold:g}"


@dataclass(frozen=True, slots=True)
class Combine:
    mode: str
    """"all" or "any"."""
    parts: tuple[Condition, ...]

    def signals(self) -> list[str]:
        return [s for p in self.parts for s in p.signals()]

    def evaluate(self, values: Mapping[str, float | None]) -> bool | None:
        results = [p.evaluate(values) for p in self.parts]
        decisive = self.mode == "any"  # True decides "any", False decides "all"
        if decisive in results:
            return decisive
        if None in results:
            return None
        return not decisive

    def describe(self) -> str:
        joiner = " and " if self.mode == "all" else " or "
        return "(" + joiner.join(p.describe() for p in self.parts) + ")"


Condition = Compare | Combine


def parse_condition(data: object, known_signals: frozenset[str], depth: int = 0) -> Condition:
    """Build a condition from TOML data, rejecting anything outside the grammar."""
    if depth > MAX_DEPTH:
        raise ConditionError(f"conditions nest deeper than {MAX_DEPTH} levels")
    if not isinstance(data, Mapping):
        raise ConditionError(f"a condition must be a table, got {type(data).__name__}")
    keys = set(data)
    if keys & {"all", "any"}:
        if len(keys) != 1:
            raise ConditionError(f"a table with all/any takes no other keys, got {sorted(keys)}")
        mode = next(iter(keys))
        parts = data[mode]
        if not isinstance(parts, list) or not parts:
            raise ConditionError(f"{mode} needs a non-empty list of conditions")
        return Combine(mode, tuple(parse_condition(p, known_signals, depth + 1) for p in parts))
    return parse_compare(data, known_signals)


def parse_compare(data: Mapping, known_signals: frozenset[str]) -> Compare:
    extra = set(data) - {"signal", "op", "threshold"}
    if extra:
        raise ConditionError(f"unknown key(s) in condition: {', '.join(sorted(extra))}")
    signal, op, threshold = data.get("signal"), data.get("op", ">"), data.get("threshold")
    if not isinstance(signal, str) or signal not in known_signals:
        raise ConditionError(f"unknown signal {signal!r}; known: {', '.join(sorted(known_signals))}")
    if op not in OPS:
        raise ConditionError(f"unknown op {op!r}; use one of {' '.join(OPS)}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ConditionError(f"threshold of {signal} must be a finite number, got {threshold!r}")
    return Compare(signal, op, float(threshold))
