"""Running one trial of the built-in workload: write its ds_config and trial description,
launch the ranks through DeepSpeed's launcher (fresh) or hand the trial to warm workers
that stay alive between trials (autotune/trials/warm_pool.py), hand the ending to autotune/trials/judge.py."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.core.dsconfig import DsConfig
from autotune.core.faults import CONTROLLER_FAULTS, RANK_FAULTS
from autotune.core.options import WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.core.step_budget import RECORD_NAME as STEP_RECORD
from autotune.rank.workload.trial_spec import SPEC_NAME, TrialSpec, describe_workload
from autotune.trials.contract import TrialRequest
from autotune.trials.judge import TrialOutcome, failed, judge
from autotune.trials.launcher import (
    TORCH_TRAIN_SCRIPT,
    TORCHRUN,
    LaunchSpec,
    TrialProcess,
    free_port,
    run_launch,
)
from autotune.trials.multinode import Cluster, cluster_args, node_env, rendezvous_env, stop_on_nodes
from autotune.trials.warm_pool import WarmWorkers, fresh_reason


class BuiltinRunner:
    """Trials of the built-in workload in fresh processes: each trial launches its ranks through
    DeepSpeed's launcher (or the cluster's) and ends them. The fresh runner of the trial contract."""

    def __init__(self, workload: WorkloadOptions, base_config: DsConfig, *,
                 launcher: list[str] | None = None, cluster: Cluster | None = None) -> None:
        self.workload = workload
        self.base_config = base_config
        self.launcher = launcher
        self.cluster = cluster
        """Where the ranks run (autotune/trials/multinode.py); None: this machine, stages x dp ranks."""
        self._cluster_args = cluster_args(cluster) if cluster is not None else None

    def begin_close(self) -> None:
        """Nothing outlives a fresh trial."""

    def close(self) -> None:
        """Nothing outlives a fresh trial."""

    def ds_config_for(self, config: TrialConfig) -> dict[str, Any]:
        return self.base_config.with_trial(
            micro_batch_size=config.micro_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            data_parallel_size=self.workload.data_parallel_size,
            reduce_bucket_size=config.reduce_bucket_size,
            activation_checkpoint_interval=config.activation_checkpoint_interval,
        ).to_dict()

    def workload_for(self, request: TrialRequest) -> WorkloadOptions:
        """The workload with what the setting steps asked of this trial (parts, layer-cost hooks)."""
        changes: dict[str, Any] = {}
        if request.layer_costs is not None:
            changes["layer_costs"] = request.layer_costs
        if request.parts is not None:
            from autotune.rank.pipeline_parts import method_for

            changes["partition_method"] = method_for(request.parts)
        if "schedule" in request.knob_values:  # the schedule sweep (--engine torch, autotune/tuning/builtin_job.py)
            changes["schedule"] = request.knob_values["schedule"]
        return dataclasses.replace(self.workload, **changes) if changes else self.workload

    def describe(self, request: TrialRequest, trial_dir: Path) -> TrialSpec:
        """What the trial's ranks are told (written as trial-NNN/trial.json)."""
        workload = self.workload_for(request)
        fault = workload.fault_for(request.number)
        incumbent = request.incumbent
        spec = describe_workload(workload, trial=request.number, trial_dir=str(trial_dir),
                                 ds_config=str(trial_dir / "ds_config.json"),
                                 fault=fault if fault in RANK_FAULTS else None,  # a runner fault stays here
                                 incumbent=(incumbent.samples_per_second, incumbent.noise) if incumbent else None,
                                 limits=request.stall.to_dict() if request.stall is not None else None)
        spec.plan.trace_steps = request.trace_steps
        return spec

    def _prepare(self, request: TrialRequest) -> tuple[Path, dict[str, Any]]:
        """The trial folder with its ds_config.json and trial.json; the ds_config."""
        ds_config = self.ds_config_for(request.config)
        trial_dir, _ = prepare_trial_dir(request.trial_dir, ds_config)
        self.describe(request, trial_dir).write(trial_dir / SPEC_NAME)
        return trial_dir, ds_config

    def run(self, request: TrialRequest) -> TrialOutcome:
        trial_dir, _ = self._prepare(request)
        return self._run_fresh(request, trial_dir)

    def _run_fresh(self, request: TrialRequest, trial_dir: Path) -> TrialOutcome:
        fault = self.workload.fault_for(request.number)
        spec = LaunchSpec(num_ranks=self.workload.world_size, script_args=["--trial-spec", str(trial_dir / SPEC_NAME)],
                          log_path=trial_dir / "launcher.log", timeout=request.timeout)
        if self.launcher is not None:
            spec.launcher = list(self.launcher)
        if self.workload.engine == "torch":  # torchrun starts the ranks; no DeepSpeed op to build first
            spec.launcher, spec.script, spec.preflight = list(TORCHRUN), TORCH_TRAIN_SCRIPT, None
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

        def stop_on_other_nodes(proc: TrialProcess) -> None:
            if cluster is not None:
                stop_on_nodes(cluster, str(trial_dir), master_port=proc.master_port)

        outcome = run_launch(TrialProcess(spec), on_start=request.on_start, after_stop=stop_on_other_nodes)
        return judge(outcome, trial_dir, request.timeout)


class WarmRunner(BuiltinRunner):
    """Trials of the built-in workload in warm workers kept alive between trials
    (autotune/trials/warm_pool.py); a trial a warm process cannot be trusted with runs fresh, and the
    run says why once. The warm runner of the trial contract."""

    def __init__(self, workload: WorkloadOptions, base_config: DsConfig, *,
                 launcher: list[str] | None = None, note: Callable[[str], None] | None = None) -> None:
        super().__init__(workload, base_config, launcher=launcher)
        self.warm = WarmWorkers(workload.world_size, launcher=launcher, note=note)

    def begin_close(self) -> None:
        """No trial follows: warm workers start exiting now (see `WarmWorkers.begin_close`)."""
        self.warm.begin_close()

    def close(self) -> None:
        self.warm.close()

    def _fresh_because(self, fault: str | None, ds_config: dict[str, Any]) -> str | None:
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


TORCH_IS_FRESH = "the torch engine's trials run in fresh processes (torchrun per trial; no warm pool yet)"
MULTI_NODE_IS_FRESH = ("DeepSpeed launcher options (--hostfile, ...) are given: every trial runs in fresh "
                       "processes")


def builtin_runner(workload: WorkloadOptions, base_config: DsConfig, *, launcher: list[str] | None = None,
                   note: Callable[[str], None] | None = None, cluster: Cluster | None = None) -> BuiltinRunner:
    """The built-in workload's runner: warm workers where the study asks for them and the ranks run on
    this machine (a pool is launched with --num_gpus here), else fresh processes."""
    if workload.workers != "warm":
        return BuiltinRunner(workload, base_config, launcher=launcher, cluster=cluster)
    if workload.engine == "torch":
        (note or print)(f"      warm workers: {TORCH_IS_FRESH}")
        return BuiltinRunner(workload, base_config, launcher=launcher, cluster=cluster)
    if cluster is not None:
        (note or print)(f"      warm workers: {MULTI_NODE_IS_FRESH}")
        return BuiltinRunner(workload, base_config, launcher=launcher, cluster=cluster)
    return WarmRunner(workload, base_config, launcher=launcher, note=note)


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


