"""Device samplers: one contract suite run against both implementations, plus each path's specifics."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
from fake_nvml import FakeNvml

from exporters.devices import (
    CpuBusySampler,
    DeviceMemory,
    DeviceSampler,
    DeviceSamplerWarning,
    NvmlSampler,
    cuda_memory_stats,
    make_device_probe,
    make_sampler,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _nvml_sampler() -> tuple[DeviceSampler, list[float]]:
    # 10 samples, 100 ms apart, utilization alternating 20 % / 80 %.
    fake = FakeNvml([(1_000_000 + i * 100_000, 20 if i % 2 else 80) for i in range(10)])
    return NvmlSampler(0, nvml=fake), [0.8, 0.2] * 5


def _cpu_sampler() -> tuple[DeviceSampler, list[float]]:
    clock = Clock()
    s = CpuBusySampler(clock=clock)
    for busy in [0.8, 0.2] * 5:
        clock.now += 0.1
        s.record(busy, 1.0)
    return s, [0.8, 0.2] * 5


@pytest.fixture(params=[_nvml_sampler, _cpu_sampler], ids=["nvml", "cpu"])
def sampler(request):
    s, expected = request.param()
    yield s, expected
    s.close()


def test_contract_samples_and_mean(sampler):
    s, expected = sampler
    assert isinstance(s, DeviceSampler)
    assert s.samples(window=10.0) == pytest.approx(expected)
    assert s.utilization(window=10.0) == pytest.approx(0.5)
    assert all(0.0 <= v <= 1.0 for v in s.samples(10.0))


def test_contract_window_limits_samples(sampler):
    s, _ = sampler
    # The newest 0.25 s holds the last three samples (100 ms apart).
    assert s.samples(window=0.25) == pytest.approx(s.samples(10.0)[-3:])
    assert len(s.samples(window=0.25)) == 3


def test_contract_memory(sampler):
    s, _ = sampler
    mem = s.memory()
    assert isinstance(mem, DeviceMemory)
    assert 0 < mem.used_bytes <= mem.total_bytes


def test_nvml_only_new_samples_are_fetched():
    fake = FakeNvml([(1_000_000, 50), (1_100_000, 70)])
    s = NvmlSampler(0, nvml=fake)
    assert s.samples(1.0) == pytest.approx([0.5, 0.7])
    fake.samples.append((1_200_000, 90))
    assert s.samples(1.0) == pytest.approx([0.5, 0.7, 0.9])
    assert fake.calls[-1] == ("samples", 1_100_000)  # asked only for what is new
    # Nothing new: NVML says "not found"; the buffer stays as it was (no rate sample mixed in).
    assert s.samples(1.0) == pytest.approx([0.5, 0.7, 0.9])


def test_nvml_without_sample_buffer_uses_utilization_rates():
    s = NvmlSampler(0, nvml=FakeNvml(samples_supported=False, rate=37))
    assert s.utilization(5.0) == pytest.approx(0.37)


def test_nvml_honours_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    fake = FakeNvml([(1, 10)])
    NvmlSampler(1, nvml=fake)
    assert fake.handles == [("index", 1)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    NvmlSampler(0, nvml=fake)
    assert fake.handles[-1] == ("uuid", "GPU-abc")


def test_cpu_sampler_clips_and_ignores_empty_intervals():
    s = CpuBusySampler(clock=Clock())
    s.record(2.0, 1.0)   # more compute than wall (clock skew): clipped to 1
    s.record(0.5, 0.0)   # no wall time: ignored
    assert s.samples(60.0) == [1.0]
    assert CpuBusySampler().utilization(60.0) is None  # nothing measured: not available


def test_make_sampler_picks_nvml_for_cuda_and_cpu_otherwise():
    assert isinstance(make_sampler("cuda:0", nvml=FakeNvml([(1, 10)])), NvmlSampler)
    assert isinstance(make_sampler("cpu"), CpuBusySampler)


def test_make_sampler_warns_when_cuda_has_no_nvml():
    class Broken(FakeNvml):
        def nvmlInit(self):
            raise self.NVMLError("Driver Not Loaded")

    with pytest.warns(DeviceSamplerWarning, match="NVML unavailable"):
        assert isinstance(make_sampler("cuda:1", nvml=Broken()), CpuBusySampler)


def test_cuda_memory_stats_is_none_on_cpu():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch import noise is not what we test
        assert cuda_memory_stats("cpu") is None


def test_cuda_memory_stats_from_allocator():
    stats = {"allocated_bytes.all.current": 900, "reserved_bytes.all.current": 1000,
             "inactive_split_bytes.all.current": 40, "allocated_bytes.all.peak": 950}
    torch = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True,
                                                 memory_stats=lambda device: stats))
    got = cuda_memory_stats("cuda:0", torch=torch)
    assert got == {"allocated_bytes": 900.0, "reserved_bytes": 1000.0, "inactive_split_bytes": 40.0,
                   "peak_bytes": 950.0, "fragmentation_ratio": pytest.approx(0.1),
                   "inactive_split_ratio": pytest.approx(0.04)}
    empty = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True, memory_stats=lambda d: {}))
    assert cuda_memory_stats("cuda:0", torch=empty)["fragmentation_ratio"] is None


def test_device_probe_on_gpu_reads_nvml_and_allocator_and_resets_peak():
    resets = []
    stats = {"allocated_bytes.all.current": 90, "reserved_bytes.all.current": 100,
             "allocated_bytes.all.peak": 95}
    torch = SimpleNamespace(cuda=SimpleNamespace(
        is_available=lambda: True, memory_stats=lambda d: stats,
        reset_peak_memory_stats=lambda d: resets.append(d)))
    probe = make_device_probe("cuda:0", nvml=FakeNvml([(1_000_000, 40), (1_100_000, 60)]), torch=torch)
    assert probe.utilization(1.0) == pytest.approx(0.5)
    mem = probe.memory()
    assert mem["fragmentation_ratio"] == pytest.approx(0.1) and mem["peak_bytes"] == 95
    assert resets == ["cuda:0"]


def test_device_probe_on_cpu_says_not_available():
    probe = make_device_probe("cpu")
    assert probe.utilization(1.0) is None
    assert probe.memory() is None
