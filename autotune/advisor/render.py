"""Findings as a table for people or JSON for tools. Presentation only."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from autotune.advisor.findings import Finding


def to_json(findings: Sequence[Finding], **meta: Any) -> str:
    fired = [f for f in findings if f.fired]
    return json.dumps({**meta, "fired": len(fired), "findings": [f.to_dict() for f in findings]},
                      indent=2, default=str)


def print_table(findings: Sequence[Finding], *, title: str, notes: Sequence[str] = ()) -> None:
    """Fired findings ranked by expected impact, then one line per rule lacking data."""
    # markup off: evidence and proposals hold brackets (`type:[Dd]ecoder`, "[stage 1]") that are not markup
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160, highlight=False,
                      markup=False, emoji=False)
    fired = [f for f in findings if f.fired]
    if fired:
        table = Table(title=title, show_lines=True)
        for name, kw in (("#", {"justify": "right"}), ("impact", {"justify": "right"}),
                         ("severity", {}), ("rule", {"no_wrap": True}), ("subject", {"no_wrap": True}),
                         ("evidence", {"ratio": 2}), ("proposed", {"ratio": 2})):
            table.add_column(name, **kw)
        for i, f in enumerate(fired, start=1):
            proposed = "\n".join(f"- {c.describe()}" for c in f.changes) or "(no concrete change)"
            table.add_row(str(i), f"{f.expected_impact:.3f}", f.severity, f.rule_id, f.subject,
                          f"{f.title}\n{f.evidence[0].describe()}", proposed)
        console.print(table)
    else:
        console.print(f"{title}: no rule fired.")
    missing: dict[tuple[str, str], list[str]] = defaultdict(list)
    for f in findings:
        if not f.fired:
            why = "; ".join(f"{s}: {w}" for s, w in f.missing.items())
            missing[(f.rule_id, why)].append(f.subject)
    if missing:
        console.print("\nInsufficient data (rules not decided):")
        for (rule_id, why), subjects in missing.items():
            where = subjects[0] if len(subjects) == 1 else f"{len(subjects)} subjects"
            console.print(f"  {rule_id} [{where}]: {why}", markup=False)
    for note in notes:
        console.print(f"\nnote: {note}", markup=False)
