"""The HTML report from studies built through the real Study API: content, missing data, refusals."""

from __future__ import annotations

import re
import sqlite3

import pytest
from builders import not_a_study
from click.testing import CliRunner
from html_study import CFGS, failed_trial, full_study, new_study, ok_trial

from autotune.cli.main import cli
from autotune.core.errors import StudyError, UserError
from autotune.report_html import at_end_of_run, report_on_folder
from autotune.report_html.gather import gather_study
from autotune.study.store import Study, open_study_readonly

pytest.importorskip("matplotlib", reason="the report extra: pip install 'autotune[report]'")

IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="[^"]*" data-figure="([^"]+)"')


def figures_in(page: str) -> dict[str, int]:
    import base64

    return {name: len(base64.b64decode(data)) for data, name in IMG.findall(page)}


def tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_full_study_page_has_every_figure_and_section(tmp_path):
    root = full_study(tmp_path / "st")
    written = report_on_folder(root)
    page = written.page.read_text()
    figs = figures_in(page)
    assert set(figs) == {"convergence", "knob-micro_batch_size", "knob-gradient_accumulation_steps",
                         "knob-reduce_bucket_size", "split-trial-000", "split-trial-004",
                         "util-trial-000", "util-trial-004", "model-check"}
    assert all(size > 1000 for size in figs.values())
    for name in figs:  # the same figures beside the page, as PNG and SVG
        assert (root / "figures" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "<svg" in (root / "figures" / f"{name}.svg").read_text()
    # the header: what, on what, how long, gain with its noise (trial 4 re-measures trial 3: the best row is the latest)
    assert "tiny, 2 pipeline stages x 2 data-parallel = 4 ranks" in page
    assert "best measured 2 times" in page and "gain over the baseline" in page
    with _opened(root) as study:
        data = gather_study(study)
    assert data.speedup is not None and data.speedup > 1
    assert f"<b>{data.speedup:.2f}x</b>" in page
    # fired rules with evidence, the config diff, failures with their (escaped) detail
    assert "Evidence:" in page and "bubble_fraction_excess" in page
    assert '<span class="del">-  &quot;gradient_accumulation_steps&quot;: 16,</span>' in page
    assert '<span class="add">+  &quot;gradient_accumulation_steps&quot;: 4,</span>' in page
    assert "oom &lt;b&gt;detail&lt;/b&gt;" in page and "<b>detail</b>" not in page
    assert '<meta name="viewport"' in page
    assert not re.search(r'(src|href)="https?:', page)


def test_report_again_removes_figures_it_no_longer_has(tmp_path):
    root = full_study(tmp_path / "st")
    report_on_folder(root)
    stale = root / "figures" / "util-trial-099.png"
    stale.write_bytes(b"old")
    keep = root / "figures" / "notes.txt"
    keep.write_text("mine")
    report_on_folder(root)
    assert not stale.exists() and keep.read_text() == "mine"


def test_failed_only_study_says_what_is_missing(tmp_path):
    s = new_study(tmp_path / "st", budget=2)
    failed_trial(s, 0, CFGS[0], "oom")
    failed_trial(s, 1, CFGS[1], "timeout")
    s.close()
    page = report_on_folder(tmp_path / "st").page.read_text()
    assert figures_in(page) == {}
    assert "Every finished trial failed (oom, timeout)" in page
    assert "The baseline (trial 0) failed (oom)" in page
    assert "timeout" in page and "What this page cannot show" in page


def test_single_trial_study(tmp_path):
    s = new_study(tmp_path / "st", budget=1)
    ok_trial(s, 0, CFGS[0], 20.0)
    s.close()
    page = report_on_folder(tmp_path / "st").page.read_text()
    assert set(figures_in(page)) == {"split-trial-000", "util-trial-000"}
    assert "Only one trial succeeded" in page
    assert "The best trial is the baseline" in page
    assert "The best configuration is the starting one" in page


def test_resumed_study_with_interrupted_trials_and_missing_csvs(tmp_path):
    s = new_study(tmp_path / "st", budget=4)
    ok_trial(s, 0, CFGS[0], 20.0)
    s.start_trial(1, CFGS[1], "climb", "")
    s.interrupt_running()  # the controller died in trial 1; the resume re-ran it
    ok_trial(s, 1, CFGS[1], 40.0, source="climb", csvs=False)
    s.start_trial(2, CFGS[2], "bayes", "")
    s.interrupt_running()  # ... and died again, not resumed since
    s.close()
    page = report_on_folder(tmp_path / "st").page.read_text()
    assert "Resumed study: 2 interrupted attempt(s) of trial(s) 1, 2; 1 ran again" in page
    assert "2 not run again yet" in page
    assert "Trial 1&#x27;s per-rank metrics (trial-001/metrics-rank*.csv) are missing" in page
    figs = figures_in(page)
    assert "convergence" in figs and "split-trial-000" in figs and "split-trial-001" not in figs
    assert page.count('class="interrupted"') == 2
    assert "2 of its 4 budgeted trials" in page


def test_empty_study(tmp_path):
    new_study(tmp_path / "st").close()
    page = report_on_folder(tmp_path / "st").page.read_text()
    assert "No trial has started in this study yet" in page and figures_in(page) == {}


def test_report_reads_the_study_without_writing_to_its_database(tmp_path):
    root = full_study(tmp_path / "st")
    db = root / "study.db"
    before = db.read_bytes()
    study = open_study_readonly(root)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        study._db.execute("INSERT INTO meta(key, value) VALUES ('x', 'y')")
    data = gather_study(study)
    study.close()
    assert data.best is not None and data.best.number == 4 and data.best.repeats == 2
    assert db.read_bytes() == before


@pytest.mark.parametrize("make", ["missing", "plain", "file", "foreign-db", "newer"])
def test_refused_folders_are_one_line_exit_2_and_left_untouched(tmp_path, make):
    root = tmp_path / "x"
    if make in ("plain", "file", "foreign-db"):
        not_a_study(root, make)
    elif make == "newer":
        s = new_study(root)
        with s._db:
            s._db.execute("UPDATE meta SET value='2' WHERE key='format'")
        s.close()
    before = tree(root) if root.is_dir() else None
    result = CliRunner().invoke(cli, ["report", str(root)])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("autotune: error: "), result.output
    if make == "newer":
        assert "study format 2" in lines[0]
    if root.is_dir():
        assert tree(root) == before
    else:
        assert not root.exists() or root.read_text() == "a file, not a folder"


def test_cli_report_with_out_folder(tmp_path):
    root = full_study(tmp_path / "st")
    out = tmp_path / "site"
    result = CliRunner().invoke(cli, ["report", str(root), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out / 'report.html'} (9 figures" in result.output
    assert (out / "figures" / "convergence.svg").is_file() and not (root / "report.html").exists()


def test_missing_matplotlib_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    import autotune.core.extras as extras

    root = full_study(tmp_path / "st")
    real = extras.importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(UserError, match=r"pip install 'autotune\[report\]'"):
        report_on_folder(root)
    notes: list[str] = []
    with _opened(root) as study:
        assert at_end_of_run(study, notes.append) is None
    assert len(notes) == 1 and "HTML report skipped" in notes[0] and "autotune[report]" in notes[0]
    assert not (root / "report.html").exists()


def test_end_of_run_writes_the_page_and_says_where(tmp_path):
    root = full_study(tmp_path / "st")
    notes: list[str] = []
    with _opened(root) as study:
        page = at_end_of_run(study, notes.append)
    assert page == root / "report.html" and page.is_file()
    assert notes == [f"wrote {root / 'report.html'}"]


def test_refused_study_raises_study_error(tmp_path):
    with pytest.raises(StudyError, match="not an autotune study"):
        open_study_readonly(tmp_path)


class _opened:
    def __init__(self, root):
        self.study = Study.open(root, create=False)

    def __enter__(self):
        return self.study

    def __exit__(self, *exc):
        self.study.close()


# -- advise --html ------------------------------------------------------------------------
FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "advise"


def test_advise_html_for_a_metrics_csv(tmp_path):
    out = tmp_path / "advice.html"
    result = CliRunner().invoke(cli, ["advise", str(FIXTURES / "h200-small-1stage.csv"), "--html", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    figs = figures_in(page)
    assert set(figs) == {"util-run", "split-run"} and all(v > 1000 for v in figs.values())
    assert (tmp_path / "advice_figures" / "util-run.svg").is_file()
    assert "Findings" in page and f"wrote {out}" in result.output


def test_advise_html_for_an_nvidia_smi_log_draws_each_device_and_says_what_it_lacks(tmp_path):
    from autotune.loaders.nvidia_smi import utilization_series

    src = FIXTURES / "nvidia_smi_2gpu.csv"
    out = tmp_path / "smi.html"
    result = CliRunner().invoke(cli, ["advise", str(src), "--html", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    figs = figures_in(page)
    assert set(figs) == {"util-devices"} and figs["util-devices"] > 1000
    assert "Device utilization over time" in page and "carries no per-step timing" in page
    assert (tmp_path / "smi_figures" / "util-devices.svg").is_file()
    series = utilization_series(src)  # the figure's data: every GPU, every sample
    assert len(series) == 2 and all(len(v) >= 2 for v in series.values())
    svg = (tmp_path / "smi_figures" / "util-devices.svg").read_text()
    assert all(f"GPU {g}" in svg for g in series)


def test_advise_html_refuses_to_overwrite_its_input(tmp_path):
    src = tmp_path / "m.csv"
    src.write_bytes((FIXTURES / "h200-small-1stage.csv").read_bytes())
    before = src.read_bytes()
    result = CliRunner().invoke(cli, ["advise", str(src), "--html", str(src)])
    assert result.exit_code == 2
    assert "would overwrite" in result.output and src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.csv"]


def test_the_model_check_plots_each_trial_held_out(tmp_path):
    """The figure's points are the model's leave-one-out predictions: each trial predicted by the
    model calibrated on the others (so no point is the trial's own fit)."""
    from autotune.model.study_model import model_of_study
    from autotune.model.validation import held_out

    root = full_study(tmp_path / "st")
    points = held_out(model_of_study(root))
    assert len(points) >= 3
    page = report_on_folder(root).page.read_text()
    assert "Performance model: predicted against measured" in page
    assert "leave-one-out" in page
