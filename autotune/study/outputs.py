"""Files a study leaves for people: summary.json, best_ds_config.json, report.md.

All written atomically after every trial, so the best configuration so far
survives a crash or Ctrl-C.
"""

from __future__ import annotations

import json

from autotune.core.fileio import write_atomic
from autotune.core.space import TrialConfig
from autotune.study.partition_record import describe_result
from autotune.study.results import StudyResults
from autotune.study.store import Study


def write_outputs(study: Study, results: StudyResults, best_ds_config: dict | None,
                  result_file: tuple[str, dict] | None = None) -> None:
    """summary.json (`results.to_dict()`), best_ds_config.json (`results.best`'s) and report.md;
    `result_file`: (name, content) of a job's own result in place of a ds_config (a torch
    pipelining script's best_schedule.json, autotune/usercmd/torch_job.py)."""
    write_atomic(study.root / "summary.json", json.dumps(results.to_dict(), indent=2) + "\n")
    if best_ds_config is not None:
        write_atomic(study.root / "best_ds_config.json", json.dumps(best_ds_config, indent=2) + "\n")
    if result_file is not None:
        write_atomic(study.root / result_file[0], json.dumps(result_file[1], indent=2) + "\n")
    write_atomic(study.root / "report.md", render_markdown(results, result_file[1] if result_file else None))


def render_markdown(results: StudyResults, schedule: dict | None = None) -> str:
    """report.md; `schedule`: a torch pipelining script's best_schedule.json content."""
    lines = ["# autotune report", ""]
    best, base = results.best, results.baseline
    trainer = results.trainer_args
    if results.user_command or results.workload:
        from autotune.study.job_record import describe_job

        job = describe_job(results.user_command, results.workload, quote=lambda c: f"`{c}`")
        if job:
            lines.append(f"On: {job}.")
    if best:
        lines.append(f"Best: trial {best.number}, micro {best.config.micro_batch_size}, "
                     f"GAS {best.config.gradient_accumulation_steps}, reduce_bucket_size "
                     f"{best.config.reduce_bucket_size or 'not tuned'}{_ckpt_text(best.config)}: "
                     f"{best.samples_per_second:.1f} samples/s"
                     f" (mean of {best.repeats} measurement(s)).")
        if schedule:
            lines.append(f"As the script's schedule: `{schedule['in_the_script']}` (best_schedule.json; the "
                         f"script's own: {schedule['script_own']['schedule']} with n_microbatches "
                         f"{schedule['script_own']['n_microbatches']}); the command: `{schedule['command']}`.")
        if trainer:
            lines.append(f"As the HF Trainer's arguments: `{trainer}` (best_ds_config.json keeps your \"auto\" "
                         "values; the Trainer fills them from these).")
    if base and base.samples_per_second:
        lines.append(f"Baseline (trial 0): {base.samples_per_second:.1f} samples/s.")
    if results.speedup:
        lines.append(f"Speed-up over the baseline: {results.speedup:.2f}x.")
    partition = describe_result(results.partition)
    if partition:
        lines.append(partition[0].upper() + partition[1:] + ".")
    if results.stopped:
        st = results.stopped
        lines.append(f"Stopped after {st['trials']} of {st['budget']} trials: {st['reason']}.")
    if results.space:
        lines.append(f"Search space: {results.space.get('description', '')}")
    lines += ["", "| trial | proposed by | micro | GAS | bucket | samples/s | status | why |",
              "|---|---|---|---|---|---|---|---|"]
    for t in results.trials:
        sps = f"{t.samples_per_second:.1f}" if t.samples_per_second else "-"
        status = t.status + (f" ({t.failure_reason})" if t.failure_reason else "")
        why = t.reason or ""
        if t.rules_fired:
            why += (" " if why else "") + "[rules fired after it: " + ", ".join(t.rules_fired) + "]"
        lines.append(f"| {t.number} | {t.source} | {t.config.micro_batch_size}{_ckpt_text(t.config, short=True)} | "
                     f"{t.config.gradient_accumulation_steps} | {t.config.reduce_bucket_size or '-'} | {sps} | "
                     f"{status} | {why} |")
    return "\n".join(lines) + "\n"


def _ckpt_text(config: TrialConfig, *, short: bool = False) -> str:
    """The checkpoint step's trials run with activation checkpointing (autotune/tuning/checkpoint_step.py)."""
    n = config.activation_checkpoint_interval or 0
    if not n:
        return ""
    return f" (ckpt {n})" if short else f", pipeline.activation_checkpoint_interval {n}"
