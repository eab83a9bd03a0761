"""Every option of `autotune run`, written once: type, default, unit, valid range and help.

One typed tree: `RunOptions` (the study, the search space, the endpoints) holding a
`WorkloadOptions` (how every trial runs the workload). From it come the click options
and `--help` of `autotune run` (`click_options`, `from_cli`), the per-field type and
range checks (`check_fields`), the settings a study stores and a resume reads back
(`to_dict`, `from_dict`), and the trial description a rank receives
(`autotune/rank/workload/trial_spec.py`). Cross-field checks (stages against the preset,
ports against the world size) stay in `autotune/tuning/validation.py`. torchtitan's
`job_config.py` is the model: a dataclass per group, a docstring per field.

Shaped as the study stores it (flat run options, the workload nested) so a study
written before this module existed still resumes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autotune.core.errors import UserError


def option(default: Any, help: str, *, flag: str | None = None, lo: float | None = None,
           hi: float | None = None, unit: str = "", group: str = "", hidden: bool = False,
           cli: bool = True, cli_type: type | None = None, show_default: bool = True,
           factory: Callable[[], Any] | None = None, multiple: bool = False,
           cli_default: Any = None) -> Any:
    """A dataclass field carrying its command-line flag, help, unit and valid range.

    `cli_default`: the command line's default where it differs from the field's (the field's
    is what a study stored before the field existed reads back)."""
    meta = {"help": help, "flag": flag, "lo": lo, "hi": hi, "unit": unit, "group": group,
            "hidden": hidden, "cli": cli, "cli_type": cli_type, "show_default": show_default,
            "multiple": multiple, "cli_default": cli_default}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True, slots=True)
class WorkloadOptions:
    """How every trial of a study runs the built-in workload (fixed for the whole study)."""

    preset: str = option("tiny", "Workload: tiny, small, medium (compute-bound on a CPU), wide-vocab (LM-head-heavy), llama-7b, llama-13b.",
                         group="workload")
    pipeline_stages: int = option(2, "Pipeline stages (at least 2 for a pipeline engine; --engine zero has "
                                  "none: 1).", flag="--stages", lo=1, hi=1024, group="workload")
    data_parallel_size: int = option(2, "Data-parallel degree (ranks = stages x dp).", flag="--dp",
                                     lo=1, hi=1024, group="workload")
    steps: int = option(6, "Measured steps per trial: the minimum with --adaptive-steps, the exact count "
                        "with --fixed-steps.", lo=1, hi=100_000, unit="steps", group="workload")
    warmup_steps: int = option(2, "Warm-up steps per trial, excluded from every summary.", lo=0,
                               hi=100_000, unit="steps", group="workload")
    # Trial length (autotune/core/step_budget.py, docs/trial-length.md). Off for a study stored
    # before these fields existed (it resumes as it was measured); on for a new `autotune run`.
    adaptive_steps: bool = option(False, "Measure until the median step time's 95 % interval is within "
                                  "--step-precision, between --steps and --max-steps; stop a trial that "
                                  "cannot beat the best so far (--fixed-steps: exactly --steps).",
                                  flag="--adaptive-steps / --fixed-steps", group="workload", cli_default=True)
    step_precision: float = option(0.03, "With --adaptive-steps: the relative half-width of the median "
                                   "step time's 95 % interval at which a trial stops (0.03 = +-3 %).",
                                   lo=0, hi=0.5, group="workload", cli_type=float)
    max_steps: int | None = option(None, "With --adaptive-steps: the most measured steps per trial "
                                   "(default: 2 x --steps).", lo=1, hi=300_000, unit="steps", group="workload")
    partition_method: str = option("parameters", "PipelineModule partition: parameters, uniform, type:REGEX "
                                   "or explicit boundaries parts:0,5,12 (docs/partition.md).", group="workload")
    layer_costs: bool = option(False, "Time every layer's forward and backward in every trial, in a block "
                               "of steps after its measured ones (layer-costs-rankR.csv; docs/partition.md).",
                               group="workload")
    # Off for a study stored before this field existed (it resumes as it was measured); on for a new run.
    layer_costs_once: bool = option(False, "A pipeline study times every layer once, in a block of steps after "
                                    "the baseline's measured ones (outside every figure), so that `plan` and the "
                                    "partition advice work from it (--no-layer-costs: never; docs/partition.md).",
                                    flag="--layer-costs-once / --no-layer-costs", group="workload",
                                    cli_default=True)
    balance_stages: bool = option(False, "When a trial's stages are unbalanced, run one trial with the "
                                  "partition its measured layer costs balance (docs/partition.md).",
                                  group="workload")
    activation_checkpoint_interval: int = option(0, "PipelineModule activation checkpoint interval (0 = off).",
                                                 lo=0, hi=1_000_000, group="workload")
    tokens: str | None = option(None, "Token file instead of synthetic data (.npy, .bin uint16 or raw bytes).",
                                group="workload", cli_type=str)
    slow_stage: int | None = option(None, "Test hook: stretch this stage's compute.", lo=0, hidden=True,
                                    group="workload")
    slow_factor: int = option(1, "Test hook: by this factor.", lo=1, hi=1000, hidden=True, group="workload")
    slow_every: int = option(1, "Test hook: every Nth step only.", lo=1, hi=1000, cli=False)
    slow_layer: int | None = option(None, "Test hook: stretch this layer's forward by --slow-factor.", lo=0,
                                    hidden=True, group="workload")
    threads: int = option(1, "torch threads per rank (CPU).", lo=1, hi=1024, cli=False)
    seed: int = option(1234, "Model and data seed of every trial.", lo=0, hi=2**32 - 1, cli=False)
    job: str = option("autotune", "The `job` label of every metric.", cli=False)
    metrics_port: int | None = option(None, "Base port of the rank endpoints (set from --rank-metrics-port).",
                                      lo=1, hi=65535, unit="port", cli=False)
    metrics_addr: str = option("127.0.0.1", "Bind address of the rank endpoints.", cli=False)
    model: str | None = option(None, "Your own pipeline: MODULE:FUNCTION, FUNCTION(num_stages, seed) returning a "
                               "deepspeed PipelineModule (docs/warm-workers.md).", group="workload", cli_type=str)
    workers: str = option("warm", "Trial processes: warm (the ranks stay alive between trials, a fresh "
                          "engine per trial; docs/warm-workers.md) or fresh (a new launch per trial).",
                          group="workload")
    engine: str = option("deepspeed", "Engine of the built-in workload: deepspeed (DeepSpeed's "
                         "PipelineEngine), zero (a plain DeepSpeedEngine with ZeRO, every rank a data-parallel "
                         "replica: --dp ranks, no stages; docs/zero.md) or torch (torch.distributed.pipelining, "
                         "launched by torchrun; docs/torch-pipelining.md).", group="workload")
    schedule: str = option("1F1B", "With --engine torch: the baseline's schedule (GPipe, 1F1B, Interleaved1F1B, "
                           "LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV); the study then "
                           "measures each other one the layout fits.", group="workload")
    virtual_stages: int = option(2, "With --engine torch: stages per rank of the looped schedules "
                                 "(Interleaved1F1B, LoopedBFS, InterleavedZeroBubble).", lo=1, hi=64,
                                 group="workload")
    faults: str = option("", "Test hook: inject faults, KIND[@TRIAL],... (autotune/core/faults.py).",
                         flag="--fault", hidden=True, group="workload", show_default=False)
    # DeepSpeed's launcher options, spelled as `deepspeed` spells them (autotune/trials/multinode.py,
    # docs/multi-node.md); passed through to every trial's launcher command.
    hostfile: str | None = option(None, "DeepSpeed hostfile (HOST slots=N per line): trials run on its hosts.",
                                  flag="--hostfile", group="launcher", cli_type=str)
    include: str = option("", "DeepSpeed --include NODE_SPEC[@NODE_SPEC...] (hosts/slots to use).",
                          flag="--include", group="launcher", show_default=False)
    exclude: str = option("", "DeepSpeed --exclude NODE_SPEC[@NODE_SPEC...] (hosts/slots to skip).",
                          flag="--exclude", group="launcher", show_default=False)
    num_nodes: int | None = option(None, "DeepSpeed --num_nodes: the first N hosts of the hostfile.",
                                   flag="--num_nodes", lo=1, hi=100_000, group="launcher")
    num_gpus: int | None = option(None, "DeepSpeed --num_gpus: slots used per host.", flag="--num_gpus",
                                  lo=1, hi=100_000, group="launcher")
    master_addr: str | None = option(None, "DeepSpeed --master_addr (default: the first host's address).",
                                     flag="--master_addr", group="launcher", cli_type=str)
    launcher: str = option("pdsh", "DeepSpeed --launcher for multi-node trials: pdsh, openmpi, mpich, "
                           "impi, mvapich, slurm.", flag="--launcher", group="launcher")
    launcher_args: str = option("", "DeepSpeed --launcher_args (passed to pdsh/mpirun/srun).",
                                flag="--launcher_args", group="launcher", show_default=False)
    ssh_port: int | None = option(None, "DeepSpeed --ssh_port for pdsh.", flag="--ssh_port", lo=1,
                                  hi=65535, unit="port", group="launcher")

    @property
    def world_size(self) -> int:
        return self.pipeline_stages * self.data_parallel_size

    def launcher_options(self) -> LauncherOptions:
        return LauncherOptions(hostfile=self.hostfile, include=self.include, exclude=self.exclude,
                               num_nodes=self.num_nodes, num_gpus=self.num_gpus, master_addr=self.master_addr,
                               launcher=self.launcher, launcher_args=self.launcher_args, ssh_port=self.ssh_port)

    @property
    def step_cap(self) -> int:
        """The most measured steps a trial runs (--steps itself with --fixed-steps)."""
        if not self.adaptive_steps:
            return self.steps
        from autotune.core.step_budget import CAP_FACTOR

        return self.max_steps if self.max_steps is not None else CAP_FACTOR * self.steps

    def fault_for(self, trial: int) -> str | None:
        from autotune.core.faults import fault_for

        return fault_for(self.faults, trial)


@dataclass(kw_only=True, slots=True)
class RunOptions:
    """A tuning run: the study, its search space, its endpoints, and the workload."""

    # The study
    budget: int = option(20, "Trials to run, baseline included [default: 20; a resumed study keeps its own].",
                         lo=1, hi=100_000, group="study", show_default=False)
    study: str = option("autotune-study", "Study folder.", group="study")
    resume: bool = option(False, "Continue the study in --study (rerunning with it does too).", group="study")
    full_budget: bool = option(False, "Run every trial of --budget; by default the search stops once no "
                               "candidate is expected to beat the best by more than the measurement "
                               "noise (docs/tuner.md).", group="study")
    config: str | None = option(None, "Starting ds_config.json (default: the built-in workload's).",
                                group="study", cli_type=str)
    trace_steps: int = option(0, "Record a torch.profiler trace of this many steps on every rank, at "
                              "the baseline and at the best's re-measurement, into traces/ of the trial "
                              "folder; read by `autotune advise` (docs/traces.md). 0: off.",
                              lo=0, hi=1000, unit="steps", group="study")
    trace_every_trial: bool = option(False, "With --trace-steps: trace every trial, not only the baseline and "
                                     "the best's re-measurement.", group="study")
    tuner: str = option("hybrid", "hybrid, bayes, random, grid, ds-autotuner, model (the performance model: "
                        "docs/model.md; optuna-gp, optuna-tpe "
                        "with optuna installed).", group="study")
    seed: int = option(0, "Proposer seed.", lo=0, hi=2**32 - 1, group="study")
    trial_timeout: float | None = option(None, "Seconds per trial (default: 4x the slowest finished "
                                         "trial's start-up and steps, scaled to the trial's batch; 900 before "
                                         "one has finished).", lo=0, unit="s", group="study", cli_type=float)
    startup_timeout: float | None = option(None, "Seconds a rank's start-up may take before the trial ends as "
                                           "a hang, with the rank's stack (default: 2x the slowest measured "
                                           "start-up; 120 before one is measured).", lo=1, unit="s",
                                           group="study", cli_type=float)
    build_wait: float = option(600.0, "Seconds to wait for another process's running build of a DeepSpeed op "
                               "whose lock the ranks need, before the run stops with the reason "
                               "(docs/robustness.md).", lo=0, unit="s", group="study", cli_type=float)
    checkpoint_on_oom: bool = option(True, "When a trial runs out of memory, run its configuration again with "
                                     "activation checkpointing, and keep it if it is the fastest (built-in "
                                     "workload; docs/tuner.md).", flag="--checkpoint-on-oom / --no-checkpoint-on-oom",
                                     group="study")
    knobs: tuple[str, ...] = option((), "Your script's model setting as a knob: NAME[:V1,V2]=FLAG (FLAG "
                                    "with {value}, e.g. 'partition_method=--partition {value}'); "
                                    "repeatable; with a COMMAND only (docs/user-script.md).",
                                    flag="--knob", group="study", multiple=True, show_default=False)
    zero_stages: str = option("0,1,2,3", "ZeRO stages the sweep of a plain DeepSpeedEngine tries, comma-separated "
                              "(its config's own stage is the baseline's); the config's stage alone fixes it "
                              "(docs/zero.md).", group="study")
    # The search space
    global_batch: int | None = option(None, "Fixed global batch (default: the starting config's "
                                      "train_batch_size).", lo=1, hi=2**31, group="space")
    free_batch: bool = option(False, "Let the global batch vary (micro and GAS both searched).", group="space")
    micro_min: int = option(1, "Smallest micro-batch.", lo=1, hi=65536, group="space")
    micro_max: int = option(64, "Largest micro-batch.", lo=1, hi=65536, group="space")
    gas_min: int = option(1, "Fewest gradient accumulation steps.", lo=1, hi=65536, group="space")
    gas_max: int = option(64, "Most gradient accumulation steps.", lo=1, hi=65536, group="space")
    max_global_batch: int | None = option(None, "Upper bound of the global batch with --free-batch.",
                                          lo=1, hi=2**31, group="space")
    integer_micro: bool = option(False, "Any integer micro-batch, not only powers of two.", group="space")
    bucket_min: int = option(10_000, "Smallest reduce_bucket_size.", lo=1, hi=10**12, unit="elements",
                             group="space", cli_type=float)
    bucket_max: int = option(500_000_000, "Largest reduce_bucket_size.", lo=1, hi=10**12, unit="elements",
                             group="space", cli_type=float)
    # The endpoints (`autotune watch` takes these four too: `endpoint_options`)
    metrics_port: int | None = option(9700, "Serve the controller's Prometheus metrics on this port "
                                      "(taken: the next free of 8).", lo=1, hi=65535, unit="port",
                                      group="endpoints")
    rank_metrics_port: int | None = option(9710, "Base port of each rank's endpoint (local rank r: base + r; "
                                           "the ports bound are listed in prometheus_targets.json in the "
                                           "--study or --out folder).",
                                           lo=1, hi=65535, unit="port", group="endpoints")
    metrics_addr: str = option("127.0.0.1", "Bind address of the endpoints (anything but loopback "
                               "exposes them).", group="endpoints")
    no_metrics: bool = option(False, "Serve no live metrics (neither the controller's nor the ranks' "
                              "endpoints, no targets file).", group="endpoints")
    workload: WorkloadOptions = option(None, "", cli=False, factory=WorkloadOptions)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunOptions:
        """The stored settings of a study (unknown keys of older versions are refused)."""
        d = dict(d)
        wl = dict(d.pop("workload", {}))
        wl.pop("extra_args", None)  # studies written before the trial description
        d["knobs"] = tuple(d.get("knobs", ()))  # stored as a JSON list
        return cls(**d, workload=WorkloadOptions(**wl))


# --- command line -------------------------------------------------------------------------

def _cli_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli")]


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _help(f: dataclasses.Field) -> str:
    m = f.metadata
    text = m["help"]
    bits = []
    if m["unit"]:
        bits.append(m["unit"])
    lo, hi = m["lo"], m["hi"]
    if f.type in ("int", "int | None") and lo is not None:
        bits.append(f"{_num(lo)}-{_num(hi)}" if hi is not None and hi < 1e6 else f">= {_num(lo)}")
    return text + (f" ({', '.join(bits)})" if bits else "")


def _num(v: float) -> str:
    """1e4 and 5e8 as people write bucket sizes; small numbers as they are."""
    if v >= 1e4 and float(f"{v:.0e}") == v:
        return f"{v:.0e}".replace("e+0", "e").replace("e+", "e")
    return f"{v:g}" if isinstance(v, float) and not v.is_integer() else f"{int(v)}"


def click_options(fn: Callable) -> Callable:
    """Decorate a click command with one option per CLI field of the tree, in declaration order."""
    return _decorate(fn, [*_cli_fields(RunOptions), *_cli_fields(WorkloadOptions)])


ENDPOINTS = "endpoints"
"""The group of the live-metrics endpoint options, which `autotune watch` shares with `autotune run`."""


def endpoint_fields() -> list[dataclasses.Field]:
    """--metrics-port, --rank-metrics-port, --metrics-addr, --no-metrics: declared once, in RunOptions."""
    return [f for f in _cli_fields(RunOptions) if f.metadata["group"] == ENDPOINTS]


def endpoint_options(fn: Callable) -> Callable:
    """Decorate a click command (`autotune watch`) with the endpoint options of `autotune run`:
    the same flags, defaults and help; `validation.validate_endpoints` checks the values."""
    return _decorate(fn, endpoint_fields())


def endpoint_defaults() -> dict[str, Any]:
    """Each endpoint option's default, by field name."""
    return {f.name: f.default for f in endpoint_fields()}


def _decorate(fn: Callable, fields: list[dataclasses.Field]) -> Callable:
    for f in reversed(fields):
        fn = _click_option(f)(fn)
    return fn


def _click_option(f: dataclasses.Field) -> Callable:
    """The click option of one field: its flag, type, default and help."""
    import click

    m = f.metadata
    if f.type == "bool":
        on = m["cli_default"] if m["cli_default"] is not None else f.default
        return click.option(_flag(f), f.name, is_flag=True, default=on, help=_help(f), hidden=m["hidden"],
                            show_default="/" in _flag(f))
    if m.get("multiple"):
        return click.option(_flag(f), f.name, multiple=True, help=_help(f), hidden=m["hidden"])
    kind = m["cli_type"] or (int if f.type.startswith("int") else str)
    default = None if f.name == "budget" else f.default
    shown = m["show_default"] and default is not None
    if shown and kind is float:
        shown = _num(default)  # --bucket-max 5e8, not 500000000
    return click.option(_flag(f), f.name, type=kind, default=default, help=_help(f),
                        hidden=m["hidden"], show_default=shown)


def from_cli(kw: dict[str, Any], *, budget: int) -> RunOptions:
    """RunOptions from the click keyword arguments (names are the field names)."""
    run_names = {f.name for f in _cli_fields(RunOptions)}
    wl_names = {f.name for f in _cli_fields(WorkloadOptions)}
    run = {k: v for k, v in kw.items() if k in run_names}
    wl = {k: v for k, v in kw.items() if k in wl_names}
    for name in ("bucket_min", "bucket_max"):  # given as floats (1e4), stored as elements
        run[name] = _finite_int(run[name], _flag(_field(RunOptions, name)))
    wl["faults"] = wl.get("faults") or ""
    run["budget"] = budget
    return RunOptions(**run, workload=WorkloadOptions(**wl))


def _finite_int(v: float, flag: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise UserError(f"{flag} must be a finite number of elements, got {v}")
    return int(v)


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


# --- per-field checks -------------------------------------------------------------------------

def check_fields(opts: RunOptions) -> None:
    """Type and range of every field, from the tree's metadata; one UserError naming the flag."""
    for owner in (opts, opts.workload):
        for f in dataclasses.fields(owner):
            if f.name == "workload":
                continue
            _check(f, getattr(owner, f.name))


def check_endpoint_fields(values: dict[str, Any]) -> None:
    """Type and range of the endpoint options (`autotune watch`'s share of `check_fields`)."""
    for f in endpoint_fields():
        _check(f, values[f.name])


def _check(f: dataclasses.Field, v: Any) -> None:
    m, name = f.metadata, _flag(f) if f.metadata.get("cli") else f.name.replace("_", "-")
    optional = f.type.endswith("| None")
    if v is None:
        if optional:
            return
        raise UserError(f"{name} must be given")
    base = f.type.split(" |")[0]
    if base.startswith("tuple"):
        if not isinstance(v, (tuple, list)) or not all(isinstance(x, str) for x in v):
            raise UserError(f"{name} must be a list of strings, got {v!r}")
        return
    if base == "bool":
        if not isinstance(v, bool):
            raise UserError(f"{name} must be true or false, got {v!r}")
        return
    if base == "int" and (isinstance(v, bool) or not isinstance(v, int)):
        raise UserError(f"{name} must be an integer, got {v!r}")
    if base == "float" and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
        raise UserError(f"{name} must be a finite number, got {v!r}")
    if base == "str":
        if not isinstance(v, str):
            raise UserError(f"{name} must be a string, got {v!r}")
        return
    lo, hi = m.get("lo"), m.get("hi")
    if m.get("unit") == "port" and not lo <= v <= hi:
        raise UserError(f"{name} must be a port {_num(lo)}-{_num(hi)}, got {v}")
    if lo is not None and (v < lo or (base == "float" and lo == 0 and v == 0)):
        raise UserError(f"{name} must be {'>' if base == 'float' and lo == 0 else '>='} {_num(lo)}, got {v}")
    if hi is not None and v > hi:
        raise UserError(f"{name} must be <= {_num(hi)}, got {v}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LauncherOptions:
    """DeepSpeed launcher options of a run, spelled as `deepspeed` spells them."""

    hostfile: str | None = None
    include: str = ""
    exclude: str = ""
    num_nodes: int | None = None
    num_gpus: int | None = None
    master_addr: str | None = None
    launcher: str = "pdsh"
    launcher_args: str = ""
    ssh_port: int | None = None

    @property
    def given(self) -> bool:
        """Anything beyond a one-machine launch of exactly stages x dp ranks."""
        return bool(self.hostfile or self.include or self.exclude or self.num_nodes is not None
                    or self.num_gpus is not None
                    or self.master_addr or self.launcher_args or self.launcher != "pdsh"
                    or self.ssh_port is not None)

    def argv(self) -> list[str]:
        """The options as `deepspeed` takes them (before the script)."""
        out: list[str] = []
        for flag, value in (("--hostfile", self.hostfile), ("--include", self.include),
                            ("--exclude", self.exclude), ("--num_nodes", self.num_nodes),
                            ("--num_gpus", self.num_gpus), ("--master_addr", self.master_addr),
                            ("--launcher_args", self.launcher_args), ("--ssh_port", self.ssh_port)):
            if value not in (None, ""):
                out += [flag, str(value)]
        if self.launcher != "pdsh":
            out += ["--launcher", self.launcher]
        return out
