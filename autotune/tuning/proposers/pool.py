"""Shared helpers for proposers: enumerating and sampling in-space configurations.

Kept apart from any optimizer so the baselines, the Bayesian adapter, the
feasibility model and the hybrid all agree on what "a point of the space" is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from autotune.core.space import SearchSpace, TrialConfig, round_bucket


def valid_pairs(space: SearchSpace) -> list[tuple[int, int]]:
    """Every (micro, GAS) pair the space allows, ascending."""
    if space.global_batch is not None:
        return [(m, space.gas_for(m)) for m in space.micro_batch_sizes]
    out = []
    for m in space.micro_batch_sizes:
        for g in space.gas_values:
            gb = m * g * space.data_parallel_size
            if gb >= space.min_global_batch and (space.max_global_batch is None or gb <= space.max_global_batch):
                out.append((m, g))
    return out


def clamp_bucket(space: SearchSpace, value: float | None) -> int | None:
    """A bucket size rounded (two significant digits) and clipped into the space's range."""
    if space.bucket_range is None:
        return None
    lo, hi = space.bucket_range
    if value is None:
        value = math.sqrt(lo * hi)
    return min(max(round_bucket(value), lo), hi)


def make_config(space: SearchSpace, micro: int, gas: int, bucket: float | None) -> TrialConfig:
    return TrialConfig(micro_batch_size=micro, gradient_accumulation_steps=gas,
                       reduce_bucket_size=clamp_bucket(space, bucket))


def random_config(space: SearchSpace, rng: np.random.Generator) -> TrialConfig:
    """Uniform over valid (micro, GAS) pairs, log-uniform over the bucket range."""
    pairs = valid_pairs(space)
    m, g = pairs[int(rng.integers(len(pairs)))]
    bucket = None
    if space.bucket_range is not None:
        lo, hi = space.bucket_range
        bucket = 10 ** rng.uniform(math.log10(lo), math.log10(hi))
    return make_config(space, m, g, bucket)


def candidate_pool(space: SearchSpace, rng: np.random.Generator, *, bucket_points: int = 9,
                   random_buckets: int = 2, extra: Iterable[TrialConfig] = ()) -> list[TrialConfig]:
    """Every valid (micro, GAS) pair crossed with a log grid of buckets plus a few random ones.

    Acquisition functions are maximised over this pool: the discrete part of
    the space is small (tens to hundreds of pairs), so enumerating it beats a
    continuous optimiser that would have to be rounded afterwards.
    """
    grid = space.bucket_grid(bucket_points)
    out: dict[tuple, TrialConfig] = {}
    for m, g in valid_pairs(space):
        buckets: list[float | None] = list(grid)
        if space.bucket_range is not None:
            lo, hi = space.bucket_range
            buckets += [10 ** rng.uniform(math.log10(lo), math.log10(hi)) for _ in range(random_buckets)]
        for b in buckets:
            cfg = make_config(space, m, g, b)
            out.setdefault(cfg.key(), cfg)
    for cfg in extra:
        if space.contains(cfg):
            out.setdefault(cfg.key(), cfg)
    return list(out.values())


def unexplored(space: SearchSpace, seen: set[tuple], rng: np.random.Generator,
               tries: int = 200) -> TrialConfig | None:
    """A random in-space config not in `seen`, or None when none is found."""
    for _ in range(tries):
        cfg = random_config(space, rng)
        if cfg.key() not in seen:
            return cfg
    for cfg in candidate_pool(space, rng):
        if cfg.key() not in seen:
            return cfg
    return None
