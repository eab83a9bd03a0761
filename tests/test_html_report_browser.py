"""The HTML report in a real headless Chromium (DevTools protocol over a pipe), and at the
end of a real `autotune run` (real DeepSpeed on CPU).

Every figure must decode (naturalWidth > 0), nothing may be logged to the console, no
request may leave the file, and at phone width nothing may scroll sideways except the
tables' own boxes. Screenshots go to $AUTOTUNE_SCREENSHOTS when set (else tmp_path).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from html_browser import Browser, chromium_binary
from html_study import full_study

pytest.importorskip("matplotlib", reason="the report extra: pip install 'autotune[report]'")

WIDTHS = [("desktop", 1280, 900, False), ("phone", 390, 844, True)]


@pytest.fixture(scope="module")
def browser():
    if chromium_binary() is None:
        pytest.skip("chromium binary not found on PATH (Debian: apt-get install chromium)")
    b = Browser()
    yield b
    b.close()


def shots(tmp_path: Path) -> Path:
    out = Path(os.environ.get("AUTOTUNE_SCREENSHOTS", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    return out


def check_page(browser: Browser, page: Path, tag: str, out: Path, figures: int) -> None:
    html = page.read_text()
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', html), "a link leaves the file"
    for label, width, height, mobile in WIDTHS:
        shot = out / f"{tag}-{label}.png"
        result = browser.load(page, width, height, shot, mobile=mobile)
        assert len(result.images) == figures
        for img in result.images:
            assert img["complete"] and img["w"] > 0 and img["h"] > 0, img
            assert img["figure"] and 0 < img["shown"] <= width, img
        assert result.console_errors == []
        leaving = [u for u in result.requests if not u.startswith(("file:", "data:"))]
        assert leaving == []
        assert result.scroll_width <= result.inner_width, f"{label}: the page scrolls sideways"
        assert shot.stat().st_size > 10_000


@pytest.mark.browser
def test_study_page_in_chromium(tmp_path, browser):
    from autotune.report_html import report_on_folder

    root = full_study(tmp_path / "st")
    page = report_on_folder(root).page
    check_page(browser, page, "study", shots(tmp_path), figures=9)


@pytest.mark.browser
def test_failed_only_page_in_chromium(tmp_path, browser):
    from html_study import CFGS, failed_trial, new_study

    from autotune.report_html import report_on_folder

    s = new_study(tmp_path / "st", budget=1)
    failed_trial(s, 0, CFGS[0], "crash")
    s.close()
    page = report_on_folder(tmp_path / "st").page
    check_page(browser, page, "failed-only", shots(tmp_path), figures=0)


@pytest.mark.browser
def test_advise_page_in_chromium(tmp_path, browser):
    from click.testing import CliRunner

    from autotune.cli.main import cli

    out = tmp_path / "advise.html"
    fixture = Path(__file__).parent / "fixtures" / "advise" / "h200-small-1stage.csv"
    result = CliRunner().invoke(cli, ["advise", str(fixture), "--html", str(out)])
    assert result.exit_code == 0, result.output
    check_page(browser, out, "advise", shots(tmp_path), figures=2)


# -- a real tuning run -----------------------------------------------------------------
@pytest.fixture(scope="module")
def real_run(builtin_study):
    """The session's built-in study (tests/shared_studies.py): a real `autotune run --budget 3`."""
    return builtin_study.study, builtin_study


@pytest.mark.slow
def test_run_writes_the_report_and_prints_its_path(real_run):
    study, proc = real_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"wrote {study / 'report.html'}" in proc.stdout
    page = (study / "report.html").read_text()
    assert "split-trial-000" in page and "util-trial-000" in page
    assert (study / "figures" / "util-trial-000.svg").is_file()


@pytest.mark.slow
@pytest.mark.browser
def test_real_run_page_in_chromium(real_run, browser, tmp_path):
    study, proc = real_run
    assert proc.returncode == 0
    page = study / "report.html"
    n = len(re.findall(r'<img src="data:image/png;base64,', page.read_text()))
    assert n >= 2  # the baseline's split and utilization at least
    check_page(browser, page, "real-run", shots(tmp_path), figures=n)
