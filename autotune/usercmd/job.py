"""A study of the user's own command: what `autotune run -- COMMAND` adds to a tuning run.

For a new study, `prepare_user_job` (autotune/usercmd/prepare.py) reads the command, finds
and checks the user's config, and starts the job once up to `deepspeed.initialize` (the
shape probe, runner.py) to measure what the search space needs: pipeline
stages (1 for a plain DeepSpeedEngine with ZeRO), data-parallel size and the model's parameter count. The user repeats
no flag for them. It then points the run's options at the user's config and
shape, so the rest of `autotune run` (validation, space, proposer, study) is
the built-in workload's, unchanged.

Why a separate start-up rather than learning the shape from trial 0: the space
(and the proposer built on it) exists before trial 0 runs, and a job that
cannot be tuned at all (no DeepSpeed engine, a crash at import) is then one
clear error before a study is created or changed.

The command, its folder and what the probe read (parameter count, stages,
data-parallel size, micro-batch and GAS) are stored in the study (meta key
`user_command`), so a resume runs the same command without the probe, and
`describe_job` names the job in the run's header and every report.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from autotune.core.dsconfig import ZERO_SETTINGS, DsConfig, check_known_zero_keys, load_ds_config
from autotune.core.errors import ConfigError, UserError
from autotune.core.space import SearchSpace
from autotune.core.trainer_args import HF_TRAINER
from autotune.study.job_record import META_KEY, describe_job
from autotune.trials.multinode import resolve_cluster
from autotune.trials.precision import check_precision
from autotune.trials.user_command import (
    UserCommandRunner,
)
from autotune.usercmd.command import (
    UserCommand,
    parse_command,
)

if TYPE_CHECKING:
    from autotune.core.options import RunOptions
    from autotune.study.store import Study
    from autotune.trials.multinode import Cluster
    from autotune.tuning.steps import SettingStep


@dataclass(kw_only=True, slots=True)
class UserJob:
    """The user's command as a study stores it."""

    RUNNER: ClassVar[type[UserCommandRunner]] = UserCommandRunner
    """The trial runner of this kind of job (a torch pipelining script's: autotune/usercmd/torch_job.py)."""
    argv: list[str]
    cwd: str
    """The folder the command runs in (relative paths in it are the user's)."""
    parameters: int
    """The model's parameters (each stage once), measured by the shape probe."""
    pipeline_stages: int | None = None
    data_parallel_size: int | None = None
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    """What the start-up check read from the engine (None: a study stored before these fields)."""
    script_config: dict | None = None
    """The DeepSpeed config the script builds in code (the command names no file), as its start-up
    check read it at `deepspeed.initialize`: the baseline, and what every trial's config is made
    from; None: the command names the file (`--deepspeed_config`, or `{config}` with `--config`)."""
    built_by: str | None = None
    """The framework that builds the engine, as the start-up check found it on the stack
    (rank/hook.py `engine_builder`): "hf_trainer", "lightning"; None: the script itself."""
    filled_config: dict | None = None
    """An HF Trainer job: the config as the Trainer filled its "auto" values from its arguments, read
    at `deepspeed.initialize`: the computing baseline (the trials' files keep the "auto" values,
    autotune/usercmd/hf_trainer.py)."""

    @property
    def is_hf_trainer(self) -> bool:
        return self.built_by == HF_TRAINER and self.filled_config is not None

    @property
    def is_pipeline(self) -> bool:
        """False: the script builds a plain DeepSpeedEngine (one "stage", every rank a replica)."""
        return (self.pipeline_stages or 2) > 1

    def command(self) -> UserCommand:
        return parse_command(self.argv, cwd=Path(self.cwd))

    def command_text(self) -> str:
        return " ".join(self.argv)

    def describe(self, opts: RunOptions) -> str:
        """The job in words (the run's header): the command and what its start-up check read."""
        return describe_job(asdict(self), asdict(opts.workload))

    def runner(self, opts: RunOptions, base: DsConfig, *, note: Callable[[str], None] | None = None,
               cluster: Cluster | None = None) -> UserCommandRunner:
        """The command's own launcher options place its ranks (`cluster` is the built-in's)."""
        wl = opts.workload
        command, own_cluster = self.launch(opts)
        parts = None
        if wl.partition_method.startswith("parts:"):  # the job's own method is overridden (docs/partition.md)
            from autotune.core.partition import parse_parts

            parts = parse_parts(wl.partition_method[len("parts:"):])
        knobs = None
        if opts.knobs:  # the user's model settings mapped to their flags (usercmd/knobs.py)
            from autotune.usercmd.knobs import parse_knobs

            knobs = parse_knobs(opts.knobs)
        trainer = None
        if self.is_hf_trainer:  # its batch in its arguments, its "auto" values kept in each trial's file
            from autotune.usercmd.hf_trainer import TrainerConfig

            assert opts.config is not None  # a Trainer job names its file (--deepspeed FILE)
            trainer = TrainerConfig(own=load_ds_config(opts.config).raw, filled=dict(self.filled_config or {}))
        return self.RUNNER(command, base, cwd=Path(self.cwd), data_parallel_size=wl.data_parallel_size,
                                 steps=wl.steps, warmup_steps=wl.warmup_steps, job=wl.job,
                                 metrics_port=wl.metrics_port, metrics_addr=wl.metrics_addr,
                                 layer_costs=wl.layer_costs, parts=parts, knobs=knobs,
                                 step_length=(wl.adaptive_steps, wl.step_precision, wl.step_cap),
                                 cluster=own_cluster, trainer=trainer,
                                 config_knobs=frozenset(ZERO_SETTINGS) if not self.is_pipeline else frozenset())

    def launch(self, opts: RunOptions) -> tuple[UserCommand, Cluster | None]:
        """The command as its trials run it (autotune's launcher options joined to its own) and
        the nodes those options place its ranks on (None: this machine alone)."""
        command = with_autotune_launcher_options(self.command(), opts)
        return command, resolve_cluster(command.cluster_options(), None, check_hosts=False)

    def space(self, opts: RunOptions, base: DsConfig) -> SearchSpace:
        """The run's space with the user's model size bounding the bucket range (not a preset's)."""
        from autotune.tuning.starting_point import build_space

        # a plain engine's bucket acts at ZeRO 1-3 (autotune/core/dsconfig.py reduce_bucket_inert)
        return build_space(opts, base, model_parameters=self.parameters, pipeline=self.is_pipeline)

    # -- the rest of the workload contract (autotune/tuning/job.py) -----------------------------
    def validate(self, opts: RunOptions) -> None:
        from autotune.tuning.validation import validate

        validate(opts, built_in=False)  # the preset's limits do not apply to the user's model

    def base_config(self, opts: RunOptions) -> DsConfig:
        """The config the script builds in code, or the HF Trainer filled, as its start-up check read
        it; else its file."""
        if self.script_config is not None:
            return DsConfig.from_dict(self.script_config, source=FROM_CODE)
        if self.is_hf_trainer:
            return DsConfig.from_dict(self.filled_config, source=FILLED)
        from autotune.tuning.starting_point import load_base_config

        return load_base_config(opts)

    def check_config(self, opts: RunOptions, base: DsConfig) -> None:
        """The user's config was checked when the job was read (`prepare_user_job`)."""

    def store(self, study: Study) -> None:
        if study.get_meta_json(META_KEY) is None:
            study.set_meta_json({META_KEY: asdict(self)})

    def steps(self, opts: RunOptions, base: DsConfig, space: SearchSpace, *, root: Path, note: Callable[[str], None],
              noise: float, cluster: Cluster | None) -> list[SettingStep]:
        """The partition step (its parts forced on the script's PipelineModule), the ZeRO sweep of a
        plain engine (autotune/engines/deepspeed_zero/: the stage, overlap_comm, contiguous_gradients
        in the trial's config) and the knob sweep of the script's own flags."""
        steps: list[SettingStep] = []
        command, own_cluster = self.launch(opts)  # the same nodes the runner's trials run on
        if self.is_pipeline:  # the baseline's layer costs (plan from any study)
            from autotune.tuning.layer_cost_step import layer_cost_steps

            steps.extend(layer_cost_steps(opts.workload))
        if opts.workload.balance_stages:
            from autotune.tuning.balance import StageBalancer

            steps.append(StageBalancer(root, note, method=None, noise=noise,
                                       multi_node=own_cluster is not None and own_cluster.multi_node))
        from autotune.tuning.knob_sweep import KnobSweep
        from autotune.usercmd.knobs import own_values, parse_knobs

        knobs = parse_knobs(opts.knobs) if opts.knobs else []
        own = own_values(knobs, command.script_args)
        if not self.is_pipeline:  # one sweep: the ZeRO settings first, then the script's own knobs
            from autotune.engines.deepspeed_zero.engine import zero_stages, zero_sweep

            steps.append(zero_sweep(base, root, note, then=knobs, then_own=own,
                                    stages=zero_stages(opts.zero_stages), parameters=space.model_parameters))
        elif knobs:
            steps.append(KnobSweep(knobs, own, root, note))
        return steps


FROM_CODE = "the script's own config, built in code"
FILLED = "the config as the HF Trainer filled it from its arguments"


def _finite(raw: object) -> object:
    """`raw` with each non-finite number as null: the Trainer fills `steps_per_print` with inf,
    which strict JSON cannot hold (autotune writes the trials' files from the user's own)."""
    if isinstance(raw, dict):
        return {k: _finite(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_finite(v) for v in raw]
    return None if isinstance(raw, float) and not math.isfinite(raw) else raw


def _config_marker(probe_dir: Path) -> dict | None:
    """What a failed start-up check saw handed to `deepspeed.initialize` (written before it ran)."""
    from autotune.trials.user_command import read_markers

    found = read_markers(probe_dir, "config")
    return found[0] if found else None


def auto_unfilled(keys: list[str], flag: str | None) -> str:
    """HF's "auto" where no Trainer fills it: the command hands the file to DeepSpeed's own `flag`,
    or (None) the start-up check found no Trainer building the engine."""
    why = (f"the command hands the file to DeepSpeed's {flag}, which no HF Trainer reads (its flag is "
           "--deepspeed FILE)" if flag else "no HF Trainer builds this job's engine (the start-up check found "
           "none at deepspeed.initialize)")
    return (f"HF Trainer's \"auto\" at {', '.join(keys)}, and {why}, so nothing fills them and DeepSpeed does "
            "not read them; put numbers there, or launch the Trainer script that fills them (docs/hf-trainer.md)")


LIGHTNING_CPU = "The DeepSpeed strategy is only supported on CUDA GPUs"
"""Lightning 2.6's DeepSpeedStrategy.setup_environment, on any other accelerator (docs/zero-facts.md)."""


def framework_hint(cmd: UserCommand, detail: str, built_by: str | None) -> str:
    """What a framework's known start-up failure on this machine means (docs/zero-facts.md)."""
    if (built_by == HF_TRAINER and "train_batch_size is not equal" in detail
            and "--use_cpu" not in cmd.script_args):
        # without it the Trainer's world size reads 1 and DeepSpeed refuses the batch it filled
        return ("; on a machine without a GPU the Trainer needs --use_cpu (without it the Trainer counts a "
                "world size of 1 and fills train_batch_size for one rank)")
    if LIGHTNING_CPU in detail:
        return ("; Lightning's DeepSpeedStrategy runs on CUDA GPUs only, so its job cannot be tuned on this "
                "machine (docs/lightning.md)")
    return ""


def _checked(base: DsConfig, where: str) -> None:
    """HF's "auto" values and the devices' precision: one line before any trial."""
    try:
        base.check_no_hf_auto()  # the job would hand them to DeepSpeed, which does not fill them
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    check_known_zero_keys(base, where)
    check_precision(base)


def config_from_code(marker: dict | None) -> DsConfig:
    """The config the start-up check saw the script hand `deepspeed.initialize` (autotune/rank/hook.py
    `script_config`): a dict built in code, or a file the code (or its own argument default) names."""
    source = (marker or {}).get("source", "none")
    if source == "code":
        if marker.get("config") is None:  # type: ignore[union-attr]
            raise UserError(f"the script's DeepSpeed config, built in code, cannot be written as JSON "
                            f"({marker.get('error')}); keep its values plain numbers, strings and lists")  # type: ignore[union-attr]
        return DsConfig.from_dict(marker["config"], source=FROM_CODE)  # type: ignore[index]
    if source in ("path", "args"):
        return load_ds_config(marker["path"])  # type: ignore[index]
    raise UserError("the script gave deepspeed.initialize no DeepSpeed config (the command names none, and "
                    "no config= in its code): pass it as --deepspeed_config FILE")


BUILTIN_ONLY = {
    "engine": "--engine", "schedule": "--schedule", "virtual_stages": "--virtual-stages", "preset": "--preset",
    "model": "--model", "tokens": "--tokens", "workers": "--workers", "pipeline_stages": "--stages",
    "data_parallel_size": "--dp", "activation_checkpoint_interval": "--activation-checkpoint-interval",
    "faults": "--fault",
}
"""Workload options that shape the built-in workload only (field: flag). The command's own script
and launcher decide these for a user's job (its engine, stages and ranks, read at the start-up
check), so each is refused with a command rather than dropped without a word."""


def refuse_builtin_only(opts: RunOptions) -> None:
    """A built-in workload's option given with a command: one line, exit 2, before anything runs."""
    from autotune.core.options import WorkloadOptions

    defaults = WorkloadOptions()
    given = [flag for name, flag in BUILTIN_ONLY.items()
             if getattr(opts.workload, name) != getattr(defaults, name)]
    if not given:
        return
    torch = {"--engine", "--schedule", "--virtual-stages"} & set(given)
    why = (" (a torch.distributed.pipelining script's schedule is the one it builds: its trials sweep the "
           "schedule classes that fit its stages, docs/torch-pipelining.md)" if torch else "")
    raise UserError(f"{', '.join(given)}: shape{'s' if len(given) == 1 else ''} the built-in workload only; with "
                    f"a command (`autotune run -- ...`) the script and its launcher decide {'it' if len(given) == 1 else 'them'}"
                    f" (read at the start-up check){why}")


def refuse_pipeline_only(opts: RunOptions) -> None:
    """What only a pipeline job has, asked of a plain engine's job: one line, exit 2."""
    from autotune.core.options import WorkloadOptions

    wl = opts.workload
    asked = {"--layer-costs": wl.layer_costs, "--balance-stages": wl.balance_stages,
             "--partition-method": wl.partition_method != WorkloadOptions().partition_method}
    for flag, given in asked.items():
        if given:
            raise UserError(f"{flag}: the script builds a plain DeepSpeedEngine (not a pipeline job); "
                            f"{flag} is for pipeline jobs")


def with_autotune_launcher_options(cmd: UserCommand, opts: RunOptions) -> UserCommand:
    """`autotune run --hostfile ... -- deepspeed ...`: autotune's launcher options join the command's."""
    return cmd.with_launcher_options(opts.workload.launcher_options().argv())
