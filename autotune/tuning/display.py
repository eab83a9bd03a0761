"""Live progress for `autotune run`: a spinner while a trial runs, one row per finished trial."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from rich.console import Console

from autotune.core.space import TrialConfig, fmt_bucket
from autotune.core.summary import TrialSummary


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def _interval(s: TrialSummary) -> str:
    """The median step time's 95 % interval as +-%: within this trial, not between launches."""
    hw = s.step_seconds_rel_half_width
    return "n/a" if hw is None else f"±{100 * hw:.1f}%"


class ProgressDisplay:
    def __init__(self, console: Console | None = None, budget: int = 0) -> None:
        # markup off: notes carry failure details and paths ("[/__w/pytorch/...pair.cc:553]"
        # from a gloo error once crashed a run as a closing markup tag)
        self.console = console or Console(highlight=False, soft_wrap=True, markup=False, emoji=False)
        self.budget = budget
        self._header_done = False

    def note(self, text: str) -> None:
        self.console.print(text, markup=False, emoji=False)

    def running(self, number: int, config: TrialConfig, source: str) -> AbstractContextManager:
        if not self.console.is_terminal:
            return nullcontext()
        return self.console.status(f"trial {number}/{self.budget - 1}: {config.describe()} ({source}) running...")

    def header(self) -> None:
        if not self._header_done:
            self.console.print(
                f"{'trial':>5} {'micro':>5} {'gas':>4} {'bucket':>8} {'samples/s':>10} {'±95%':>6} {'util':>5} "
                f"{'fluct':>5} {'comm/comp':>9} {'bubble':>11} {'imbal':>5}  {'status':<8} proposed by"
            )
            self._header_done = True

    def trial_row(self, number: int, config: TrialConfig, source: str, status: str,
                  summary: TrialSummary | None, failure: str | None, best: bool) -> None:
        self.header()
        bucket = "-" if config.reduce_bucket_size is None else fmt_bucket(config.reduce_bucket_size)
        if summary is not None:
            sps = f"{summary.samples_per_second:10.1f} {_interval(summary):>6}"
            util = _pct(summary.device_utilization_mean)
            fl = _pct(summary.device_utilization_fluctuation)
            ccr = "n/a" if summary.comm_compute_ratio is None else f"{summary.comm_compute_ratio:.2f}"
            if summary.bubble_fraction_measured is None or summary.bubble_fraction_ideal is None:
                bub = imb = "n/a"  # not a pipeline job (the run's header says so)
            else:
                bub = f"{summary.bubble_fraction_measured:.2f}/{summary.bubble_fraction_ideal:.2f}"
                imb = "n/a" if summary.stage_compute_imbalance is None else f"{summary.stage_compute_imbalance:.2f}"
        else:
            sps, util, fl, ccr, bub, imb = f"{'-':>10} {'-':>6}", "-", "-", "-", "-", "-"
        status_text = status if failure is None else f"{status}: {failure}"
        if summary is not None and summary.stopped_early:
            status_text = f"{status} (stopped early)"
        mark = " *best*" if best else ""
        self.console.print(
            f"{number:>5} {config.micro_batch_size:>5} {config.gradient_accumulation_steps:>4} "
            f"{bucket:>8} {sps} {util:>5} {fl:>5} {ccr:>9} {bub:>11} {imb:>5}  {status_text:<8} "
            f"{source}{mark}", markup=False, emoji=False
        )
