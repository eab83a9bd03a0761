"""The tuning loop behind `autotune run`: baseline, then propose -> run -> tell, to the budget.

Resume rule: finished trials (ok or failed) are kept exactly once and told
back to the proposer; a trial that was running when the controller died is
marked `interrupted`, its leftover processes are stopped (by the process group
stored in the study, and by the trial's path on their command lines), and its
configuration is run again first under the same trial number. Interrupted
trials never count toward the budget, so a resumed study ends with exactly
`budget` counted trials, or fewer when the search converged first (the budget is
a cap: autotune/search_stop.py; `--full-budget` runs them all).

Ctrl-C (SIGINT) and SIGTERM stop the running trial's whole process group,
mark it interrupted, write the best configuration so far and return with
exit code 130 (SIGINT) or 143 (SIGTERM). Further signals during that cleanup
are ignored so it cannot be cut short.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from autotune import search_stop
from autotune.display import ProgressDisplay
from autotune.errors import AutotuneError
from autotune.faults import crash_point
from autotune.judge import TrialOutcome
from autotune.launcher import leftover_ports, remove_shm_buffers, stop_leftovers
from autotune.proposers.base import STATUS_FAILED, STATUS_OK, Proposal, Proposer, TrialResult
from autotune.space import SearchSpace, TrialConfig
from autotune.study import STATUS_INTERRUPTED, STATUS_RUNNING, Study, TrialRow
from autotune.study_outputs import write_outputs
from autotune.study_results import StudyResults, read_results
from autotune.summary import TrialSummary
from autotune.trial import TrialRunner
from autotune.trial_limits import TrialLimits, limits_for

MEASURED_IN_FULL = frozenset({"baseline", "remeasure", "confirm", "recheck"})
"""Proposal sources never stopped early: the reference and the re-measurements."""
DEFAULT_NOISE = 0.10
"""The early-stop margin where the proposer states none (HybridProposer.noise's default)."""


@dataclass(kw_only=True, slots=True)
class TuneResult:
    results: StudyResults
    """The study's results as written at the end (summary.json is `results.to_dict()`)."""
    interrupted: bool = False
    exit_code: int = 0
    """130 after Ctrl-C, 143 after SIGTERM, else 0."""


class StartupStalls(AutotuneError):
    """The ranks' start-up stalls at the same place trial after trial: the run stops with where."""


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: unwind, stopping the running trial on the way."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGINT/SIGTERM raise Stopped once; later ones are ignored while we clean up."""
    def handler(signum: int, _frame: Any) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    try:
        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


class Tuner:
    def __init__(self, *, study: Study, runner: TrialRunner, space: SearchSpace, proposer: Proposer,
                 baseline: TrialConfig, display: ProgressDisplay, budget: int,
                 trial_timeout: float | None = None, startup_timeout: float | None = None,
                 rules_fired: Callable[[TrialSummary], list[str]] | None = None,
                 exporter: Any | None = None, balancer: Any | None = None, checkpointing: Any | None = None,
                 stop_early: bool = True) -> None:
        self.study, self.runner, self.space, self.proposer = study, runner, space, proposer
        self.balancer = balancer
        """A model-setting step around the search: the partition (autotune/balance.py,
        --balance-stages) or the user's mapped knobs (autotune/usercmd/knobs.py, --knob)."""
        self.checkpointing = checkpointing
        """The checkpoint step: an out-of-memory micro-batch again with activation checkpointing
        (autotune/checkpoint_step.py)."""
        self.baseline, self.display, self.budget = baseline, display, budget
        self.trial_timeout = trial_timeout
        self.startup_timeout = startup_timeout
        """The user's limits (--trial-timeout, --startup-timeout); None: from the measured trials
        (autotune/trial_limits.py)."""
        self._startup_hang: str | None = None
        """Where the last trial hung in its start-up, if it did: the same place twice stops the run."""
        self.rules_fired = rules_fired
        self.exporter = exporter
        self.stop_early = stop_early
        """The budget as a cap: stop once the proposer says the search has converged
        (autotune/search_stop.py); False with --full-budget."""
        self._held: dict[int, tuple[TrialConfig, TrialResult]] = {}
        """Results not told to the proposer yet: held while the partition step or the knob sweep
        decides which of the baseline's key's measurements holds (autotune/balance.py `superseded`)."""

    # -- the loop -------------------------------------------------------------
    def run(self) -> TuneResult:
        with _stop_on_signals():
            try:
                redo = self._recover()
                while len(self.study.counted()) < self.budget:
                    proposal = self._next_proposal(redo)
                    if proposal is None:
                        break  # converged: the note says why
                    self._run_one(proposal)
            except AutotuneError:  # the run cannot go on (a build holds a lock, start-up stalls)
                self.study.interrupt_running()
                self._write()
                raise
            except KeyboardInterrupt as exc:
                signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
                for sig in (signal.SIGINT, signal.SIGTERM):  # the cleanup is not cut short
                    signal.signal(sig, signal.SIG_IGN)
                self.study.interrupt_running()
                results = self._write()
                self.display.note(f"interrupted ({signal.Signals(signum).name}): the running trial was "
                                  "stopped; the study is consistent and the best configuration so far "
                                  "is written. Resume with --resume.")
                return TuneResult(results=results, interrupted=True, exit_code=128 + int(signum))
        getattr(self.runner, "begin_close", lambda: None)()  # the ranks exit while the outputs are written
        results = self._write()
        from autotune.report_html import at_end_of_run

        at_end_of_run(self.study, self.display.note)  # report.html, or one note saying why not
        return TuneResult(results=results)

    def _marker(self, number: int) -> str:
        """What every process of trial `number` has on its command line: a path in its folder.

        The folder, not one file in it: the ranks' arguments name the trial's ds_config or
        its trial spec, and a marker must match whichever they name. The trailing separator
        keeps trial-001 from matching trial-0010.
        """
        return str(self.study.trial_dir(number).resolve()) + os.sep

    def _recover(self) -> list[TrialRow]:
        """Stop leftovers of a dead controller, replay finished trials to the proposer."""
        self.study.remove_stale_temp_files()
        left = [t for t in self.study.trials() if t.status == STATUS_RUNNING]
        for t in left:
            self._clean_up_after(t)
            # Marked only now: a controller killed during the clean-up leaves the row
            # `running`, so the next resume cleans up after it again (buffers included).
            self.study.interrupt(t.id)
        finished = self.study.counted()
        if finished or left:
            self.display.note(f"resuming: {len(finished)} finished trial(s) kept, "
                              f"{len(left)} interrupted trial(s) will be run again")
        done = {t.number for t in finished}
        interrupted = [t for t in self.study.trials() if t.status == STATUS_INTERRUPTED]
        if self.balancer is not None:
            self.balancer.replay(finished, [t for t in interrupted if t.number not in done], budget=self.budget)
        if self.checkpointing is not None:
            self.checkpointing.replay(finished, [t for t in interrupted if t.number not in done])
        for t in finished:  # after the replay: told as an uninterrupted run told them
            self._held[t.number] = (t.config, _result_from_row(t))
        self._tell_settled()
        redo, seen = [], set()
        for t in interrupted:
            if t.number not in done and t.number not in seen:
                redo.append(t)
                seen.add(t.number)
                stop_leftovers(None, self._marker(t.number))  # anything an earlier stop missed
        return redo

    def _clean_up_after(self, t: TrialRow) -> None:
        """Stop what a dead controller left of trial `t`, then remove its ranks' /dev/shm buffers.

        The buffers go only after the processes are stopped (a live rank could still create
        them), by the stored port and by any port on a leftover's command line (the
        controller may have died before it stored the port).
        """
        crash_point("recover", t.number)
        marker = self._marker(t.number)
        ports = leftover_ports(marker) | ({t.master_port} if t.master_port is not None else set())
        found = stop_leftovers(t.pgid, marker)
        if found:
            self.display.note(f"stopped {found} leftover process(es) of interrupted trial {t.number}")
        cluster = getattr(self.runner, "cluster", None)
        if cluster is not None and cluster.multi_node:  # the other nodes' ranks, found by the same marker
            from autotune.multinode import stop_on_nodes

            for port in ports or {None}:
                missed = stop_on_nodes(cluster, marker, master_port=port)
            if missed:
                self.display.note(f"could not reach {', '.join(missed)} to stop trial {t.number}'s ranks there")
        for port in ports:
            remove_shm_buffers(port)

    def _next_proposal(self, redo: list[TrialRow]) -> tuple[int, Proposal] | None:
        if redo:
            t = redo.pop(0)
            return t.number, Proposal(config=t.config, source=t.source,
                                      reason=(t.reason + " (re-run after interruption)").strip())
        numbers = [t.number for t in self.study.trials()]
        number = max(numbers) + 1 if numbers else 0
        if not any(t.number == 0 for t in self.study.counted()) and 0 not in numbers:
            return 0, Proposal(config=self.baseline, source="baseline",
                               reason="the starting configuration, measured as the reference")
        # the model-setting steps' trials first: each follows from the trial just finished
        balanced = ((self.checkpointing.next_proposal() if self.checkpointing is not None else None)
                    or (self.balancer.next_proposal() if self.balancer is not None else None))
        if balanced is None:
            stopped = search_stop.check(self.study, self.proposer, self.budget, enabled=self.stop_early)
            if stopped is not None:
                self.display.note(search_stop.describe(stopped))
                return None
        return number, balanced or self.proposer.ask()

    def _run_one(self, item: tuple[int, Proposal]) -> None:
        number, proposal = item
        cfg = proposal.config
        trial_id = self.study.start_trial(number, cfg, proposal.source, proposal.reason)
        crash_point("after-start", number)
        if self.exporter is not None:
            self.exporter.trial_started(number, cfg)

        def record_group(proc: Any) -> None:
            self.study.set_launch(trial_id, proc.pgid, proc.master_port)
            crash_point("during-trial", number)

        if self.balancer is not None:
            self.balancer.before(number, proposal)
        incumbent = self._incumbent(proposal)
        limits = self._limits(cfg)
        with self.display.running(number, cfg, proposal.source):
            outcome = self.runner.run(number, cfg, self.study.trial_dir(number), timeout=limits.timeout,
                                      on_start=record_group, incumbent=incumbent, stall=limits.stall)
        fired = self.rules_fired(outcome.summary) if (self.rules_fired and outcome.summary) else []
        crash_point("before-finish", number)
        self.study.finish_trial(
            trial_id, status=outcome.result.status,
            samples_per_second=outcome.result.samples_per_second if outcome.result.ok else None,
            failure_reason=outcome.result.failure_reason, failure_detail=outcome.failure_detail,
            summary=outcome.summary.to_dict() if outcome.summary else None,
            rules_fired=fired, wall_seconds=outcome.wall_seconds,
        )
        crash_point("after-finish", number)
        best = self.study.best()
        is_best = best is not None and best.number == number and outcome.result.ok
        # the trial's row and its own notes first, then what the model-setting steps decided from it
        self.display.trial_row(number, cfg, proposal.source, outcome.result.status, outcome.summary,
                               _failure_text(outcome), is_best)
        if outcome.summary is not None and outcome.summary.stopped_early and incumbent is not None:
            self.display.note(f"      stopped early: after {outcome.summary.steps} measured steps its median "
                              f"step's interval lies below the best trial's {incumbent[0]:.1f} samples/s by "
                              f"more than the {incumbent[1]:.0%} noise margin")
        if not outcome.result.ok:
            log = self.study.trial_dir(number) / "launcher.log"
            self.display.note(f"      failed ({outcome.result.failure_reason}): "
                              f"{outcome.failure_detail or 'no detail'}; log kept in {log}")
        if proposal.reason and proposal.source not in ("baseline",):
            self.display.note(f"      why: {proposal.reason}")
        if self.balancer is not None:
            self.balancer.after(number, proposal, outcome.result.ok, outcome.result.samples_per_second,
                                outcome.summary, is_best=is_best, room=self.budget - len(self.study.counted()))
        if self.checkpointing is not None:
            earlier = [t.samples_per_second for t in self.study.counted()
                       if t.number != number and t.status == STATUS_OK and t.samples_per_second]
            self.checkpointing.after(number, cfg, proposal.source, outcome.result.ok,
                                     outcome.result.failure_reason, outcome.result.samples_per_second,
                                     max(earlier) if earlier else None)
        self._held[number] = (cfg, outcome.result)
        self._tell_settled()
        self._check_startup_hang(outcome)
        if self.exporter is not None:
            self.exporter.trial_finished(number, cfg, outcome.result.status,
                                         outcome.result.samples_per_second, outcome.summary, fired)
        self._write()

    def _tell_settled(self) -> None:
        """Tell the proposer the held results, unless the partition step or knob sweep is still deciding.

        A partition round (or knob) trial runs a configuration measured before with other parts: the
        proposer must see that configuration once, with the measurement that holds for the
        partition later trials run (a failed or slower partition trial is not a run of the
        configuration; a kept one replaces the runs before it: autotune/measurements.py). Checkpointed trials are never
        told: the proposers' encoding has no checkpoint interval (autotune/checkpoint_step.py)."""
        if getattr(self.balancer, "deciding", False):
            return
        from autotune.measurements import superseded

        stale = superseded(self.study.counted())
        for n in sorted(self._held):
            cfg, result = self._held.pop(n)
            if n not in stale and not cfg.activation_checkpoint_interval:
                self.proposer.tell(cfg, result)

    def _incumbent(self, proposal: Proposal) -> tuple[float, float] | None:
        """(samples/s, noise margin) of the best trial so far: with adaptive steps a trial that
        cannot plausibly beat it stops early (autotune/step_budget.py). None for the baseline and
        for any re-measurement (remeasure, confirm, recheck, a configuration measured before):
        those runs exist to measure in full."""
        if proposal.source in MEASURED_IN_FULL:
            return None
        best = self.study.best()
        if best is None or not best.samples_per_second:
            return None
        if any(t.config.key() == proposal.config.key() for t in self.study.counted()):
            return None
        return float(best.samples_per_second), float(getattr(self.proposer, "noise", DEFAULT_NOISE))

    def _limits(self, config: TrialConfig) -> TrialLimits:
        return limits_for(config, self.study.trials(), trial_timeout=self.trial_timeout,
                          startup_timeout=self.startup_timeout)

    def _check_startup_hang(self, outcome: TrialOutcome) -> None:
        """A start-up that stalls at the same place twice in a row will stall every trial: stop.

        A stale extension lock does not get here twice: the launch's pre-flight removes it
        before the next trial (autotune/ext_locks.py)."""
        from autotune.hangs import startup_place

        where = startup_place(outcome.failure_detail) if outcome.result.failure_reason == "hang" else None
        if where is not None and where == self._startup_hang:
            raise StartupStalls(f"two trials in a row stalled in their ranks' start-up {where}; every trial "
                                "would: fix that, then resume with --resume")
        self._startup_hang = where

    def _write(self) -> StudyResults:
        results = read_results(self.study)  # one snapshot: summary.json's best is best_ds_config.json's
        best_cfg = self.runner.ds_config_for(results.best.config) if results.best else None
        write_outputs(self.study, results, best_cfg)
        return results


def _result_from_row(t: TrialRow) -> TrialResult:
    summary = TrialSummary.from_dict(t.summary) if t.summary else None
    if t.status == STATUS_OK:
        return TrialResult(status=STATUS_OK, samples_per_second=t.samples_per_second or 0.0, summary=summary)
    return TrialResult(status=STATUS_FAILED, failure_reason=t.failure_reason)


def _failure_text(o: TrialOutcome) -> str | None:
    if o.result.ok:
        return None
    return o.result.failure_reason


def dump_space(space: SearchSpace) -> dict[str, Any]:
    return {"description": space.describe(), "micro_batch_sizes": space.micro_batch_sizes,
            "gas_values": space.gas_values, "global_batch": space.global_batch,
            "bucket_range": list(space.bucket_range) if space.bucket_range else None,
            "pipeline_stages": space.pipeline_stages, "data_parallel_size": space.data_parallel_size}
