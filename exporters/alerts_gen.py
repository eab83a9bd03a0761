"""Generate the Prometheus rules (and their promtool unit tests) from rules/builtin.toml.

Why generated: the advisor's thresholds live once, in `rules/builtin.toml`
(rule ids `utilization-fluctuation`, `comm-compute-high`, `fragmentation-high`,
`bubble-above-ideal`, each with a numeric `threshold`). The alerts mirror them;
`tests/test_prometheus_rules.py` fails when the committed files differ from
this generator's output, so the two cannot drift.

    python -m exporters.alerts_gen            # rewrite rules/prometheus/*.yml
    python -m exporters.alerts_gen --check    # exit 1 if they are stale

Each alert mirrors the advisor's aggregation: fluctuation, comm/compute and
fragmentation use the worst rank (so: any rank above threshold); the bubble
uses the mean over ranks, hence a recording rule per (job, trial).
YAML is written by hand (JSON-quoted scalars are valid YAML) to avoid a
dependency and keep the output byte-stable.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOML_PATH = ROOT / "autotune" / "data" / "builtin_rules.toml"  # rules/builtin.toml links here
ALERTS_PATH = ROOT / "rules" / "prometheus" / "alerts.yml"
TESTS_PATH = ROOT / "rules" / "prometheus" / "alerts_test.yml"
FOR = "1m"
RANK_LABELS = {"job": "demo", "trial": "3", "device": "cuda:0", "host": "node1"}

RECORDING: tuple[tuple[str, str], ...] = (
    ("job_trial_stage:autotune_step_schedule_compute_seconds:avg",
     "avg by (job, trial, stage) (autotune_step_schedule_compute_seconds)"),
    ("job_trial:autotune_stage_compute_imbalance:ratio",
     "max by (job, trial) (job_trial_stage:autotune_step_schedule_compute_seconds:avg)"
     " / avg by (job, trial) (job_trial_stage:autotune_step_schedule_compute_seconds:avg)"),
    ("job_trial:autotune_bubble_measured_ratio:avg",
     "avg by (job, trial) (autotune_bubble_measured_ratio)"),
    ("job_trial:autotune_bubble_ideal_ratio:max",
     "max by (job, trial) (autotune_bubble_ideal_ratio)"),
    ("job_trial:autotune_samples_per_second:min",
     "min by (job, trial) (autotune_samples_per_second)"),
)


@dataclass(frozen=True, slots=True)
class AlertSpec:
    rule_id: str
    alert: str
    signal: str
    """PromQL of the signal; the alert is `signal > threshold`."""
    summary: str
    description: str
    """Go template; `{{ $value }}` is the signal value."""
    per_rank: bool
    """True: one alert per rank series; False: per (job, trial)."""
    advisor_signal: str
    """The `signal` the TOML rule compares; a different one means the alert no longer mirrors it."""


ALERTS: tuple[AlertSpec, ...] = (
    AlertSpec("utilization-fluctuation", "AutotuneUtilizationFluctuationHigh",
              "autotune_device_utilization_fluctuation_ratio",
              "Device utilization fluctuates",
              "Rank {{ $labels.rank }} (stage {{ $labels.stage }}) utilization std is "
              "{{ $value | printf \"%.2f\" }} over the last steps.", True, "device_utilization_fluctuation"),
    AlertSpec("comm-compute-high", "AutotuneCommComputeHigh",
              "autotune_comm_compute_ratio",
              "Communication and waiting dominate compute",
              "Rank {{ $labels.rank }} (stage {{ $labels.stage }}) spends "
              "{{ $value | printf \"%.2f\" }} s of transfer (not waiting) per compute second.", True, "comm_compute_ratio"),
    AlertSpec("fragmentation-high", "AutotuneMemoryFragmentationHigh",
              "autotune_memory_fragmentation_ratio",
              "CUDA caching allocator is fragmented",
              "Rank {{ $labels.rank }} on {{ $labels.device }}: 1 - allocated/reserved is "
              "{{ $value | printf \"%.2f\" }}.", True, "memory_fragmentation_ratio"),
    AlertSpec("bubble-above-ideal", "AutotuneBubbleAboveIdeal",
              "job_trial:autotune_bubble_measured_ratio:avg"
              " - on (job, trial) job_trial:autotune_bubble_ideal_ratio:max",
              "Pipeline bubble far above the 1F1B ideal",
              "Trial {{ $labels.trial }}: measured bubble exceeds the ideal by "
              "{{ $value | printf \"%.2f\" }}.", False, "bubble_fraction_excess"),
)


def load_thresholds(path: Path = TOML_PATH) -> dict[str, float]:
    """Thresholds by rule id, from any TOML layout that gives each rule an `id` and `threshold`.

    Accepts `[[rule]] id = ... threshold = ...`, `[rules.<id>] threshold = ...` and
    similar nestings; raises ValueError naming any rule of ALERTS that is missing.
    """
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    found: dict[str, Mapping] = {}
    _walk(data, None, found)
    missing = [a.rule_id for a in ALERTS if a.rule_id not in found]
    if missing:
        raise ValueError(f"{path}: no numeric `threshold` for rule id(s) {', '.join(missing)}")
    for a in ALERTS:
        rule = found[a.rule_id]
        if rule.get("op", ">") != ">" or rule.get("signal", a.advisor_signal) != a.advisor_signal:
            raise ValueError(
                f"{path}: rule {a.rule_id} compares {rule.get('signal')} {rule.get('op')}; the alert "
                f"mirrors {a.advisor_signal} > threshold: update exporters/alerts_gen.py too")
    return {a.rule_id: float(found[a.rule_id]["threshold"]) for a in ALERTS}


def _walk(node: object, key: str | None, found: dict[str, Mapping]) -> None:
    if isinstance(node, Mapping):
        rid = node.get("id", key)
        t = node.get("threshold")
        if isinstance(rid, str) and isinstance(t, int | float) and not isinstance(t, bool):
            found.setdefault(rid, node)
        for k, v in node.items():
            _walk(v, k, found)
    elif isinstance(node, list):
        for v in node:
            _walk(v, None, found)


def _q(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def _num(x: float) -> str:
    return repr(float(x)).removesuffix(".0") if float(x).is_integer() else repr(float(x))


def render_rules(thresholds: Mapping[str, float]) -> str:
    out = ["# Generated by `python -m exporters.alerts_gen` from rules/builtin.toml. Do not edit.",
           "groups:", "  - name: autotune-recording", "    rules:"]
    for record, expr in RECORDING:
        out += [f"      - record: {record}", f"        expr: {_q(expr)}"]
    out += ["  - name: autotune-alerts", "    rules:"]
    for a in ALERTS:
        t = thresholds[a.rule_id]
        out += [
            f"      - alert: {a.alert}",
            f"        expr: {_q(f'{a.signal} > {_num(t)}')}",
            f"        for: {FOR}",
            "        labels:",
            "          severity: warning",
            f"          rule_id: {_q(a.rule_id)}",
            "        annotations:",
            f"          rule_id: {_q(a.rule_id)}",
            f"          threshold: {_q(_num(t))}",
            f"          summary: {_q(a.summary)}",
            f"          description: {_q(a.description)}",
        ]
    return "\n".join(out) + "\n"


def _series(metric: str, labels: Mapping[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{metric}{{{inner}}}"


def _description(a: AlertSpec, labels: Mapping[str, str], value: float) -> str:
    text = a.description.replace('{{ $value | printf "%.2f" }}', f"{value:.2f}")
    for k, v in labels.items():
        text = text.replace(f"{{{{ $labels.{k} }}}}", v)
    return text


def render_tests(thresholds: Mapping[str, float]) -> str:
    """promtool unit tests: per alert, a hot series fires after `for`, a calm one never does."""
    out = ["# Generated by `python -m exporters.alerts_gen` from rules/builtin.toml. Do not edit.",
           "# Run: promtool test rules rules/prometheus/alerts_test.yml",
           "rule_files:", "  - alerts.yml", "evaluation_interval: 1m", "tests:"]
    for a in ALERTS:
        t = thresholds[a.rule_id]
        hot, calm = round(t * 1.5 + 0.05, 4), round(t * 0.5, 4)
        if a.per_rank:
            hot_l = {**RANK_LABELS, "rank": "0", "stage": "0"}
            calm_l = {**RANK_LABELS, "rank": "1", "stage": "1"}
            series = [(a.signal, hot_l, hot), (a.signal, calm_l, calm)]
            alert_labels, value = hot_l, hot
        else:  # bubble: two ranks per trial; trial 3 far above ideal, trial 4 near it
            ideal = 0.2
            series = []
            for trial, excess in (("3", hot), ("4", calm)):
                for rank in ("0", "1"):
                    lab = {**RANK_LABELS, "trial": trial, "rank": rank, "stage": rank}
                    series.append(("autotune_bubble_measured_ratio", lab, ideal + excess))
                    series.append(("autotune_bubble_ideal_ratio", lab, ideal))
            alert_labels = {"job": RANK_LABELS["job"], "trial": "3"}
            value = (ideal + hot) - ideal
        out += [f"  - name: {_q(a.alert)}", "    interval: 1m", "    input_series:"]
        for metric, labels, v in series:
            out += [f"      - series: {_q(_series(metric, labels))}",
                    f"        values: {_q(f'{_num(v)}x15')}"]
        out += ["    alert_rule_test:",
                "      - eval_time: 0m",
                f"        alertname: {a.alert}",
                "        exp_alerts: []",
                "      - eval_time: 10m",
                f"        alertname: {a.alert}",
                "        exp_alerts:",
                "          - exp_labels:",
                "              severity: warning",
                f"              rule_id: {_q(a.rule_id)}"]
        out += [f"              {k}: {_q(v)}" for k, v in alert_labels.items()]
        out += ["            exp_annotations:",
                f"              rule_id: {_q(a.rule_id)}",
                f"              threshold: {_q(_num(t))}",
                f"              summary: {_q(a.summary)}",
                f"              description: {_q(_description(a, alert_labels, value))}"]
    # The stage-imbalance recording rule: stage 1 computes 3 s, stage 0 1 s -> 3 / 2 = 1.5.
    out += ["  - name: \"stage compute imbalance recording rule\"", "    interval: 1m",
            "    input_series:"]
    for rank, secs in (("0", 1), ("1", 3)):
        lab = {**RANK_LABELS, "rank": rank, "stage": rank}
        out += [f"      - series: {_q(_series('autotune_step_schedule_compute_seconds', lab))}",
                f"        values: {_q(f'{secs}x5')}"]
    out += ["    promql_expr_test:",
            "      - expr: job_trial:autotune_stage_compute_imbalance:ratio",
            "        eval_time: 2m",
            "        exp_samples:",
            "          - labels: " + _q(_series("job_trial:autotune_stage_compute_imbalance:ratio",
                                              {"job": RANK_LABELS["job"], "trial": RANK_LABELS["trial"]})),
            "            value: 1.5"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--toml", type=Path, default=TOML_PATH)
    p.add_argument("--out", type=Path, default=ALERTS_PATH)
    p.add_argument("--tests-out", type=Path, default=TESTS_PATH)
    p.add_argument("--check", action="store_true", help="exit 1 if the files are stale")
    args = p.parse_args(argv)
    thresholds = load_thresholds(args.toml)
    wanted = {args.out: render_rules(thresholds), args.tests_out: render_tests(thresholds)}
    stale = [path for path, text in wanted.items()
             if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path} is stale; run python -m exporters.alerts_gen", file=sys.stderr)
        return 1 if stale else 0
    for path, text in wanted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
