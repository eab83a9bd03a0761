"""The report's figures, drawn with matplotlib (Agg): one small figure per question.

matplotlib is imported here and only here, lazily (`pip install 'autotune[report]'`).
Each function returns a `Figure`: PNG bytes (inlined in the page) and SVG text
(written beside it). Small figures, one question each, so the page can lay them out
side by side on a desktop and one under the other on a phone.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autotune.core.extras import require
from autotune.core.space import fmt_bucket
from autotune.core.trial_kind import BASELINE
from autotune.report_html.gather import KNOB_LABELS, StepData, StudyReport
from autotune.study.store import STATUS_FAILED, STATUS_OK
from autotune.tuning import preload

WIDTH, HEIGHT, DPI = 5.6, 3.4, 130
SOURCE_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
                 "#ccb974", "#64b5cd"]
# Transfer and waiting apart (schema 2, autotune/rank/p2p_split.py): a send that waits for a slow
# peer is drawn as waiting, not as communication.
SPLIT = (("compute", "compute", "#4c72b0"), ("communication", "transfer (p2p, reductions)", "#dd8452"),
         ("waiting", "waiting for peers", "#c44e52"), ("data", "data loading", "#55a868"),
         ("other", "other (host)", "#b0b0b0"))
FAILED_COLOR = "#c44e52"


@dataclass(frozen=True, slots=True)
class Figure:
    name: str
    """File stem: figures/NAME.png and NAME.svg."""
    title: str
    caption: str
    png: bytes
    svg: str


def _plt() -> Any:
    require("report")
    preload.wait()  # `autotune run` imports matplotlib in the background (autotune/tuning/preload.py)
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 10, "legend.fontsize": 8.5, "axes.spines.top": False,
                         "axes.spines.right": False, "svg.fonttype": "none",
                         "svg.hashsalt": "autotune", "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _finish(plt: Any, fig: Any, name: str, title: str, caption: str) -> Figure:
    fig.tight_layout()
    png, svg = io.BytesIO(), io.StringIO()
    # "tight": legends placed below the axes are kept, and no empty margin is left
    fig.savefig(png, format="png", dpi=DPI, bbox_inches="tight", pad_inches=0.08)
    fig.savefig(svg, format="svg", metadata={"Date": None}, bbox_inches="tight", pad_inches=0.08)
    plt.close(fig)
    return Figure(name=name, title=title, caption=caption, png=png.getvalue(), svg=svg.getvalue())


def _headroom(ax: Any, values: Sequence[float | None]) -> None:
    """From 0 to a little above the highest point, so markers and rings are never cut."""
    top = max((v for v in values if v), default=1.0)
    ax.set_ylim(0, top * 1.15)


def _source_colors(sources: Sequence[str]) -> dict[str, str]:
    order = [BASELINE] + sorted(set(sources) - {BASELINE})  # the reference keeps the first color
    return {s: SOURCE_COLORS[i % len(SOURCE_COLORS)] for i, s in enumerate(order)}


# -- study figures ---------------------------------------------------------------------
def convergence(r: StudyReport) -> Figure:
    """Best-so-far samples/s against trial number; points by proposer, failures with reasons."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH, HEIGHT))
    colors = _source_colors([t.source for t in r.counted])
    ok = sorted(r.ok, key=lambda t: t.number)
    for source, color in colors.items():
        pts = [t for t in ok if t.source == source]
        if pts:
            ax.scatter([t.number for t in pts], [t.samples_per_second for t in pts], s=36, color=color,
                       label=source, zorder=3, edgecolor="white", linewidth=0.6)
    xs, ys, best = [], [], -math.inf
    for t in sorted(r.counted, key=lambda t: t.number):
        if t.status == STATUS_OK and t.samples_per_second:
            best = max(best, t.samples_per_second)
        if best > -math.inf:
            xs.append(t.number)
            ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", color="#222222", linewidth=1.6, label="best so far", zorder=2)
    if r.baseline is not None and r.baseline.status == STATUS_OK and r.baseline.samples_per_second:
        ax.axhline(r.baseline.samples_per_second, color="#777777", linestyle="--", linewidth=1,
                   label=f"baseline ({r.baseline.samples_per_second:.0f} samples/s)")
    failed = [t for t in r.counted if t.status == STATUS_FAILED]
    if failed:
        low = min((t.samples_per_second for t in ok), default=1.0) * 0.0
        ax.scatter([t.number for t in failed], [low] * len(failed), marker="x", color=FAILED_COLOR, s=48,
                   label="failed", zorder=4, clip_on=False)
        for t in failed:
            ax.annotate(t.failure_reason or "failed", (t.number, low), xytext=(0, 7),
                        textcoords="offset points", rotation=90, fontsize=7, color=FAILED_COLOR,
                        ha="center", va="bottom")
    _headroom(ax, [t.samples_per_second for t in ok])
    ax.set_xlabel("trial")
    ax.set_ylabel("samples/s")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    return _finish(plt, fig, "convergence", "Best-so-far throughput against trial",
                   "Each finished trial's throughput, coloured by who proposed it; the black step is "
                   "the best so far, the dashed line the baseline; crosses on the axis are failed "
                   "trials with their reason.")


def knob(r: StudyReport, name: str) -> Figure:
    """Throughput against one knob; the incumbent (best configuration) ringed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH * 0.8, HEIGHT * 0.95))
    colors = _source_colors([t.source for t in r.counted])
    ok = [t for t in r.ok if getattr(t.config, name) is not None]
    for t in ok:
        ax.scatter(getattr(t.config, name), t.samples_per_second, s=34, color=colors.get(t.source, "#444"),
                   zorder=3, edgecolor="white", linewidth=0.6)
    failed = [t for t in r.counted if t.status == STATUS_FAILED and getattr(t.config, name) is not None]
    if failed:
        ax.scatter([getattr(t.config, name) for t in failed], [0] * len(failed), marker="x",
                   color=FAILED_COLOR, s=44, zorder=4, clip_on=False, label="failed")
    if r.best is not None and getattr(r.best.config, name) is not None:
        ax.scatter(getattr(r.best.config, name), r.best.samples_per_second, s=190, facecolor="none",
                   edgecolor="#222222", linewidth=1.8, zorder=5,
                   label=f"best (mean of {r.best.repeats})" if r.best.repeats > 1 else "best")
    values = sorted({getattr(t.config, name) for t in r.counted if getattr(t.config, name) is not None})
    if values and values[-1] / max(values[0], 1) >= 16:
        ax.set_xscale("log", base=2 if name != "reduce_bucket_size" else 10)
    if name == "reduce_bucket_size":
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: fmt_bucket(int(v)) if v >= 1 else ""))
    elif values:
        ax.set_xticks(values)
        ax.set_xticklabels([str(v) for v in values])
        ax.minorticks_off()
    _headroom(ax, [t.samples_per_second for t in ok])
    ax.set_xlabel(KNOB_LABELS.get(name, name))
    ax.set_ylabel("samples/s")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)  # off the points
    label = KNOB_LABELS.get(name, name)
    return _finish(plt, fig, f"knob-{name}", f"Throughput against {label}",
                   f"Every successful trial at its {label}, coloured by who proposed it (as above); the ring is "
                   "the best configuration, crosses on the axis are failed trials.")


def stage_split(data: StepData, title: str, name: str, xmax: float | None = None) -> Figure:
    """Per-stage seconds per step: compute / communication / waiting / data / other, plus the ideal bubble."""
    plt = _plt()
    stages = data.stages
    fig, ax = plt.subplots(figsize=(WIDTH * 0.9, 1.1 + 0.7 * len(stages)))
    y = list(range(len(stages)))
    left = [0.0] * len(stages)
    for attr, label, color in SPLIT:
        vals = [getattr(s, attr) for s in stages]
        ax.barh(y, vals, left=left, height=0.5, color=color, label=label)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.barh([v + 0.38 for v in y], [s.ideal_bubble for s in stages], height=0.16, color="none",
            edgecolor="#222222", hatch="////", linewidth=0.6, label="ideal bubble (p-1)/(m+p-1)")
    ax.set_yticks(y)
    ax.set_yticklabels([f"stage {s.stage}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (mean over the stage's ranks)")
    if xmax:
        ax.set_xlim(0, xmax)
    ax.grid(axis="y", visible=False)
    # above the bars: the same place whatever the number of stages (below, it met the axis label)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.02), ncol=3, frameon=False)
    return _finish(plt, fig, name, title,
                   "Mean seconds per step of each pipeline stage by what it did; the thin hatched bar "
                   "is the bubble the 1F1B schedule cannot avoid at this gradient accumulation.")


def utilization(data: StepData, title: str, name: str) -> Figure:
    """Device utilization per rank over the measured steps."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH * 0.9, HEIGHT))
    for i, rank in enumerate(data.ranks):
        style = "-" if rank.stage % 2 == 0 else "--"
        ax.plot(rank.step, [100 * u for u in rank.utilization], style, marker="o", markersize=3,
                linewidth=1.3, color=SOURCE_COLORS[i % len(SOURCE_COLORS)],
                label=f"rank {rank.rank} (stage {rank.stage})")
    ax.set_ylim(0, 105)
    ax.set_xlabel("step")
    ax.set_ylabel("device utilization %")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(4, max(2, len(data.ranks) // 2)),
              frameon=False)
    what = ("the device's own utilization counter (NVML)" if any(r.from_device for r in data.ranks)
            else "the busy fraction: compute time / step time")
    return _finish(plt, fig, name, title,
                   f"Utilization of each rank at every measured step (warm-up left out); here it is "
                   f"{what}.")


def model_check(r: StudyReport) -> Figure:
    """The performance model's held-out prediction of each trial against its measurement."""
    from autotune.model.validation import mean_abs_error

    plt = _plt()
    fig, ax = plt.subplots(figsize=(HEIGHT * 1.25, HEIGHT))
    pts = r.held_out
    measured = [p.measured_samples_per_second for p in pts]
    predicted = [p.predicted_samples_per_second for p in pts]
    top = max(measured + predicted) * 1.1
    ax.plot([0, top], [0, top], color="#777777", linestyle="--", linewidth=1, label="predicted = measured")
    ax.scatter(measured, predicted, s=36, color=SOURCE_COLORS[1], edgecolor="white", linewidth=0.6, zorder=3)
    for p in pts:
        ax.annotate(str(p.trial), (p.measured_samples_per_second, p.predicted_samples_per_second),
                    xytext=(4, 3), textcoords="offset points", fontsize=7)
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured samples/s")
    ax.set_ylabel("predicted samples/s")
    ax.legend(loc="upper left", frameon=False)
    err = mean_abs_error(pts) or 0.0
    return _finish(plt, fig, "model-check", f"Performance model: predicted against measured ({err * 100:.1f} % error)",
                   f"Each trial (numbered) as the model calibrated on the study's other trials predicts it "
                   f"(leave-one-out, docs/model.md): step-time error {err * 100:.1f} % over {len(pts)} trials "
                   "it had not seen. On the dashed line the prediction is exact.")


def study_figures(r: StudyReport) -> list[Figure]:
    """Every figure the study's data allows, in page order."""
    figs: list[Figure] = []
    if len(r.ok) >= 2 or (r.ok and len(r.counted) >= 2):
        figs.append(convergence(r))
        figs.extend(knob(r, k) for k in r.knobs)
    pair = _pair(r)
    xmax = max((s.step for _, d in pair for s in d.stages), default=0.0) * 1.05 or None
    for label, data in pair:
        figs.append(stage_split(data, f"Time per step: {label}", f"split-trial-{data.trial:03d}", xmax))
    for label, data in pair:
        figs.append(utilization(data, f"Utilization: {label}", f"util-trial-{data.trial:03d}"))
    if r.held_out:
        figs.append(model_check(r))
    return figs


def _pair(r: StudyReport) -> list[tuple[str, StepData]]:
    out = []
    if r.baseline is not None and r.baseline.number in r.steps:
        out.append(("baseline, trial 0", r.steps[r.baseline.number]))
    if r.best is not None and r.best.number in r.steps and (r.baseline is None or r.best.number != r.baseline.number):
        out.append((f"best, trial {r.best.number}", r.steps[r.best.number]))
    return out


def device_utilization(series: dict[str, list[float]]) -> Figure:
    """An nvidia-smi log: each GPU's utilization over its samples (a device far above the others
    is a pipeline's bottleneck stage)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH * 0.9, HEIGHT))
    for i, (gpu, values) in enumerate(sorted(series.items())):
        ax.plot(range(len(values)), [100 * u for u in values], "-", linewidth=1.3,
                color=SOURCE_COLORS[i % len(SOURCE_COLORS)], label=f"GPU {gpu}")
    ax.set_ylim(0, 105)
    ax.set_xlabel("sample (nvidia-smi -l interval)")
    ax.set_ylabel("GPU utilization %")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(4, max(2, len(series))), frameon=False)
    return _finish(plt, fig, "util-devices", "Utilization: every GPU of the log",
                   "nvidia-smi's utilization.gpu of each device at every sample: the share of the "
                   "sampling interval in which a kernel ran.")


def metrics_figures(steps: dict[int, StepData], devices: dict[str, list[float]] | None = None) -> list[Figure]:
    figs: list[Figure] = [device_utilization(devices)] if devices else []
    xmax = max((s.step for d in steps.values() for s in d.stages), default=0.0) * 1.05 or None
    for trial, data in sorted(steps.items()):
        label, tag = (f"trial {trial}", f"trial-{trial:03d}") if trial >= 0 else ("this run", "run")
        figs.append(utilization(data, f"Utilization: {label}", f"util-{tag}"))
        figs.append(stage_split(data, f"Time per step: {label}", f"split-{tag}", xmax))
    return figs
