"""Reference studies shared by many test modules, each run once per session (conftest.py).

A real `autotune run` costs a controller, a pool of DeepSpeed ranks and its trials: tests that
only read a finished study read one of these instead of running their own. Each is a plain
value (folders, exit code, output); a test that changes a study works on `copy_study`'s copy.

- `builtin_study`: the built-in workload as the README runs it (2 stages x 2 dp, ZeRO-1, warm
  workers), budget 3, every trial healthy, with a 2-step profiler trace of the baseline
  (`--trace-steps 2`: tests/test_traces.py).
- `fault_study`: the built-in workload on 2 ranks with a fault injected in most trials
  (autotune/core/faults.py) and the checkpoint step after the out-of-memory one.
- `usercmd_study`: `autotune run -- deepspeed examples/pipeline_train.py ...`, the user's
  script unchanged, budget 3, with the layer-cost hooks, given parts and a 2-step trace.
- `zero_study`: `autotune run --engine zero`, the built-in decoder as a plain DeepSpeedEngine
  (ZeRO-2, 2 data-parallel ranks, warm workers), budget 6: the ZeRO sweep, then the search; a
  2-step profiler trace of the baseline (`--trace-steps 2`: tests/test_traces.py).
- `usercmd_zero_study`: `autotune run -- deepspeed examples/zero_train_dict.py ...`, the user's own
  plain-engine ZeRO-2 script with its config built in code, unchanged, budget 2, its baseline
  traced in its own loop's optimizer steps.
- `torch_script_study`: `autotune run -- torchrun examples/torch_pipeline_train.py --schedule GPipe ...`,
  the user's own torch.distributed.pipelining script unchanged (no DeepSpeed), budget 6: the
  schedule sweep, then the search over n_microbatches.
- `hf_trainer_study`: `autotune run -- deepspeed examples/hf_trainer_train.py --deepspeed ds.json ...`,
  a real HF Trainer (tiny GPT-2 from a config) whose config is all "auto" batch values, budget 4.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from launch_helpers import autotune_cli
from robust_helpers import FAST, alive_under, write_config

from autotune.trials.launcher import processes_with
from autotune.trials.precision import probe_devices

SHM = Path("/dev/shm")
REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
USER_CONFIG = EXAMPLES / "ds_config.json"


@dataclass(frozen=True)
class SharedStudy:
    """A finished `autotune run`: where, how it ended, what it printed, what it left."""

    root: Path
    """The run's working directory (the study is `root / "st"`)."""
    study: Path
    returncode: int
    stdout: str
    stderr: str
    alive_after: list[int]
    """Processes still naming `root` right after the run (none, in a correct run)."""
    shm_leaked: set[Path]
    """DeepSpeed /dev/shm buffers that appeared during the run and are still there."""
    command: tuple[str, ...] = ()
    """The user's command after `--` (usercmd_study only)."""

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _run(root: Path, *args: str, command: tuple[str, ...] = (), env: dict | None = None) -> SharedStudy:
    assert alive_under(root) == []
    before = set(SHM.glob("deepspeed_allreduce_buffer_*"))
    proc = autotune_cli("run", "--study", str(root / "st"), *args, *(("--", *command) if command else ()),
                        cwd=root, timeout=1200, env=env)
    leaked = set(SHM.glob("deepspeed_allreduce_buffer_*")) - before
    return SharedStudy(root=root, study=root / "st", returncode=proc.returncode, stdout=proc.stdout,
                       stderr=proc.stderr, alive_after=alive_under(root), shm_leaked=leaked, command=command)


TRACE_STEPS = 2
"""Steps the shared studies trace (the baseline's, and the best's re-measurement if one runs)."""


def run_builtin_study(root: Path) -> SharedStudy:
    """`autotune run --budget 3` with the default config (dp 2, 4 ranks), 2 measured steps."""
    return _run(root, "--budget", "3", "--steps", "2", "--warmup-steps", "1", "--fixed-steps",
                "--trace-steps", str(TRACE_STEPS))


# The loss-scale collapse needs fp16 (only fp16 has a dynamic loss scale), and whether
# DeepSpeed's CPU accelerator runs fp16 depends on the CPU model. Where it cannot, the
# run goes without fp16 and without that one fault; every other fault is still checked.
CPU = probe_devices("cpu")
HAS_FP16 = CPU.supported["fp16"]
NO_FP16_REASON = f"{CPU.device} has no fp16 ({CPU.why_not.get('fp16')}): the loss scale cannot collapse here"
FAULTS = {1: ("oom", "oom"), 3: ("kill", "killed"), 4: ("nan", "nonfinite_loss"),
          5: ("nometrics", "no_metrics"), 6: ("nolauncher", "launcher_missing")}
"""Trial -> (the --fault kind injected, the failure reason it must end with). Trial 2 has none:
it is the checkpoint step's rerun of trial 1's micro-batch (tests/test_checkpoint_ranks.py)."""
if HAS_FP16:
    FAULTS[7] = ("overflow", "loss_scale_collapse")
FAULT_BUDGET = len(FAULTS) + 2  # the baseline and the checkpointed trial are healthy


def run_fault_study(root: Path) -> SharedStudy:
    """FAST on 2 ranks, --full-budget (every trial of the budget runs), a fault in each trial of FAULTS."""
    # fp16 with the loss scale starting at its minimum: a healthy trial never overflows,
    # the `overflow` fault makes every gradient overflow, so the scale collapses for real.
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 0, "min_loss_scale": 1,
                     "hysteresis": 1, "loss_scale_window": 1000}} if HAS_FP16 else {}
    cfg = write_config(root, **fp16)
    spec = ",".join(f"{kind}@{n}" for n, (kind, _) in FAULTS.items())
    return _run(root, "--budget", str(FAULT_BUDGET), "--config", str(cfg), "--fault", spec, "--full-budget", *FAST)


def user_env() -> dict[str, str]:
    """`deepspeed` is the one next to this Python, as in the user's activated environment."""
    return {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


USER_PARTS = "parts:0,2,6"
"""Given to the user's PipelineModule (its own code asks for `parameters`): tests/test_layer_costs.py."""


def run_usercmd_study(root: Path) -> SharedStudy:
    """The engine-owned-loader example through `deepspeed`, budget 3, 2 measured steps each,
    with --layer-costs and --partition-method parts:0,2,6 (the bootstrap's two hooks)."""
    command = ("deepspeed", "--num_gpus", "2", str(EXAMPLES / "pipeline_train.py"),
               "--deepspeed_config", str(USER_CONFIG), "--steps", "100000", "--save-dir", "ckpt")
    return _run(root, "--budget", "3", "--steps", "2", "--warmup-steps", "1", "--fixed-steps",
                "--trial-timeout", "600", "--layer-costs", "--partition-method", USER_PARTS,
                "--trace-steps", str(TRACE_STEPS), command=command, env=user_env())


ZERO_STAGE = 2
"""The ZeRO study's stage: the gradients partitioned, reduced while the backward runs."""
ZERO_BUDGET = 6


def run_zero_study(root: Path) -> SharedStudy:
    """`autotune run --engine zero`: the built-in decoder as a plain DeepSpeedEngine with ZeRO-2 on
    2 data-parallel ranks, warm workers, budget ZERO_BUDGET (the stage sweep's three trials among
    them), 2 measured steps each, with a TRACE_STEPS-step profiler trace of the baseline."""
    cfg = write_config(root, train_batch_size=16, zero_optimization={"stage": ZERO_STAGE})
    return _run(root, "--engine", "zero", "--config", str(cfg), "--budget", str(ZERO_BUDGET), "--steps", "2",
                "--warmup-steps", "1", "--fixed-steps", "--no-metrics", "--trace-steps", str(TRACE_STEPS))


ZERO_SCRIPT_CONFIG = EXAMPLES / "ds_zero2.json"
ZERO_DICT_SCRIPT = EXAMPLES / "zero_train_dict.py"


def run_usercmd_zero_study(root: Path) -> SharedStudy:
    """The user's own plain-engine script with its config built in code (examples/zero_train_dict.py:
    a ZeRO-2 dict passed as `config=`, its own loop of forward, backward and step) through
    `deepspeed`, unchanged, budget 2, 2 measured steps each, its baseline traced (TRACE_STEPS)."""
    command = ("deepspeed", "--num_gpus", "2", str(ZERO_DICT_SCRIPT), "--steps", "100000", "--save-dir", "ckpt")
    return _run(root, "--budget", "2", "--steps", "2", "--warmup-steps", "1", "--fixed-steps",
                "--trial-timeout", "600", "--no-metrics", "--trace-steps", str(TRACE_STEPS), command=command,
                env=user_env())


HF_SCRIPT = EXAMPLES / "hf_trainer_train.py"
HF_BATCH = (2, 4)
"""The Trainer command's own --per_device_train_batch_size and --gradient_accumulation_steps."""
HF_CONFIG = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
             "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
             "zero_optimization": {"stage": 0, "reduce_bucket_size": "auto"}, "steps_per_print": 1000000}
"""The Trainer job's config, as HF's examples write one: every batch value "auto"."""


def run_hf_trainer_study(root: Path) -> SharedStudy:
    """A real HF Trainer through `deepspeed` (2 ranks, `--use_cpu`: the Trainer's DeepSpeed path
    on CPU, docs/zero-facts.md), its config file full of "auto", the stage fixed at ZeRO-0 by
    `--zero-stages 0`, so that every trial after the baseline changes the Trainer's micro-batch
    (the global batch fixed at 16), budget 4, 2 measured steps each."""
    import json

    (root / "ds_hf.json").write_text(json.dumps(HF_CONFIG, indent=2) + "\n", encoding="utf-8")
    (root / "text.txt").write_bytes(HF_SCRIPT.read_bytes() * 4)  # some text to train on
    micro, gas = HF_BATCH
    command = ("deepspeed", "--num_gpus", "2", str(HF_SCRIPT), "--deepspeed", "ds_hf.json", "--text", "text.txt",
               "--n_layer", "2", "--output_dir", "out", "--per_device_train_batch_size", str(micro),
               "--gradient_accumulation_steps", str(gas), "--max_steps", "100000", "--report_to", "none",
               "--save_strategy", "no", "--use_cpu", "--disable_tqdm", "true")
    return _run(root, "--budget", "4", "--zero-stages", "0", "--steps", "2", "--warmup-steps", "1",
                "--fixed-steps", "--trial-timeout", "600", "--no-metrics", command=command, env=user_env())


TORCH_SCRIPT = EXAMPLES / "torch_pipeline_train.py"
TORCH_OWN = ("GPipe", 2, 16)
"""The torch script's own schedule, n_microbatches and step's batch (its flags)."""
TORCH_BUDGET = 7
TORCH_KNOB = "activation_checkpoint:0,1=--activation-checkpoint {value}"
"""The script's own activation-checkpointing flag, mapped as a knob (docs/user-script.md)."""


def run_torch_script_study(root: Path) -> SharedStudy:
    """The user's torch pipelining script through `torchrun` on 2 ranks (a stage each), unchanged,
    budget TORCH_BUDGET (the baseline, four schedules, the checkpoint knob, one search trial), 2
    measured steps each."""
    schedule, n, batch = TORCH_OWN
    command = ("torchrun", "--nproc-per-node", "2", str(TORCH_SCRIPT), "--schedule", schedule,
               "--n-microbatches", str(n), "--batch", str(batch), "--steps", "100000",
               "--activation-checkpoint", "0")
    return _run(root, "--budget", str(TORCH_BUDGET), "--steps", "2", "--warmup-steps", "1", "--fixed-steps",
                "--trial-timeout", "300", "--no-metrics", "--knob", TORCH_KNOB, command=command, env=user_env())


def copy_study(shared: SharedStudy, dest: Path) -> Path:
    """A copy of the shared study's folder under `dest`, for a test that writes to it."""
    assert not processes_with(str(shared.study.resolve())), "the shared run is over"
    return Path(shutil.copytree(shared.study, dest / shared.study.name))
