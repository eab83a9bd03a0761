"""Can this machine's devices run the precision a ds_config asks for? Asked as DeepSpeed asks.

`deepspeed.initialize` refuses fp16 or bf16 when its accelerator says the device cannot
do it (`runtime/engine.py` `_do_sanity_check`: "Type fp16 is not supported on your
device."). The answer depends on the machine: DeepSpeed's CPU accelerator asks oneDNN
whether this CPU has fp16 (an AMD EPYC without AVX-512 has not), so a config one machine
runs fails on the next, in every trial alike. autotune asks once, before the first trial.

The probe mirrors DeepSpeed 0.19.8's accelerators (`accelerator/cpu_accelerator.py`,
`accelerator/cuda_accelerator.py`); a test checks that it agrees with DeepSpeed's own
answer on the machine it runs on.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass, field

from autotune.core.dsconfig import DsConfig
from autotune.core.errors import ConfigError, UserError
from autotune.core.faults import DEVICE_PRECISIONS_ENV as TEST_OVERRIDE_ENV

PRECISIONS = ("fp16", "bf16")


@dataclass(frozen=True, slots=True)
class DeviceSupport:
    """What the trial ranks' accelerator answers for each reduced precision."""

    device: str
    """Human name, e.g. "CPU (AMD EPYC)" or "CUDA device 0 (NVIDIA H200)"."""
    supported: dict[str, bool]
    why_not: dict[str, str] = field(default_factory=dict)
    """Precision -> the accelerator's reason, for the ones it refuses."""


def requested_precisions(cfg: DsConfig) -> list[str]:
    """The reduced precisions the config enables (DeepSpeed reads `bf16` and the old `bfloat16`)."""
    raw = cfg.raw
    sections = {"fp16": [raw.get("fp16")], "bf16": [raw.get("bf16"), raw.get("bfloat16")]}
    return [p for p, secs in sections.items()
            if any(isinstance(s, dict) and s.get("enabled") is True for s in secs)]


def unsupported_message(precision: str, support: DeviceSupport) -> str:
    """The one line `run` and `check` both say."""
    other = "bf16 or fp32" if precision == "fp16" and support.supported.get("bf16") else "fp32"
    return (f"the ds_config enables {precision} ({precision}.enabled: true), which {support.device} "
            f"cannot run ({support.why_not.get(precision, 'the accelerator refuses it')}); every trial "
            f"would fail in deepspeed.initialize: set {precision}.enabled to false ({other}) "
            f"or run on devices with {precision}")


def check_precision(cfg: DsConfig, support: DeviceSupport | None = None) -> None:
    """Raise a one-line ConfigError when the config asks for a precision the devices lack."""
    requested = requested_precisions(cfg)
    if not requested:  # fp32 runs everywhere: no need to import torch and ask the devices
        return
    support = support or probe_devices()
    for precision in requested:
        if not support.supported.get(precision, True):
            raise ConfigError(unsupported_message(precision, support))


@functools.cache
def probe_devices(accelerator: str | None = None) -> DeviceSupport:
    """This machine's answer, for the accelerator the ranks will use (DS_ACCELERATOR, else
    CUDA when torch sees a device, else CPU). Needs torch; imported here, not at module load."""
    override = os.environ.get(TEST_OVERRIDE_ENV)
    if override is not None:
        have = {p.strip() for p in override.split(",")}
        return DeviceSupport(device=f"the test device ({TEST_OVERRIDE_ENV}={override})",
                             supported={p: p in have for p in PRECISIONS},
                             why_not={p: "test override" for p in PRECISIONS if p not in have})
    try:
        import torch
    except ImportError:
        raise UserError("asking the devices which precisions they run needs torch, which this Python "
                        "lacks: pip install 'autotune[tune]' and a torch build for this machine") from None
    name = accelerator or os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return _cpu_support(torch)
    if name == "cuda":
        return _cuda_support(torch)
    # xpu, npu, hpu, mps...: DeepSpeed's answer lives in accelerators we do not mirror.
    return DeviceSupport(device=f"accelerator {name!r}", supported={p: True for p in PRECISIONS})


def _cpu_support(torch) -> DeviceSupport:  # noqa: ANN001 - the torch module
    try:
        fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # DeepSpeed treats any failure of the query as "no"
        fp16 = False
    why = {} if fp16 else {"fp16": "oneDNN has no fp16 on this CPU: "
                                   "torch.ops.mkldnn._is_mkldnn_fp16_supported() is False"}
    # DeepSpeed's CPU accelerator accepts bf16 on every CPU (emulated where AVX-512 lacks it).
    return DeviceSupport(device=f"this machine's CPU ({cpu_model()}) under DeepSpeed's CPU accelerator",
                         supported={"fp16": fp16, "bf16": True}, why_not=why)


def _cuda_support(torch) -> DeviceSupport:  # noqa: ANN001 - the torch module
    if not torch.cuda.is_available():  # DeepSpeed answers yes here; the trial fails elsewhere
        return DeviceSupport(device="CUDA (no device visible)", supported={p: True for p in PRECISIONS})
    major, minor = torch.cuda.get_device_capability()
    fp16 = major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")
    bf16 = bool(torch.cuda.is_bf16_supported())
    why = {}
    if not fp16:
        why["fp16"] = (f"compute capability {major}.{minor}: DeepSpeed needs 7.0, or 6.x with "
                       "DS_ALLOW_DEPRECATED_FP16=1")
    if not bf16:
        why["bf16"] = f"compute capability {major}.{minor} has no bf16"
    return DeviceSupport(device=f"CUDA device 0 ({torch.cuda.get_device_name(0)})",
                         supported={"fp16": fp16, "bf16": bf16}, why_not=why)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
