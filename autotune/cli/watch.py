"""`autotune watch -- COMMAND`: parse arguments, call autotune/usercmd/watch.py, exit with the job's code.

Registered in the main group by autotune.cli.main.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from autotune.core.options import endpoint_options
from autotune.usercmd.watch import WatchOptions

_D = WatchOptions()


@click.command("watch", context_settings={"allow_interspersed_args": False})
@click.option("--out", default=_D.out, show_default=True,
              help="Folder of the watches; each writes OUT/run-NNN (CSVs, log, findings), never over an earlier one.")
@click.option("--config", "config", default=None,
              help="The DeepSpeed config, for a command that takes it through {config}.")
@click.option("--job", default=_D.job, show_default=True, help="The `job` label of every metric.")
@endpoint_options  # --metrics-port, --rank-metrics-port, --metrics-addr, --no-metrics: as `autotune run`'s
@click.option("--interval", type=float, default=_D.interval, show_default=True,
              help="Seconds between advisor evaluations of the CSVs.")
@click.option("--window", type=click.IntRange(min=0), default=_D.window, show_default=True,
              help="Steps of each rank that an evaluation summarizes (the last N; 0 = all so far).")
@click.option("--warmup-steps", type=click.IntRange(min=0), default=_D.warmup_steps, show_default=True,
              help="First steps of each rank left out of every summary.")
@click.option("--trace-steps", type=click.IntRange(min=0, max=1000), default=_D.trace_steps, show_default=True,
              help="Record a torch.profiler trace of this many steps on every rank, after the warm-up, into "
                   "OUT/run-NNN/traces/ (read by `autotune advise`; docs/traces.md). 0: off.")
@click.option("--quiet", is_flag=True, help="Do not echo the job's output (it is in OUT/run-NNN/launcher.log).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- COMMAND...")
def watch_command(out: str, config: str | None, job: str, metrics_port: int, rank_metrics_port: int,
                  metrics_addr: str, no_metrics: bool, interval: float, window: int, warmup_steps: int,
                  trace_steps: int, quiet: bool, command: tuple[str, ...]) -> None:
    """Run your training job unchanged, instrumented, for as long as it runs.

    autotune watch -- deepspeed train.py --deepspeed_config ds_config.json

    Per-rank metrics CSV and Prometheus endpoint, the advisor's findings printed when they
    change and served on the controller endpoint; exits with the job's exit code (130 on Ctrl-C,
    after stopping every rank).
    """
    from autotune.tuning.display import ProgressDisplay
    from autotune.usercmd.watch import watch

    opts = WatchOptions(out=out, config=config, job=job, metrics_port=metrics_port,
                        rank_metrics_port=rank_metrics_port, metrics_addr=metrics_addr, no_metrics=no_metrics,
                        interval=interval, window=window, warmup_steps=warmup_steps, trace_steps=trace_steps,
                        echo=not quiet)
    sys.exit(watch(list(command), opts, cwd=Path.cwd(), display=ProgressDisplay()))
