"""Property-based: malformed ds_configs, metrics CSVs and rule files through the real CLI
(`autotune check`, `autotune advise`, `autotune run --config`), in-process. A user never
sees a traceback: the command accepts the file or says what is wrong in one line (exit 2)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.cli.main import cli
from benchmarks.fuzz_loaders import (
    mutate_bytes,
    mutate_csv,
    mutate_json,
    mutate_toml,
    seed_csv,
    seed_ds_config,
    seed_rules,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_scalars = st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=True) | st.text(max_size=8)
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
bad_batch_value = (st.integers(max_value=0) | st.floats().filter(lambda f: not (math.isfinite(f) and f == int(f) and f >= 1))
                   | st.text(max_size=5).filter(lambda s: s != "auto") | st.lists(st.integers(), max_size=2)
                   | st.booleans())


def run_cli(*args: str):
    res = CliRunner().invoke(cli, list(args), catch_exceptions=True)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    return res


def one_line_error(res) -> None:
    assert res.exit_code == 2, res.output
    assert len([ln for ln in res.output.strip().splitlines() if ln.strip()]) == 1, res.output


def mutated(seed: str, structured, rnd, use_bytes: bool) -> bytes:
    if use_bytes:
        return mutate_bytes(seed.encode(), rnd)
    return structured(seed, rnd).encode("utf-8", "surrogatepass")


@SETTINGS
@given(rnd=st.randoms(use_true_random=False), use_bytes=st.booleans())
def test_check_with_mutated_ds_config(tmp_path, rnd, use_bytes):
    p = tmp_path / "ds.json"
    p.write_bytes(mutated(seed_ds_config(), mutate_json, rnd, use_bytes))
    res = run_cli("check", str(p))
    assert res.exit_code in (0, 1, 2)
    if res.exit_code == 2:
        one_line_error(res)


@SETTINGS
@given(value=json_values)
def test_check_with_arbitrary_json(tmp_path, value):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(value))
    res = run_cli("check", str(p))
    assert res.exit_code in (0, 1, 2)
    if not isinstance(value, dict):
        one_line_error(res)


@SETTINGS
@given(base=st.dictionaries(st.text(max_size=6), json_values, max_size=3),
       key=st.sampled_from(BATCH_KEYS), bad=bad_batch_value)
def test_run_refuses_a_malformed_config_before_touching_the_study(tmp_path, base, key, bad):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({**base, key: bad}))
    study = tmp_path / "st"
    res = run_cli("run", "--budget", "1", "--study", str(study), "--config", str(p))
    one_line_error(res)
    assert not study.exists()


@SETTINGS
@given(text=st.text(max_size=40).filter(lambda t: not t.strip().startswith("{")))
def test_run_refuses_non_object_config(tmp_path, text):
    p = tmp_path / "ds.json"
    p.write_text(text)
    res = run_cli("run", "--budget", "1", "--study", str(tmp_path / "st"), "--config", str(p))
    one_line_error(res)


@SETTINGS
@given(rnd=st.randoms(use_true_random=False), use_bytes=st.booleans())
def test_advise_with_mutated_metrics_csv(tmp_path, rnd, use_bytes):
    p = tmp_path / "m.csv"
    p.write_bytes(mutated(seed_csv(), mutate_csv, rnd, use_bytes))
    res = run_cli("advise", str(p), "--format", "json")
    assert res.exit_code in (0, 2)
    if res.exit_code == 2:
        one_line_error(res)


@SETTINGS
@given(rnd=st.randoms(use_true_random=False), use_bytes=st.booleans())
def test_advise_with_mutated_rule_file(tmp_path, rnd, use_bytes):
    metrics = tmp_path / "m.csv"
    metrics.write_text(seed_csv())
    rules = tmp_path / "r.toml"
    rules.write_bytes(mutated(seed_rules(), mutate_toml, rnd, use_bytes))
    res = run_cli("advise", str(metrics), "--rules", str(rules), "--format", "json")
    assert res.exit_code in (0, 2)
    if res.exit_code == 2:
        one_line_error(res)


def test_the_seeds_are_valid(tmp_path):
    """The mutations start from files the CLI accepts, so rejections come from the mutation."""
    (tmp_path / "m.csv").write_text(seed_csv())
    (tmp_path / "ds.json").write_text(seed_ds_config())
    (tmp_path / "r.toml").write_text(seed_rules().replace('id = "', 'id = "user-'))
    assert run_cli("check", str(tmp_path / "ds.json")).exit_code in (0, 1)
    assert run_cli("advise", str(tmp_path / "m.csv"), "--rules", str(tmp_path / "r.toml")).exit_code == 0
    assert Path(tmp_path / "m.csv").stat().st_size > 0
