"""The device and network a plan is for: a preset (autotune/data/hardware/*.toml, each with
its public sources) or the user's own TOML file in the same format.

Datasheet figures are the top-level keys; what no datasheet gives (the share of peak FLOP/s
a transformer reaches, message latencies, the memory a GPU holds outside the model) sits in
`[assumed]`, and every figure a plan takes from either is marked as scaled from the preset.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from autotune.core.errors import UserError

DATASHEET = ("peak_flops", "memory_bytes", "memory_bandwidth", "nvlink_bandwidth", "network_bandwidth")
ASSUMED = ("model_flops_utilization", "nvlink_latency", "network_latency", "context_bytes")


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    peak_flops: float
    """Dense half-precision Tensor Core FLOP/s."""
    memory_bytes: float
    memory_bandwidth: float
    nvlink_bandwidth: float
    """Bytes/s one direction per GPU within a node."""
    network_bandwidth: float
    """Bytes/s one direction per GPU across nodes."""
    model_flops_utilization: float
    nvlink_latency: float
    network_latency: float
    context_bytes: float
    sources: tuple[str, ...]
    file: str

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.model_flops_utilization


def preset_names() -> list[str]:
    folder = resources.files("autotune") / "data" / "hardware"
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def load_hardware(name_or_file: str, *, device_memory: float | None = None) -> Hardware:
    """A preset by name (a100, h100, h200) or a TOML file; a UserError naming what is wrong."""
    path = Path(name_or_file)
    if path.suffix == ".toml" or path.exists():
        source = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise UserError(f"{path}: cannot read the hardware file ({err.strerror or err})") from None
    elif name_or_file.lower() in preset_names():
        source = f"preset {name_or_file.lower()}"
        text = (resources.files("autotune") / "data" / "hardware" / f"{name_or_file.lower()}.toml").read_text(encoding="utf-8")
    else:
        raise UserError(f"--hardware {name_or_file}: neither a preset ({', '.join(preset_names())}) nor a .toml file")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{source}: not valid TOML ({err})") from None
    assumed = raw.get("assumed", {})
    if not isinstance(assumed, dict):
        raise UserError(f"{source}: [assumed] must be a table")
    values: dict[str, float] = {}
    for key in DATASHEET + ASSUMED:
        v = (assumed if key in ASSUMED else raw).get(key)
        where = f"[assumed] {key}" if key in ASSUMED else key
        if v is None:
            raise UserError(f"{source}: missing {where} (see autotune/data/hardware/h100.toml for every field)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise UserError(f"{source}: {where} = {v!r} must be a positive number")
        values[key] = float(v)
    if values["model_flops_utilization"] > 1:
        raise UserError(f"{source}: [assumed] model_flops_utilization = {values['model_flops_utilization']:g} "
                        "is a share of the peak: at most 1")
    if device_memory is not None:
        if not math.isfinite(device_memory) or device_memory <= 0:
            raise UserError(f"--device-memory {device_memory:g}: must be a positive number of bytes")
        values["memory_bytes"] = float(device_memory)
    sources = raw.get("sources", [])
    return Hardware(name=str(raw.get("name", path.stem)), sources=tuple(str(s) for s in sources), file=source,
                    **values)
