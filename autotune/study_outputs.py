"""Files a study leaves for people: summary.json, best_ds_config.json, report.md.

All written atomically after every trial, so the best configuration so far
survives a crash or Ctrl-C.
"""

from __future__ import annotations

import json
from typing import Any

from autotune.balance import describe_result, read_result
from autotune.fileio import write_atomic
from autotune.study import STATUS_OK, Study, TrialRow


def trial_entry(t: TrialRow) -> dict[str, Any]:
    return {
        "trial": t.number, "status": t.status, "source": t.source, "reason": t.reason,
        "micro_batch_size": t.config.micro_batch_size,
        "gradient_accumulation_steps": t.config.gradient_accumulation_steps,
        "reduce_bucket_size": t.config.reduce_bucket_size,
        "activation_checkpoint_interval": t.config.activation_checkpoint_interval,
        "samples_per_second": t.samples_per_second, "failure_reason": t.failure_reason,
        "failure_detail": t.failure_detail, "rules_fired": t.rules_fired,
        "wall_seconds": t.wall_seconds,
    }


def study_results(study: Study) -> dict[str, Any]:
    """summary.json's content: every trial, the baseline, the best, the speed-up (a dict of the
    whole study, unlike `autotune.summary.TrialSummary`, one trial's signals)."""
    trials = study.trials()
    counted = [t for t in trials if t.status in ("ok", "failed")]
    baseline = next((t for t in counted if t.number == 0), None)
    best = study.best()
    speedup = None
    if best and baseline and baseline.status == STATUS_OK and baseline.samples_per_second:
        speedup = (best.samples_per_second or 0.0) / baseline.samples_per_second
    from autotune.usercmd.job import META_KEY, describe_job

    workload, user_command = study.get_meta_json("workload"), study.get_meta_json(META_KEY)
    if user_command and isinstance(workload, dict):
        workload = {**workload, "preset": None}  # the user's command ran, not a built-in preset
    return {
        "format": 1,
        "job": describe_job(user_command, workload),  # the job in words (autotune/usercmd/job.py)
        "user_command": user_command,  # the command and what its start-up check read; null: built-in
        "budget": study.get_meta_json("budget"),
        "space": study.get_meta_json("space"),
        "workload": workload,
        "trials": [trial_entry(t) for t in trials],
        "counted_trials": len(counted),
        "failed_trials": sum(1 for t in counted if t.status == "failed"),
        "baseline": trial_entry(baseline) if baseline else None,
        "best": ({**trial_entry(best), "measurements": best.repeats} if best else None),
        "speedup_over_baseline": speedup,
        "stopped": study.get_meta_json("stopped"),  # before the budget: why (autotune/search_stop.py)
        "partition": read_result(study.root),  # --balance-stages: the parts the best needs (autotune/balance.py)
    }


def write_outputs(study: Study, best_ds_config: dict | None) -> dict[str, Any]:
    summary = study_results(study)
    write_atomic(study.root / "summary.json", json.dumps(summary, indent=2) + "\n")
    if best_ds_config is not None:
        write_atomic(study.root / "best_ds_config.json", json.dumps(best_ds_config, indent=2) + "\n")
    write_atomic(study.root / "report.md", render_markdown(summary))
    return summary


def render_markdown(summary: dict[str, Any]) -> str:
    lines = ["# autotune report", ""]
    best, base = summary["best"], summary["baseline"]
    if summary.get("user_command") or summary.get("workload"):
        from autotune.usercmd.job import describe_job

        job = describe_job(summary.get("user_command"), summary.get("workload"), quote=lambda c: f"`{c}`")
        if job:
            lines.append(f"On: {job}.")
    if best:
        lines.append(f"Best: trial {best['trial']}, micro {best['micro_batch_size']}, "
                     f"GAS {best['gradient_accumulation_steps']}, reduce_bucket_size "
                     f"{best['reduce_bucket_size'] or 'not tuned'}{_ckpt_text(best)}: "
                     f"{best['samples_per_second']:.1f} samples/s"
                     f" (mean of {best['measurements']} measurement(s)).")
    if base and base["samples_per_second"]:
        lines.append(f"Baseline (trial 0): {base['samples_per_second']:.1f} samples/s.")
    if summary["speedup_over_baseline"]:
        lines.append(f"Speed-up over the baseline: {summary['speedup_over_baseline']:.2f}x.")
    partition = describe_result(summary.get("partition"))
    if partition:
        lines.append(partition[0].upper() + partition[1:] + ".")
    if summary.get("stopped"):
        st = summary["stopped"]
        lines.append(f"Stopped after {st['trials']} of {st['budget']} trials: {st['reason']}.")
    if summary.get("space"):
        lines.append(f"Search space: {summary['space'].get('description', '')}")
    lines += ["", "| trial | proposed by | micro | GAS | bucket | samples/s | status | why |",
              "|---|---|---|---|---|---|---|---|"]
    for t in summary["trials"]:
        sps = f"{t['samples_per_second']:.1f}" if t["samples_per_second"] else "-"
        status = t["status"] + (f" ({t['failure_reason']})" if t["failure_reason"] else "")
        why = t["reason"] or ""
        if t["rules_fired"]:
            why += (" " if why else "") + "[rules fired after it: " + ", ".join(t["rules_fired"]) + "]"
        lines.append(f"| {t['trial']} | {t['source']} | {t['micro_batch_size']}{_ckpt_text(t, short=True)} | "
                     f"{t['gradient_accumulation_steps']} | {t['reduce_bucket_size'] or '-'} | {sps} | "
                     f"{status} | {why} |")
    return "\n".join(lines) + "\n"


def _ckpt_text(t: dict[str, Any], *, short: bool = False) -> str:
    """The checkpoint step's trials run with activation checkpointing (autotune/checkpoint_step.py)."""
    n = t.get("activation_checkpoint_interval") or 0
    if not n:
        return ""
    return f" (ckpt {n})" if short else f", pipeline.activation_checkpoint_interval {n}"
