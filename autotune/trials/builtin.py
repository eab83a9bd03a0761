"""Running one trial of the built-in workload: write its ds_config and trial description,
launch the ranks through DeepSpeed's launcher (fresh) or hand the trial to warm workers
that stay alive between trials (autotune/trials/warm_pool.py), hand the ending to autotune/trials/judge.py."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from autotune.core.dsconfig import DsConfig, with_swept
from autotune.core.faults import CONTROLLER_FAULTS, RANK_FAULTS
from autotune.core.options import WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.core.step_budget import RECORD_NAME as STEP_RECORD
from autotune.rank.workload.trial_spec import SPEC_NAME, TrialSpec, workload_settings
from autotune.trials.contract import TrialRequest, plan_for, trial_ds_config
from autotune.trials.judge import TrialOutcome, failed, judge
from autotune.trials.launcher import (
    DEEPSPEED_LAUNCH,
    LaunchSpec,
    RankLaunch,
    TrialProcess,
    free_port,
    run_launch,
)
from autotune.trials.multinode import (
    Cluster,
    cluster_args,
    node_env,
    rendezvous_env,
    stop_on_other_nodes,
)
from autotune.trials.warm_pool import WarmWorkers, fresh_reason

TEXT_WORKLOAD_FIELDS = frozenset(f.name for f in dataclasses.fields(WorkloadOptions) if f.type in ("str", str))
"""The workload options a knob value (a string) can set."""


class BuiltinRunner:
    """Trials of the built-in workload in fresh processes: each trial launches its ranks through
    its engine's launch (DeepSpeed's launcher or the cluster's by default, autotune/engines/) and
    ends them. The fresh runner of the trial contract."""

    def __init__(self, workload: WorkloadOptions, base_config: DsConfig, *,
                 launcher: list[str] | None = None, cluster: Cluster | None = None,
                 launch: RankLaunch = DEEPSPEED_LAUNCH, workload_knobs: frozenset[str] = frozenset(),
                 config_knobs: frozenset[str] = frozenset()) -> None:
        unknown = workload_knobs - TEXT_WORKLOAD_FIELDS
        if unknown:
            raise ValueError(f"workload knobs {sorted(unknown)} are not text options of the workload")
        self.workload = workload
        self.base_config = base_config
        self.launcher = launcher
        """A launcher command in place of the launch's own (tests: a launcher that fails on purpose)."""
        self.launch = launch
        """How the engine's ranks start (its engine's, autotune/engines/)."""
        self.workload_knobs = workload_knobs
        """The workload options the engine's setting steps sweep as knobs (the torch engine's
        schedule): a request's knob value of one of these names sets it for that trial."""
        self.config_knobs = config_knobs
        """The ds_config settings the engine's setting steps sweep as knobs, by dotted path (the ZeRO
        engine's `zero_optimization.stage`): a request's knob value of one of these sets it in the
        trial's ds_config.json (autotune/core/dsconfig.py `with_swept`)."""
        self.cluster = cluster
        """Where the ranks run (autotune/trials/multinode.py); None: this machine, stages x dp ranks."""
        self._cluster_args = cluster_args(cluster) if cluster is not None else None

    def begin_close(self) -> None:
        """Nothing outlives a fresh trial."""

    def close(self) -> None:
        """Nothing outlives a fresh trial."""

    def ds_config_for(self, config: TrialConfig) -> dict[str, object]:
        return trial_ds_config(self.base_config, config, self.workload.data_parallel_size)

    def workload_for(self, request: TrialRequest) -> WorkloadOptions:
        """The workload with what the setting steps asked of this trial (parts, layer-cost hooks,
        and the workload options an engine's setting step sweeps by name: the torch engine's schedule)."""
        swept = {k: v for k, v in request.knob_values.items() if k in self.workload_knobs}
        if request.layer_costs is None and request.parts is None and not swept:
            return self.workload
        workload = copy.copy(self.workload)
        if request.layer_costs is not None:
            workload.layer_costs = request.layer_costs
        if request.parts is not None:
            from autotune.rank.pipeline_parts import method_for

            workload.partition_method = method_for(request.parts)
        for name, value in swept.items():
            setattr(workload, name, value)
        return workload

    def describe(self, request: TrialRequest, trial_dir: Path) -> TrialSpec:
        """What the trial's ranks are told (written as trial-NNN/trial.json)."""
        workload = self.workload_for(request)
        fault = workload.fault_for(request.number)
        return TrialSpec(plan=plan_for(request, trial_dir, workload_settings(workload)), workload=workload,
                         ds_config=str(trial_dir / "ds_config.json"),
                         fault=fault if fault in RANK_FAULTS else None)  # a runner fault stays here

    def _prepare(self, request: TrialRequest) -> tuple[Path, dict[str, object]]:
        """The trial folder with its ds_config.json and trial.json; the ds_config."""
        ds_config = with_swept(self.ds_config_for(request.config),
                               {k: v for k, v in request.knob_values.items() if k in self.config_knobs})
        trial_dir, _ = prepare_trial_dir(request.trial_dir, ds_config)
        self.describe(request, trial_dir).write(trial_dir / SPEC_NAME)
        return trial_dir, ds_config

    def run(self, request: TrialRequest) -> TrialOutcome:
        trial_dir, _ = self._prepare(request)
        return self._run_fresh(request, trial_dir)

    def _run_fresh(self, request: TrialRequest, trial_dir: Path) -> TrialOutcome:
        fault = self.workload.fault_for(request.number)
        launch = self.launch
        spec = LaunchSpec(num_ranks=self.workload.world_size, script_args=["--trial-spec", str(trial_dir / SPEC_NAME)],
                          log_path=trial_dir / "launcher.log", timeout=request.timeout,
                          launcher=list(self.launcher or launch.launcher), script=launch.script, style=launch.style)
        if not launch.builds_ops:  # e.g. torchrun's ranks: no DeepSpeed op to build first
            spec.preflight = None
        spec.cluster_args = self._cluster_args
        cluster = self.cluster if self.cluster is not None and self.cluster.multi_node else None
        if cluster is not None:  # the other nodes' ranks get their environment through DeepSpeed's env file
            spec.master_port = free_port()
            rendezvous = rendezvous_env(cluster, spec.cluster_args or [], spec.master_port)
            spec.env.update(node_env(trial_dir, cluster, rendezvous))
        if fault == "nolauncher":
            spec.launcher = [str(trial_dir / "no-such-launcher")]
        elif fault == "noscript":
            spec.script = trial_dir / "no-such-train.py"
        if not spec.script.is_file():
            detail = f"training script {spec.script} not found; reinstall autotune"
            spec.log_path.write_text(detail + "\n", encoding="utf-8")
            return failed("launcher_missing", detail, 0.0)
        outcome = run_launch(TrialProcess(spec), on_start=request.on_start,
                             after_stop=stop_on_other_nodes(cluster, str(trial_dir)))
        return judge(outcome, trial_dir, request.timeout)


class WarmRunner(BuiltinRunner):
    """Trials of the built-in workload in warm workers kept alive between trials
    (autotune/trials/warm_pool.py); a trial a warm process cannot be trusted with runs fresh, and the
    run says why once. The warm runner of the trial contract."""

    def __init__(self, workload: WorkloadOptions, base_config: DsConfig, *,
                 launcher: list[str] | None = None, note: Callable[[str], None] | None = None,
                 workload_knobs: frozenset[str] = frozenset(), config_knobs: frozenset[str] = frozenset()) -> None:
        super().__init__(workload, base_config, launcher=launcher, workload_knobs=workload_knobs,
                         config_knobs=config_knobs)
        self.warm = WarmWorkers(workload.world_size, launcher=launcher, note=note)

    def begin_close(self) -> None:
        """No trial follows: warm workers start exiting now (see `WarmWorkers.begin_close`)."""
        self.warm.begin_close()

    def close(self) -> None:
        self.warm.close()

    def _fresh_because(self, fault: str | None, ds_config: dict[str, object]) -> str | None:
        """Why this trial runs in fresh processes although the study asks for warm workers."""
        if fault in CONTROLLER_FAULTS:
            return f"the injected fault {fault!r} is a launch fault: this trial runs in fresh processes"
        interval = self.workload.activation_checkpoint_interval
        why = fresh_reason(ds_config, interval)
        if why and not fresh_reason(self.base_config.to_dict(), interval):
            return f"{why}: the checkpoint step's trials run in fresh processes"  # the others stay warm
        return f"{why}: every trial runs in fresh processes" if why else None

    def run(self, request: TrialRequest) -> TrialOutcome:
        trial_dir, ds_config = self._prepare(request)
        why = self._fresh_because(self.workload.fault_for(request.number), ds_config)
        if why is None:
            outcome = self.warm.run(trial_dir / SPEC_NAME, trial_dir, ds_config, request.timeout, request.on_start)
            return judge(outcome, trial_dir, request.timeout)
        self.warm.say_once(f"      warm workers: {why}")
        self.warm.close()  # a fresh trial's processes and a pool's do not share the cores
        return self._run_fresh(request, trial_dir)


MULTI_NODE_IS_FRESH = ("DeepSpeed launcher options (--hostfile, ...) are given: every trial runs in fresh "
                       "processes")


def builtin_runner(workload: WorkloadOptions, base_config: DsConfig, *, launcher: list[str] | None = None,
                   note: Callable[[str], None] | None = None, cluster: Cluster | None = None,
                   launch: RankLaunch = DEEPSPEED_LAUNCH, workload_knobs: frozenset[str] = frozenset(),
                   config_knobs: frozenset[str] = frozenset()) -> BuiltinRunner:
    """The built-in workload's runner: warm workers where the study asks for them, the engine's
    launch has them and the ranks run on this machine (a pool is launched with --num_gpus here),
    else fresh processes."""
    fresh = BuiltinRunner(workload, base_config, launcher=launcher, cluster=cluster, launch=launch,
                          workload_knobs=workload_knobs, config_knobs=config_knobs)
    if workload.workers != "warm":
        return fresh
    why = launch.warm_refusal or (MULTI_NODE_IS_FRESH if cluster is not None else None)
    if why is not None:
        (note or print)(f"      warm workers: {why}")
        return fresh
    return WarmRunner(workload, base_config, launcher=launcher, note=note, workload_knobs=workload_knobs,
                      config_knobs=config_knobs)


def prepare_trial_dir(trial_dir: Path, ds_config: dict, *, stale: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """The trial folder, absolute, cleared of an interrupted attempt's results (its CSVs and any
    `stale` patterns; its log kept aside), with the trial's ds_config.json written in it."""
    trial_dir = trial_dir.resolve()  # absolute in every command line: leftovers are found by it
    trial_dir.mkdir(parents=True, exist_ok=True)
    for pattern in ("metrics-rank*.csv", "layer-costs-rank*.csv", "hang-rank*.txt", "startup-rank*.json",
                    STEP_RECORD, *stale):  # a re-run after an interruption starts clean
        for old in trial_dir.glob(pattern):
            old.unlink()
    keep_old_log(trial_dir / "launcher.log")
    ds_path = trial_dir / "ds_config.json"
    ds_path.write_text(json.dumps(ds_config, indent=2) + "\n", encoding="utf-8")
    return trial_dir, ds_path


def keep_old_log(log: Path) -> None:
    """A re-run keeps the log of the interrupted attempt next to its own."""
    if not log.exists():
        return
    k = 1
    while (kept := log.with_name(f"launcher.interrupted-{k}.log")).exists():
        k += 1
    log.rename(kept)


