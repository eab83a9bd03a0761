import json

import pytest

from autotune.dsconfig import DsConfig, load_ds_config
from autotune.errors import ConfigError


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
    ("[1, 2]", "JSON object"),
    ('{"train_batch_size": -3}', "positive integer"),
    ('{"train_batch_size": "many"}', "positive integer"),
    ('{"zero_optimization": {"stage": 7}}', "0-3"),
])
def test_malformed_configs(tmp_path, text, msg):
    p = tmp_path / "ds.json"
    p.write_text(text)
    with pytest.raises(ConfigError, match=msg):
        load_ds_config(p)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_ds_config(tmp_path / "nope.json")


def test_roundtrip_file(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    assert load_ds_config(p).micro_batch_size == 2
