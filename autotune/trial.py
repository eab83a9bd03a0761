"""Running one trial of the built-in workload: write its ds_config and trial description,
launch the ranks through DeepSpeed's launcher (fresh) or hand the trial to warm workers
that stay alive between trials (autotune/workers.py), hand the ending to autotune/judge.py."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from autotune.dsconfig import DsConfig
from autotune.faults import CONTROLLER_FAULTS, RANK_FAULTS
from autotune.judge import TrialOutcome, failed, judge
from autotune.launcher import LaunchOutcome, LaunchSpec, TrialProcess
from autotune.multinode import Cluster, cluster_args, node_env, stop_on_nodes
from autotune.options import WorkloadOptions
from autotune.space import TrialConfig
from autotune.step_budget import RECORD_NAME as STEP_RECORD
from autotune.watchdog import StallLimits
from autotune.workers import WarmWorkers, fresh_reason
from autotune.workload.trial_spec import SPEC_NAME, TrialSpec, describe_workload


class TrialRunner:
    """Runs trials of one workload; `on_start` receives the process (to record its group id)."""

    def __init__(self, workload: WorkloadOptions, base_config: DsConfig, *,
                 launcher: list[str] | None = None, note: Callable[[str], None] | None = None,
                 cluster: Cluster | None = None) -> None:
        self.workload = workload
        self.base_config = base_config
        self.launcher = launcher
        self.cluster = cluster
        """Where the ranks run (autotune/multinode.py); None: this machine, stages x dp ranks."""
        self._cluster_args = cluster_args(cluster) if cluster is not None else None
        self.warm: WarmWorkers | None = None
        if workload.workers == "warm":
            self.warm = WarmWorkers(workload.world_size, launcher=launcher, note=note)

    def begin_close(self) -> None:
        """No trial follows: warm workers start exiting now (see `WarmWorkers.begin_close`)."""
        if self.warm is not None:
            self.warm.begin_close()

    def close(self) -> None:
        """Stop the warm workers, if any (the end of a run)."""
        if self.warm is not None:
            self.warm.close()

    def _fresh_because(self, fault: str | None, ds_config: dict) -> str | None:
        """Why this trial runs in fresh processes although the study asks for warm workers."""
        if self.cluster is not None:  # the pool is launched with --num_gpus on this machine only
            return "DeepSpeed launcher options (--hostfile, ...) are given: every trial runs in fresh processes"
        if fault in CONTROLLER_FAULTS:
            return f"the injected fault {fault!r} is a launch fault: this trial runs in fresh processes"
        why = fresh_reason(ds_config, self.workload.activation_checkpoint_interval)
        if why and not fresh_reason(self.base_config.to_dict(), self.workload.activation_checkpoint_interval):
            return f"{why}: the checkpoint step's trials run in fresh processes"  # the others stay warm
        return f"{why}: every trial runs in fresh processes" if why else None

    def ds_config_for(self, config: TrialConfig) -> dict:
        return self.base_config.with_trial(
            micro_batch_size=config.micro_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            data_parallel_size=self.workload.data_parallel_size,
            reduce_bucket_size=config.reduce_bucket_size,
            activation_checkpoint_interval=config.activation_checkpoint_interval,
        ).to_dict()

    def describe(self, number: int, trial_dir: Path, incumbent: tuple[float, float] | None = None,
                 stall: StallLimits | None = None) -> TrialSpec:
        """What trial `number`'s ranks are told (written as trial-NNN/trial.json); `incumbent`:
        (samples/s, noise) a trial must plausibly beat not to be stopped early."""
        fault = self.workload.fault_for(number)
        return describe_workload(self.workload, trial=number, trial_dir=str(trial_dir),
                                 ds_config=str(trial_dir / "ds_config.json"),
                                 fault=fault if fault in RANK_FAULTS else None,  # a runner fault stays here
                                 incumbent=incumbent, limits=stall.to_dict() if stall is not None else None)

    def run(self, number: int, config: TrialConfig, trial_dir: Path, *, timeout: float,
            on_start: Callable[[TrialProcess], None] | None = None,
            incumbent: tuple[float, float] | None = None, stall: StallLimits | None = None) -> TrialOutcome:
        """`stall`: each rank's start-up and step limits (autotune/watchdog.py); None: no watchdog."""
        trial_dir, ds_path = prepare_trial_dir(trial_dir, self.ds_config_for(config))
        fault = self.workload.fault_for(number)
        description = self.describe(number, trial_dir, incumbent, stall)
        spec = LaunchSpec(
            num_ranks=self.workload.world_size,
            script_args=["--trial-spec", str(description.write(trial_dir / SPEC_NAME))],
            log_path=trial_dir / "launcher.log", timeout=timeout,
        )
        if self.launcher is not None:
            spec.launcher = list(self.launcher)
        spec.cluster_args = self._cluster_args
        multi_node = self.cluster is not None and self.cluster.multi_node
        if multi_node:  # the other nodes' ranks get their environment through DeepSpeed's env file
            spec.env.update(node_env(trial_dir))
        if fault == "nolauncher":
            spec.launcher = [str(trial_dir / "no-such-launcher")]
        elif fault == "noscript":
            spec.script = trial_dir / "no-such-train.py"
        if self.warm is not None:
            ds_config = json.loads(ds_path.read_text(encoding="utf-8"))
            why = self._fresh_because(fault, ds_config)
            if why is None:
                outcome = self.warm.run(trial_dir / SPEC_NAME, trial_dir, ds_config, timeout, on_start)
                return judge(outcome, trial_dir, timeout) if outcome.launch_error is None else \
                    failed("launcher_missing", outcome.launch_error, 0.0)
            self.warm.say_once(f"      warm workers: {why}")
            self.warm.close()  # a fresh trial's processes and a pool's do not share the cores
        if not spec.script.is_file():
            detail = f"training script {spec.script} not found; reinstall autotune"
            spec.log_path.write_text(detail + "\n", encoding="utf-8")
            return failed("launcher_missing", detail, 0.0)
        proc = TrialProcess(spec)
        try:
            error = proc.start()
            if error is not None:
                spec.log_path.write_text(error + "\n", encoding="utf-8")
                return failed("launcher_missing", error, 0.0)
            if on_start is not None:
                on_start(proc)
            rc, timed_out = proc.wait()
        finally:
            proc.stop(grace=2.0)  # ranks the launcher left behind, or a Ctrl-C: the whole group goes
            if multi_node:  # ranks on the nodes are sshd's children, not in the launcher's group
                stop_on_nodes(self.cluster, str(trial_dir), master_port=proc.master_port)
        outcome = LaunchOutcome(returncode=rc, timed_out=timed_out,
                                wall_seconds=time.monotonic() - proc.started, log_path=spec.log_path)
        return judge(outcome, trial_dir, timeout)


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


