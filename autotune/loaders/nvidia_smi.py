"""`nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,memory.total --format=csv -l 5`.

Header cells carry units (`utilization.gpu [%]`), values too (`87 %`,
`1024 MiB`); with `nounits` only the header does. Several GPUs interleave,
one row per GPU per sample. Such a log carries only utilization and memory:
the fluctuation and memory-headroom rules can run, the others report
insufficient data. nvidia-smi's memory.used counts what the allocator
reserved, so fragmentation is not available from it.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from autotune.advisor.signals import ALL_SIGNALS, RankValue, SignalSet
from autotune.core.errors import InputFileError
from autotune.loaders.detect import read_rows
from autotune.loaders.device_lead import add_device_lead

NOTE = ("nvidia-smi input: only utilization (fluctuation, and which device stays busier than the "
        "others: a pipeline's bottleneck stage) and memory signals exist; communication, bubble, "
        "stage-compute, jitter and fragmentation rules report insufficient data")
UNIT_BYTES = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
              "KB": 10**3, "MB": 10**6, "GB": 10**9}
MISSING_VALUES = {"[N/A]", "N/A", "[Not Supported]", "[Unknown Error]", ""}


def _split(cell: str) -> tuple[str, str]:
    """'87 %' -> ('87', '%'); 'utilization.gpu [%]' -> ('utilization.gpu', '%')."""
    cell = cell.strip()
    if cell.endswith("]") and " [" in cell:
        name, unit = cell[:-1].split(" [", 1)
        return name.strip(), unit.strip()
    if " " in cell:
        num, unit = cell.rsplit(" ", 1)
        return num.strip(), unit.strip()
    return cell, ""


def load_nvidia_smi(path: str | Path, *, stages: int | None = None) -> SignalSet:
    """The log's signals; with `stages`, devices map to pipeline stages in index order."""
    p = Path(path)
    util, used_ratio, used_bytes, names = _read(p)
    out = _signals(p, util, used_ratio, used_bytes)
    add_device_lead(out, util, names, stages=stages, source=p.name)
    return out


def utilization_series(path: str | Path) -> dict[str, list[float]]:
    """Each GPU's 0-1 utilization samples in file order (the HTML page draws them over time)."""
    return dict(_read(Path(path))[0])


def _read(p: Path) -> tuple[dict[str, list[float]], list[tuple[str, float]], list[float], dict[str, str]]:
    rows = read_rows(p, "nvidia-smi")
    header = [_split(h) for h in rows[0]]
    names = [n for n, _ in header]
    for need in ("index", "utilization.gpu"):
        if need not in names:
            raise InputFileError(f"{p}: nvidia-smi CSV without a {need} column; query index,utilization.gpu")
    col = {n: i for i, n in enumerate(names)}
    util: dict[str, list[float]] = defaultdict(list)
    names_of: dict[str, str] = {}
    used_ratio: list[tuple[str, float]] = []
    used_bytes: list[float] = []
    for line, row in enumerate(rows[1:], start=2):
        if not row or all(not c.strip() for c in row):
            continue
        if row[0].strip() == rows[0][0].strip():
            continue  # `-l` repeats the header after a restart
        if len(row) != len(header):
            raise InputFileError(f"{p}: line {line}: {len(row)} cells, header has {len(header)}")
        gpu = row[col["index"]].strip()
        ident = [row[col[k]].strip() for k in ("name", "pci.bus_id") if k in col and row[col[k]].strip()]
        if ident:
            names_of.setdefault(gpu, ", ".join(ident))
        u = _value(p, line, row[col["utilization.gpu"]], header[col["utilization.gpu"]][1], percent=True)
        if u is not None:
            util[gpu].append(u / 100.0)
        if "memory.used" in col and "memory.total" in col:
            used = _value(p, line, row[col["memory.used"]], header[col["memory.used"]][1])
            total = _value(p, line, row[col["memory.total"]], header[col["memory.total"]][1])
            if used is not None:
                used_bytes.append(used)
                if total:
                    used_ratio.append((gpu, used / total))
    if not util:
        raise InputFileError(f"{p}: no utilization samples in the nvidia-smi CSV")
    return util, used_ratio, used_bytes, names_of


def _value(p: Path, line: int, cell: str, header_unit: str, percent: bool = False) -> float | None:
    text = cell.strip()
    if text in MISSING_VALUES:
        return None
    num, unit = _split(text)
    unit = unit or header_unit
    try:
        x = float(num)
    except ValueError:
        raise InputFileError(f"{p}: line {line}: non-numeric value {cell.strip()!r}") from None
    if percent:
        if unit != "%":
            raise InputFileError(f"{p}: line {line}: unknown unit {unit!r} for utilization (expected %)")
        if not 0 <= x <= 100:
            raise InputFileError(f"{p}: line {line}: utilization {x} outside 0-100 %")
        return x
    if unit not in UNIT_BYTES:
        raise InputFileError(f"{p}: line {line}: unknown memory unit {unit!r}; known: {', '.join(UNIT_BYTES)}")
    return x * UNIT_BYTES[unit]


def _signals(p: Path, util: dict[str, list[float]], used_ratio: list[tuple[str, float]],
             used_bytes: list[float]) -> SignalSet:
    fluct = {g: statistics.pstdev(v) for g, v in util.items() if len(v) >= 2}
    means = {g: statistics.fmean(v) for g, v in util.items()}
    peak_ratio: dict[str, float] = {}
    for g, r in used_ratio:
        peak_ratio[g] = max(r, peak_ratio.get(g, 0.0))
    why = "not in an nvidia-smi log (utilization and memory only)"
    values: dict[str, float | None] = {
        "device_utilization_fluctuation": max(fluct.values()) if fluct else None,
        "cross_device_fluctuation": statistics.pstdev(means.values()) if len(means) > 1 else None,
        "device_utilization_mean": statistics.fmean(means.values()),
        "memory_used_ratio": max(peak_ratio.values()) if peak_ratio else None,
        "memory_peak_bytes": max(used_bytes) if used_bytes else None,
    }
    per_rank = {
        "device_utilization_fluctuation": [RankValue(v, device=f"gpu{g}") for g, v in fluct.items()],
        "memory_used_ratio": [RankValue(v, device=f"gpu{g}") for g, v in peak_ratio.items()],
    }
    unavailable = {
        "device_utilization_fluctuation": "needs at least two samples per GPU",
        "memory_used_ratio": "memory.used/memory.total not queried",
        "memory_fragmentation_ratio": "not available: nvidia-smi reports reserved memory, not the allocator's split",
    }
    for s in ALL_SIGNALS:
        if s not in values and s not in unavailable:
            unavailable[s] = why
    return SignalSet(subject=f"nvidia-smi log {p.name}", kind="metrics", values=values,
                     per_rank=per_rank, unavailable=unavailable)
