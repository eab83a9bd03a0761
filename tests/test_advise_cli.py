"""`autotune advise` / `autotune check` in-process: output, exit codes, --write-config."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from builders import csv_text, grid_records
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.cli.advise import advise_command, check_command
from autotune.core.dsconfig import DsConfig
from autotune.core.schema import CSV_COLUMNS

FIX = Path(__file__).parent / "fixtures" / "advise"


@click.group()
def cli() -> None:
    """Local group: the lead registers the commands in autotune.cli.main."""


cli.add_command(advise_command)
cli.add_command(check_command)


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def metrics(tmp_path):
    f = tmp_path / "metrics.csv"
    # comm (transfer only) 0.2 over compute 0.6-0.62: 0.32-0.33 > 0.25, comm-compute-high fires
    f.write_text(csv_text(grid_records(trials=2, comm_seconds=0.2)))
    return f


@pytest.fixture
def config(tmp_path):
    f = tmp_path / "ds_config.json"
    f.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                             "gradient_accumulation_steps": 4,
                             "zero_optimization": {"stage": 2, "reduce_bucket_size": 100000},
                             "pipeline": {"partition_method": "uniform"}}))
    return f


def test_advise_table(metrics, config):
    r = run("advise", str(metrics), "--config", str(config))
    assert r.exit_code == 0, r.output
    assert "comm-compute-high" in r.output and "zero-stage-with-pipeline" in r.output
    assert "Insufficient data" in r.output and "not available" in r.output
    assert r.output.index("zero-stage-with-pipeline") < r.output.index("comm-compute-high")


def test_advise_json(metrics):
    r = run("advise", str(metrics), "--format", "json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["format"] == "metrics" and data["fired"] >= 1
    ids = {(f["rule_id"], f["trial"]) for f in data["findings"] if f["status"] == "fired"}
    assert ("comm-compute-high", 0) in ids and ("comm-compute-high", 1) in ids


def test_advise_nvidia_smi_notes_limits():
    r = run("advise", str(FIX / "nvidia_smi_2gpu.csv"))
    assert r.exit_code == 0 and "utilization-fluctuation" in r.output
    assert "only utilization" in r.output


def test_write_config(metrics, config, tmp_path):
    out = tmp_path / "new.json"
    r = run("advise", str(metrics), "--config", str(config), "--write-config", str(out))
    assert r.exit_code == 0, r.output
    new = json.loads(out.read_text())
    assert new["zero_optimization"]["stage"] == 1 and "partition_method" not in new["pipeline"]
    assert new["train_batch_size"] == new["train_micro_batch_size_per_gpu"] * new["gradient_accumulation_steps"] * 2
    DsConfig.from_dict(new).resolve_batch(2)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_write_config_refuses_to_overwrite_input(metrics, config):
    before = config.read_text()
    r = run("advise", str(metrics), "--config", str(config), "--write-config", str(config))
    assert r.exit_code == 2 and "overwrite" in r.output and config.read_text() == before


def test_write_config_needs_config(metrics, tmp_path):
    r = run("advise", str(metrics), "--write-config", str(tmp_path / "x.json"))
    assert r.exit_code == 2 and "--config" in r.output


def test_check(config):
    r = run("check", str(config))
    assert r.exit_code == 1  # a critical rule fired (ZeRO-2 with pipeline)
    assert "zero-stage-with-pipeline" in r.output and "ignored-pipeline-keys" in r.output


def test_check_clean_config_exits_zero(tmp_path):
    f = tmp_path / "ok.json"
    f.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 16}))
    r = run("check", str(f), "--stages", "4", "--world-size", "8", "--format", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["fired"] == 0


def test_check_stages_without_world_size(config):
    r = run("check", str(config), "--stages", "2")
    assert r.exit_code == 2 and "together" in r.output


@pytest.mark.parametrize("content", ["", "{not json", "[1, 2]", '{"zero_optimization": {"stage": 9}}',
                                     '{"train_batch_size": "lots"}'])
def test_bad_configs_exit_2(tmp_path, content):
    f = tmp_path / "c.json"
    f.write_text(content)
    r = run("check", str(f))
    assert r.exit_code == 2 and r.output.startswith("autotune: error: ") and r.output.count("\n") == 1
    assert "Traceback" not in r.output


@pytest.mark.parametrize("name,content", [
    ("empty.csv", b""), ("bin.csv", b"\x89PNG\r\n\x1a\n\x00\x00"), ("cols.csv", b"x,y\n1,2\n"),
    ("cells.csv", None),
])
def test_bad_metrics_exit_2(tmp_path, name, content):
    f = tmp_path / name
    if content is None:
        content = csv_text(grid_records()).replace("0.6", "abc", 1).encode()
    f.write_bytes(content)
    r = run("advise", str(f))
    assert r.exit_code == 2 and r.output.startswith("autotune: error: ") and r.output.count("\n") == 1


def test_missing_file_exit_2(tmp_path):
    r = run("advise", str(tmp_path / "nope.csv"))
    assert r.exit_code == 2 and "no such file" in r.output


def test_bad_rule_file_exit_2(metrics, tmp_path):
    rf = tmp_path / "r.toml"
    rf.write_text("[[rule]]\nid = 'x'\n")
    r = run("advise", str(metrics), "--rules", str(rf))
    assert r.exit_code == 2 and "r.toml" in r.output


HEADER = ",".join(CSV_COLUMNS)
GOOD_ROW = csv_text(grid_records(steps=2, ranks=1)).splitlines()[2]  # step 1: measured


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12),
       column=st.integers(0, len(CSV_COLUMNS) - 1))
def test_property_bad_cell_in_metrics_exits_2(tmp_path, junk, column):
    """A numeric cell replaced by non-numeric text: always exit 2, one line."""
    name = CSV_COLUMNS[column]
    cells = GOOD_ROW.split(",")
    try:
        float(junk)
        junk = "x" + junk
    except ValueError:
        pass
    junk = junk.replace(",", ";").replace('"', "'").replace("\n", " ").replace("\r", " ")
    junk = junk.replace("\x00", "?")  # a NUL makes it a binary file: covered by the random-bytes test
    if not junk.strip():
        junk = "x"
    cells[column] = junk
    f = tmp_path / "m.csv"
    f.write_text(HEADER + "\n" + ",".join(cells) + "\n", encoding="utf-8")
    r = run("advise", str(f))
    if name in ("device", "host"):
        assert r.exit_code == 0, r.output
    else:
        assert r.exit_code == 2, (name, junk, r.output)
        assert r.output.startswith("autotune: error: ") and r.output.count("\n") == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=0, max_size=300))
def test_property_random_bytes_never_traceback(tmp_path, data):
    f = tmp_path / "m.csv"
    f.write_bytes(data)
    r = run("advise", str(f))
    assert r.exit_code == 2, r.output
    assert r.output.startswith("autotune: error: ") and "Traceback" not in r.output


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                          lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                          max_leaves=8),
       key=st.sampled_from(["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                            "zero_optimization", "pipeline", "bf16", "fp16"]))
def test_property_malformed_config_values(tmp_path, value, key):
    """Any JSON value in a known key: exit 0/1 with findings, or a clean exit 2; never a traceback."""
    f = tmp_path / "c.json"
    f.write_text(json.dumps({key: value}))
    r = run("check", str(f))
    assert r.exit_code in (0, 1, 2), r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    if r.exit_code == 2:
        assert r.output.startswith("autotune: error: ") and r.output.count("\n") == 1


def test_real_h200_run_is_host_bound_and_fragmented():
    """A metrics CSV from a real instrumented run on an H200 (benchmarks/gpu_check.py,
    `small` preset, 1 stage, bf16): the GPU ran kernels ~10 % of the time its
    instructions spanned, so `host-bound` fires; the CUDA allocator's figures are there.
    Written outside a study (trial -1, instrument()'s default), which advise once refused."""
    res = run("advise", "--format", "json", str(FIX / "h200-small-1stage.csv"))
    assert res.exit_code == 0, res.output
    found = {f["rule_id"]: f for f in json.loads(res.output)["findings"]}
    assert found["host-bound"]["status"] == "fired"
    assert "micro_batch_size" in json.dumps(found["host-bound"]["changes"])
    assert found["fragmentation-high"]["status"] == "fired"


def test_host_bound_is_not_available_on_cpu(metrics):
    res = run("advise", "--format", "json", str(metrics))
    found = {f["rule_id"]: f for f in json.loads(res.output)["findings"]}
    assert found["host-bound"]["status"] == "insufficient_data"
    assert "busy fraction" in json.dumps(found["host-bound"]["missing"])


def test_a_csv_written_before_schema_2_reads_and_says_which_definitions_it_has(metrics):
    """The fixture predates the `schema_version` column: its comm held the sends' waits (issue 24)."""
    old = run("advise", str(FIX / "h200-small-1stage.csv"), "--format", "json")
    assert old.exit_code == 0, old.output
    assert any("metrics schema 1" in n and "over-states the transfer" in n for n in json.loads(old.output)["notes"])
    table = run("advise", str(FIX / "h200-small-1stage.csv"))
    assert table.exit_code == 0 and "metrics schema 1" in table.output
    new = run("advise", str(metrics), "--format", "json")
    assert new.exit_code == 0 and not any("schema" in n for n in json.loads(new.output)["notes"])
