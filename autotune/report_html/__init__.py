"""The HTML report: `autotune report STUDY`, the end of `autotune run`, `autotune advise --html`.

gather (read the data) -> figures (matplotlib) -> page (HTML) -> files written here:
the page, and each figure as PNG and SVG in a folder beside it. matplotlib is the
optional extra `report`; without it every entry point here raises one UserError
naming `pip install 'autotune[report]'` (or, at the end of a run, returns a note).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.core.errors import AutotuneError, UserError
from autotune.core.extras import EXTRAS, missing_modules, require
from autotune.core.fileio import write_atomic
from autotune.study.store import Study

REPORT_NAME = "report.html"
FIGURES_DIR = "figures"
_OURS = re.compile(r"^(convergence|knob-.+|split-.+|util-.+)\.(png|svg)$")


@dataclass(frozen=True, slots=True)
class Written:
    page: Path
    figures: list[Path]


def write_study_report(study: Study, out_dir: Path | None = None) -> Written:
    """Gather, draw and write `report.html` and `figures/` for an open study (read only)."""
    require("report")
    from autotune.report_html.figures import study_figures
    from autotune.report_html.gather import gather_study
    from autotune.report_html.page import render_study

    out_dir = Path(out_dir) if out_dir is not None else study.root
    data = gather_study(study)
    figs = study_figures(data)
    return _write(out_dir / REPORT_NAME, out_dir / FIGURES_DIR, FIGURES_DIR,
                  lambda href: render_study(data, figs, href), figs)


def report_on_folder(root: str | Path, out_dir: str | Path | None = None) -> Written:
    """`autotune report`: open `root` read-only (refused unless a valid study), then write."""
    require("report")
    from autotune.study.store import open_study_readonly

    study = open_study_readonly(root)
    try:
        if out_dir is not None:
            _check_out_dir(Path(out_dir))
        return write_study_report(study, Path(out_dir) if out_dir is not None else None)
    finally:
        study.close()


def check_html_target(out: str | Path, inputs: Sequence[str | Path]) -> None:
    """`advise --html OUT`, before anything runs: matplotlib present, OUT a new file name."""
    require("report")
    out = Path(out)
    for p in inputs:
        if _same_file(out, Path(p)):
            raise UserError(f"--html {out} would overwrite {p}; choose a new file")
    if out.is_dir():
        raise UserError(f"--html {out} is a folder; give a file name such as {out / 'advise.html'}")
    if not out.parent.is_dir():
        raise UserError(f"--html {out}: folder {out.parent} does not exist")
    figs = out.parent / f"{out.stem}_figures"
    if figs.exists() and not figs.is_dir():
        raise UserError(f"--html {out}: {figs} exists and is not a folder (the figures go there)")


def write_metrics_report(out: str | Path, metrics: str | Path | Sequence[str | Path], loaded: Any,
                         findings: Sequence[Any]) -> Written:
    """`advise --html OUT`: OUT and its figures in `OUT-stem_figures/` beside it.
    `metrics`: the input file, or every file of a multi-file `advise` (`loaded.groups` says the jobs)."""
    out = Path(out)
    inputs = [metrics] if isinstance(metrics, (str, Path)) else list(metrics)
    check_html_target(out, inputs)
    from autotune.report_html.figures import metrics_figures
    from autotune.report_html.gather import gather_metrics
    from autotune.report_html.page import render_metrics

    summaries = list(getattr(loaded, "summaries", []))
    names = [s.subject for s in loaded.subjects] if summaries else None  # advise builds them in step
    data = gather_metrics(inputs[0], list(findings), loaded.format, loaded.notes, [*summaries, *loaded.subjects],
                          groups=getattr(loaded, "groups", None), names=names)
    figs = metrics_figures(data.steps, data.device_utilization)
    fig_dir = f"{out.stem}_figures"
    return _write(out, out.parent / fig_dir, fig_dir, lambda href: render_metrics(data, figs, href), figs)


def at_end_of_run(study: Study, note: Callable[[str], None]) -> Path | None:
    """The end of `autotune run`: write the page and say where, or say why not. Never raises.

    A missing matplotlib is one note naming the extra; any other failure while drawing is
    one note too: the tuning result (summary.json, best_ds_config.json) is already
    written, and a figure must not turn a finished run into a failed one.
    """
    missing = missing_modules("report")
    if missing:
        note(f"HTML report skipped: {', '.join(missing)} not installed; "
             f"pip install 'autotune[report]' ({EXTRAS['report'].purpose}), "
             f"then `autotune report {study.root}`")
        return None
    try:
        written = write_study_report(study)
    except (AutotuneError, OSError, ValueError, RuntimeError) as exc:
        note(f"HTML report not written ({exc.__class__.__name__}: {exc}); "
             f"`autotune report {study.root}` retries it")
        return None
    note(f"wrote {written.page}")
    return written.page


# -- files ---------------------------------------------------------------------------------
def _write(page: Path, fig_dir: Path, href: str, render: Callable[[str], str], figs: Sequence[Any]) -> Written:
    try:
        if figs:
            fig_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for f in figs:
            paths.append(write_atomic(fig_dir / f"{f.name}.png", f.png))
            paths.append(write_atomic(fig_dir / f"{f.name}.svg", f.svg.encode("utf-8")))
        keep = {p.name for p in paths}
        for old in fig_dir.iterdir() if fig_dir.is_dir() else ():  # figures of an earlier report that this one no longer has
            if old.is_file() and _OURS.match(old.name) and old.name not in keep:
                old.unlink()
        write_atomic(page, render(href).encode("utf-8"))
    except OSError as exc:
        raise UserError(f"{page}: cannot write the report ({exc.strerror or exc})") from None
    return Written(page=page, figures=paths)


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")
    if not out.exists() and not out.parent.is_dir():
        raise UserError(f"--out {out}: folder {out.parent} does not exist")


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


__all__ = ["Written", "at_end_of_run", "check_html_target", "report_on_folder", "write_metrics_report", "write_study_report"]
