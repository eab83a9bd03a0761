"""The HTML page: one self-contained file (figures inlined as base64 PNG, CSS inline).

No script, no external request: it opens offline, from a mail attachment or a CI
artifact. Every text that came from data is escaped with `html.escape`.
"""

from __future__ import annotations

import base64
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any

from autotune import __version__
from autotune.core.space import TrialConfig, fmt_bucket
from autotune.core.summary import NOT_A_PIPELINE, TrialSummary
from autotune.report_html.figures import Figure
from autotune.report_html.gather import KNOB_LABELS, MetricsReport, StudyReport
from autotune.study.store import STATUS_OK

CSS = """
:root { color-scheme: light; --fg:#1f2328; --muted:#59636e; --line:#d1d9e0; --bg:#f6f8fa; --accent:#0969da; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg); }
main { max-width: 1180px; margin: 0 auto; padding: 16px; }
h1 { font-size: 1.5rem; margin: 0.2em 0 0.3em; overflow-wrap: anywhere; }
h2 { font-size: 1.15rem; margin: 1.6em 0 0.5em; padding-bottom: 0.2em; border-bottom: 1px solid var(--line); }
h3 { font-size: 1rem; margin: 0 0 0.3em; }
.headline { display: grid; grid-template-columns: repeat(auto-fit, minmax(200px, 1fr)); gap: 10px; margin: 12px 0; }
.stat { background: var(--bg); border: 1px solid var(--line); border-radius: 8px; padding: 10px 12px; }
.stat b { display: block; font-size: 1.35rem; }
.stat span { color: var(--muted); font-size: 0.85rem; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 4px 14px; margin: 0; }
dl.facts dt { color: var(--muted); }
dl.facts dd { margin: 0; overflow-wrap: anywhere; }
.missing { background: #fff8c5; border: 1px solid #d4a72c; border-radius: 8px; padding: 8px 14px; }
.missing ul { margin: 0.3em 0; padding-left: 1.2em; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(100%, 440px), 1fr)); gap: 14px; }
figure { margin: 0; border: 1px solid var(--line); border-radius: 8px; padding: 10px; background: #fff; }
figure img { display: block; width: auto; max-width: 100%; height: auto; margin: 0 auto; }
figcaption { color: var(--muted); font-size: 0.85rem; margin-top: 4px; }
figcaption a { color: var(--accent); }
.wide { max-width: 860px; }
.finding { border: 1px solid var(--line); border-left: 4px solid #d4a72c; border-radius: 6px; padding: 8px 12px; margin: 8px 0; }
.finding.critical { border-left-color: #cf222e; }
.finding.info { border-left-color: #0969da; }
.finding p { margin: 0.3em 0; }
.sev { font-size: 0.75rem; text-transform: uppercase; letter-spacing: 0.04em; color: var(--muted); }
code, pre { font: 0.85rem/1.45 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
pre { background: var(--bg); border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; overflow-x: auto; }
pre .add { color: #116329; background: #dafbe1; } pre .del { color: #82071e; background: #ffebe9; }
pre .hunk { color: var(--muted); }
.table { overflow-x: auto; border: 1px solid var(--line); border-radius: 6px; }
table { border-collapse: collapse; width: 100%; font-size: 0.85rem; }
th, td { padding: 4px 8px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; }
th { background: var(--bg); white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.best td { background: #dafbe1; }
tr.failed td { color: #82071e; }
tr.interrupted td { color: var(--muted); font-style: italic; }
details { margin: 1em 0; } summary { cursor: pointer; color: var(--muted); }
footer { color: var(--muted); font-size: 0.8rem; margin: 2em 0 1em; }
@media (max-width: 600px) {
  body { font-size: 14px; } main { padding: 10px; }
  dl.facts { grid-template-columns: 1fr; } dl.facts dt { margin-top: 6px; }
  td.why { min-width: 14em; }
}
"""


def _figure(fig: Figure, figures_href: str, wide: bool = False) -> str:
    data = base64.b64encode(fig.png).decode("ascii")
    return (f'<figure class="{"wide" if wide else ""}" id="fig-{escape(fig.name)}"><h3>{escape(fig.title)}</h3>'
            f'<img src="data:image/png;base64,{data}" alt="{escape(fig.title)}" data-figure="{escape(fig.name)}">'
            f"<figcaption>{escape(fig.caption)} "
            f'<a href="{escape(figures_href)}/{escape(fig.name)}.svg">SVG</a> · '
            f'<a href="{escape(figures_href)}/{escape(fig.name)}.png">PNG</a></figcaption></figure>')


def _grid(figs: Iterable[Figure], href: str) -> str:
    body = "".join(_figure(f, href) for f in figs)
    return f'<div class="grid">{body}</div>' if body else ""


def _missing(lines: Sequence[str]) -> str:
    if not lines:
        return ""
    items = "".join(f"<li>{escape(m)}</li>" for m in lines)
    return f'<section class="missing"><h3>What this page cannot show</h3><ul>{items}</ul></section>'


def _page(title: str, body: str) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><style>{CSS}</style></head>"
            f"<body><main>{body}<footer>Written by autotune {escape(__version__)} on "
            f"{escape(time.strftime('%Y-%m-%d %H:%M'))}. Self-contained: no script, no external "
            "resource; the figures are also beside this file as PNG and SVG.</footer></main></body></html>\n")


def _findings(findings: Sequence[Any], empty: str) -> str:
    if not findings:
        return f"<p>{escape(empty)}</p>"
    out = []
    for f in findings:
        ev = "".join(f"<p><b>Evidence:</b> <code>{escape(e.describe())}</code></p>" for e in f.evidence)
        changes = "".join(f"<li>{escape(c.describe())}</li>" for c in f.changes)
        out.append(
            f'<div class="finding {escape(f.severity)}"><span class="sev">{escape(f.severity)} · '
            f"{escape(f.rule_id)} · expected impact {f.expected_impact:.0%} of step time</span>"
            f"<h3>{escape(f.title)}</h3>{ev}"
            + (f"<p><b>Proposed:</b></p><ul>{changes}</ul>" if changes else "")
            + (f"<p>{escape(f.explanation)}</p>" if f.explanation else "") + "</div>")
    return "".join(out)


def _sps(v: float | None) -> str:
    return "-" if not v else f"{v:,.1f}"


def _bucket(v: int | None) -> str:
    return "-" if v is None else fmt_bucket(v)


def _config_text(c: TrialConfig) -> str:
    text = f"micro {c.micro_batch_size}, GAS {c.gradient_accumulation_steps}"
    text += f", bucket {_bucket(c.reduce_bucket_size)}" if c.reduce_bucket_size is not None else ""
    return text + (f", activation checkpointing every {c.activation_checkpoint_interval} layer(s)"
                   if c.activation_checkpoint_interval else "")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


# -- the study page ----------------------------------------------------------------------
def render_study(r: StudyReport, figs: Sequence[Figure], figures_href: str) -> str:
    by_name = {f.name: f for f in figs}
    name = r.root.resolve().name
    parts = [f"<h1>autotune report: {escape(name)}</h1>", _headline(r), _facts(r), _missing(r.missing)]
    if "convergence" in by_name:
        parts += ["<h2>Did it converge?</h2>", _figure(by_name["convergence"], figures_href, wide=True)]
    knob_figs = [by_name[f"knob-{k}"] for k in r.knobs if f"knob-{k}" in by_name]
    if knob_figs:
        parts += ["<h2>Which knob mattered?</h2>", _grid(knob_figs, figures_href)]
    split = [f for f in figs if f.name.startswith("split-")]
    util = [f for f in figs if f.name.startswith("util-")]
    if split or util:
        parts.append("<h2>Where did the time go?</h2>")
        if r.best is not None and r.baseline is not None and r.best.number == r.baseline.number:
            parts.append("<p>The best trial is the baseline: one configuration is shown.</p>")
        parts += [_grid(split, figures_href), "<h2>Device utilization over the steps</h2>",
                  _grid(util, figures_href)]
    if "model-check" in by_name:
        parts += ["<h2>Could it have predicted the trials?</h2>", _grid([by_name["model-check"]], figures_href)]
    if r.best is not None:
        parts += [f"<h2>Rules that fired on the best trial ({r.best.number})</h2>",
                  _findings(r.findings, "No rule fired on the best trial's measurements.")]
        parts += ["<h2>Best configuration against the starting one</h2>", _diff(r)]
    if r.traces:
        parts += ["<h2>Profiler traces</h2>", _traces(r)]
    parts += ["<h2>Every trial</h2>", _trial_table(r)]
    return _page(f"autotune report: {name}", "".join(parts))


def _traces(r: StudyReport) -> str:
    """Each traced trial's files (linked), the command that reads them and where to open them."""
    rows = []
    for t in r.traces:
        links = ", ".join(f'<a href="{escape(os.path.relpath(f, r.root))}">{escape(f.name.split(".")[0])}</a>'
                          for f in t.files)
        folder = f"{r.root}/trial-{t.number:03d}/traces"
        rows.append(f"<tr><td class=num>{t.number}</td><td>{escape(t.kind)}</td><td>{links}</td>"
                    f"<td><code>autotune advise {escape(folder)}</code></td></tr>")
    head = "<tr><th>trial</th><th>proposed by</th><th>one trace per rank</th><th>advice from them</th></tr>"
    return (f'<div class="table"><table>{head}{"".join(rows)}</table></div>'
            "<p>Open a trace in Perfetto (<code>https://ui.perfetto.dev</code>, Open trace file) or in Chrome's "
            "<code>chrome://tracing</code> (Load); HTA's <code>TraceAnalysis(trace_dir=...)</code> reads the folder.</p>")


def _headline(r: StudyReport) -> str:
    stats = []
    if r.best is not None:
        stats.append((_sps(r.best.samples_per_second) + " samples/s",
                      f"best: trial {r.best.number}, {_config_text(r.best.config)}"))
    if r.baseline is not None and r.baseline.status == STATUS_OK:
        stats.append((_sps(r.baseline.samples_per_second) + " samples/s",
                      f"baseline: {_config_text(r.baseline.config)}"))
    if r.speedup is not None:
        stats.append((f"{r.speedup:.2f}x", "gain over the baseline; " + _noise(r)))
    stats.append((f"{len(r.counted)}" + (f" / {r.settings['budget']}" if r.settings.get("budget") else ""),
                  "trials finished" + (f", {sum(1 for t in r.counted if t.status != STATUS_OK)} failed"
                                       if any(t.status != STATUS_OK for t in r.counted) else "")))
    cells = "".join(f'<div class="stat"><b>{escape(v)}</b><span>{escape(t)}</span></div>' for v, t in stats)
    return f'<section class="headline">{cells}</section>'


def _noise(r: StudyReport) -> str:
    assert r.best is not None
    runs = r.measurements.get(r.best.config.key(), [])
    if len(runs) > 1:
        sd = statistics.stdev(runs)
        text = (f"best measured {len(runs)} times: {', '.join(f'{v:.0f}' for v in runs)} samples/s "
                f"(mean {statistics.fmean(runs):.1f} ± {sd:.1f})")
    else:
        text = "best measured once (not re-measured)"
    if r.best.summary:
        p10, p90 = r.best.summary.get("samples_per_second_p10"), r.best.summary.get("samples_per_second_p90")
        if p10 and p90:
            text += f"; its steps ranged {p10:.0f}-{p90:.0f} samples/s (p10-p90)"
    return text


def _facts(r: StudyReport) -> str:
    wl, space, settings = r.workload, r.space, r.settings
    rows: list[tuple[str, str]] = []
    knobs = ", ".join(KNOB_LABELS.get(k, k) for k in r.knobs) or "nothing yet"
    rows.append(("Tuned", knobs + (f": {space['description']}" if space.get("description") else "")))
    if wl:
        device = next((rk.device for d in r.steps.values() for rk in d.ranks if rk.device), "")
        from autotune.study.job_record import describe_job

        on = [describe_job(r.user_command, wl), f"device {device}" if device else ""]  # command or preset
        rows.append(("On", ", ".join(p for p in on if p)
                           + f"; {wl.get('steps')} measured + {wl.get('warmup_steps')} warm-up steps per trial"))
    if settings:
        rows.append(("Proposer", f"{settings.get('tuner', '?')} (seed {settings.get('seed', '?')}), starting config "
                                 f"{settings.get('config') or 'the built-in workload default'}"))
    walls = [t.wall_seconds for t in r.trials if t.wall_seconds]
    if r.trials:
        ends = [t.finished for t in r.trials if t.finished] or [r.trials[-1].started]
        span = max(ends) - min(t.started for t in r.trials)
        rows.append(("How long", f"{_duration(span)} from the first trial's start to the last one's end; "
                                 f"{_duration(sum(walls))} inside trials; started "
                                 f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(min(t.started for t in r.trials)))}"))
    repeated = {k: v for k, v in r.measurements.items() if len(v) > 1}
    if repeated:
        rows.append(("Re-measured", "; ".join(
            f"{_config_text(TrialConfig(micro_batch_size=k[0], gradient_accumulation_steps=k[1], reduce_bucket_size=k[2], activation_checkpoint_interval=k[3]))}: "
            + ", ".join(f"{x:.0f}" for x in v) + " samples/s" for k, v in repeated.items())))
    body = "".join(f"<dt>{escape(a)}</dt><dd>{escape(b)}</dd>" for a, b in rows)
    return f'<dl class="facts">{body}</dl>'


def _diff(r: StudyReport) -> str:
    assert r.best is not None
    if r.baseline is None:
        return "<p>No baseline to compare with.</p>"
    if r.best.config == r.baseline.config:
        return "<p>The best configuration is the starting one: nothing to change.</p>"
    knob_rows = "".join(
        f"<tr><td>{escape(KNOB_LABELS.get(k, k))}</td><td class=num>{escape(_val(getattr(r.baseline.config, k), k))}"
        f"</td><td class=num>{escape(_val(getattr(r.best.config, k), k))}</td></tr>"
        for k in ("micro_batch_size", "gradient_accumulation_steps", "reduce_bucket_size",
                  "activation_checkpoint_interval")
        if getattr(r.baseline.config, k) != getattr(r.best.config, k))
    table = (f'<div class="table"><table><tr><th>knob</th><th>starting</th><th>best</th></tr>{knob_rows}'
             "</table></div>")
    if not r.config_diff:
        return table
    lines = []
    for ln in r.config_diff:
        cls = ("hunk" if ln.startswith(("@@", "---", "+++")) else "add" if ln.startswith("+")
               else "del" if ln.startswith("-") else "")
        lines.append(f'<span class="{cls}">{escape(ln)}</span>' if cls else escape(ln))
    return table + "<p>ds_config.json, as the trials ran it:</p><pre>" + "\n".join(lines) + "</pre>"


def _val(v: Any, knob: str) -> str:
    return "-" if v is None else (fmt_bucket(v) if knob == "reduce_bucket_size" else str(v))


def _trial_table(r: StudyReport) -> str:
    if not r.trials:
        return "<p>No trial yet.</p>"
    best_num = r.best.number if r.best else None
    head = ("<tr><th>trial</th><th>proposed by</th><th>micro</th><th>GAS</th><th>bucket</th>"
            "<th>samples/s</th><th>status</th><th>why</th></tr>")
    rows = []
    for t in r.trials:
        cls = "best" if t.number == best_num and t.status == STATUS_OK else t.status
        status = t.status + (f" ({t.failure_reason})" if t.failure_reason else "")
        why = t.reason or ""
        if t.failure_detail:
            why += (" | " if why else "") + t.failure_detail
        if t.rules_fired:
            why += (" | " if why else "") + "rules fired: " + ", ".join(t.rules_fired)
        rows.append(f'<tr class="{escape(cls)}"><td class=num>{t.number}</td><td>{escape(t.source)}</td>'
                    f"<td class=num>{t.config.micro_batch_size}</td><td class=num>{t.config.gradient_accumulation_steps}</td>"
                    f"<td class=num>{escape(_bucket(t.config.reduce_bucket_size))}</td>"
                    f"<td class=num>{escape(_sps(t.samples_per_second))}</td><td>{escape(status)}</td>"
                    f'<td class="why">{escape(why)}</td></tr>')
    return f'<div class="table"><table>{head}{"".join(rows)}</table></div>'


def _trial_name(trial: int) -> str:
    return f"trial {trial}" if trial >= 0 else "this run (outside a study)"


# -- the advise page ---------------------------------------------------------------------
def render_metrics(m: MetricsReport, figs: Sequence[Figure], figures_href: str) -> str:
    name = m.label or m.source.name
    parts = [f"<h1>autotune advise: {escape(name)}</h1>"]
    stats = []
    names = m.names if len(m.names) == len(m.summaries) else [_trial_name(s.trial) for s in m.summaries]
    for s, who in list(zip(m.summaries, names, strict=True))[:4]:
        stats.append((f"{s.samples_per_second:,.1f} samples/s",
                      f"{who}: micro {s.micro_batch_size}, GAS {s.gradient_accumulation_steps}, "
                      f"{s.pipeline_stages} stage(s) x {s.data_parallel_size} dp, {s.steps} measured steps"))
    stats.append((str(len(m.findings)), "rules fired"))
    parts.append('<section class="headline">' + "".join(
        f'<div class="stat"><b>{escape(v)}</b><span>{escape(t)}</span></div>' for v, t in stats) + "</section>")
    facts = [("Input", f"{m.label or m.source} ({m.format})")]
    for s, who in list(zip(m.summaries, names, strict=True))[:4]:
        facts.append((who[:1].upper() + who[1:], f"utilization mean {s.device_utilization_mean:.0%}, "
                                                  + _pipeline_words(s)))
    parts.append('<dl class="facts">' + "".join(f"<dt>{escape(a)}</dt><dd>{escape(b)}</dd>" for a, b in facts)
                 + "</dl>")
    parts.append(_missing(m.missing + [f"Note: {n}" for n in m.notes]))
    util = [f for f in figs if f.name.startswith("util-")]
    split = [f for f in figs if f.name.startswith("split-")]
    if util:
        when = "time" if m.device_utilization else "the steps"  # an nvidia-smi log has samples, not steps
        parts += [f"<h2>Device utilization over {when}</h2>", _grid(util, figures_href)]
    if split:
        parts += ["<h2>Where did the time go?</h2>", _grid(split, figures_href)]
    parts += ["<h2>Findings</h2>", _findings(m.findings, "No rule fired on this input.")]
    if m.insufficient:
        items = "".join(f"<li><code>{escape(f.rule_id)}</code> [{escape(f.subject)}]: "
                        f"{escape('; '.join(f'{k}: {v}' for k, v in f.missing.items()))}</li>"
                        for f in m.insufficient)
        parts.append(f"<details><summary>{len(m.insufficient)} rule(s) not decided for lack of data"
                     f"</summary><ul>{items}</ul></details>")
    return _page(f"autotune advise: {name}", "".join(parts))


def _pipeline_words(s: TrialSummary) -> str:
    """The bubble and stage imbalance in words; a job with no pipeline says so (never 0)."""
    if s.bubble_fraction_measured is None or s.bubble_fraction_ideal is None or s.stage_compute_imbalance is None:
        return f"bubble and stage imbalance: {NOT_A_PIPELINE}"
    return (f"bubble {s.bubble_fraction_measured:.2f} measured / {s.bubble_fraction_ideal:.2f} ideal, "
            f"stage imbalance {s.stage_compute_imbalance:.2f}")
