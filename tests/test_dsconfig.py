import json

import pytest

from autotune.advisor.config_rules import config_facts
from autotune.advisor.findings import FIRED, Change, Finding
from autotune.advisor.patch import patch_config
from autotune.core.dsconfig import (
    ZERO_KEYS,
    DsConfig,
    check_known_zero_keys,
    load_ds_config,
    reduce_bucket_acts,
    reduce_bucket_inert,
    unknown_zero_keys,
)
from autotune.core.errors import ConfigError
from autotune.core.space import SearchSpace


def test_resolve_batch_fills_missing_like_deepspeed():
    c = DsConfig.from_dict({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4})
    assert c.resolve_batch(2).gradient_accumulation_steps == 8
    c = DsConfig.from_dict({"train_batch_size": 64, "gradient_accumulation_steps": 4})
    assert c.resolve_batch(2).micro_batch_size == 8


def test_impossible_arithmetic_names_the_numbers_and_fix():
    c = DsConfig.from_dict({"train_batch_size": 1000, "train_micro_batch_size_per_gpu": 32,
                            "gradient_accumulation_steps": 4})
    with pytest.raises(ConfigError, match=r"1000 != micro 32 x GAS 4 x dp 8; use train_batch_size 1024"):
        c.resolve_batch(8)


def test_zero2_refused_under_pipeline():
    with pytest.raises(ConfigError, match="use stage 1"):
        DsConfig.from_dict({"zero_optimization": {"stage": 2}}).check_pipeline()


def test_with_trial_keeps_user_keys_and_sets_consistent_batch():
    c = DsConfig.from_dict({"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 1}})
    d = c.with_trial(micro_batch_size=4, gradient_accumulation_steps=8, data_parallel_size=2,
                     reduce_bucket_size=100000).to_dict()
    assert d["optimizer"] == {"type": "Adam"}
    assert d["train_batch_size"] == 64
    assert d["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 100000}


@pytest.mark.parametrize("text, msg", [
    ("{not json", "not valid JSON"),
    ('{"a": 1 "b": 2}', "nor the hjson DeepSpeed also reads"),
    ('{"train_batch_size": 1e999,}', "nor the hjson DeepSpeed also reads"),  # hjson overflows (found by fuzzing)
    ("[1, 2]", "JSON object"),
    ("  \n", "the file is empty"),
    ('{"train_batch_size": -3}', "positive integer"),
    ('{"train_batch_size": "many"}', "positive integer"),
    ('{"zero_optimization": {"stage": 7}}', "0-3"),
])
def test_malformed_configs(tmp_path, text, msg):
    p = tmp_path / "ds.json"
    p.write_text(text)
    with pytest.raises(ConfigError, match=msg):
        load_ds_config(p)


LENIENT = """{
  // a published config: DeepSpeed reads it with hjson (runtime/config.py)
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 4,
  "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e5,},
}
"""


def test_a_config_deepspeed_reads_is_read_and_its_leniency_said(tmp_path):
    """Comments and trailing commas load as DeepSpeed loads them; the config says where it left
    strict JSON, `check` reports it as a finding, and what autotune writes is strict JSON."""
    p = tmp_path / "ds.json"
    p.write_text(LENIENT)
    cfg = load_ds_config(p)
    assert (cfg.micro_batch_size, cfg.gradient_accumulation_steps, cfg.zero_stage, cfg.reduce_bucket_size) == \
        (2, 4, 1, 500_000)
    assert cfg.not_strict_json is not None and "line 2" in cfg.not_strict_json
    facts = config_facts(cfg)
    assert facts.get("config.not_strict_json") == 1.0
    assert config_facts(DsConfig.from_dict({"train_micro_batch_size_per_gpu": 2})).get("config.not_strict_json") == 0.0
    written = json.dumps(cfg.with_trial(micro_batch_size=4, gradient_accumulation_steps=2, data_parallel_size=1,
                                        reduce_bucket_size=None).to_dict())
    assert json.loads(written)["zero_optimization"]["stage"] == 1  # strict JSON again
    (tmp_path / "strict.json").write_text(written)
    assert load_ds_config(tmp_path / "strict.json").not_strict_json is None


def test_hf_trainers_auto_values_are_found_and_said_by_check():
    cfg = DsConfig.from_dict({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4,
                              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "eps": 1e-8}},
                              "zero_optimization": {"stage": 1, "reduce_bucket_size": "auto"}})
    assert cfg.hf_auto_keys == ["train_micro_batch_size_per_gpu", "optimizer.params.lr",
                                "zero_optimization.reduce_bucket_size"]
    assert cfg.micro_batch_size is None and cfg.reduce_bucket_size is None  # read as not set
    facts = config_facts(cfg)
    assert facts.get("config.hf_auto_values") == 3.0
    with pytest.raises(ConfigError, match="put numbers there, or tune the Trainer script"):
        cfg.check_no_hf_auto()
    DsConfig.from_dict({"train_micro_batch_size_per_gpu": 2}).check_no_hf_auto()  # nothing to refuse


def test_check_reports_the_leniency_and_refuses_what_deepspeed_refuses(tmp_path):
    import subprocess
    import sys

    (tmp_path / "ds.json").write_text(LENIENT)
    out = subprocess.run([sys.executable, "-m", "autotune", "check", str(tmp_path / "ds.json"), "--format", "json"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    fired = {f["rule_id"] for f in json.loads(out.stdout)["findings"] if f.get("fired", True)}
    assert "config-not-strict-json" in fired
    (tmp_path / "dup.json").write_text('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}')
    out = subprocess.run([sys.executable, "-m", "autotune", "check", str(tmp_path / "dup.json")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f"autotune: error: {tmp_path / 'dup.json'}: duplicate keys train_micro_batch_size_per_gpu: "
        "DeepSpeed refuses such a config"]


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_ds_config(tmp_path / "nope.json")


def test_roundtrip_file(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    assert load_ds_config(p).micro_batch_size == 2


@pytest.mark.parametrize("zero, dp, acts", [
    (0, 1, False), (0, 2, False), (0, None, False),
    (1, 1, False), (1, 2, True), (1, 8, True), (1, None, True),  # None: dp not known, it may act
])
def test_the_reduce_bucket_acts_only_with_zero1_and_dp_above_1(zero, dp, acts):
    assert reduce_bucket_acts(zero, dp) is acts
    why = reduce_bucket_inert(zero, dp)
    assert (why is None) is acts
    if not acts:
        assert ("ZeRO-0" in why) is (zero != 1) and ("dp = 1" in why) is (zero == 1)


def _bucket_finding(dp: int) -> Finding:
    return Finding(rule_id="r", title="t", severity="info", status=FIRED, subject="s", trial=None,
                   evidence=[], expected_impact=0.1, explanation="", data_parallel_size=dp,
                   changes=[Change(kind="trial", target="reduce_bucket_size", current=200_000, new=100_000)])


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("dp", [1, 2])
def test_the_search_space_the_config_facts_and_the_patch_follow_the_one_bucket_rule(zero, dp):
    acts = reduce_bucket_acts(zero, dp)
    space = SearchSpace.build(pipeline_stages=2, data_parallel_size=dp, zero_stage=zero)
    assert (space.bucket_range is not None) is acts
    assert space.bucket_note.startswith("reduce_bucket_size searched" if acts else "reduce_bucket_size not searched")
    cfg = DsConfig.from_dict({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                              "zero_optimization": {"stage": zero, "reduce_bucket_size": 200_000}})
    facts = config_facts(cfg, stages=2, world_size=2 * dp)
    assert (facts.get("reduce_bucket_size") is not None) is acts
    patched = patch_config(cfg, [_bucket_finding(dp)])
    assert patched["zero_optimization"]["reduce_bucket_size"] == (100_000 if acts else 200_000)


def test_the_zero_keys_are_the_installed_deepspeeds():
    """ZERO_KEYS is DeepSpeedZeroConfig's fields and aliases, which forbids any other key."""
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    model = zero_config.DeepSpeedZeroConfig
    names = set()
    for name, f in model.model_fields.items():
        names |= {name, *(a for a in (f.alias, f.validation_alias) if isinstance(a, str))}
    assert model.model_config.get("extra") == "forbid"  # why an unknown key fails every trial
    assert names == set(ZERO_KEYS)


def test_an_unknown_zero_key_is_one_line_with_the_nearest_known():
    cfg = DsConfig.from_dict({"train_micro_batch_size_per_gpu": 1,
                              "zero_optimization": {"stage": 2, "reduce_bucket_sizee": 5}})
    assert unknown_zero_keys(cfg.raw) == ["reduce_bucket_sizee"]
    with pytest.raises(ConfigError, match=r"ds\.json: zero_optimization\.reduce_bucket_sizee: .*did you mean "
                                          r"reduce_bucket_size\?"):
        check_known_zero_keys(cfg, "ds.json")
    check_known_zero_keys(DsConfig.from_dict({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1}}),
                          "ok.json")  # every key it knows passes
