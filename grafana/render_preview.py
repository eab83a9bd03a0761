"""Render a static preview of grafana/dashboards/autotune.json from real Prometheus data.

Grafana is not packaged in Debian, so this draws each panel of the dashboard JSON
itself: it runs the panel's own PromQL (template variables substituted) against a
real Prometheus, draws the results as inline SVG in one HTML page laid out on the
dashboard's grid, and screenshots it with headless chromium. It is a preview
rendered from the same queries, not Grafana: styling and legends are approximate.

    # against a running Prometheus that scrapes an instrumented job
    .venv/bin/python grafana/render_preview.py --prom http://127.0.0.1:9090 --job myjob
    # self-contained demo: in-process exporters + a real Prometheus (needs `prometheus`)
    .venv/bin/python grafana/render_preview.py --demo --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import contextlib
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASH = ROOT / "grafana" / "dashboards" / "autotune.json"
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#f2495c", "#b877d9", "#8ab8ff", "#ffb357"]
COL_W, ROW_H = 66, 34


def get(prom: str, path: str, **params: object) -> list[dict]:
    q = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{prom}/api/v1/{path}?{q}", timeout=10) as r:
        body = json.loads(r.read())
    return body["data"]["result"] if body["status"] == "success" else []


def substitute(expr: str, job: str, rate: str) -> str:
    return (expr.replace("$job", job).replace("$trial", ".*").replace("$stage", ".*")
            .replace("$rank", ".*").replace("$__rate_interval", rate))


def legend(fmt: str, metric: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt) or \
        ",".join(f"{k}={v}" for k, v in metric.items() if k != "__name__")


def fmt_value(v: float, unit: str | None) -> str:
    if unit == "percentunit":
        return f"{v * 100:.1f}%"
    if unit == "bytes":
        for u in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(v) < 1024:
                return f"{v:.1f} {u}"
            v /= 1024
    if unit == "s":
        return f"{v * 1e3:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"
    if abs(v) >= 1e5:
        return f"{v:.2e}"
    return f"{v:.3g}"


def svg_timeseries(series: list[tuple[str, list[tuple[float, float]]]], w: int, h: int,
                   unit: str | None, threshold: float | None) -> str:
    pts = [p for _, s in series for p in s]
    if not pts:
        return '<div class="nodata">No data</div>'
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    ymax = max([p[1] for p in pts] + [threshold or 0]) * 1.1 or 1.0
    ml, mb, mt = 60, 18, 6
    pw, ph = w - ml - 8, h - mb - mt

    def xy(t: float, v: float) -> str:
        x = ml + (t - x0) / ((x1 - x0) or 1) * pw
        return f"{x:.1f},{mt + ph - v / ymax * ph:.1f}"

    out = [f'<svg width="{w}" height="{h}">']
    for frac in (0, 0.5, 1):
        y = mt + ph - frac * ph
        out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y}" y2="{y}" stroke="#2c3235"/>'
                   f'<text x="{ml - 4}" y="{y + 4}" text-anchor="end">{fmt_value(ymax * frac, unit)}</text>')
    for i, (_, s) in enumerate(series):
        out.append(f'<polyline fill="none" stroke="{COLORS[i % len(COLORS)]}" stroke-width="1.5" '
                   f'points="{" ".join(xy(t, v) for t, v in s)}"/>')
    if threshold is not None:
        y = mt + ph - threshold / ymax * ph
        out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y}" y2="{y}" stroke="#f2495c" '
                   'stroke-dasharray="4 3"/>')
    out.append(f'<text x="{ml}" y="{h - 4}">{time.strftime("%H:%M:%S", time.localtime(x0))}</text>'
               f'<text x="{ml + pw}" y="{h - 4}" text-anchor="end">'
               f'{time.strftime("%H:%M:%S", time.localtime(x1))}</text></svg>')
    return "".join(out)


def legend_html(names: list[str]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{COLORS[i % len(COLORS)]}"></i>{html.escape(n)}</span>'
        for i, n in enumerate(names)) + "</div>"


def render_panel(p: dict, prom: str, job: str, span: int) -> str:
    w, h = p["gridPos"]["w"] * COL_W - 8, p["gridPos"]["h"] * ROW_H - 8
    unit = p["fieldConfig"]["defaults"].get("unit")
    steps = p["fieldConfig"]["defaults"].get("thresholds", {}).get("steps", [])
    threshold = steps[-1]["value"] if len(steps) > 1 else None
    now = time.time()
    body = ""
    if p["type"] == "timeseries":
        series = []
        for t in p["targets"]:
            expr = substitute(t["expr"], job, "10s")
            for r in get(prom, "query_range", query=expr, start=now - span, end=now, step=1):
                series.append((legend(t["legendFormat"], r["metric"]),
                               [(float(a), float(b)) for a, b in r["values"]]))
        body = svg_timeseries(series, w - 8, h - 60, unit, threshold) + legend_html([n for n, _ in series])
    elif p["type"] in ("stat", "bargauge"):
        items = []
        for t in p["targets"]:
            for r in get(prom, "query", query=substitute(t["expr"], job, "10s")):
                items.append((legend(t["legendFormat"], r["metric"]), float(r["value"][1])))
        if p["type"] == "stat":
            body = '<div class="stats">' + "".join(
                f'<div><b style="color:{COLORS[i % len(COLORS)]}">{fmt_value(v, unit)}</b>'
                f'<small>{html.escape(n)}</small></div>' for i, (n, v) in enumerate(items)) + "</div>"
        else:
            top = max([v for _, v in items] + [1])
            body = "".join(f'<div class="bar"><small>{html.escape(n)}</small><i style="width:'
                           f'{v / top * 70:.0f}%"></i>{v:g}</div>' for n, v in items)
        body = body or '<div class="nodata">No data</div>'
    else:  # barchart / table: instant tables merged on the trial label
        rows: dict[str, dict[str, str]] = {}
        names = []
        for t in p["targets"]:
            res = get(prom, "query", query=substitute(t["expr"], job, "10s"))
            col = t["legendFormat"] or t["expr"].split("{")[0].replace("autotune_", "")
            names.append(col)
            for r in res:
                row = rows.setdefault(r["metric"].get("trial", "?"), {"trial": r["metric"].get("trial", "?")})
                if col.endswith("config_info"):
                    row.update({k: v for k, v in r["metric"].items()
                                if k not in ("__name__", "job", "instance", "trial")})
                else:
                    row[col] = f"{float(r['value'][1]):.1f}"
        ordered = [rows[k] for k in sorted(rows, key=lambda s: int(s) if s.isdigit() else 0)]
        if p["type"] == "barchart":
            body = _barchart(ordered, [n for n in names], w - 8, h - 60) + legend_html(names)
        else:
            cols = list(dict.fromkeys(k for r in ordered for k in r))
            body = "<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>" + "".join(
                "<tr>" + "".join(f"<td>{html.escape(r.get(c, ''))}</td>" for c in cols) + "</tr>"
                for r in ordered) + "</table>"
    g = p["gridPos"]
    return (f'<div class="panel" style="left:{g["x"] * COL_W}px;top:{g["y"] * ROW_H + 40}px;'
            f'width:{w}px;height:{h}px"><h3>{html.escape(p["title"])}</h3>{body}</div>')


def _barchart(rows: list[dict], cols: list[str], w: int, h: int) -> str:
    vals = [[float(r.get(c, 0) or 0) for c in cols] for r in rows]
    if not vals:
        return '<div class="nodata">No data</div>'
    top = max(max(v) for v in vals) * 1.1 or 1
    group = (w - 40) / len(vals)
    bw = group * 0.8 / len(cols)
    out = [f'<svg width="{w}" height="{h}">']
    for i, (r, v) in enumerate(zip(rows, vals, strict=True)):
        for j, x in enumerate(v):
            bh = x / top * (h - 20)
            out.append(f'<rect x="{30 + i * group + j * bw:.1f}" y="{h - 18 - bh:.1f}" width="{bw - 2:.1f}" '
                       f'height="{bh:.1f}" fill="{COLORS[j % len(COLORS)]}"/>')
        out.append(f'<text x="{30 + i * group + group * 0.4:.1f}" y="{h - 4}" text-anchor="middle">'
                   f'trial {r["trial"]}</text>')
    return "".join(out) + "</svg>"


CSS = """body{background:#111217;color:#ccccdc;font:12px sans-serif;margin:0;position:relative}
.top{padding:8px 12px;font-size:16px;color:#fff} .top small{color:#8e8e8e;font-size:11px;margin-left:12px}
.panel{position:absolute;background:#181b1f;border:1px solid #2c3235;border-radius:3px;padding:4px;overflow:hidden}
h3{margin:2px 4px 6px;font-size:12px;color:#d8d9da} text{fill:#8e8e8e;font-size:10px}
.legend span{margin-right:10px;white-space:nowrap;font-size:10px} .legend i{display:inline-block;width:10px;height:3px;margin-right:4px;vertical-align:middle}
.stats{display:flex;gap:14px;justify-content:center} .stats div{text-align:center} .stats b{font-size:22px;display:block}
.bar{margin:3px 4px;font-size:11px} .bar small{display:inline-block;width:130px} .bar i{display:inline-block;height:10px;background:#73bf69;margin-right:6px}
table{border-collapse:collapse;width:100%;font-size:11px} td,th{border-bottom:1px solid #2c3235;padding:2px 6px;text-align:left}
.nodata{color:#8e8e8e;text-align:center;margin-top:30px}"""


def render_html(prom: str, job: str, span: int) -> str:
    dash = json.loads(DASH.read_text())
    panels = "".join(render_panel(p, prom, job, span) for p in dash["panels"])
    return (f"<html><head><meta charset='utf-8'><style>{CSS}</style></head><body>"
            f"<div class='top'>{html.escape(dash['title'])}<small>job={html.escape(job)} · preview "
            "rendered from the dashboard's PromQL against a real Prometheus (not Grafana)</small></div>"
            f"{panels}</body></html>")


def screenshot(page: Path, out: Path, width: int, height: int) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium not found: apt-get install chromium (the HTML is at " + str(page) + ")")
    profile = tempfile.mkdtemp(prefix="autotune-chromium-")
    try:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                        "--disable-background-networking", "--disable-component-update",
                        "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                        "--hide-scrollbars", f"--screenshot={out}", f"--window-size={width},{height}",
                        page.as_uri()], check=True, capture_output=True, timeout=120)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def demo(seconds: float):
    """Context manager: in-process exporters + a real Prometheus (the live test's feed)."""
    sys.path.insert(0, str(ROOT / "grafana"))
    from live_demo import ALERTS, Feed, prometheus_server, wait_for_history

    @contextlib.contextmanager
    def run():
        feed = Feed()
        try:
            with prometheus_server(feed.targets, rule_files=[ALERTS]) as prom:
                wait_for_history(prom, seconds)
                yield prom.url
        finally:
            feed.close()
    return run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prom", default="http://127.0.0.1:9090")
    p.add_argument("--job", default=None, help="job label (default: live-gpu in --demo)")
    p.add_argument("--span", type=int, default=120, help="seconds of history per graph")
    p.add_argument("--demo", action="store_true", help="start in-process exporters + Prometheus")
    p.add_argument("--demo-seconds", type=float, default=60)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    p.add_argument("--html", type=Path, help="also keep the HTML page here")
    args = p.parse_args(argv)
    dash = json.loads(DASH.read_text())
    width = 24 * COL_W + 8
    height = max(q["gridPos"]["y"] + q["gridPos"]["h"] for q in dash["panels"]) * ROW_H + 50

    def produce(prom: str, job: str) -> None:
        page = args.html or Path(tempfile.mkdtemp()) / "dashboard.html"
        page.write_text(render_html(prom, job, args.span))
        screenshot(page.resolve(), args.out.resolve(), width, height)
        print(f"wrote {args.out}")

    if args.demo:
        with demo(args.demo_seconds) as url:
            produce(url, args.job or "live-gpu")
    else:
        produce(args.prom.rstrip("/"), args.job or "autotune")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
