"""A fake `pynvml` module: just the calls NvmlSampler makes, with scriptable samples.

Lets tests run the GPU code path on a machine without a GPU. Timestamps are
microseconds, values percent, as in NVML.
"""

from __future__ import annotations

from types import SimpleNamespace


class FakeNvml:
    NVML_GPU_UTILIZATION_SAMPLES = 1
    NVML_VALUE_TYPE_UNSIGNED_INT = 1

    class NVMLError(Exception):
        pass

    def __init__(self, samples: list[tuple[int, int]] | None = None, *, rate: int = 37,
                 samples_supported: bool = True) -> None:
        self.samples = list(samples or [])
        self.rate = rate
        self.samples_supported = samples_supported
        self.initialized = False
        self.handles: list[object] = []
        self.calls: list[tuple[str, object]] = []

    def nvmlInit(self) -> None:
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.handles.append(("index", index))
        return f"gpu{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.handles.append(("uuid", uuid))
        return uuid

    def nvmlDeviceGetSamples(self, handle, sampling_type, last_seen):
        self.calls.append(("samples", last_seen))
        if not self.samples_supported:
            raise self.NVMLError("Not Supported")
        new = [SimpleNamespace(timeStamp=ts, sampleValue=SimpleNamespace(uiVal=v))
               for ts, v in self.samples if ts > last_seen]
        if not new:
            raise self.NVMLError("Not Found")  # what the real NVML does when nothing is new
        return self.NVML_VALUE_TYPE_UNSIGNED_INT, new

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self.rate, memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(total=80 * 2**30, used=12 * 2**30, free=68 * 2**30)
