"""The between-launch noise margin is written once (autotune/core/noise.py) and every user takes it from there."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

from autotune.core.noise import NOISE_MARGIN
from autotune.core.rank_plan import RankPlan
from autotune.core.step_budget import rank_budget
from autotune.rank.hook import BootstrapSettings
from autotune.rank.workload.trial_spec import TrialSpec
from autotune.tuning.balance import StageBalancer
from autotune.tuning.proposers.hybrid import HybridProposer

REPO = Path(__file__).resolve().parent.parent
MARGIN_NAMES = {"noise", "NOISE", "DEFAULT_NOISE", "NOISE_MARGIN"}
"""The names the margin went by while it was written in each module."""


def test_every_default_of_the_margin_is_the_one_constant():
    assert 0 < NOISE_MARGIN < 1
    assert inspect.signature(HybridProposer).parameters["noise"].default == NOISE_MARGIN
    assert inspect.signature(StageBalancer).parameters["noise"].default == NOISE_MARGIN
    assert inspect.signature(rank_budget).parameters["noise"].default == NOISE_MARGIN
    assert {f.name: f.default for f in dataclasses.fields(RankPlan)}["noise"] == NOISE_MARGIN
    for cls in (TrialSpec, BootstrapSettings):  # both descriptions carry the one plan (rank_plan.py)
        assert {f.name: f.type for f in dataclasses.fields(cls)}["plan"] in (RankPlan, "RankPlan"), cls


def _numbers(node: ast.AST | None) -> list[float]:
    if node is None:
        return []
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, float)]


def _name(target: ast.AST) -> str | None:
    return target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else None


def test_no_module_but_autotune_noise_writes_the_margin_as_a_number():
    found = []
    for pkg in ("autotune", "exporters"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            if path == REPO / "autotune" / "core" / "noise.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                pairs: list[tuple[str | None, ast.AST | None]] = []
                if isinstance(node, ast.arguments):  # def f(noise=0.10), keyword-only included
                    args = [*node.posonlyargs, *node.args]
                    with_default = args[len(args) - len(node.defaults):]
                    pairs += [(a.arg, d) for a, d in zip(with_default, node.defaults, strict=True)]
                    pairs += [(a.arg, d) for a, d in zip(node.kwonlyargs, node.kw_defaults, strict=True)]
                elif isinstance(node, ast.keyword):  # f(noise=x if y else 0.10)
                    pairs.append((node.arg, node.value))
                elif isinstance(node, ast.AnnAssign):  # noise: float = 0.10
                    pairs.append((_name(node.target), node.value))
                elif isinstance(node, ast.Assign):  # NOISE = 0.10, self.noise = 0.10
                    pairs += [(_name(t), node.value) for t in node.targets]
                found += [f"{path.relative_to(REPO)}:{name}" for name, value in pairs
                          if name in MARGIN_NAMES and _numbers(value)]
    assert found == [], "the noise margin is autotune.core.noise.NOISE_MARGIN; import it"


def test_the_tie_is_one_rule_and_its_users_read_it():
    from autotune.core.noise import beats, tie_floor, ties
    from autotune.core.step_budget import hopeless_step_seconds

    assert ties(10.0, 9.0) and ties(9.0, 10.0) and not ties(10.0, 8.9)
    assert beats(12.0, 10.0) and not beats(10.8, 10.0) and not beats(9.0, 10.0)
    assert beats(1.0, 0.0)  # nothing measured in force: any measurement beats it
    # the early stop: a step slower than the incumbent's tie floor cannot tie (8 samples / 10 per s)
    assert hopeless_step_seconds(10.0, NOISE_MARGIN, 8) == 8 / tie_floor(10.0)
    # no module writes the tie as arithmetic on the margin any more
    for path in (REPO / "autotune").rglob("*.py"):
        if path.name == "noise.py":
            continue
        text = path.read_text(encoding="utf-8")
        for pattern in ("(1 - self.noise)", "(1.0 - noise)", "(1 - noise)", "- 1.0) <= self.noise"):
            assert pattern not in text, f"{path.relative_to(REPO)} writes the tie itself: {pattern}"
