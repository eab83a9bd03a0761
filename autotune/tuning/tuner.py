"""The tuning loop behind `autotune run`: baseline, then propose -> run -> tell, to the budget.

Resume rule: finished trials (ok or failed) are kept exactly once and told
back to the proposer; a trial that was running when the controller died is
marked `interrupted`, its leftover processes are stopped (by the process group
stored in the study, and by the trial's path on their command lines), and its
configuration is run again first under the same trial number. Interrupted
trials never count toward the budget, so a resumed study ends with exactly
`budget` counted trials, or fewer when the search converged first (the budget is
a cap: autotune/tuning/search_stop.py; `--full-budget` runs them all).

Ctrl-C (SIGINT) and SIGTERM stop the running trial's whole process group,
mark it interrupted, write the best configuration so far and return with
exit code 130 (SIGINT) or 143 (SIGTERM). Further signals during that cleanup
are ignored so it cannot be cut short (autotune/tuning/stop_signals.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autotune.core.errors import AutotuneError
from autotune.core.faults import crash_point
from autotune.core.noise import NOISE_MARGIN
from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.summary import TrialSummary
from autotune.core.trial_kind import BASELINE
from autotune.core.trial_result import STATUS_FAILED, STATUS_OK, TrialResult
from autotune.study.results import StudyResults
from autotune.study.store import STATUS_INTERRUPTED, STATUS_RUNNING, Study, TrialRow
from autotune.trials.contract import Incumbent, Runner, TrialRequest
from autotune.trials.judge import TrialOutcome
from autotune.trials.launcher import (
    TrialProcess,
    leftover_ports,
    remove_shm_buffers,
    stop_leftovers,
)
from autotune.trials.limits import TrialLimits, limits_for
from autotune.tuning import search_stop
from autotune.tuning.callbacks import StudyOutputs
from autotune.tuning.proposers.base import Proposal, Proposer
from autotune.tuning.steps import SettingStep, TrialEnd, TunerCallback
from autotune.tuning.stop_signals import Stopped, ignore_stop_signals, stop_on_signals


@dataclass(kw_only=True, slots=True)
class TuneResult:
    results: StudyResults
    """The study's results as written at the end (summary.json is `results.to_dict()`)."""
    interrupted: bool = False
    exit_code: int = 0
    """130 after Ctrl-C, 143 after SIGTERM, else 0."""


ENDING_ROOM = 2
"""The budget's room at which the setting steps are asked for what they want before the search
ends (`SettingStep.before_end`): their trial, then one slot for the proposer's re-measurement."""


class StartupStalls(AutotuneError):
    """The ranks' start-up stalls at the same place trial after trial: the run stops with where."""


class Tuner:
    """The loop. Its collaborators are contracts: a Runner (autotune/trials/contract.py), a Proposer,
    setting steps and callbacks (autotune/tuning/steps.py)."""

    def __init__(self, *, study: Study, runner: Runner, space: SearchSpace, proposer: Proposer,
                 baseline: TrialConfig, note: Callable[[str], None], budget: int,
                 trial_timeout: float | None = None, startup_timeout: float | None = None,
                 rules_fired: Callable[[TrialSummary], list[str]] | None = None,
                 steps: Sequence[SettingStep] = (), callbacks: Sequence[TunerCallback] = (),
                 stop_early: bool = True,
                 at_end: Callable[[Study, Callable[[str], None]], object] | None = None) -> None:
        self.study, self.runner, self.space, self.proposer = study, runner, space, proposer
        self.at_end = at_end
        """What the command adds once a run has ended and its files are written (`autotune run`:
        report.html, autotune/report_html/); it says its own failures and never raises."""
        self.steps = list(steps)
        """The model-setting steps around the search, in the order they propose: the checkpoint
        step, the partition rounds, the knob sweep (autotune/tuning/steps.py)."""
        self.outputs = StudyOutputs(study, runner)
        self.callbacks = list(callbacks)
        """The display and the live metrics; the study's output files (`outputs`) are written after
        them, once the steps and the proposer have heard of the trial."""
        self.baseline, self.note, self.budget = baseline, note, budget
        self.trial_timeout = trial_timeout
        self.startup_timeout = startup_timeout
        """The user's limits (--trial-timeout, --startup-timeout); None: from the measured trials
        (autotune/trials/limits.py)."""
        self._startup_hang: str | None = None
        """Where the last trial hung in its start-up, if it did: the same place twice stops the run."""
        self.rules_fired = rules_fired
        self.stop_early = stop_early
        """The budget as a cap: stop once the proposer says the search has converged
        (autotune/tuning/search_stop.py); False with --full-budget."""
        self._held: dict[int, tuple[TrialConfig, TrialResult]] = {}
        """Results not told to the proposer yet: held while a setting step decides which of the
        measurements of the configuration it re-runs holds (autotune/core/measurements.py `superseded`)."""

    # -- the loop -------------------------------------------------------------
    def run(self) -> TuneResult:
        try:
            return self._loop()
        finally:
            for callback in self.callbacks:
                callback.run_ended()

    def _loop(self) -> TuneResult:
        with stop_on_signals():
            try:
                redo = self._recover()
                while len(self.study.counted()) < self.budget:
                    proposal = self._next_proposal(redo)
                    if proposal is None:
                        break  # converged: the note says why
                    self._run_one(proposal)
            except AutotuneError:  # the run cannot go on (a build holds a lock, start-up stalls)
                self.study.interrupt_running()
                self.outputs.write()
                raise
            except KeyboardInterrupt as exc:
                stop = Stopped.of(exc)
                ignore_stop_signals()  # the cleanup is not cut short
                self.study.interrupt_running()
                results = self.outputs.write()
                self.note(f"interrupted ({stop.name}): the running trial was "
                          "stopped; the study is consistent and the best configuration so far "
                          "is written. Resume with --resume.")
                return TuneResult(results=results, interrupted=True, exit_code=stop.exit_code)
        self.runner.begin_close()  # the ranks exit while the outputs are written
        results = self.outputs.write()
        if self.at_end is not None:
            self.at_end(self.study, self.note)
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
            self.note(f"resuming: {len(finished)} finished trial(s) kept, "
                              f"{len(left)} interrupted trial(s) will be run again")
        done = {t.number for t in finished}
        interrupted = [t for t in self.study.trials() if t.status == STATUS_INTERRUPTED]
        for step in self.steps:
            step.replay(finished, [t for t in interrupted if t.number not in done], self.budget)
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
            self.note(f"stopped {found} leftover process(es) of interrupted trial {t.number}")
        cluster = self.runner.cluster
        if cluster is not None and cluster.multi_node:  # the other nodes' ranks, found by the same marker
            from autotune.trials.multinode import stop_on_nodes

            missed: set[str] = set()
            found_ports: list[int | None] = [*sorted(ports)] or [None]  # no port known: by the marker alone
            for port in found_ports:
                missed.update(stop_on_nodes(cluster, marker, master_port=port))
            if missed:
                self.note(f"could not reach {', '.join(sorted(missed))} to stop trial {t.number}'s ranks there")
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
            return 0, Proposal(config=self.baseline, source=BASELINE,
                               reason="the starting configuration, measured as the reference")
        # the setting steps' trials first: each follows from the trial just finished
        queued = next((p for step in self.steps if (p := step.next_proposal()) is not None), None)
        if queued is None:
            stopped = search_stop.check(self.study, self.proposer, self.budget, enabled=self.stop_early)
            room = self.budget - len(self.study.counted())
            if stopped is not None or room <= ENDING_ROOM:
                best = self.study.best()
                queued = next((p for step in self.steps if (p := step.before_end(best, room)) is not None), None)
            if stopped is not None and queued is None:
                self.note(search_stop.describe(stopped))
                return None
        return number, queued or self.proposer.ask()

    def _run_one(self, item: tuple[int, Proposal]) -> None:
        number, proposal = item
        cfg = proposal.config
        trial_id = self.study.start_trial(number, cfg, proposal.source, proposal.reason)
        crash_point("after-start", number)

        def record_group(proc: TrialProcess) -> None:
            self.study.set_launch(trial_id, proc.pgid, proc.master_port)
            crash_point("during-trial", number)

        limits = self._limits(cfg)
        request = TrialRequest(number=number, config=cfg, trial_dir=self.study.trial_dir(number),
                               timeout=limits.timeout, stall=limits.stall, incumbent=self._incumbent(proposal),
                               on_start=record_group)
        for step in self.steps:
            step.prepare(request, proposal.kind)
        earlier = [t.samples_per_second for t in self.study.counted()
                   if t.status == STATUS_OK and t.samples_per_second]
        for callback in self.callbacks:
            callback.trial_started(number, proposal)
        outcome = self.runner.run(request)
        result = outcome.result
        fired = self.rules_fired(outcome.summary) if (self.rules_fired and outcome.summary) else []
        crash_point("before-finish", number)
        self.study.finish_trial(
            trial_id, status=result.status,
            samples_per_second=result.samples_per_second if result.ok else None,
            failure_reason=result.failure_reason, failure_detail=outcome.failure_detail,
            summary=outcome.summary.to_dict() if outcome.summary else None,
            rules_fired=fired, wall_seconds=outcome.wall_seconds,
        )
        crash_point("after-finish", number)
        best = self.study.best()
        end = TrialEnd(number=number, proposal=proposal, ok=result.ok,
                       samples_per_second=result.samples_per_second, failure_reason=result.failure_reason,
                       summary=outcome.summary, is_best=best is not None and best.number == number and result.ok,
                       room=self.budget - len(self.study.counted()), earlier_best=max(earlier) if earlier else None,
                       incumbent=request.incumbent)
        # the trial's row and its own notes first, then what the setting steps decide from it
        for callback in self.callbacks:
            callback.trial_finished(end, outcome, fired)
        for step in self.steps:
            step.after(end)
        self._held[number] = (cfg, result)
        self._tell_settled()
        self._check_startup_hang(outcome)
        self.outputs.write()  # last: after the steps and the proposer

    def _tell_settled(self) -> None:
        """Tell the proposer the held results, unless the partition step or knob sweep is still deciding.

        A partition round (or knob) trial runs a configuration measured before with other parts: the
        proposer must see that configuration once, with the measurement that holds for the
        partition later trials run (a failed or slower partition trial is not a run of the
        configuration; a kept one replaces the runs before it: autotune/core/measurements.py). Checkpointed trials are never
        told: the proposers' encoding has no checkpoint interval (autotune/tuning/checkpoint_step.py)."""
        if any(step.deciding for step in self.steps):
            return
        from autotune.core.measurements import superseded

        stale = superseded(self.study.counted())
        for n in sorted(self._held):
            cfg, result = self._held.pop(n)
            if n not in stale and not cfg.activation_checkpoint_interval:
                self.proposer.tell(cfg, result)

    def _incumbent(self, proposal: Proposal) -> Incumbent | None:
        """(samples/s, noise margin) of the best trial so far: with adaptive steps a trial that
        cannot plausibly beat it stops early (autotune/core/step_budget.py). None for the baseline and
        for any re-measurement (remeasure, confirm, recheck, a configuration measured before):
        those runs exist to measure in full."""
        if proposal.kind.measured_in_full:
            return None
        best = self.study.best()
        if best is None or not best.samples_per_second:
            return None
        if any(t.config.key() == proposal.config.key() for t in self.study.counted()):
            return None
        return Incumbent(float(best.samples_per_second), float(getattr(self.proposer, "noise", NOISE_MARGIN)))

    def _limits(self, config: TrialConfig) -> TrialLimits:
        return limits_for(config, self.study.trials(), trial_timeout=self.trial_timeout,
                          startup_timeout=self.startup_timeout)

    def _check_startup_hang(self, outcome: TrialOutcome) -> None:
        """A start-up that stalls at the same place twice in a row will stall every trial: stop.

        A stale extension lock does not get here twice: the launch's pre-flight removes it
        before the next trial (autotune/trials/ext_locks.py)."""
        from autotune.trials.hangs import startup_place

        where = startup_place(outcome.failure_detail) if outcome.result.failure_reason == "hang" else None
        if where is not None and where == self._startup_hang:
            raise StartupStalls(f"two trials in a row stalled in their ranks' start-up {where}; every trial "
                                "would: fix that, then resume with --resume")
        self._startup_hang = where


def _result_from_row(t: TrialRow) -> TrialResult:
    summary = TrialSummary.from_dict(t.summary) if t.summary else None
    if t.status == STATUS_OK:
        return TrialResult(status=STATUS_OK, samples_per_second=t.samples_per_second or 0.0, summary=summary)
    return TrialResult(status=STATUS_FAILED, failure_reason=t.failure_reason)


def _failure_text(o: TrialOutcome) -> str | None:
    if o.result.ok:
        return None
    return o.result.failure_reason


def dump_space(space: SearchSpace) -> dict[str, object]:
    return {"description": space.describe(), "micro_batch_sizes": space.micro_batch_sizes,
            "gas_values": space.gas_values, "global_batch": space.global_batch,
            "bucket_range": list(space.bucket_range) if space.bucket_range else None,
            "pipeline_stages": space.pipeline_stages, "data_parallel_size": space.data_parallel_size,
            "model_parameters": space.model_parameters}
