"""The dashboard preview, rendered by a real headless Chromium from a real Prometheus."""

from __future__ import annotations

import json
import shutil
import struct
import sys

import pytest
from prom_helpers import REPO

pytestmark = [pytest.mark.browser, pytest.mark.prometheus]


def png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def test_preview_renders_every_panel_with_data(tmp_path):
    if shutil.which("chromium") is None:
        pytest.skip("chromium binary not found on PATH (Debian: apt-get install chromium)")
    sys.path.insert(0, str(REPO / "grafana"))
    import render_preview

    out, page = tmp_path / "dash.png", tmp_path / "dash.html"
    assert render_preview.main(["--demo", "--demo-seconds", "6", "--out", str(out), "--html", str(page)]) == 0
    width, height = png_size(out)
    assert width > 1000 and height > 1000
    html = page.read_text()
    dash = json.loads((REPO / "grafana" / "dashboards" / "autotune.json").read_text())
    for panel in dash["panels"]:
        assert panel["title"] in html
    # the GPU-shaped demo job has data for every panel: no "No data" placeholder
    assert "No data" not in html
