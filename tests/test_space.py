import pytest

from autotune.core.errors import UserError
from autotune.core.space import SearchSpace, TrialConfig, divisors, powers_of_two, round_bucket


def test_helpers():
    assert powers_of_two(3, 40) == [4, 8, 16, 32]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert round_bucket(123456) == 120000
    assert round_bucket(5e8) == 500_000_000


def test_fixed_global_batch_uses_divisors_and_derives_gas():
    s = SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1, global_batch=64)
    assert s.micro_batch_sizes == [1, 2, 4, 8, 16]  # micro 32 would leave GAS 1 < 2 stages
    for m in s.micro_batch_sizes:
        cfg = TrialConfig(micro_batch_size=m, gradient_accumulation_steps=s.gas_for(m),
                          reduce_bucket_size=10**6)
        assert m * cfg.gradient_accumulation_steps * 2 == 64
        assert s.contains(cfg)
    assert not s.contains(TrialConfig(micro_batch_size=4, gradient_accumulation_steps=4,
                                      reduce_bucket_size=10**6))


def test_integer_micro_allows_non_powers():
    s = SearchSpace.build(pipeline_stages=2, data_parallel_size=1, zero_stage=0, global_batch=24,
                          powers_of_two_only=False)
    assert s.micro_batch_sizes == [1, 2, 3, 4, 6, 8, 12]  # GAS >= 2 stages


def test_bucket_only_searched_with_zero1_and_dp():
    assert SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1).bucket_range
    s0 = SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=0)
    assert s0.bucket_range is None and "ZeRO-0" in s0.bucket_note
    s1 = SearchSpace.build(pipeline_stages=2, data_parallel_size=1, zero_stage=1)
    assert s1.bucket_range is None and "dp = 1" in s1.bucket_note


def test_free_batch_bounds():
    s = SearchSpace.build(pipeline_stages=2, data_parallel_size=1, zero_stage=0, micro_max=8,
                          gas_max=8, max_global_batch=16)
    assert s.contains(TrialConfig(micro_batch_size=2, gradient_accumulation_steps=8))
    assert not s.contains(TrialConfig(micro_batch_size=4, gradient_accumulation_steps=8))
    assert all(c.micro_batch_size * c.gradient_accumulation_steps <= 16 for c in s.grid())


def test_grid_log_spaced_buckets():
    s = SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1, global_batch=16,
                          bucket_min=10_000, bucket_max=100_000_000)
    assert s.bucket_grid(5) == [10_000, 100_000, 1_000_000, 10_000_000, 100_000_000]
    assert len(s.grid(5)) == len(s.micro_batch_sizes) * 5


@pytest.mark.parametrize("kw, text", [
    (dict(micro_min=8, micro_max=2), "swap"),
    (dict(bucket_min=10, bucket_max=1), "swap"),
    (dict(global_batch=63), "multiple of dp"),
    (dict(global_batch=4, micro_min=4), "leaves no micro-batch"),
    (dict(micro_min=0), ">= 1"),
])
def test_bad_bounds_are_user_errors(kw, text):
    with pytest.raises(UserError, match=text):
        SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1, **kw)


def test_baseline_follows_a_global_batch_override():
    """--global-batch 8 with a config of global batch 64: the baseline runs global batch 8 too."""
    from autotune.core.options import RunOptions, WorkloadOptions
    from autotune.tuning.starting_point import baseline_config, build_space, load_base_config

    opts = RunOptions(global_batch=8, workload=WorkloadOptions(data_parallel_size=1))
    base = load_base_config(opts)
    space = build_space(opts, base)
    b = baseline_config(base, opts, space)
    assert b.micro_batch_size * b.gradient_accumulation_steps == 8
    assert b.micro_batch_size == 1  # the default config's micro-batch


def test_bucket_range_ends_at_the_model_size_where_the_model_is_smaller():
    """A bucket holding every gradient reduces in one go; larger ones only allocate more."""
    small = SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1, global_batch=64,
                              model_parameters=234_048)
    assert small.bucket_range == (10_000, 240_000)  # rounded up: the top holds every gradient
    assert small.bucket_saturation == 240_000
    assert "234,048 parameters" in small.describe()
    assert max(c.reduce_bucket_size for c in small.grid(4)) == 240_000
    # the default 5e8 of a baseline stands for the top; in-range configs are left alone
    base = TrialConfig(micro_batch_size=1, gradient_accumulation_steps=32, reduce_bucket_size=500_000_000)
    assert small.canonical(base).reduce_bucket_size == 240_000 and small.contains(small.canonical(base))
    inside = TrialConfig(micro_batch_size=1, gradient_accumulation_steps=32, reduce_bucket_size=50_000)
    assert small.canonical(inside) == inside
    # a model larger than the range (LLaMA-7B: 6.7e9) keeps it, and nothing is mapped
    big = SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1, global_batch=64,
                            model_parameters=6_738_415_616)
    assert big.bucket_range == (10_000, 500_000_000) and big.bucket_saturation is None
    assert big.canonical(base) == base


def test_parameter_count_matches_the_built_model():
    pytest.importorskip("torch")
    from autotune.rank.workload.model import DecoderLayerPipe, EmbeddingPipe, LMHeadPipe
    from autotune.rank.workload.presets import get_preset, parameter_count

    for name in ("tiny", "small"):
        p = get_preset(name)
        layers = [EmbeddingPipe(p), *(DecoderLayerPipe(p) for _ in range(p.num_layers)), LMHeadPipe(p)]
        assert parameter_count(p) == sum(t.numel() for m in layers for t in m.parameters()), name
    # the real shapes give the published sizes
    assert round(parameter_count(get_preset("llama-7b")) / 1e9, 2) == 6.74
    assert round(parameter_count(get_preset("llama-13b")) / 1e9, 2) == 13.02
