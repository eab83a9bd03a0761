"""Command line: parse arguments, call into the package. Nothing else lives here."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from autotune import __version__
from autotune.core.errors import AutotuneError
from autotune.core.options import click_options

if TYPE_CHECKING:
    from autotune.study.results import StudyResults


class _ReportedError(click.ClickException):
    """An AutotuneError shown as one line, with its own exit code."""

    def __init__(self, err: AutotuneError) -> None:
        super().__init__(str(err))
        self.exit_code = err.exit_code

    def show(self, file=None) -> None:  # noqa: ANN001 - click's signature
        click.echo(f"autotune: error: {self.message}", err=True)


class AutotuneGroup(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except AutotuneError as err:
            raise _ReportedError(err) from None


@click.group(cls=AutotuneGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="autotune")
def cli() -> None:
    """Profile and auto-tune DeepSpeed pipeline-parallel training."""


# COMMAND: the user's own training job after `--` (autotune/usercmd, docs/user-script.md).
# Option parsing stops at its first word, so its options are never read as autotune's; an
# unknown option before it stays an error (no ignore_unknown_options: a typo is not a command).
@cli.command("run", context_settings={"allow_interspersed_args": False})
@click_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[-- COMMAND...]")
def run_cmd(**kw) -> None:
    """Tune micro-batch, gradient accumulation and reduce_bucket_size with real trials.

    Without COMMAND: the built-in workload. With it, your own job, unchanged:
    autotune run -- deepspeed train.py --deepspeed_config ds_config.json

    Every option, its default, unit and range, is declared once in autotune/core/options.py.
    """
    from autotune.core.options import from_cli
    from autotune.report_html import at_end_of_run
    from autotune.study.store import stored_budget
    from autotune.tuning.session import tune

    budget = kw["budget"] if kw["budget"] is not None else (stored_budget(kw["study"]) or 20)
    opts = from_cli(kw, budget=budget)
    try:
        result = tune(opts, command=list(kw["command"]) or None, at_end=at_end_of_run)  # + report.html
    except KeyboardInterrupt:  # before the first trial started: nothing to stop
        click.echo("autotune: interrupted before any trial ran; nothing to clean up", err=True)
        sys.exit(130)
    _print_outcome(result.results, opts.study)
    if result.interrupted:
        sys.exit(result.exit_code or 130)


def _print_outcome(results: StudyResults, study: str) -> None:
    best, base = results.best, results.baseline
    if best is None:
        click.echo("no trial succeeded; see the launcher logs in the study folder", err=True)
        return
    click.echo(
        f"\nbest: trial {best.number}: micro {best.config.micro_batch_size}, GAS "
        f"{best.config.gradient_accumulation_steps}, reduce_bucket_size {best.config.reduce_bucket_size or 'not tuned'}"
        f" -> {best.samples_per_second:.1f} samples/s"
        + (f" (mean of {best.repeats} runs)" if best.repeats > 1 else "")
    )
    schedule = _torch_result(results, study)
    if schedule:  # a torch pipelining script: no ds_config, its schedule and count
        click.echo(f"in the script: {schedule['in_the_script']} (its own: {schedule['script_own']['schedule']}, "
                   f"n_microbatches {schedule['script_own']['n_microbatches']}); the command: {schedule['command']}")
    if results.trainer_args:  # an HF Trainer job: its batch lives in its arguments
        click.echo(f"as the Trainer's arguments: {results.trainer_args} (with best_ds_config.json as --deepspeed)")
    if base and base.samples_per_second and results.speedup:
        click.echo(f"baseline: {base.samples_per_second:.1f} samples/s; "
                   f"speed-up {results.speedup:.2f}x")
    from autotune.study.partition_record import describe_result

    partition = describe_result(results.partition)  # --balance-stages: what the code needs
    if partition:
        click.echo(partition)
    result = "best_schedule.json" if schedule else "best_ds_config.json"
    click.echo(f"wrote {study}/{result}, {study}/summary.json, {study}/report.md")


def _torch_result(results: StudyResults, study: str) -> dict | None:
    """A torch pipelining script's best_schedule.json (autotune/usercmd/torch_job.py), else None."""
    import json
    from pathlib import Path

    from autotune.usercmd.torch_job import RESULT_FILE, TORCH

    if (results.user_command or {}).get("engine") != TORCH:
        return None
    try:
        found = json.loads((Path(study) / RESULT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _register_commands() -> None:
    # advise and check need only the base install: registered unconditionally, so a broken
    # install is an ImportError at start-up, never a command that silently vanished.
    from autotune.cli.advise import advise_command, check_command

    cli.add_command(advise_command, "advise")
    cli.add_command(check_command, "check")
    from autotune.cli.report import report_command

    cli.add_command(report_command, "report")
    from autotune.cli.predict import plan_command, predict_command

    cli.add_command(predict_command, "predict")
    cli.add_command(plan_command, "plan")
    from autotune.cli.watch import watch_command

    cli.add_command(watch_command, "watch")


_register_commands()


def main() -> None:
    cli(prog_name="autotune")


if __name__ == "__main__":
    main()
