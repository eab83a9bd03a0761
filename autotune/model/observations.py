"""What the model calibrates from: each finished trial of a study, measured per stage.

One `Observation` per successful trial with metrics: its configuration, its measured step
time, and per stage (the ranks of a stage averaged, each rank's median over its measured
steps) the terms the model fits: forward+backward work per micro-batch, its wall time, the
optimizer step, the data-parallel reduction, the fastest point-to-point transfer and the
peak memory; with the per-layer costs where the trial measured them (a pipeline study's baseline, by default).

How each term is read from the metrics CSV (core/schema.py), per step of one rank:
- work: `compute_cpu_seconds` on a CPU (the thread's CPU time: the stage's work without its
  wait for a core); `compute_seconds - optimizer_seconds` on a GPU (CUDA events);
- reduction: `comm_seconds - (p2p_seconds - wait_seconds)`: the transfer time that is not
  point-to-point is the data-parallel (and tied) gradient reduction;
- transfer: `p2p_fastest_seconds`, the fastest single send or receive, which waited for nobody.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from autotune.core.errors import InputFileError
from autotune.core.summary import Columns
from autotune.rank.layer_costs import LayerCosts, read_trial_layer_costs


@dataclass(frozen=True, slots=True)
class StageMeasure:
    """One stage of one trial, per optimizer step unless named per micro-batch."""

    work_seconds: float
    """Forward + backward work of the step (all its micro-batches)."""
    wall_compute_seconds: float
    """Forward + backward wall time of the step (on a CPU shared by more ranks than cores: the
    work plus the wait for a core)."""
    optimizer_seconds: float
    reduce_seconds: float
    transfer_seconds: float | None
    """One point-to-point transfer with no wait (None: a single-stage trial or an older CSV)."""
    data_seconds: float
    wait_seconds: float
    step_seconds: float
    peak_memory_bytes: float | None
    gather_seconds: float | None = None
    """A plain engine's all-gathers of the step (None: a pipeline, or an older CSV)."""


@dataclass(frozen=True, slots=True)
class Observation:
    """One successful trial, as the model sees it."""

    trial: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    reduce_bucket_size: int | None
    checkpoint_interval: int
    stages: int
    data_parallel_size: int
    step_seconds: float
    """The trial's median step time (slowest rank)."""
    samples_per_second: float
    device: str
    """cpu or cuda."""
    stage: list[StageMeasure]
    layer_costs: LayerCosts | None = None
    peak_memory_kind: str | None = None
    """process_max_rss (a CPU process's peak resident set since it started) or cuda_max_allocated."""
    parts: list[int] | None = field(default=None)
    """The partition the trial ran (known from its layer costs)."""
    seq_length: int | None = None
    """Tokens per sample (None: not a token model, or not known)."""
    zero_stage: int | None = None
    """The trial's `zero_optimization.stage` (None: not known; the bucket rule then lets it act)."""
    plain_engine: bool = False
    """A plain DeepSpeedEngine (no pipeline): its CSV times each collective and has no point-to-point."""
    mixed_precision: bool | None = None
    """fp16 or bf16 enabled in the trial's ds_config.json (None: not known)."""
    zero_settings: tuple[tuple[str, str], ...] = ()
    """The ZeRO sweep's settings besides the stage (overlap_comm, the sizes, ...: what its knob
    trials change) as the trial ran them, DeepSpeed's defaults filled in."""

    @property
    def ranks(self) -> int:
        return self.stages * self.data_parallel_size

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size


def observe_trial(trial_dir: Path, number: int, config: dict, checkpoint_interval: int) -> Observation | None:
    """The observation of one trial folder, or None where its metrics cannot calibrate."""
    from autotune.loaders.metrics import read_trial_columns

    files = sorted(trial_dir.glob("metrics-rank*.csv"))
    if not files:
        return None
    try:
        cols = read_trial_columns(files)
    except InputFileError:
        return None
    if "warmup" not in cols or not len(cols["time"]):
        return None
    keep = cols["warmup"] == 0
    if not keep.any():
        return None
    c = {k: v[keep] for k, v in cols.items()}
    stages = int(c["pipeline_stages"][0])
    device = "cuda" if _cuda(trial_dir) else "cpu"
    per_stage: list[StageMeasure] = []
    for s in range(stages):
        ranks = sorted({int(r) for r in c["rank"][c["stage"] == s]})
        if not ranks:
            return None
        per_stage.append(_stage_measure(c, ranks, device))
    lc = None
    try:
        lc = read_trial_layer_costs(trial_dir)
    except (InputFileError, ValueError, KeyError, OSError):
        lc = None
    if lc is not None and lc.stages != stages:
        lc = None
    return Observation(
        trial=number, micro_batch_size=int(config["micro_batch_size"]),
        gradient_accumulation_steps=int(config["gradient_accumulation_steps"]),
        reduce_bucket_size=config.get("reduce_bucket_size"), checkpoint_interval=checkpoint_interval,
        stages=stages, data_parallel_size=int(c["data_parallel_size"][0]),
        step_seconds=float(config["step_seconds"]), samples_per_second=float(config["samples_per_second"]),
        device=device, stage=per_stage, layer_costs=lc,
        peak_memory_kind=lc.peak_memory_kind if lc else ("cuda_max_allocated" if device == "cuda" else "process_max_rss"),
        parts=list(lc.parts) if lc else None, seq_length=_seq(c), zero_stage=config.get("zero_stage"),
        plain_engine=_plain(c), mixed_precision=config.get("mixed_precision"),
        zero_settings=tuple(config.get("zero_settings") or ()))


def _plain(c: Columns) -> bool:
    """A plain engine writes its collective calls and no point-to-point (rank/instrument.py)."""
    calls = c.get("collective_calls")
    p2p = c.get("p2p_seconds")
    return (calls is not None and bool(np.isfinite(calls).any())
            and (p2p is None or not bool(np.isfinite(p2p).any())))


def _seq(c: Columns) -> int | None:
    v = c.get("seq_length")
    if v is None:
        return None
    v = v[np.isfinite(v) & (v > 0)]
    return int(v[0]) if len(v) else None


def _cuda(trial_dir: Path) -> bool:
    from autotune.loaders.metrics import read_text_columns

    first = sorted(trial_dir.glob("metrics-rank*.csv"))[0]
    try:
        devices = read_text_columns(first, ["device"]).get("device", [])
    except (InputFileError, OSError, KeyError):
        return False
    return bool(devices) and str(devices[0]).startswith("cuda")


def _stage_measure(c: Columns, ranks: list[int], device: str) -> StageMeasure:
    def med(name: str, rank: int) -> float | None:
        if name not in c:
            return None
        v = c[name][c["rank"] == rank]
        v = v[np.isfinite(v)]
        return float(np.median(v)) if len(v) else None

    def mean(name: str) -> float | None:
        vals = [v for v in (med(name, r) for r in ranks) if v is not None]
        return statistics.fmean(vals) if vals else None

    compute = mean("compute_seconds") or 0.0
    optimizer = mean("optimizer_seconds") or 0.0
    wall = max(0.0, compute - optimizer)
    cpu = mean("compute_cpu_seconds") if device == "cpu" else None
    comm = mean("comm_seconds") or 0.0
    p2p, wait = mean("p2p_seconds"), mean("wait_seconds") or 0.0
    reduce = max(0.0, comm - (p2p - wait)) if p2p is not None else comm
    fastest = [v for v in (_min(c, "p2p_fastest_seconds", r) for r in ranks) if v is not None]
    peak = [v for v in (med("memory_peak_bytes", r) for r in ranks) if v is not None]
    return StageMeasure(work_seconds=cpu if cpu is not None else wall, wall_compute_seconds=wall,
                        optimizer_seconds=optimizer, reduce_seconds=reduce,
                        transfer_seconds=statistics.median(fastest) if fastest else None,
                        data_seconds=mean("data_seconds") or 0.0, wait_seconds=wait,
                        step_seconds=mean("step_seconds") or 0.0, peak_memory_bytes=max(peak) if peak else None,
                        gather_seconds=mean("gather_seconds"))


def _min(c: Columns, name: str, rank: int) -> float | None:
    if name not in c:
        return None
    v = c[name][c["rank"] == rank]
    v = v[np.isfinite(v) & (v > 0)]
    return float(v.min()) if len(v) else None


def observe_study(root: str | Path) -> list[Observation]:
    """Every successful trial of the study at `root` that the model can calibrate from."""
    from autotune.study.store import open_study_readonly

    root = Path(root)
    study = open_study_readonly(root)
    try:
        rows = study.trials()
    finally:
        study.close()
    out = []
    for row in rows:
        if row.status != "ok" or not row.summary or not row.samples_per_second:
            continue
        s = row.summary
        raw = _trial_config(root / f"trial-{row.number:03d}")  # its ds_config.json, read once
        zero = _zero_section(raw)
        step = s.get("step_seconds")
        if not step or not math.isfinite(step):
            continue
        config: dict[str, object] = {"micro_batch_size": row.config.micro_batch_size,
                                  "gradient_accumulation_steps": row.config.gradient_accumulation_steps,
                                  "reduce_bucket_size": _bucket(zero, row.config.reduce_bucket_size),
                                  "step_seconds": step, "samples_per_second": row.samples_per_second,
                                  "zero_stage": _zero_stage(zero), "mixed_precision": _mixed(raw),
                                  "zero_settings": _other_zero_settings(raw)}
        obs = observe_trial(root / f"trial-{row.number:03d}", row.number, config,
                            row.config.activation_checkpoint_interval)
        if obs is not None:
            out.append(obs)
    return out


def _trial_config(trial_dir: Path) -> dict | None:
    """The trial's ds_config.json (None: unreadable)."""
    import json

    try:
        raw = json.loads((trial_dir / "ds_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _mixed(raw: dict | None) -> bool | None:
    """fp16 or bf16 enabled (DeepSpeed's sections; "auto" counts as not known)."""
    if raw is None:
        return None
    flags = [sec.get("enabled") for k in ("fp16", "bf16") if isinstance(sec := raw.get(k), dict)]
    if any(f == "auto" for f in flags):
        return None
    return any(f is True for f in flags)


def _zero_section(raw: dict | None) -> dict | None:
    """The `zero_optimization` section of a trial's config (None: no config read)."""
    if raw is None:
        return None
    zero = raw.get("zero_optimization")
    return zero if isinstance(zero, dict) else ({} if isinstance(raw, dict) else None)


def _other_zero_settings(raw: dict | None) -> tuple[tuple[str, str], ...]:
    """The ZeRO sweep's settings besides the stage as DeepSpeed runs them (the config's value, else
    its default: core/dsconfig.py `effective_zero_settings`), so a stage trial that wrote a value
    only to keep it as it was reads the same as the baseline."""
    from autotune.core.dsconfig import ZERO_STAGE_KEY, DsConfig, effective_zero_settings
    from autotune.core.errors import AutotuneError

    if raw is None:
        return ()
    try:
        effective = effective_zero_settings(DsConfig.from_dict(raw, source="trial"))
    except (AutotuneError, ValueError, TypeError):  # a config the trial ran that this reader cannot
        return ()
    return tuple(sorted((k, v) for k, v in effective.items() if k != ZERO_STAGE_KEY))


def _zero_stage(zero: dict | None) -> int | None:
    """The ZeRO stage the trial ran (DeepSpeed's default 0 where its config sets none)."""
    if zero is None:
        return None
    v = zero.get("stage", 0)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _bucket(zero: dict | None, bucket: int | None) -> int | None:
    """The bucket the trial ran with (the trial's own value, else its ds_config.json's)."""
    if bucket is not None:
        return bucket
    v = zero.get("reduce_bucket_size") if isinstance(zero, dict) else None
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
