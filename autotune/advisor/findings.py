"""What the engine reports: findings with their evidence and concrete proposed changes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

FIRED = "fired"
INSUFFICIENT = "insufficient_data"
SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


@dataclass(kw_only=True, slots=True)
class Evidence:
    """The measurement behind a finding: signal, measured value, threshold, where."""

    signal: str
    measured: float | None
    op: str
    threshold: float
    ranks: list[int] = field(default_factory=list)
    stages: list[int] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    detail: str = ""

    def describe(self) -> str:
        got = "n/a" if self.measured is None else f"{self.measured:.4g}"
        where = []
        if self.ranks:
            where.append("ranks " + ",".join(map(str, self.ranks)))
        if self.stages:
            where.append("stages " + ",".join(map(str, self.stages)))
        if self.devices:
            where.append("devices " + ",".join(self.devices))
        text = f"{self.signal} = {got} ({self.op} {self.threshold:g})"
        if where:
            text += " on " + "; ".join(where)
        return text + (f"; {self.detail}" if self.detail else "")


@dataclass(kw_only=True, slots=True)
class Change:
    """One concrete proposed change, with the current and the new value."""

    kind: str
    """"trial" (micro/GAS/bucket), "config" (a ds_config key) or "advice" (env, code, data loader)."""
    target: str
    current: object
    new: object
    action: str = "set"
    """"set", "delete" or "keep_only" (config moves)."""
    note: str = ""

    def describe(self) -> str:
        if self.action == "delete":
            text = f"remove {self.target} (now {self.current!r})"
        elif self.action == "keep_only":
            text = f"remove {self.target}.{{{', '.join(map(str, self.current or []))}}}"
        elif self.current is None:
            text = f"{self.target} = {_show(self.new)}"
        else:
            text = f"{self.target}: {_show(self.current)} -> {_show(self.new)}"
        return text + (f" ({self.note})" if self.note else "")


def _show(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


@dataclass(kw_only=True, slots=True)
class Finding:
    """One rule's verdict on one subject (a trial, a device log, or the ds_config)."""

    rule_id: str
    title: str
    severity: str
    status: str
    """"fired" or "insufficient_data"."""
    subject: str
    trial: int | None
    evidence: list[Evidence]
    changes: list[Change]
    """Proposed changes, best first; trial changes are alternatives, config changes go together."""
    expected_impact: float
    """Rough share of step time the fix could recover (0-1); ranks the findings."""
    explanation: str
    missing: dict[str, str] = field(default_factory=dict)
    """For insufficient data: signal -> why it is not available."""
    data_parallel_size: int | None = None
    """The subject's dp, when known (keeps train_batch_size consistent in patch_config)."""

    @property
    def fired(self) -> bool:
        return self.status == FIRED

    def to_dict(self) -> dict:
        return asdict(self)


def rank_findings(findings: list[Finding]) -> list[Finding]:
    """Fired findings by expected impact (then severity), insufficient-data ones last."""
    return sorted(findings, key=lambda f: (not f.fired, -f.expected_impact,
                                           SEVERITY_ORDER.get(f.severity, 9), f.rule_id,
                                           -1 if f.trial is None else f.trial))
