"""An HF Trainer's DeepSpeed job, and Lightning's (issue 42). The end-to-end checks read the shared
Trainer study (tests/shared_studies.py `hf_trainer_study`: a real `transformers.Trainer` on 2 CPU
ranks, its config all "auto" batch values, ZeRO-0 fixed, budget 4); the config writing, the
argument rewriting and the command's reading run without a launch; Lightning's refusal on CPU is
one real start-up check."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from launch_helpers import autotune_cli
from shared_studies import EXAMPLES, HF_BATCH, HF_CONFIG, user_env

from autotune.core.errors import UserError
from autotune.core.knob import Knob
from autotune.core.trainer_args import GAS_FLAG, MICRO_FLAG
from autotune.usercmd.command import parse_command
from autotune.usercmd.hf_trainer import TrainerConfig, with_batch
from autotune.usercmd.job import framework_hint
from autotune.usercmd.knobs import value_in

GLOBAL_BATCH = HF_BATCH[0] * HF_BATCH[1] * 2


def _trial_files(study: Path) -> list[Path]:
    return sorted(study.glob("trial-*/ds_config.json"))


def _engine(trial_dir: Path) -> dict:
    return json.loads((trial_dir / "engine-rank0.json").read_text())


# -- the shared study --------------------------------------------------------------------------
def test_a_trainer_job_is_tuned_with_its_batch_in_the_trainers_arguments(hf_trainer_study):
    """Every trial ok; each launched the Trainer with the proposed micro-batch and GAS as its own
    arguments, and the engine the Trainer built ran exactly those (the file says "auto")."""
    s = hf_trainer_study
    assert s.returncode == 0, s.output[-3000:]
    assert "the job: an HF Trainer's; its batch is set through its arguments" in s.output
    summary = json.loads((s.study / "summary.json").read_text())
    assert summary["failed_trials"] == 0 and summary["counted_trials"] == 4, summary
    assert summary["user_command"]["built_by"] == "hf_trainer"
    micros = set()
    for t in summary["trials"]:
        trial_dir = s.study / f"trial-{t['trial']:03d}"
        micro, gas = t["micro_batch_size"], t["gradient_accumulation_steps"]
        assert micro * gas * 2 == GLOBAL_BATCH  # the global batch stays fixed
        log = (trial_dir / "launcher.log").read_text(errors="replace")
        assert f"{MICRO_FLAG} {micro} {GAS_FLAG} {gas}" in log  # the Trainer's own arguments, in place
        engine = _engine(trial_dir)
        assert (engine["micro_batch_size"], engine["gradient_accumulation_steps"]) == (micro, gas), engine
        micros.add(micro)
    assert len(micros) > 1  # ZeRO-0 fixed: every trial after the baseline is another micro-batch
    assert s.alive_after == [] and not s.shm_leaked


def test_every_trial_file_keeps_the_users_auto_values(hf_trainer_study):
    """The Trainer fills "auto" from its arguments, and refuses explicit batch values that disagree
    with them: each trial's file is the user's own, "auto" kept, and trial 0's is it unchanged."""
    files = _trial_files(hf_trainer_study.study)
    assert len(files) == 4
    for path in files:
        assert json.loads(path.read_text()) == HF_CONFIG, path  # ZeRO-0 fixed: nothing else tuned
    best = json.loads((hf_trainer_study.study / "best_ds_config.json").read_text())
    assert best == HF_CONFIG
    assert "Infinity" not in (hf_trainer_study.study / "best_ds_config.json").read_text()  # strict JSON


def test_the_best_is_given_as_the_trainers_arguments(hf_trainer_study):
    s = hf_trainer_study
    summary = json.loads((s.study / "summary.json").read_text())
    best = summary["best"]
    args = f"{MICRO_FLAG} {best['micro_batch_size']} {GAS_FLAG} {best['gradient_accumulation_steps']}"
    assert summary["best_trainer_args"] == args
    assert f"as the Trainer's arguments: {args}" in s.stdout
    assert f"`{args}`" in (s.study / "report.md").read_text()


def test_a_trainer_trials_records_are_its_optimizer_steps(hf_trainer_study):
    """The Trainer's loop (accelerate's backward and step on the engine) gives one record per
    optimizer step, with the step's loss and the ZeRO-0 gradient all-reduce as communication."""
    rows = (hf_trainer_study.study / "trial-000" / "metrics-rank0.csv").read_text().splitlines()
    header = rows[0].split(",")
    records = [dict(zip(header, r.split(","), strict=True)) for r in rows[1:]]
    assert [r["step"] for r in records] == ["0", "1", "2"]  # 1 warm-up + 2 measured
    for r in records:
        assert r["gradient_accumulation_steps"] == str(HF_BATCH[1]) and float(r["loss"]) > 0
        assert float(r["comm_seconds"]) > 0 and r["p2p_seconds"] == ""


# -- without a launch --------------------------------------------------------------------------
def test_hf_trainers_deepspeed_flag_names_the_config(tmp_path):
    (tmp_path / "train.py").write_text("")
    for args, at in ((("--deepspeed", "ds.json", "--x", "1"), 1), (("--x", "1", "--deepspeed=ds.json"), 2)):
        cmd = parse_command(["deepspeed", "train.py", *args], cwd=tmp_path)
        assert (cmd.config_at, cmd.user_config, cmd.config_in_code) == (at, "ds.json", False)
        argv = cmd.argv_for("/s/trial-001/ds_config.json", 29500)
        assert argv.count("/s/trial-001/ds_config.json") + argv.count("--deepspeed=/s/trial-001/ds_config.json") == 1
    # DeepSpeed's own --deepspeed is a bare flag: the config is the --deepspeed_config after it
    cmd = parse_command(["deepspeed", "train.py", "--deepspeed", "--deepspeed_config", "c.json"], cwd=tmp_path)
    assert cmd.user_config == "c.json"
    with pytest.raises(UserError, match="2 times"):
        parse_command(["deepspeed", "train.py", "--deepspeed", "a.json", "--deepspeed_config", "b.json"],
                      cwd=tmp_path)


def test_the_trainers_batch_arguments_are_replaced_in_place_or_added():
    args = ("--deepspeed", "ds.json", "--per-device-train-batch-size", "2", "--gradient_accumulation_steps=4")
    out = with_batch(args, 8, 1)
    assert out == ("--deepspeed", "ds.json", "--per-device-train-batch-size", "8", "--gradient_accumulation_steps=1")
    assert value_in(out, Knob(name="m", flag="--per-device-train-batch-size", joined=False, values=())) == "8"
    assert value_in(out, Knob(name="g", flag=GAS_FLAG, joined=False, values=())) == "1"
    assert with_batch(("--deepspeed", "ds.json"), 4, 2) == ("--deepspeed", "ds.json", MICRO_FLAG, "4", GAS_FLAG, "2")


def _filled() -> dict:
    """HF_CONFIG as the Trainer hands it to deepspeed.initialize: numbers in, its own sections added."""
    return {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
            "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 5e-05, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 0, "reduce_bucket_size": 4096}, "steps_per_print": float("inf"),
            "fp16": {"enabled": False}}


def test_a_trial_file_writes_only_what_the_trial_changes():
    tc = TrainerConfig(own=HF_CONFIG, filled=_filled())
    assert tc.trial_file(_filled()) == HF_CONFIG  # the baseline: the user's file itself
    trial = _filled()
    trial.update(train_batch_size=16, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1)
    trial["zero_optimization"] = {"stage": 2, "reduce_bucket_size": 50000, "overlap_comm": True}
    out = tc.trial_file(trial)
    assert out["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 50000, "overlap_comm": True}
    assert [out[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")] \
        == ["auto"] * 3  # the arguments carry the batch
    assert out["optimizer"] == HF_CONFIG["optimizer"] and "fp16" not in out and out["steps_per_print"] == 1000000
    # numbers in the user's file stay numbers, the trial's own (they must agree with the arguments)
    own = {**HF_CONFIG, "train_micro_batch_size_per_gpu": 2}
    assert TrainerConfig(own=own, filled=_filled()).trial_file(trial)["train_micro_batch_size_per_gpu"] == 8


def test_known_framework_failures_say_what_they_mean(tmp_path):
    (tmp_path / "t.py").write_text("")
    cmd = parse_command(["deepspeed", "t.py", "--deepspeed", "ds.json"], cwd=tmp_path)
    detail = "AssertionError: Check batch related parameters. train_batch_size is not equal to ... 8 != 2 * 4 * 2"
    assert "--use_cpu" in framework_hint(cmd, detail, "hf_trainer")
    cpu = parse_command(["deepspeed", "t.py", "--deepspeed", "ds.json", "--use_cpu"], cwd=tmp_path)
    assert framework_hint(cpu, detail, "hf_trainer") == ""
    assert framework_hint(cmd, "ValueError: something else", "hf_trainer") == ""


@pytest.mark.slow
def test_auto_values_without_a_trainer_are_one_line_after_the_start_up_check(tmp_path):
    """A plain script handed a config with "auto" through {config} (a Trainer could take it so):
    its start-up check finds no Trainer to fill them, so no trial can run. (Through DeepSpeed's own
    --deepspeed_config it is refused before the check: tests/test_usercmd_cli.py.)"""
    (tmp_path / "ds.json").write_text(json.dumps({**HF_CONFIG, "zero_optimization": {"stage": 2}}))
    proc = autotune_cli("run", "--study", str(tmp_path / "st"), "--budget", "2", "--no-metrics",
                        "--config", "ds.json", "--", "deepspeed", "--num_gpus", "2", str(EXAMPLES / "zero_train.py"),
                        "--deepspeed_config", "{config}", "--steps", "100000", cwd=tmp_path, env=user_env(),
                        timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "no HF Trainer builds this job's engine" in err[0], proc.stderr
    assert "train_micro_batch_size_per_gpu" in err[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "st" / "study.db").exists()


@pytest.mark.slow
def test_lightning_on_cpu_is_refused_with_its_own_reason(tmp_path):
    """Lightning 2.6's DeepSpeedStrategy refuses every accelerator but CUDA: the start-up check
    says so in one line, names Lightning's own error, and nothing is created."""
    proc = autotune_cli("run", "--study", str(tmp_path / "st"), "--budget", "2", "--no-metrics", "--",
                        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        str(EXAMPLES / "lightning_train.py"), "--devices", "2", "--accelerator", "cpu",
                        cwd=tmp_path, env=user_env(), timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr
    assert re.search(r"RuntimeError: The DeepSpeed strategy is only supported on CUDA GPUs", err[0]), err
    assert "runs on CUDA GPUs only" in err[0] and not (tmp_path / "st").exists()
