"""The layout's promises, checked on the source: dependencies point one way.

The folders are the roles (docs/architecture.md): `core` the data model, `rank` what runs in a
training rank, `trials` one trial from the controller's side, `study` the history, `tuning` the
run's loop, `cli` the commands.

- no import cycle among the modules of `autotune` and `exporters`, lazy imports included;
- rank-side code imports only the data model (and the rank side, and exporters' rank endpoints);
- the data model imports nothing else of autotune; nothing imports the command line;
- the trace reader (`autotune.traces`) imports only the data model: the advice, the report
  and (one day) a rank can read a trace without the tuner or a trial;
- the advisor knows nothing of the tuner: no `autotune.advisor` module imports the tuning run;
- the performance model reads studies and runs nothing: `autotune.model` imports neither the
  tuning run, nor a trial's launch, nor a user's command;
- the core reaches `exporters` only where a probe or a run is wired to its endpoints;
- the study store reaches the data model only, never a feature (a step, the user's command);
- no optional import is swallowed silently: each `except ImportError` is listed here, with why.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("autotune", "exporters")

# The only places where the core imports exporters: the assembly of a rank's sinks
# (`instrument()`, the one-liner) and of a run's controller endpoint. Exporters depend on
# the core's data model (schema, summary, space), never the other way round elsewhere.
CORE_TO_EXPORTERS = {"autotune.rank.instrument", "autotune.tuning.session", "autotune.usercmd.watch"}

# What the study store (`autotune.study.store`, with the rows' rules it asks: `autotune.core.measurements`)
# may reach, lazy imports included: the data model. A feature that writes trials of its own
# kind (the knob sweep, the partition step) names its source there, so the store never imports it.
STORE_REACHES = {"autotune.study.store", "autotune.core.measurements", "autotune.core.space",
                 "autotune.core.errors", "autotune.core.dsconfig", "autotune.core.trial_kind",
                 "autotune.core.trial_result", "autotune.core.noise"}

ALLOWED_IMPORT_FALLBACKS = {
    # Without torch there is no CUDA: the trial ranks get DeepSpeed's CPU accelerator.
    "autotune.trials.launcher",
    # Without torch the device question is answered with a one-line UserError naming the install.
    "autotune.trials.precision",
    # Without torch there is no CUDA allocator: fragmentation is "not available", never 0.
    "exporters.devices",
    # A user's job run by another Python than autotune's: the rank says so and runs uninstrumented.
    "autotune.rank.bootstrap.sitecustomize",
    # Without py-cpuinfo DeepSpeed asks lscpu itself: there is nothing to cache.
    "autotune.rank.cpu_info",
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (REPO / pkg).rglob("*.py"):
            if "__pycache__" in p.parts:
                continue
            parts = p.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = p
    return out


MODULES = _modules()
TREES = {name: ast.parse(p.read_text(encoding="utf-8")) for name, p in MODULES.items()}


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def _imports(name: str, *, module_level_only: bool) -> set[str]:
    tree = TREES[name]
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    return {t for n in nodes for t in _targets(n) if t in MODULES and t != name}


def test_no_import_cycle():
    graph = {m: _imports(m, module_level_only=False) for m in MODULES}
    seen: dict[str, int] = {}  # 1 = on the stack, 2 = done
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        seen[m] = 1
        for n in sorted(graph[m]):
            # `pkg/__init__` re-exporting its own modules is not a cycle of design.
            if m.startswith(n + ".") or n.startswith(m + "."):
                continue
            if seen.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in seen:
                visit(n, [*stack, n])
        seen[m] = 2

    for m in sorted(MODULES):
        if m not in seen:
            visit(m, [m])
    assert cycles == []


def test_the_advisor_knows_nothing_of_the_tuner():
    bad = {m: sorted(i for i in _imports(m, module_level_only=False)
                     if i.startswith("autotune.tuning"))
           for m in MODULES if m.startswith("autotune.advisor")}
    assert {m: v for m, v in bad.items() if v} == {}


def test_the_model_reads_studies_and_runs_nothing():
    """model/ calibrates on a study's records and predicts; the tuner may ask it, never the reverse."""
    banned = ("autotune.tuning", "autotune.trials", "autotune.usercmd", "autotune.cli")
    bad = {m: sorted(i for i in _imports(m, module_level_only=False) if i.startswith(banned))
           for m in MODULES if m.startswith("autotune.model")}
    assert any(m.startswith("autotune.model") for m in MODULES)
    assert {m: v for m, v in bad.items() if v} == {}


def test_a_trial_knows_nothing_of_the_tuner():
    """trials/ runs what it is asked (a TrialRequest) and judges it; what to ask is tuning/'s.
    What both share (TrialResult, the space, the kinds) is the data model's (core/)."""
    bad = {m: sorted(i for i in _imports(m, module_level_only=False) if i.startswith("autotune.tuning"))
           for m in MODULES if m.startswith("autotune.trials")}
    assert {m: v for m, v in bad.items() if v} == {}


def test_the_study_reads_its_records_without_the_features_that_write_them():
    """study/ (the store, the results, the outputs) reads partition.json and the job's record
    through its own readers (partition_record.py, job_record.py), not the partition step's or
    the user command's modules."""
    bad = {m: sorted(i for i in _imports(m, module_level_only=False)
                     if i.startswith(("autotune.tuning", "autotune.usercmd")))
           for m in MODULES if m.startswith("autotune.study")}
    assert {m: v for m, v in bad.items() if v} == {}


def test_the_core_reaches_exporters_only_where_it_wires_them():
    users = {m for m in MODULES if m.startswith("autotune")
             and any(i.startswith("exporters") for i in _imports(m, module_level_only=False))}
    assert users <= CORE_TO_EXPORTERS, users - CORE_TO_EXPORTERS


def test_the_store_imports_no_feature():
    reached, todo = set(), ["autotune.study.store"]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo += sorted(_imports(m, module_level_only=False))
    assert reached <= STORE_REACHES, sorted(reached - STORE_REACHES)


def test_no_silent_optional_import():
    found = defaultdict(int)
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                names = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)}
                if names & {"ImportError", "ModuleNotFoundError"}:
                    found[name] += 1
    assert set(found) <= ALLOWED_IMPORT_FALLBACKS, set(found) - ALLOWED_IMPORT_FALLBACKS


RANK_MAY_IMPORT = ("autotune.core", "autotune.rank", "exporters")
"""A training rank runs inside the user's job: it may import the data model, the rank side
itself and the exporters' rank endpoints, never the controller (tuning, trials, study, cli)."""


def _outside(prefix: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {m: sorted(i for i in _imports(m, module_level_only=False)
                     if not i.startswith(allowed) and i != "autotune")
           for m in MODULES if m == prefix or m.startswith(prefix + ".")}
    return {m: v for m, v in bad.items() if v}


def test_rank_side_code_imports_only_the_data_model():
    assert _outside("autotune.rank", RANK_MAY_IMPORT) == {}


def test_the_trace_reader_imports_only_the_data_model():
    assert any(m.startswith("autotune.traces") for m in MODULES)
    assert _outside("autotune.traces", ("autotune.core", "autotune.traces")) == {}


def test_the_data_model_imports_nothing_else_of_autotune():
    assert _outside("autotune.core", ("autotune.core",)) == {}


def test_nothing_imports_the_command_line():
    users = {m for m in MODULES if not m.startswith("autotune.cli") and m != "autotune.__main__"
             and any(i.startswith("autotune.cli") for i in _imports(m, module_level_only=False))}
    assert users == set()


def _compares_engine_to_a_name(tree: ast.AST) -> list[int]:
    """Lines that compare an `engine` value (a name or an attribute) with a string literal."""
    def is_engine(n: ast.AST) -> bool:
        return (isinstance(n, ast.Name) and n.id == "engine") or (isinstance(n, ast.Attribute) and n.attr == "engine")

    def is_text(n: ast.AST) -> bool:
        return isinstance(n, ast.Constant) and isinstance(n.value, str)

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_engine(x) for x in sides) and any(is_text(x) for x in sides):
                lines.append(node.lineno)
    return lines


def test_no_branch_on_the_engine_outside_the_engines_folder():
    """Each engine is a plug-in (autotune/engines/): nothing else asks which engine runs."""
    bad = {m: lines for m in MODULES if not m.startswith("autotune.engines")
           if (lines := _compares_engine_to_a_name(TREES[m]))}
    assert bad == {}
    # the check itself can fail: it finds the branch the built-in job had before the seam
    assert _compares_engine_to_a_name(ast.parse('if opts.workload.engine == "torch": pass')) == [1]


def test_a_trial_is_handed_its_engines_launch():
    """A runner never looks an engine up: the job hands it the engine's `RankLaunch`, so trials/
    imports nothing of autotune/engines/ (whose setting steps are the tuning run's)."""
    bad = {m: sorted(i for i in _imports(m, module_level_only=False) if i.startswith("autotune.engines"))
           for m in MODULES if m.startswith("autotune.trials")}
    assert {m: v for m, v in bad.items() if v} == {}


def test_the_tuning_run_and_the_engines_do_not_reach_up():
    """The knob sweep is the tuning run's own step (tuning/knob_sweep.py), not the user
    command's, so an engine's setting step needs nothing of usercmd/; the run's page
    (report_html/) is written by the command that ran it, not by the loop."""
    up = {m: sorted(i for i in _imports(m, module_level_only=False) if i.startswith("autotune.usercmd"))
          for m in MODULES if m.startswith("autotune.engines") or m == "autotune.tuning.knob_sweep"}
    up.update({m: sorted(i for i in _imports(m, module_level_only=False) if i.startswith("autotune.report_html"))
               for m in MODULES if m.startswith(("autotune.tuning", "autotune.trials", "autotune.engines"))})
    assert {m: v for m, v in up.items() if v} == {}


def test_deepspeeds_engine_internals_are_read_in_the_engine_face_only():
    """The rank side reads a PipelineEngine's `_INSTRUCTION_MAP` and `grid` in
    autotune/rank/engine_face.py and nowhere else (the torch engine keeps its own `grid`)."""
    readers = {"_INSTRUCTION_MAP": {"autotune.rank.engine_face"},
               "grid": {"autotune.rank.engine_face", "autotune.rank.torch_pp.engine"}}
    found: dict[str, set[str]] = defaultdict(set)
    for name, tree in TREES.items():
        if not name.startswith("autotune.rank"):
            continue
        for node in ast.walk(tree):
            attr = node.attr if isinstance(node, ast.Attribute) else (
                node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
            if attr in readers:
                found[attr].add(name)
    assert {k: v - readers[k] for k, v in found.items() if v - readers[k]} == {}
    assert found["_INSTRUCTION_MAP"] == {"autotune.rank.engine_face"}  # the check sees the one reader


def _literal_labels(name: str, tree: ast.AST) -> list[str]:
    """Where `tree` writes a proposal's `source` as a literal, or defaults a proposer's to one."""
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Proposal":
            bad += [f"{name}:{node.lineno}" for kw in node.keywords
                    if kw.arg == "source" and isinstance(kw.value, (ast.Constant, ast.JoinedStr))]
        if isinstance(node, ast.FunctionDef) and name.startswith("autotune.tuning"):
            pairs = [*zip(reversed(node.args.args), reversed(node.args.defaults), strict=False),
                     *zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True)]
            bad += [f"{name}:{node.lineno}" for arg, default in pairs
                    if arg.arg == "source" and isinstance(default, ast.Constant) and isinstance(default.value, str)]
    return bad


def test_every_trial_label_is_defined_in_the_trial_kind_module():
    """A proposal's `source` is written from core/trial_kind.py's labels, never as a literal
    where it is proposed (the study stores it; the steps and reports read it back)."""
    assert [b for name, tree in TREES.items() for b in _literal_labels(name, tree)] == []
    # the check can fail: it finds what the rule moves and the Bayesian proposer wrote before
    assert sorted(_literal_labels("autotune.tuning.x", ast.parse(
        'Proposal(config=c, source=f"rule:{r}")\ndef f(*, source: str = "bayes"): pass'))) == \
        ["autotune.tuning.x:1", "autotune.tuning.x:2"]
