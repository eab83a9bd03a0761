"""One trial of the user's own command: write its ds_config, launch the command, classify the end.

The user-command runner of the trial contract (autotune/trials/contract.py: the tuner
cannot tell it from the built-in workload's runners), with the same trial folder:
ds_config.json, launcher.log, metrics-rankR.csv. The ranks are instrumented by the bootstrap (hook.py), whose
marker files add three reasons to autotune.trials.judge.judge's classification:

- `unknown_engine`: deepspeed.initialize returned something that is not a DeepSpeed engine (a
  PipelineEngine, or a plain DeepSpeedEngine with ZeRO, which the bootstrap times by its
  optimizer steps: autotune/rank/step_boundary.py);
- `no_engine`: the script exited 0 without ever calling deepspeed.initialize;
- `ended_early`: the script returned by itself before the trial's warm-up + measured steps.

Everything else (oom, killed, timeout, crash, no_metrics, ...) is judged as for the
built-in workload.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.core.dsconfig import DsConfig, with_swept
from autotune.core.rank_plan import RankPlan, RankSettings
from autotune.core.space import TrialConfig
from autotune.rank.hook import ENV, FILE_ENV, MODE_PROBE, MODE_TRIAL, BootstrapSettings
from autotune.rank.watchdog import StallLimits
from autotune.trials.builtin import prepare_trial_dir
from autotune.trials.contract import TrialRequest, plan_for, trial_ds_config
from autotune.trials.judge import TrialOutcome, failed, judge
from autotune.trials.launcher import LaunchOutcome, LaunchSpec, TrialProcess, free_port, run_launch
from autotune.trials.multinode import (
    Cluster,
    node_env,
    rendezvous_env,
    resolve_cluster,
    stop_on_other_nodes,
)
from autotune.usercmd.command import UserCommand

if TYPE_CHECKING:
    from autotune.core.knob import Knob
    from autotune.usercmd.hf_trainer import TrainerConfig

BOOTSTRAP_DIR = Path(__file__).resolve().parent.parent / "rank" / "bootstrap"
PROBE_TIMEOUT = 900.0
"""Seconds for the start-up shape probe (a first run may compile DeepSpeed's CPU ops)."""


class CommandProcess(TrialProcess):
    """TrialProcess (process group, timeout, clean-up, /dev/shm by port) running the user's command.

    Only `start` differs: launcher.build_command writes autotune's own script and
    `--no_local_rank`, and a user's script may need `--local_rank`.
    """

    def __init__(self, spec: LaunchSpec, command: UserCommand, ds_config: Path | None, cwd: Path, *,
                 master_port: int | None = None) -> None:
        super().__init__(spec)
        self.command, self.ds_config, self.cwd = command, ds_config, cwd
        self.own_port = master_port
        """The job's own --master_port (`autotune watch` keeps it); None: a free port."""

    def start(self) -> str | None:
        env = self.launch_env(own_tools=False)  # the user's `deepspeed` is the one their PATH names
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.master_port = self.own_port or free_port()
        argv = self.command.argv_for(self.ds_config, self.master_port)
        log = open(self.spec.log_path, "wb")
        try:
            self.proc = subprocess.Popen(argv, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        except OSError as exc:
            return f"cannot start the launcher {argv[0]!r}: {exc.strerror}"
        finally:
            log.close()
        return None


def rank_env(settings: BootstrapSettings) -> dict[str, str]:
    """The bootstrap first on the ranks' path, and what it should do."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": str(BOOTSTRAP_DIR) + (os.pathsep + path if path else ""),
            ENV: settings.to_env()}


def multi_node_command(command: UserCommand, settings: BootstrapSettings, run_dir: Path, spec: LaunchSpec,
                       *, cwd: Path) -> tuple[UserCommand, Cluster | None]:
    """A command that names several nodes: the settings go to the nodes' ranks by file and their
    environment by DeepSpeed's env file (`spec.env` points at it, and `spec.master_port` is the
    port the file names where the runner sets no master); the cluster, else None."""
    cluster = resolve_cluster(command.cluster_options(), None, check_hosts=False)  # checked before
    if cluster is None or not cluster.multi_node:
        return command, None
    settings_file = run_dir / "bootstrap-settings.json"
    settings_file.write_text(settings.to_env(), encoding="utf-8")
    command = command.for_cluster(cluster)
    spec.master_port = free_port()
    rendezvous = rendezvous_env(cluster, list(command.launcher_args), spec.master_port)
    spec.env.update(node_env(run_dir, cluster, {FILE_ENV: str(settings_file), **rendezvous}, cwd=cwd,
                             own_tools=False))
    return command, cluster


def launch(command: UserCommand, *, ds_config: Path | None, cwd: Path, run_dir: Path, settings: BootstrapSettings,
           timeout: float, on_start: Callable[[TrialProcess], None] | None = None) -> LaunchOutcome:
    spec = LaunchSpec(num_ranks=0, script_args=[], log_path=run_dir / "launcher.log", timeout=timeout,
                      env=rank_env(settings), launcher=list(command.prefix))
    command, cluster = multi_node_command(command, settings, run_dir, spec, cwd=cwd)
    return run_launch(CommandProcess(spec, command, ds_config, cwd, master_port=spec.master_port), on_start=on_start,
                      after_stop=stop_on_other_nodes(cluster, str(run_dir)))


def read_markers(run_dir: Path, kind: str) -> list[dict]:
    out = []
    for p in sorted(run_dir.glob(f"{kind}-rank*.json")):
        try:
            out.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return out


def judge_user_trial(outcome: LaunchOutcome, run_dir: Path, timeout: float, *, steps_needed: int) -> TrialOutcome:
    """The bootstrap's markers first (what only it can tell), then the built-in classification."""
    wall = outcome.wall_seconds
    if outcome.launch_error is not None:
        return judge(outcome, run_dir, timeout)
    engines = read_markers(run_dir, "engine")
    other = next((e for e in engines if e.get("deepspeed") is False and not e.get("torch_pipelining")), None)
    if other is not None:
        return failed("unknown_engine", f"deepspeed.initialize returned a {other.get('engine')}, not a DeepSpeed "
                                         "engine; autotune tunes DeepSpeed's engines", wall)
    if outcome.timed_out and not engines:
        return failed("timeout", f"no result within {timeout:.0f} s, and the script had not returned "
                                  "from deepspeed.initialize; every rank was stopped", wall)
    if not outcome.timed_out and outcome.returncode == 0:
        if not engines:
            return failed("no_engine", "the script exited without calling deepspeed.initialize", wall)
        exits = read_markers(run_dir, "exit")
        calls = min((int(e.get("train_batch_calls", 0)) for e in exits), default=0)
        if exits and not read_markers(run_dir, "done") and calls < steps_needed:  # adaptive: the minimum counts
            return failed("ended_early", f"the script returned after {calls} train_batch() call(s); a trial "
                                          f"needs {steps_needed} (warm-up + measured steps): let it run "
                                          "more steps (e.g. a larger --steps of its own)", wall)
    return judge(outcome, run_dir, timeout)


@dataclass(kw_only=True, slots=True)
class PipelineShape:
    """What the engine says about the job (measured, not asked of the user)."""

    stages: int
    data_parallel_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    parameters: int
    """The whole model's parameters: each stage's counted once (a plain engine's replica: all of them)."""
    pipeline: bool = True
    """False: a plain DeepSpeedEngine (stages 1, every rank a replica)."""
    zero_stage: int = 0
    script_config: dict | None = None
    """What the script handed `deepspeed.initialize` (rank 0's `config-rank0.json` marker,
    autotune/rank/hook.py `script_config`): `source` code, path, args or none."""
    torch_pipelining: dict | None = None
    """A torch.distributed.pipelining script: what its ranks' schedules said at their first step
    (`schedule`, `n_microbatches`, `step_batch`, `num_stages`, `stage_sets`: each rank's stages,
    and `text`: the job in words); None: a DeepSpeed engine's job."""


def probe_shape(command: UserCommand, *, ds_config: Path | None, cwd: Path, timeout: float = PROBE_TIMEOUT,
                startup_timeout: float | None = None) -> tuple[PipelineShape | None, TrialOutcome | None, Path]:
    """Start the job once, up to deepspeed.initialize, to read stages and dp from its engine.

    Its ranks' start-up has the limit of a first trial (autotune/trials/limits.py): a start-up
    that stalls is a `hang` within that, not the whole timeout.
    Returns (shape, None, folder) or (None, the classified failure, folder with its log).
    """
    from autotune.trials.limits import STARTUP_BEFORE_MEASURED

    run_dir = Path(tempfile.mkdtemp(prefix="autotune-probe-"))
    stall = StallLimits(startup_seconds=startup_timeout or STARTUP_BEFORE_MEASURED)
    settings = BootstrapSettings(mode=MODE_PROBE, plan=RankPlan(trial_dir=str(run_dir), limits=stall.to_dict()))
    outcome = launch(command, ds_config=ds_config, cwd=cwd, run_dir=run_dir, settings=settings,
                     timeout=timeout)
    engines = read_markers(run_dir, "engine")
    done = read_markers(run_dir, "done")
    if outcome.returncode == 0 and not outcome.timed_out and engines and done:
        first = engines[0]
        pipeline = bool(first.get("pipeline"))
        per_stage = {e["stage"]: e["parameters"] for e in engines if e.get("pipeline")}
        return PipelineShape(stages=first["stages"], data_parallel_size=first["dp"],
                             micro_batch_size=first["micro_batch_size"],
                             gradient_accumulation_steps=first["gradient_accumulation_steps"],
                             parameters=sum(per_stage.values()) if pipeline else int(first["parameters"]),
                             pipeline=pipeline, zero_stage=int(first.get("zero_stage", 0)),
                             script_config=next(iter(read_markers(run_dir, "config")), None)), None, run_dir
    from autotune.rank.torch_schedule_probe import MARKER

    schedules = read_markers(run_dir, MARKER)
    if schedules and not engines:  # the script pipelines with torch, not DeepSpeed (autotune/usercmd/torch_job.py)
        return torch_shape(schedules), None, run_dir
    failure = judge_user_trial(outcome, run_dir, timeout, steps_needed=0)
    if failure.result.ok:  # exit 0 with metrics but no done marker: cannot happen in probe mode
        failure = failed("crash", "the start-up check ended without reaching deepspeed.initialize", 0.0)
    return None, failure, run_dir


def torch_shape(markers: list[dict]) -> PipelineShape:
    """A torch pipelining script's shape from its ranks' schedule markers (every rank reports at its
    first step: autotune/rank/torch_schedule_probe.py `describe`, `summarize`)."""
    from autotune.rank.torch_schedule_probe import job_text, summarize

    job = summarize(markers)
    batch, n = job["step_batch"], job["n_microbatches"]
    return PipelineShape(stages=job["pipeline_ranks"], data_parallel_size=job["data_parallel"],
                         micro_batch_size=batch // n if batch and n else 0, gradient_accumulation_steps=n,
                         parameters=job["parameters"], torch_pipelining={**job, "text": job_text(markers)})


class UserCommandRunner:
    """Runs trials of the user's command: the user-command runner of the trial contract
    (autotune/trials/contract.py). Each trial launches the command as typed, with autotune's
    ds_config in it, and its ranks instrumented by the bootstrap."""

    def __init__(self, command: UserCommand, base_config: DsConfig, *, cwd: Path, data_parallel_size: int,
                 steps: int, warmup_steps: int, job: str = "autotune", metrics_port: int | None = None,
                 metrics_addr: str = "127.0.0.1", layer_costs: bool = False, parts: list[int] | None = None,
                 step_length: tuple[bool, float, int] = (False, 0.03, 0), knobs: list[Knob] | None = None,
                 cluster: Cluster | None = None, config_knobs: frozenset[str] = frozenset(),
                 trainer: TrainerConfig | None = None) -> None:
        self.command, self.base_config, self.cwd = command, base_config, cwd
        self.data_parallel_size = data_parallel_size
        self.steps, self.warmup_steps = steps, warmup_steps
        self.job, self.metrics_port, self.metrics_addr = job, metrics_port, metrics_addr
        self.layer_costs = layer_costs
        """Time every layer of the job's PipelineModule (--layer-costs)."""
        self.parts = parts
        """Stage boundaries the job's PipelineModule is built with (--partition-method parts:...)."""
        self.step_length = step_length
        """(adaptive, precision, cap of measured steps): how long each trial measures (autotune/core/step_budget.py)."""
        self.knobs: list[Knob] = list(knobs or [])
        """The model settings mapped to the script's flags (--knob, usercmd/knobs.py)."""
        self.cluster = cluster
        """Where the ranks run when the command names nodes (resume clean-up reads it)."""
        self.config_knobs = config_knobs
        """The ds_config settings a setting step sweeps, by dotted path (a plain engine's ZeRO sweep):
        a request's value of one of these is set in the trial's config (`with_settings`)."""
        self.trainer = trainer
        """An HF Trainer job: each trial's batch goes in the Trainer's arguments, and its config keeps
        the user's "auto" values (autotune/usercmd/hf_trainer.py); None: the config carries the batch."""

    def begin_close(self) -> None:
        """Nothing outlives a trial of the user's command."""

    def close(self) -> None:
        """Nothing outlives a trial of the user's command."""

    def ds_config_for(self, config: TrialConfig) -> dict[str, object]:
        """The user's own config where it would run exactly this trial, else it with the trial's values
        (an HF Trainer's: with the user's "auto" values where the trial keeps them)."""
        ds_config = trial_ds_config(self.base_config, config, self.data_parallel_size, own_when_unchanged=True)
        return self.trainer.trial_file(ds_config) if self.trainer is not None else ds_config

    def settings_for(self, request: TrialRequest, trial_dir: Path) -> BootstrapSettings:
        """What the trial's ranks are told (through the bootstrap's environment or file); a script
        that builds its config in code is handed the trial's at `deepspeed.initialize`."""
        return BootstrapSettings(mode=MODE_TRIAL, plan=plan_for(request, trial_dir, self.rank_settings),
                                 ds_config=str(trial_dir / "ds_config.json") if self.command.config_in_code else None)

    @property
    def rank_settings(self) -> RankSettings:
        """This runner's own part of every trial's plan."""
        adaptive, precision, cap = self.step_length
        return RankSettings(warmup_steps=self.warmup_steps, steps=self.steps, adaptive_steps=adaptive,
                            step_precision=precision, max_steps=cap, metrics_port=self.metrics_port,
                            metrics_addr=self.metrics_addr, job=self.job, layer_costs=self.layer_costs,
                            parts=self.parts)

    def run(self, request: TrialRequest) -> TrialOutcome:
        # a swept setting the config already runs is not written: trial 0 runs the user's own file
        ds_config = with_swept(self.ds_config_for(request.config),
                               {k: v for k, v in request.knob_values.items() if k in self.config_knobs})
        trial_dir, ds_path = prepare_trial_dir(
            request.trial_dir, ds_config, stale=("engine-rank*.json", "done-rank*.json", "exit-rank*.json"))
        settings = self.settings_for(request, trial_dir)
        command = self.command
        if self.trainer is not None:  # the Trainer fills the config's batch from these arguments
            from autotune.usercmd.hf_trainer import with_batch

            command = dataclasses.replace(command, script_args=with_batch(
                command.script_args, request.config.micro_batch_size, request.config.gradient_accumulation_steps))
        if request.knob_values:  # what the trial's knobs ran (the result file of a torch job reads it)
            from autotune.usercmd.knobs import TRIAL_FILE

            (trial_dir / TRIAL_FILE).write_text(json.dumps(request.knob_values) + "\n", encoding="utf-8")
        if self.knobs:  # the script's own flags for the mapped model settings (usercmd/knobs.py)
            from autotune.usercmd.knobs import apply_knobs

            command = apply_knobs(command, request.knob_values, self.knobs)
        outcome = launch(command, ds_config=ds_path, cwd=self.cwd, run_dir=trial_dir,
                         settings=settings, timeout=request.timeout, on_start=request.on_start)
        return judge_user_trial(outcome, trial_dir, request.timeout, steps_needed=settings.total_steps)
