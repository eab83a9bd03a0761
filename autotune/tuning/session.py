"""Assembles a tuning run from validated options: the job, config, space, proposer, study, runner.

The CLI only parses arguments into RunOptions and calls `tune()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.core.dsconfig import DsConfig
from autotune.core.errors import UserError
from autotune.core.extras import require
from autotune.core.noise import NOISE_MARGIN
from autotune.core.options import RunOptions
from autotune.core.space import SearchSpace
from autotune.study.store import Study
from autotune.trials.precision import check_precision
from autotune.tuning.builtin_job import BuiltinJob
from autotune.tuning.callbacks import LiveMetricsCallback, ProgressCallback
from autotune.tuning.display import ProgressDisplay
from autotune.tuning.job import TuningJob
from autotune.tuning.starting_point import baseline_config
from autotune.tuning.steps import TunerCallback
from autotune.tuning.tuner import Tuner, TuneResult, dump_space

if TYPE_CHECKING:
    from autotune.core.space import TrialConfig
    from autotune.core.summary import TrialSummary
    from autotune.trials.multinode import Cluster
    from autotune.tuning.proposers.base import Proposal
    from exporters.run_endpoints import RunEndpoints


def open_study(opts: RunOptions) -> tuple[Study, RunOptions]:
    """Create a new study, or reopen an existing one with the settings it was created with."""
    root = Path(opts.study)
    if (root / "study.db").exists():
        study = Study.open(root, create=False)
        stored = study.get_meta_json("settings")
        if stored is None:
            raise UserError(f"{root}: study has no stored settings; it is damaged or from another version")
        try:
            resumed = RunOptions.from_dict(stored)
        except (TypeError, ValueError, AttributeError):
            study.close()
            raise UserError(f"{root}: stored settings are not readable by this autotune (another "
                            "version?); start a new study with another --study") from None
        resumed.budget, resumed.resume = opts.budget, True
        resumed.trial_timeout = opts.trial_timeout or resumed.trial_timeout
        resumed.startup_timeout = opts.startup_timeout or resumed.startup_timeout
        resumed.full_budget = opts.full_budget  # whether to stop a converged search is this run's
        for name in ("metrics_port", "rank_metrics_port", "metrics_addr", "no_metrics"):
            setattr(resumed, name, getattr(opts, name))  # where to serve is this run's, not the study's
        return study, resumed
    if opts.resume:
        raise UserError(f"{root}: nothing to resume (no study.db); drop --resume to start a new study")
    return Study.open(root, create=True, meta={"settings": opts.to_dict()}), opts


def prepare(opts: RunOptions, job: TuningJob) -> tuple[DsConfig, SearchSpace]:
    """Validate, then build the starting config and the search space once, before the study
    folder is touched: a new study is never created with settings that cannot run."""
    job.validate(opts)
    base = job.base_config(opts)
    check_precision(base)  # a precision the devices lack would fail every trial alike
    job.check_config(opts, base)  # so would a config the job cannot run
    return base, job.space(opts, base)


def prepare_job(opts: RunOptions, command: list[str] | None, note: Callable[[str], None]) -> TuningJob:
    """The job a run tunes: the user's command (autotune/usercmd), or the built-in workload. The one
    place that tells them apart; from here on both are a TuningJob (autotune/tuning/job.py)."""
    if command:
        from autotune.usercmd.prepare import prepare_user_job

        return prepare_user_job(opts, command, note)  # sets the run's config, stages and dp
    return BuiltinJob()


def resumed_job(study: Study, job: TuningJob) -> TuningJob:
    """A study of a user's command resumed without the command finds it in the study."""
    from autotune.usercmd.prepare import resumed_user_job

    return resumed_user_job(study) or job


def tune(opts: RunOptions, display: ProgressDisplay | None = None, *,
         command: list[str] | None = None,
         at_end: Callable[[Study, Callable[[str], None]], object] | None = None) -> TuneResult:
    """`command`: the user's own training command (autotune/usercmd); None = the built-in workload.
    `at_end`: what the command writes once the run has ended (`autotune run`: report.html)."""
    require("tune", what="autotune run")  # before any trial: not N launcher_missing failures
    display = display or ProgressDisplay(budget=opts.budget)
    from autotune.trials import ext_locks

    ext_locks.PREFLIGHT.note = display.note  # what the pre-flight of every launch says goes to the run's output
    ext_locks.PREFLIGHT.wait_limit = opts.build_wait
    job = prepare_job(opts, command, display.note)
    base, space = prepare(opts, job)
    cluster = _cluster(opts, display)  # hostfile, slots, launcher, hosts: checked before the study
    study, stored = open_study(opts)
    exporter = None
    try:
        if stored is not opts:  # a resumed study runs the settings it was created with
            opts = stored
            job = resumed_job(study, job)
            base = job.base_config(opts)
            check_precision(base)  # ask again for the stored config, before anything is written
            cluster = _cluster(opts, display)
        space = job.space(opts, base)
        job.store(study)
        display.budget = opts.budget
        _store_meta(study, opts, space)
        from autotune.tuning.proposers.registry import make_proposer

        moves, fired = _rules_hooks()
        proposer = make_proposer(opts.tuner, space, seed=opts.seed, moves=moves, budget=opts.budget,
                                 study_root=opts.study)
        baseline = baseline_config(base, opts, space)
        wl = opts.workload
        wl.metrics_port = None if opts.no_metrics else opts.rank_metrics_port
        wl.metrics_addr = opts.metrics_addr
        display.note(f"study: {study.root}  |  {job.describe(opts)}  |  tuner: {opts.tuner}, budget {opts.budget}")
        display.note(f"space: {space.describe()}")
        exporter = _live_metrics(opts, display, study)
        from autotune.tuning import preload

        preload.start()  # the optimizer's and the report's imports, while the baseline starts its ranks
        runner = job.runner(opts, base, note=display.note, cluster=cluster)
        steps = job.steps(opts, base, space, root=study.root, note=display.note, cluster=cluster,
                          noise=float(getattr(proposer, "noise", NOISE_MARGIN)))
        if opts.trace_steps:
            from autotune.tuning.trace_step import TraceStep

            steps = [*steps, TraceStep(opts.trace_steps, study.root, every=opts.trace_every_trial)]
        callbacks: list[TunerCallback] = [ProgressCallback(display, study)]
        if exporter is not None:
            callbacks.append(LiveMetricsCallback(exporter))
        tuner = Tuner(study=study, runner=runner, space=space, proposer=proposer,
                      baseline=baseline, note=display.note, budget=opts.budget,
                      trial_timeout=opts.trial_timeout, startup_timeout=opts.startup_timeout,
                      rules_fired=fired, steps=steps, callbacks=callbacks, stop_early=not opts.full_budget,
                      at_end=at_end)
        try:
            return tuner.run()
        finally:
            runner.close()  # warm workers (autotune/trials/warm_pool.py) end with the run
    finally:
        if exporter is not None:
            exporter.close()
        study.close()


def _cluster(opts: RunOptions, display: ProgressDisplay) -> Cluster | None:
    """The nodes of a run with DeepSpeed launcher options (autotune/trials/multinode.py), else None."""
    from autotune.trials.multinode import resolve_cluster

    cluster = resolve_cluster(opts.workload.launcher_options(), opts.workload.world_size)
    if cluster is not None:
        how = f"multi-node through {cluster.options.launcher}" if cluster.multi_node else "one node"
        display.note(f"nodes: {cluster.describe()} ({how})")
        if cluster.multi_node and not opts.no_metrics and opts.metrics_addr.startswith("127."):
            display.note(f"rank metrics: every node's ranks bind {opts.metrics_addr}, where only that node can "
                         "scrape them; --metrics-addr 0.0.0.0 lets a Prometheus here scrape them all (the "
                         "targets file lists each rank under its node's hostfile name)")
    return cluster


def _store_meta(study: Study, opts: RunOptions, space: SearchSpace) -> None:
    import os

    # the controller's cores: the performance model's core sharing (autotune/model/step_model.py)
    study.set_meta_json({"budget": opts.budget, "space": dump_space(space),
                         "workload": dataclasses.asdict(opts.workload),
                         "host": {"cores": len(os.sched_getaffinity(0))}})


def _rules_hooks() -> tuple[Callable[[TrialSummary, TrialConfig, SearchSpace], list[Proposal]],
                            Callable[[TrialSummary], list[str]]]:
    """The advisor's moves (steer the hybrid) and fired-rule ids (for the report)."""
    from autotune.advisor.engine import evaluate
    from autotune.tuning.proposers.rule_moves import propose_moves

    def fired(summary: TrialSummary) -> list[str]:
        return sorted({f.rule_id for f in evaluate([summary]) if getattr(f, "fired", True)})

    return propose_moves, fired


def _live_metrics(opts: RunOptions, display: ProgressDisplay, study: Study) -> RunEndpoints | None:
    """The controller and rank endpoints (on by default) and STUDY/prometheus_targets.json."""
    if opts.no_metrics or (opts.metrics_port is None and opts.rank_metrics_port is None):
        return None
    from exporters.run_endpoints import start_run_endpoints

    return start_run_endpoints(job=opts.workload.job, addr=opts.metrics_addr, controller_port=opts.metrics_port,
                               rank_port=opts.workload.metrics_port, world_size=opts.workload.world_size,
                               folder=study.root, trial_dir=study.trial_dir, note=display.note)


