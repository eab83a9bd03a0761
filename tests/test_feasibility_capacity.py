"""The out-of-memory model uses the device's capacity before any trial steps over the cliff:
limit = capacity x (1 - headroom) (headroom 0 by default), raised to the largest peak that fitted; without a capacity
(CPU) the old behaviour holds. The capacity is read behind the NVML/torch probe
(exporters/devices.py), tested with the project's fake NVML."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from builders import record
from fake_nvml import FakeNvml

from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.summary import summarize_trial
from autotune.core.trial_result import STATUS_FAILED, STATUS_OK, TrialResult
from autotune.tuning.proposers.feasibility import FeasibilityModel
from exporters.devices import make_device_probe

GIB = 1024**3


def space() -> SearchSpace:
    return SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1, micro_max=64, gas_max=32)


def cfg(m: int, g: int = 4, b: int = 1_000_000) -> TrialConfig:
    return TrialConfig(micro_batch_size=m, gradient_accumulation_steps=g, reduce_bucket_size=b)


def fitted(peak: float, capacity: float | None) -> TrialResult:
    return TrialResult(status=STATUS_OK, samples_per_second=1.0,
                       summary=SimpleNamespace(memory_peak_bytes=peak, memory_capacity_bytes=capacity))


def model(capacity: float | None, headroom: float = 0.0) -> FeasibilityModel:
    f = FeasibilityModel(space(), headroom=headroom)
    for m in (1, 2, 4):  # 10 GiB + 1 GiB per sample in flight (2 in flight)
        f.observe(cfg(m), fitted(10 * GIB + 2 * m * GIB, capacity))
    return f


def test_a_config_predicted_over_capacity_is_vetoed_before_any_oom():
    f = model(80 * GIB)
    assert f.oom_count == 0 and f.limit() == pytest.approx(80 * GIB)  # headroom 0 by default
    assert f.vetoed(cfg(64, 2)) and f.vetoed(cfg(64, 4))  # 138 GiB predicted: cannot fit at all
    assert f.p_ok(cfg(64, 4)) < 1e-6
    assert not f.vetoed(cfg(32)) and not f.vetoed(cfg(16)) and f.p_ok(cfg(16)) > 0.99  # 74, 42 GiB
    f = model(80 * GIB, headroom=0.10)
    assert f.limit() == pytest.approx(72 * GIB) and f.vetoed(cfg(32)) and f.p_ok(cfg(32)) < 0.5


def test_without_capacity_nothing_is_vetoed_before_an_oom():
    f = model(None, headroom=0.10)
    assert f.limit() is None and not f.vetoed(cfg(64, 4)) and f.p_ok(cfg(64, 4)) == 1.0
    f.observe(cfg(32), TrialResult(status=STATUS_FAILED, failure_reason="oom"))
    assert f.limit() == pytest.approx(74 * GIB, rel=0.05) and f.vetoed(cfg(32, 2))


def test_a_peak_that_fitted_raises_the_prior_and_an_oom_lowers_it():
    f = model(80 * GIB, headroom=0.10)
    f.observe(cfg(32), fitted(73 * GIB, 80 * GIB))  # it fitted above 72 GiB: the limit is at least there
    assert f.limit() >= 73 * GIB and not f.vetoed(cfg(32))
    f.observe(cfg(16), TrialResult(status=STATUS_FAILED, failure_reason="oom"))  # ~42 GiB predicted
    assert f.limit() < 50 * GIB and f.vetoed(cfg(16, 2))


def test_the_smallest_reported_capacity_is_the_limit():
    f = model(80 * GIB)
    f.observe(cfg(8), fitted(26 * GIB, 40 * GIB))
    assert f.capacity == 40 * GIB and f.limit() == pytest.approx(40 * GIB)


# ---- where the capacity comes from ------------------------------------------------------------

def _torch(mem_get_info):
    stats = {"allocated_bytes.all.current": 90, "reserved_bytes.all.current": 100, "allocated_bytes.all.peak": 95}
    return SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True, memory_stats=lambda d: stats,
                                                reset_peak_memory_stats=lambda d: None, mem_get_info=mem_get_info))


def test_the_probe_reads_cuda_total_once_and_falls_back_to_nvml():
    calls = []

    def info(device):
        calls.append(device)
        return (3 * GIB, 141 * GIB)

    probe = make_device_probe("cuda:0", nvml=FakeNvml(), torch=_torch(info))
    assert probe.memory()["capacity_bytes"] == 141 * GIB and probe.memory()["capacity_bytes"] == 141 * GIB
    assert calls == ["cuda:0"]

    def broken(device):
        raise RuntimeError("CUDA driver too old")

    probe = make_device_probe("cuda:0", nvml=FakeNvml(), torch=_torch(broken))
    assert probe.memory()["capacity_bytes"] == 80 * GIB  # FakeNvml's total


def test_cpu_reports_no_capacity():
    assert make_device_probe("cpu").memory() is None


def test_the_trial_summary_keeps_the_smallest_ranks_capacity():
    rows = [record(rank=r, stage=r, step=s, memory_capacity_bytes=c)
            for r, c in ((0, 80 * GIB), (1, 40 * GIB)) for s in range(3)]
    assert summarize_trial(rows).memory_capacity_bytes == 40 * GIB
    assert summarize_trial([record(rank=0, step=s) for s in range(3)]).memory_capacity_bytes is None
