"""One contract suite run against every proposer (style.md lesson 3), plus focused
tests for the out-of-memory veto and the hybrid's rule-taking."""

from __future__ import annotations

import math

import pytest

from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_result import STATUS_FAILED, STATUS_OK, TrialResult
from autotune.tuning.proposers.base import Proposal, Proposer
from autotune.tuning.proposers.feasibility import FeasibilityModel
from autotune.tuning.proposers.hybrid import HybridProposer
from autotune.tuning.proposers.registry import make_proposer, names

NAMES = names()


def free_space() -> SearchSpace:
    return SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1, micro_max=16,
                             gas_max=16, max_global_batch=256)


def fixed_space() -> SearchSpace:
    return SearchSpace.build(pipeline_stages=2, data_parallel_size=1, zero_stage=0, global_batch=64)


def objective(cfg: TrialConfig) -> TrialResult:
    """Small synthetic landscape: better with micro and GAS, a bucket optimum at 1e6, OOM at micro 16."""
    if cfg.micro_batch_size >= 16:
        return TrialResult(status=STATUS_FAILED, failure_reason="oom")
    m, g = cfg.micro_batch_size, cfg.gradient_accumulation_steps
    bucket = 1.0 if cfg.reduce_bucket_size is None else 1 / (1 + abs(math.log10(cfg.reduce_bucket_size) - 6))
    sps = m * g / ((g + 1) * (0.5 + 0.1 * m)) * bucket
    return TrialResult(status=STATUS_OK, samples_per_second=sps)


def build(name: str, space: SearchSpace, seed: int = 0) -> Proposer:
    return make_proposer(name, space, seed=seed, moves=lambda *a, **k: [])


def loop(p: Proposer, n: int) -> list[Proposal]:
    out = []
    for _ in range(n):
        prop = p.ask()
        out.append(prop)
        p.tell(prop.config, objective(prop.config))
    return out


@pytest.mark.parametrize("space_fn", [free_space, fixed_space])
@pytest.mark.parametrize("name", NAMES)
def test_asks_in_space_without_duplicates(name: str, space_fn) -> None:
    space = space_fn()
    n = min(8, len(space.grid(4)))
    props = loop(build(name, space), n)
    assert all(space.contains(p.config) for p in props)
    keys = [p.config.key() for p in props]
    assert len(set(keys)) == len(keys), f"{name} repeated a point while unexplored points remain"
    assert all(isinstance(p.source, str) and p.source for p in props)


@pytest.mark.parametrize("name", NAMES)
def test_seeded_determinism(name: str) -> None:
    a = [p.config.key() for p in loop(build(name, free_space(), seed=3), 7)]
    b = [p.config.key() for p in loop(build(name, free_space(), seed=3), 7)]
    assert a == b


@pytest.mark.parametrize("name", NAMES)
def test_tell_accepts_failures_and_foreign_configs(name: str) -> None:
    space = free_space()
    p = build(name, space)
    out_of_space = TrialConfig(micro_batch_size=3, gradient_accumulation_steps=5, reduce_bucket_size=None)
    assert not space.contains(out_of_space)
    p.tell(out_of_space, TrialResult(status=STATUS_OK, samples_per_second=10.0))  # a user's baseline
    foreign = TrialConfig(micro_batch_size=16, gradient_accumulation_steps=8, reduce_bucket_size=1_000_000)
    p.tell(foreign, TrialResult(status=STATUS_FAILED, failure_reason="oom"))
    p.tell(TrialConfig(micro_batch_size=2, gradient_accumulation_steps=2, reduce_bucket_size=10_000),
           TrialResult(status=STATUS_FAILED, failure_reason="crash"))
    props = loop(p, 6)
    assert all(space.contains(x.config) for x in props)
    assert foreign.key() not in {x.config.key() for x in props}


@pytest.mark.parametrize("name", NAMES)
def test_budget_loop_finds_good_point(name: str) -> None:
    space = free_space()
    props = loop(build(name, space, seed=1), 20)
    values = [objective(p.config).samples_per_second for p in props]
    best_possible = max(objective(c).samples_per_second for c in space.grid(9))
    assert len(props) == 20
    assert max(values) >= 0.5 * best_possible


def test_bayes_uses_the_model_after_initial_points() -> None:
    p = make_proposer("bayes", free_space(), seed=0)
    props = loop(p, 8)
    assert [x.reason for x in props[:5]] == ["initial random point"] * 5
    assert all("expected improvement" in x.reason for x in props[5:])


def test_bayes_failure_penalty_is_finite() -> None:
    p = make_proposer("bayes", free_space(), seed=0)
    loop(p, 6)
    _, y = p.observations()
    p.tell(cfg(16, 8), TrialResult(status=STATUS_FAILED, failure_reason="oom"))
    _, y = p.observations()
    assert y and all(math.isfinite(v) for v in y)
    assert y[-1] > max(y[:-1]) - 1e-9  # the failure is the worst (highest) objective value


# ---- the out-of-memory veto --------------------------------------------------------

def cfg(m: int, g: int, b: int | None = 1_000_000) -> TrialConfig:
    return TrialConfig(micro_batch_size=m, gradient_accumulation_steps=g, reduce_bucket_size=b)


def test_feasibility_dominance_uses_in_flight_micro_batches() -> None:
    space = SearchSpace.build(pipeline_stages=4, data_parallel_size=2, zero_stage=1, micro_max=32, gas_max=32)
    f = FeasibilityModel(space)
    f.observe(cfg(8, 8), TrialResult(status=STATUS_FAILED, failure_reason="oom"))
    assert f.vetoed(cfg(16, 4))        # more activations in flight
    assert f.vetoed(cfg(8, 32))        # GAS beyond the stage count adds nothing in flight
    assert not f.vetoed(cfg(8, 2))     # only 2 micro-batches in flight
    assert not f.vetoed(cfg(4, 32))
    assert not f.vetoed(cfg(8, 8, 10_000))  # a 100x smaller bucket may fit
    f.observe(cfg(4, 4), TrialResult(status=STATUS_FAILED, failure_reason="timeout"))
    assert not f.vetoed(cfg(4, 8))     # non-memory failures are not memory evidence


class _Summary:
    def __init__(self, mem: float) -> None:
        self.memory_peak_bytes = mem


def test_feasibility_memory_model_vetoes_above_estimated_limit() -> None:
    space = SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1, micro_max=64, gas_max=32)
    f = FeasibilityModel(space)
    gib = 1024**3
    for m in (1, 2, 4):  # 10 GiB + 1 GiB per sample in flight (2 in flight)
        f.observe(cfg(m, 4), TrialResult(status=STATUS_OK, samples_per_second=1.0,
                                         summary=_Summary(10 * gib + 2 * m * gib)))
    assert f.p_ok(cfg(32, 4)) == 1.0  # no out-of-memory seen: no evidence of a limit
    f.observe(cfg(32, 4), TrialResult(status=STATUS_FAILED, failure_reason="oom"))
    assert f.limit() == pytest.approx(74 * gib, rel=0.05)
    assert f.vetoed(cfg(32, 2)) and f.vetoed(cfg(64, 1))
    assert not f.vetoed(cfg(16, 4))
    assert f.p_ok(cfg(16, 4)) > 0.99
    assert f.p_ok(cfg(32, 4)) == 0.0


def test_hybrid_never_reruns_a_vetoed_config() -> None:
    space = free_space()
    h = HybridProposer(space, seed=0, moves=lambda *a, **k: [])
    props = loop(h, 20)
    oom = [p.config for p in props if p.config.micro_batch_size >= 16]
    assert 1 <= len(oom) <= 2, "after an out-of-memory trial at micro 16 the veto must keep it away"
    for later in oom[1:]:  # only a 10x smaller bucket may try the same load again
        assert later.reduce_bucket_size * 10 <= oom[0].reduce_bucket_size


# ---- the hybrid takes rule moves -------------------------------------------------

def test_hybrid_takes_rule_moves_and_merges_disjoint_ones() -> None:
    space = free_space()
    calls = []

    def moves(summary, current, sp, rules=None) -> list[Proposal]:
        calls.append((summary, current))
        out = []
        if current.gradient_accumulation_steps < 16:
            out.append(Proposal(config=cfg(current.micro_batch_size, 16, current.reduce_bucket_size),
                                source="rule:bubble", reason="bubble above target"))
        if current.reduce_bucket_size != 1_000_000:
            out.append(Proposal(config=cfg(current.micro_batch_size, current.gradient_accumulation_steps),
                                source="rule:bucket", reason="comm above target"))
        return out

    h = HybridProposer(space, seed=0, moves=moves)
    base = cfg(1, 1, 500_000_000)
    h.tell(base, TrialResult(status=STATUS_OK, samples_per_second=1.0, summary=object()))
    p = h.ask()
    assert calls and calls[0][1] == base
    assert p.source.startswith("rule:bubble+rule:bucket")
    assert p.config.gradient_accumulation_steps == 16 and p.config.reduce_bucket_size == 1_000_000
    assert "bubble above target" in p.reason


def test_hybrid_without_rules_still_climbs_the_micro_batch() -> None:
    space = free_space()
    h = HybridProposer(space, seed=0, moves=None)
    h.tell(cfg(2, 4), TrialResult(status=STATUS_OK, samples_per_second=1.0))
    p = h.ask()
    assert p.source == "climb" and p.config.micro_batch_size == 4


def test_hybrid_remeasures_close_top_two_at_the_end() -> None:
    space = free_space()
    h = HybridProposer(space, seed=0, moves=None, budget=3)
    h.tell(cfg(2, 4), TrialResult(status=STATUS_OK, samples_per_second=10.0))
    h.tell(cfg(4, 4), TrialResult(status=STATUS_OK, samples_per_second=10.5))
    p = h.ask()
    assert p.source == "remeasure" and p.config == cfg(4, 4)


def test_history_stores_a_saturated_bucket_as_the_ranges_top() -> None:
    """The baseline's default 5e8 on a small model reduces like the range's top:
    the model learns from it instead of dropping it as out of space."""
    from autotune.tuning.proposers.history import History

    space = SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1, global_batch=64,
                              model_parameters=234_048)
    h = History(space)
    base = TrialConfig(micro_batch_size=1, gradient_accumulation_steps=32, reduce_bucket_size=500_000_000)
    assert h.record(base, TrialResult(status=STATUS_OK, samples_per_second=100.0))
    assert h.observations[0].config.reduce_bucket_size == 240_000 and h.ignored == 0
