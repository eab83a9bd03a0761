"""Command line: parse arguments, call into the package. Nothing else lives here."""

from __future__ import annotations

import sys

import click

from autotune import __version__
from autotune.errors import AutotuneError


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


@cli.command("run")
@click.option("--budget", type=int, default=None,
              help="Trials to run, baseline included [default: 20; a resumed study keeps its own].")
@click.option("--study", "study", default="autotune-study", show_default=True, help="Study folder.")
@click.option("--resume", is_flag=True, help="Continue the study in --study (rerunning with it does too).")
@click.option("--config", type=click.Path(dir_okay=False), default=None,
              help="Starting ds_config.json (default: the built-in workload's).")
@click.option("--tuner", default="hybrid", show_default=True,
              help="hybrid, bayes, random, grid or ds-autotuner.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--preset", default="tiny", show_default=True, help="Workload: tiny, small, llama-7b, llama-13b.")
@click.option("--stages", type=int, default=2, show_default=True, help="Pipeline stages.")
@click.option("--dp", type=int, default=2, show_default=True, help="Data-parallel degree (ranks = stages x dp).")
@click.option("--global-batch", type=int, default=None,
              help="Fixed global batch (default: the starting config's train_batch_size).")
@click.option("--free-batch", is_flag=True, help="Let the global batch vary (micro and GAS both searched).")
@click.option("--max-global-batch", type=int, default=None, help="Upper bound with --free-batch.")
@click.option("--micro-min", type=int, default=1, show_default=True)
@click.option("--micro-max", type=int, default=64, show_default=True)
@click.option("--gas-min", type=int, default=1, show_default=True)
@click.option("--gas-max", type=int, default=64, show_default=True)
@click.option("--integer-micro", is_flag=True, help="Any integer micro-batch, not only powers of two.")
@click.option("--bucket-min", type=float, default=1e4, show_default=True, help="reduce_bucket_size, elements.")
@click.option("--bucket-max", type=float, default=5e8, show_default=True)
@click.option("--steps", type=int, default=6, show_default=True, help="Measured steps per trial.")
@click.option("--warmup-steps", type=int, default=2, show_default=True)
@click.option("--trial-timeout", type=float, default=None,
              help="Seconds per trial (default: derived from the slowest finished trial).")
@click.option("--partition-method", default="parameters", show_default=True)
@click.option("--activation-checkpoint-interval", type=int, default=0, show_default=True)
@click.option("--tokens", type=click.Path(dir_okay=False), default=None, help="Token file instead of synthetic data.")
@click.option("--metrics-port", type=int, default=None, help="Serve the controller's Prometheus metrics here.")
@click.option("--rank-metrics-port", type=int, default=None, help="Base port of each rank's endpoint.")
@click.option("--metrics-addr", default="127.0.0.1", show_default=True,
              help="Bind address of the endpoints (anything but loopback exposes them).")
@click.option("--slow-stage", type=int, default=None, hidden=True)
@click.option("--slow-factor", type=int, default=1, hidden=True)
@click.option("--fault", default=None, hidden=True)
def run_cmd(**kw) -> None:
    """Tune micro-batch, gradient accumulation and reduce_bucket_size with real trials."""
    from autotune.errors import UserError
    from autotune.session import RunOptions, tune
    from autotune.study import stored_budget
    from autotune.trial import WorkloadOptions

    budget = kw["budget"] if kw["budget"] is not None else (stored_budget(kw["study"]) or 20)
    buckets = {}
    for name in ("bucket_min", "bucket_max"):
        v = kw[name]
        if not (v == v and abs(v) < 1e15):  # NaN and inf never reach int()
            raise UserError(f"--{name.replace('_', '-')} must be a finite number of elements, got {v}")
        buckets[name] = int(v)
    wl = WorkloadOptions(
        preset=kw["preset"], pipeline_stages=kw["stages"], data_parallel_size=kw["dp"],
        steps=kw["steps"], warmup_steps=kw["warmup_steps"], partition_method=kw["partition_method"],
        activation_checkpoint_interval=kw["activation_checkpoint_interval"], tokens=kw["tokens"],
        slow_stage=kw["slow_stage"], slow_factor=kw["slow_factor"], faults=kw["fault"] or "",
    )
    opts = RunOptions(
        budget=budget, study=kw["study"], resume=kw["resume"], config=kw["config"],
        tuner=kw["tuner"], seed=kw["seed"], global_batch=kw["global_batch"], free_batch=kw["free_batch"],
        max_global_batch=kw["max_global_batch"], micro_min=kw["micro_min"], micro_max=kw["micro_max"],
        gas_min=kw["gas_min"], gas_max=kw["gas_max"], integer_micro=kw["integer_micro"],
        bucket_min=buckets["bucket_min"], bucket_max=buckets["bucket_max"],
        trial_timeout=kw["trial_timeout"], metrics_port=kw["metrics_port"],
        rank_metrics_port=kw["rank_metrics_port"], metrics_addr=kw["metrics_addr"], workload=wl,
    )
    try:
        result = tune(opts)
    except KeyboardInterrupt:  # before the first trial started: nothing to stop
        click.echo("autotune: interrupted before any trial ran; nothing to clean up", err=True)
        sys.exit(130)
    _print_outcome(result.summary, opts.study)
    if result.interrupted:
        sys.exit(result.exit_code or 130)


def _print_outcome(summary: dict, study: str) -> None:
    best, base = summary.get("best"), summary.get("baseline")
    if best is None:
        click.echo("no trial succeeded; see the launcher logs in the study folder", err=True)
        return
    click.echo(
        f"\nbest: trial {best['trial']}: micro {best['micro_batch_size']}, GAS "
        f"{best['gradient_accumulation_steps']}, reduce_bucket_size {best['reduce_bucket_size'] or 'not tuned'}"
        f" -> {best['samples_per_second']:.1f} samples/s"
        + (f" (mean of {best['measurements']} runs)" if best.get("measurements", 1) > 1 else "")
    )
    if base and base.get("samples_per_second") and summary.get("speedup_over_baseline"):
        click.echo(f"baseline: {base['samples_per_second']:.1f} samples/s; "
                   f"speed-up {summary['speedup_over_baseline']:.2f}x")
    click.echo(f"wrote {study}/best_ds_config.json, {study}/summary.json, {study}/report.md")


def _register_commands() -> None:
    # advise and check need only the base install: registered unconditionally, so a broken
    # install is an ImportError at start-up, never a command that silently vanished.
    from autotune.cli_advise import advise_command, check_command

    cli.add_command(advise_command, "advise")
    cli.add_command(check_command, "check")
    from autotune.cli_report import report_command

    cli.add_command(report_command, "report")


_register_commands()


def main() -> None:
    cli(prog_name="autotune")


if __name__ == "__main__":
    main()
