"""Shared test configuration.

Hypothesis runs derandomized: the same examples every run, so CI cannot fail
on a case nobody can reproduce. `benchmarks/fuzz_loaders.py` explores fresh
random cases (10,000+) instead.
"""

from hypothesis import settings

settings.register_profile("autotune", derandomize=True, deadline=None)
settings.load_profile("autotune")
