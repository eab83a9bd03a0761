"""Device samplers and CUDA allocator stats: the small interface in front of NVML and torch.

API (all the instrumentation needs)::

    sampler = make_sampler("cuda:0")        # NvmlSampler on a GPU, else CpuBusySampler
    sampler.samples(window=2.0)             # list of 0-1 utilization samples, last 2 s
    sampler.utilization(window=2.0)         # their mean, or None when no sample exists
    sampler.memory()                        # DeviceMemory(used_bytes, total_bytes, peak_bytes) | None
    sampler.close()
    cuda_memory_stats("cuda:0")             # allocator stats dict, or None on CPU
    probe = make_device_probe("cuda:0")     # what autotune.rank.instrument asks once per step:
    probe.utilization(step_seconds)         #   NVML mean over the step, None on CPU
    probe.memory()                          #   cuda_memory_stats (peak reset per step) and
                                            #   capacity_bytes (device total), None on CPU

Why two samplers: on a GPU, NVML's sample buffer (nvmlDeviceGetSamples,
about one sample every 1/6 s on recent GPUs) gives high-frequency utilization
cheaply, without synchronizing the device. A CPU has no such counter with
the same meaning, so `CpuBusySampler` uses the advisor's CPU definition:
busy fraction = compute seconds / wall seconds, fed by the probe via
`record(compute_seconds, wall_seconds)`. Neither falls back silently:
`make_sampler` warns when a CUDA device has no usable NVML.

`pynvml` (nvidia-ml-py) and torch are imported lazily; tests inject a fake
NVML module (`nvml=`) and a fake torch (`torch=`).
"""

from __future__ import annotations

import os
import resource
import statistics
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}
"""nvmlValueType_t -> the member of the nvmlValue_t union that holds the sample."""


class DeviceSamplerWarning(UserWarning):
    """A device sampler could not be used as asked (e.g. CUDA device without NVML)."""


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """Device-level memory as the driver (GPU) or the OS (CPU) sees it."""

    used_bytes: float
    total_bytes: float
    peak_bytes: float | None = None
    """CPU: process peak RSS; GPU: None (use cuda_memory_stats for allocator peaks)."""


@runtime_checkable
class DeviceSampler(Protocol):
    """What instrumentation asks of a device. Every method is cheap and never raises."""

    name: str

    def samples(self, window: float) -> list[float]:
        """0-1 utilization samples from the last `window` seconds (oldest first)."""
        ...

    def utilization(self, window: float) -> float | None:
        """Mean of `samples(window)`; None when there is none ("not available")."""
        ...

    def memory(self) -> DeviceMemory | None: ...

    def close(self) -> None: ...


class NvmlSampler:
    """GPU utilization from NVML's sample buffer, memory from nvmlDeviceGetMemoryInfo.

    `index` is the CUDA device index as the process sees it; CUDA_VISIBLE_DEVICES
    (integers or GPU-UUIDs) is honoured when mapping it to the NVML device.
    """

    def __init__(self, index: int = 0, *, nvml: ModuleType | Any | None = None) -> None:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py; lazy so CPU-only installs never need it
        self._nvml = nvml
        nvml.nvmlInit()
        self._handle = _nvml_handle(nvml, index)
        self.name = f"cuda:{index}"
        self._buffer: deque[tuple[int, float]] = deque(maxlen=4096)
        self._last_seen = 0
        self._samples_ok = False

    def _poll(self) -> None:
        nv = self._nvml
        try:
            vtype, raw = nv.nvmlDeviceGetSamples(self._handle, nv.NVML_GPU_UTILIZATION_SAMPLES,
                                                 self._last_seen)
        except nv.NVMLError:
            if self._samples_ok:
                return  # NVML_ERROR_NOT_FOUND: nothing new since last_seen
            # Sample buffer unsupported (or empty so far): the driver's utilization
            # rate (its own 1/6-1 s average) is the next best measured value.
            try:
                rate = nv.nvmlDeviceGetUtilizationRates(self._handle).gpu
            except nv.NVMLError:
                return
            now_us = int(time.time() * 1e6)
            self._buffer.append((now_us, rate / 100.0))
            self._last_seen = max(self._last_seen, now_us)
            return
        self._samples_ok = True
        member = _VALUE_FIELDS.get(vtype, "uiVal")
        for s in sorted(raw, key=lambda s: s.timeStamp):
            if s.timeStamp > self._last_seen:
                self._buffer.append((s.timeStamp, float(getattr(s.sampleValue, member)) / 100.0))
                self._last_seen = s.timeStamp

    def samples(self, window: float) -> list[float]:
        self._poll()
        if not self._buffer:
            return []
        newest = self._buffer[-1][0]
        cutoff = newest - int(window * 1e6)
        return [v for ts, v in self._buffer if ts >= cutoff]

    def utilization(self, window: float) -> float | None:
        vals = self.samples(window)
        return statistics.fmean(vals) if vals else None

    def memory(self) -> DeviceMemory | None:
        try:
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except self._nvml.NVMLError:
            return None
        return DeviceMemory(used_bytes=float(info.used), total_bytes=float(info.total))

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


class CpuBusySampler:
    """CPU fallback: busy fraction = compute seconds / wall seconds, per recorded interval.

    The probe calls `record(compute_seconds, wall_seconds)` once per step (or per
    instruction group); `samples(window)` returns the busy fractions recorded in the
    last `window` seconds, so fluctuation has the same meaning as in the CSV.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, maxlen: int = 4096) -> None:
        self.name = "cpu"
        self._clock = clock
        self._buffer: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def record(self, compute_seconds: float, wall_seconds: float) -> None:
        if wall_seconds <= 0:
            return
        self._buffer.append((self._clock(), min(1.0, max(0.0, compute_seconds / wall_seconds))))

    def samples(self, window: float) -> list[float]:
        cutoff = self._clock() - window
        return [v for ts, v in self._buffer if ts >= cutoff]

    def utilization(self, window: float) -> float | None:
        vals = self.samples(window)
        return statistics.fmean(vals) if vals else None

    def memory(self) -> DeviceMemory | None:
        """Process resident set size, physical memory, and peak RSS (Linux/macOS)."""
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            total = float(os.sysconf("SC_PHYS_PAGES") * page)
            with open("/proc/self/statm") as fh:
                rss = float(int(fh.read().split()[1]) * page)
        except (OSError, ValueError, IndexError):
            return None
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # KiB on Linux
        return DeviceMemory(used_bytes=rss, total_bytes=total, peak_bytes=peak)

    def close(self) -> None:
        self._buffer.clear()


def make_sampler(device: str, *, nvml: ModuleType | Any | None = None) -> DeviceSampler:
    """NvmlSampler for "cuda[:N]" when NVML works, else CpuBusySampler (warning on CUDA)."""
    if device.startswith("cuda"):
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        try:
            return NvmlSampler(index, nvml=nvml)
        except Exception as exc:  # ImportError, NVMLError, driver mismatch: all mean "no NVML"
            warnings.warn(
                f"{device}: NVML unavailable ({exc!r}); utilization falls back to the CPU "
                "busy fraction compute/step. Install nvidia-ml-py to get GPU samples.",
                DeviceSamplerWarning, stacklevel=2)
    return CpuBusySampler()


def _nvml_handle(nvml: Any, index: int) -> Any:
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible):
        entry = visible[index]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        if entry.startswith(("GPU-", "MIG-")):
            return nvml.nvmlDeviceGetHandleByUUID(entry)
    return nvml.nvmlDeviceGetHandleByIndex(index)


def cuda_memory_stats(device: object, *, torch: ModuleType | Any | None = None) -> dict[str, float | None] | None:
    """CUDA caching-allocator view of `device`, or None where there is no such allocator.

    Keys: allocated_bytes, reserved_bytes, inactive_split_bytes, peak_bytes (allocated
    peak since the last `torch.cuda.reset_peak_memory_stats`), fragmentation_ratio
    (1 - allocated/reserved; None while nothing is reserved) and inactive_split_ratio
    (inactive_split/reserved, the second view). Never a made-up 0 on CPU: None.
    """
    if torch is None:
        try:
            import torch
        except ImportError:
            return None
    dev_type = getattr(device, "type", str(device).split(":", 1)[0])
    if dev_type != "cuda" or not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats(device)
    allocated = float(stats.get("allocated_bytes.all.current", 0))
    reserved = float(stats.get("reserved_bytes.all.current", 0))
    inactive = float(stats.get("inactive_split_bytes.all.current", 0))
    return {
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "inactive_split_bytes": inactive,
        "peak_bytes": float(stats.get("allocated_bytes.all.peak", 0)),
        "fragmentation_ratio": 1.0 - allocated / reserved if reserved > 0 else None,
        "inactive_split_ratio": inactive / reserved if reserved > 0 else None,
    }


class DeviceProbe:
    """Per-step view for the instrumentation: a sampler's utilization + allocator stats.

    `memory()` resets the CUDA peak counter after reading it, so `peak_bytes` is the
    peak of the step just measured (the schema's meaning), not of the whole process.
    On CPU both methods return None: the caller uses its busy fraction and leaves
    memory "not available".
    """

    def __init__(self, device: object, sampler: DeviceSampler | None, *,
                 torch: ModuleType | Any | None = None) -> None:
        self.device = device
        self.sampler = sampler
        self._torch = torch
        self._capacity: float | None = None

    def utilization(self, window: float) -> float | None:
        return self.sampler.utilization(window) if self.sampler is not None else None

    def memory(self) -> dict[str, float | None] | None:
        stats = cuda_memory_stats(self.device, torch=self._torch)
        if stats is not None:
            torch = self._torch
            if torch is None:
                import torch
            torch.cuda.reset_peak_memory_stats(self.device)
            stats["capacity_bytes"] = self.capacity(torch)
        return stats

    def capacity(self, torch: Any) -> float | None:
        """The device's total memory, read once: cudaMemGetInfo's total (what this process
        can address, MIG slices included), else NVML's; None when neither answers."""
        if self._capacity is None:
            try:
                self._capacity = float(torch.cuda.mem_get_info(self.device)[1])
            except Exception:  # noqa: BLE001 - a probe never raises; NVML is the second source
                mem = self.sampler.memory() if self.sampler is not None else None
                self._capacity = mem.total_bytes if mem is not None else None
        return self._capacity

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()


def make_device_probe(device: object, *, nvml: ModuleType | Any | None = None,
                      torch: ModuleType | Any | None = None) -> DeviceProbe:
    """DeviceProbe for a torch device or its name ("cuda:0", "cpu")."""
    name = str(device)
    if name == "cuda":
        name = "cuda:0"
    sampler = make_sampler(name, nvml=nvml) if name.startswith("cuda") else None
    if isinstance(sampler, CpuBusySampler):
        sampler = None  # make_sampler warned; the caller's busy fraction is the same definition
    return DeviceProbe(device, sampler, torch=torch)
