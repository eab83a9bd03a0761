"""Rule files: user rules load through the built-ins' path; bad files give one-line errors."""

from __future__ import annotations

import pytest
from builders import healthy_summary

from autotune.advisor import evaluate, load_rule_file, load_rules
from autotune.advisor.conditions import Combine, Compare
from autotune.core.errors import InputFileError

GOOD = """
[[rule]]
id = "slow-trial"
title = "Throughput below 60 samples/s"
severity = "info"
signal = "samples_per_second"
op = "<"
threshold = 60
when = { any = [ { signal = "pipeline_stages", op = ">=", threshold = 2 },
                 { signal = "data_parallel_size", op = ">=", threshold = 2 } ] }
explanation = "Custom rule."
[[rule.move]]
param = "micro_batch_size"
scale = 2
"""


def test_user_rule_file_adds_a_rule(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text(GOOD)
    rules = load_rules([f])
    assert "slow-trial" in {r.id for r in rules} and "comm-compute-high" in {r.id for r in rules}
    got = [x for x in evaluate([healthy_summary()], rules=rules) if x.rule_id == "slow-trial"]
    assert got[0].fired and got[0].changes[0].new == 8


def test_same_id_replaces_builtin(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text(GOOD.replace('"slow-trial"', '"comm-compute-high"'))
    rules = load_rules([f])
    assert sum(r.id == "comm-compute-high" for r in rules) == 1
    assert next(r for r in rules if r.id == "comm-compute-high").signal == "samples_per_second"


@pytest.mark.parametrize("mutation,needle", [
    (lambda s: s.replace('"samples_per_second"', '"__import__"'), "unknown signal"),
    (lambda s: s.replace('op = "<"', 'op = "lambda"'), "unknown op"),
    (lambda s: s.replace("threshold = 60", 'threshold = "60"'), "finite number"),
    (lambda s: s.replace('severity = "info"', 'severity = "fatal"'), "severity"),
    (lambda s: s.replace("scale = 2", 'scale = 2\nvalue = 3'), "exactly one"),
    (lambda s: s.replace('param = "micro_batch_size"', 'param = "lr"'), "move param"),
    (lambda s: "bogus = 1\n" + s, "unknown top-level"),
    (lambda s: s + "\nbogus = 1\n", "unknown move key"),
    (lambda s: s.replace("[[rule]]", "[rule", 1), "not valid TOML"),
    (lambda s: "", "no [[rule]]"),
])
def test_bad_rule_files_one_line_error(tmp_path, mutation, needle):
    f = tmp_path / "bad.toml"
    f.write_text(mutation(GOOD))
    with pytest.raises(InputFileError) as exc:
        load_rule_file(f)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_missing_and_binary_rule_files(tmp_path):
    with pytest.raises(InputFileError, match="not found"):
        load_rule_file(tmp_path / "nope.toml")
    b = tmp_path / "bin.toml"
    b.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(InputFileError):
        load_rule_file(b)


def test_builtin_mirrored_thresholds():
    """Another developer mirrors these four as Prometheus alerts: ids and thresholds are a contract."""
    rules = {r.id: r for r in load_rules()}
    assert rules["utilization-fluctuation"].signal == "device_utilization_fluctuation"
    assert rules["utilization-fluctuation"].threshold == 0.15
    assert rules["comm-compute-high"].threshold == 0.25
    assert rules["fragmentation-high"].threshold == 0.05
    assert rules["bubble-above-ideal"].signal == "bubble_fraction_excess"
    assert rules["bubble-above-ideal"].threshold == 0.10


def test_condition_three_valued_logic():
    a, b = Compare("x", ">", 1), Compare("y", ">", 1)
    assert Combine("all", (a, b)).evaluate({"x": 2}) is None
    assert Combine("all", (a, b)).evaluate({"x": 0}) is False
    assert Combine("any", (a, b)).evaluate({"x": 2}) is True
    assert Combine("any", (a, b)).evaluate({"x": 0}) is None
    assert Combine("any", (a, b)).evaluate({"x": 0, "y": 0}) is False
