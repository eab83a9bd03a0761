"""`autotune advise` and `autotune check`: parse arguments, call the advisor, print.

Registered in the main group by autotune.cli.main. Every UserError becomes one
line on stderr and exit code 2.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from autotune.advisor import evaluate, load_rules, patch_config
from autotune.advisor.findings import FIRED, Change, Evidence, Finding
from autotune.advisor.render import print_table, to_json
from autotune.core.dsconfig import DsConfig, load_ds_config
from autotune.core.errors import UserError
from autotune.core.fileio import write_atomic
from autotune.core.summary import NOT_A_PIPELINE
from autotune.loaders.detect import NVIDIA_SMI, TRACE
from autotune.trials.precision import requested_precisions


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One line on stderr and exit 2 for user errors, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            click.echo(f"autotune: error: {exc}", err=True)
            raise SystemExit(exc.exit_code) from None
    return wrapper


_FORMAT = click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table",
                       show_default=True, help="Output format.")
_RULES = click.option("--rules", "rule_files", multiple=True, type=click.Path(dir_okay=False),
                      help="Extra rule file (TOML); repeatable. Same id replaces a built-in rule.")


@click.command("advise")
@click.argument("metrics", nargs=-1, required=True)
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="The ds_config.json the metrics were measured with (enables config rules).")
@click.option("--stages", type=click.IntRange(min=1),
              help="Pipeline stages of the job a device log (nvidia-smi) comes from: devices map to "
                   "stages in index order (one rank per device, stage = rank // dp), so the "
                   "bottleneck device's stage is named. A metrics CSV records its stages itself.")
@_FORMAT
@click.option("--write-config", "write_path", type=click.Path(dir_okay=False),
              help="Write the config with the proposed changes applied (needs --config).")
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="Also write an HTML page (figures beside it in OUT-stem_figures/); needs autotune[report].")
@_RULES
@_user_errors
def advise_command(metrics: tuple[str, ...], config_path: str | None, stages: int | None, fmt: str,
                   write_path: str | None, html_path: str | None, rule_files: tuple[str, ...]) -> None:
    """Recommendations from METRICS: autotune metrics CSVs, an nvidia-smi CSV, a Prometheus export
    or torch.profiler traces (.json, .json.gz; a folder of one job's per-rank traces).

    METRICS is one or more files, quoted globs ('run/metrics-rank*.csv') or folders: a study's
    trial folder or the folder instrument() wrote into (its metrics-rank*.csv are one job,
    merged so imbalance across ranks shows), or a whole study folder (one subject per trial).
    """
    from autotune.loaders import load_inputs

    if write_path and not config_path:
        raise UserError("--write-config needs --config (the ds_config.json to patch)")
    if write_path and config_path and _same_file(write_path, config_path):
        raise UserError(f"--write-config {write_path} would overwrite the input config; choose a new file")
    if html_path:  # before anything is written: matplotlib there, OUT not one of the inputs
        from autotune.report_html import check_html_target

        check_html_target(html_path, [p for p in (*metrics, config_path, write_path) if p])
    rules = load_rules(rule_files)
    loaded = load_inputs(metrics, stages=stages)
    if write_path and any(_same_file(write_path, str(p)) for p in loaded.sources):
        raise UserError(f"--write-config {write_path} would overwrite an input; choose a new file")
    if loaded.format == TRACE:  # a trace folder is the user's (or the profiler's): never written into
        folders = {os.path.realpath(p.parent) for p in loaded.sources}
        for out in (write_path, html_path):
            if out and os.path.realpath(os.path.dirname(os.path.abspath(out))) in folders:
                raise UserError(f"{out} is inside a trace folder given as input; write it elsewhere")
    notes = list(loaded.notes)
    if stages is not None and loaded.format != NVIDIA_SMI:
        notes.append(f"--stages {stages} is for device logs; {loaded.format} input records its stages itself")
    cfg = load_ds_config(config_path) if config_path else None
    ctx: dict[str, Any] = {"config_name": Path(config_path).name} if config_path else {}
    if cfg is not None and stages is not None and loaded.format == NVIDIA_SMI:
        # The config's micro-batch and GAS with these stages (no world size: a log may be one
        # node of many): the layout rules get their numbers, the ideal bubble included.
        ctx["stages"] = stages
    if cfg is not None and loaded.layout is not None:  # a trace knows its stages and world, not its batch
        ctx["stages"], ctx["world_size"] = loaded.layout
    if any(sig.unavailable.get("bubble_fraction_measured") == NOT_A_PIPELINE for sig in loaded.subjects):
        notes.append(f"bubble, stage imbalance and point-to-point: {NOT_A_PIPELINE} (no stages), so no "
                     "pipeline rule applies")
    findings = evaluate(loaded.subjects, ds_config=cfg, rules=rules, context=ctx)
    if write_path and cfg is not None:
        _write_json_atomic(Path(write_path), patch_config(cfg, findings))
    if html_path:
        from autotune.report_html import write_metrics_report

        page = write_metrics_report(html_path, loaded.sources, loaded, findings).page
    shown = metrics[0] if len(metrics) == 1 else f"{metrics[0]} + {len(metrics) - 1} more"
    if fmt == "json":
        click.echo(to_json(findings, input=metrics[0] if len(metrics) == 1 else list(metrics),
                           sources=[str(p) for p in loaded.sources], format=loaded.format, notes=notes,
                           written_config=write_path))
        if html_path:
            click.echo(f"wrote {page}", err=True)
    else:
        print_table(findings, title=f"autotune advise: {shown} ({loaded.format})", notes=notes)
        if write_path:
            click.echo(f"\nwrote patched config to {write_path}")
        if html_path:
            click.echo(f"\nwrote {page}")


@click.command("check")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--stages", type=click.IntRange(min=1),
              help="Pipeline stages (enables batch-layout rules; 1: a plain DeepSpeedEngine with ZeRO, no pipeline).")
@click.option("--world-size", type=click.IntRange(min=1), help="Total ranks (with --stages).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None,
              help="Also check that this machine's devices run the config's precision (fp16/bf16), "
                   "as DeepSpeed's accelerator decides: auto = what `autotune run` would use here. "
                   "Needs torch. [default: not checked; the config may be meant for other devices]")
@_FORMAT
@_RULES
@_user_errors
def check_command(config: str, stages: int | None, world_size: int | None, device: str | None,
                  fmt: str, rule_files: tuple[str, ...]) -> None:
    """Run the configuration rules on a ds_config.json alone. Exit 1 if a critical rule fires."""
    from autotune.advisor import check_config

    if (stages is None) != (world_size is None):
        raise UserError("give --stages and --world-size together")
    rules = load_rules(rule_files)
    cfg = load_ds_config(config)
    findings = check_config(cfg, stages=stages, world_size=world_size, rules=rules, name=Path(config).name)
    notes = []
    if device is not None:
        findings = [*precision_findings(cfg, device, name=Path(config).name), *findings]
    elif requested_precisions(cfg):
        notes.append(f"{'/'.join(requested_precisions(cfg))} enabled: not checked against any device "
                     "(add --device auto to ask this machine's, as `autotune run` does)")
    if fmt == "json":
        click.echo(to_json(findings, input=config, format="ds_config"))
    else:
        print_table(findings, title=f"autotune check: {config}", notes=notes)
    if any(f.fired and f.severity == "critical" for f in findings):
        raise SystemExit(1)


def precision_findings(cfg: DsConfig, device: str, *, name: str) -> list[Finding]:
    """A critical finding per precision the config enables and this machine's devices lack."""
    from autotune.trials.precision import probe_devices, unsupported_message

    support = probe_devices(None if device == "auto" else device)
    if device == "cuda" and not support.why_not and support.device.startswith("CUDA (no device"):
        raise UserError("--device cuda: torch sees no CUDA device on this machine; use --device auto or cpu")
    out = []
    for precision in requested_precisions(cfg):
        if support.supported.get(precision, True):
            continue
        message = unsupported_message(precision, support)
        out.append(Finding(
            rule_id="precision-unsupported", title=f"{precision} is not available on this device",
            severity="critical", status=FIRED, subject=name, trial=None,
            evidence=[Evidence(signal=f"config.{precision}.enabled", measured=1.0, op="==", threshold=1.0,
                               devices=[support.device], detail=support.why_not.get(precision, ""))],
            changes=[Change(kind="config", target=f"{precision}.enabled", current=True, new=False)],
            expected_impact=1.0, explanation=message))
    return out


def _same_file(a: str, b: str) -> bool:
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists():
        return os.path.samefile(pa, pb)
    return pa.resolve() == pb.resolve()


def _write_json_atomic(path: Path, data: dict) -> None:
    try:
        write_atomic(path, json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"{path}: cannot write ({exc.strerror or exc})") from None
