"""`--knob NAME[:V1,V2]=FLAG`: the user's model settings mapped to their script's flags
(autotune/usercmd/knobs.py): parsing, the flag in the command, the sweep's decision, and a
real study of examples/pipeline_train.py whose partition method is swept."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from launch_helpers import autotune_in_process
from step_driver import Driven

from autotune.core.errors import UserError
from autotune.core.space import TrialConfig
from autotune.tuning.knob_sweep import KnobSweep
from autotune.tuning.proposers.base import Proposal
from autotune.usercmd.knobs import own_values, parse_knob, parse_knobs, value_in, with_value

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "pipeline_train.py"
CONFIG = REPO / "examples" / "ds_config.json"


def test_both_spellings_and_the_default_values():
    k = parse_knob("partition_method=--partition {value}")
    assert (k.flag, k.joined, k.values) == ("--partition", False, ("parameters", "uniform"))
    k = parse_knob("activation_checkpoint_interval:0,2,4=--ckpt={value}")
    assert (k.flag, k.joined, k.values) == ("--ckpt", True, ("0", "2", "4"))
    assert k.tokens("2") == ["--ckpt=2"]


@pytest.mark.parametrize("text, words", [
    ("partition_method", "maps no flag"),
    ("partition_method=", "maps no flag"),
    ("partition_method=--partition", "has no {value}"),
    ("partition_method={value}", "names no flag"),
    ("partition_method=partition {value}", "is not a flag"),
    ("partition_method=--a {value} --b", "names no flag"),
    ("my_knob=--mine {value}", "no values to try"),
    ("stages=--stages {value}", "the stage count is the engine's"),
    ("x:1,1=--x {value}", "listed twice"),
    ("9bad=--x {value}", "is not a knob name"),
])
def test_bad_knobs_are_one_line(text, words):
    with pytest.raises(UserError, match=words.replace("{", r"\{").replace("}", r"\}")):
        parse_knob(text)


def test_the_config_flag_is_not_a_knob():
    from autotune.usercmd.knobs import check_against_command

    for args, at in ((("--cfg", "ds.json"), 1), (("--cfg=ds.json",), 0)):
        with pytest.raises(UserError, match="where the command takes the DeepSpeed config"):
            check_against_command(parse_knobs(["x:a,b=--cfg {value}"]), args, at)
    with pytest.raises(UserError, match="where the command takes the DeepSpeed config"):
        check_against_command(parse_knobs(["x:a,b=--deepspeed_config={value}"]), (), None)
    check_against_command(parse_knobs(["x:a,b=--other {value}"]), ("--cfg", "ds.json"), 1)  # fine


def test_a_flag_or_name_mapped_twice_is_refused():
    with pytest.raises(UserError, match="more than once"):
        parse_knobs(["partition_method=--p {value}", "partition_method=--q {value}"])
    with pytest.raises(UserError, match="more than one knob"):
        parse_knobs(["partition_method=--p {value}", "x:1,2=--p {value}"])


def test_the_commands_own_value_is_replaced_in_place_or_the_flag_appended():
    k = parse_knob("partition_method=--partition {value}")
    args = ("--deepspeed_config", "ds.json", "--partition", "parameters", "--steps", "9")
    assert value_in(args, k) == "parameters"
    assert with_value(args, k, "uniform") == ("--deepspeed_config", "ds.json", "--partition", "uniform",
                                              "--steps", "9")
    assert value_in(("--partition=type:Block",), k) == "type:Block"
    assert with_value(("--partition=type:Block",), k, "uniform") == ("--partition=uniform",)
    assert with_value(("--steps", "9"), k, "uniform") == ("--steps", "9", "--partition", "uniform")


class _Runner:
    """What the runner is told: the knob values of the request the sweep filled in last."""

    def __init__(self, sweep: Driven) -> None:
        self.sweep = sweep

    @property
    def knob_values(self) -> dict[str, str]:
        return self.sweep.request.knob_values


def _sweep(tmp_path, *texts, own=("--partition", "parameters")):
    knobs = parse_knobs(list(texts))
    sweep = Driven(KnobSweep(knobs, own_values(knobs, own), tmp_path, note=lambda s: None))
    return sweep, _Runner(sweep)


CFG = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=8)


def test_sweep_tries_each_other_value_at_the_baseline_and_keeps_the_fastest(tmp_path):
    sweep, runner = _sweep(tmp_path, "partition_method:parameters,uniform,type:Block=--partition {value}")
    base = Proposal(config=CFG, source="baseline")
    sweep.before(0, base)
    assert runner.knob_values == {"partition_method": "parameters"}
    sweep.after(0, base, True, 100.0, None)
    tried = []
    while (p := sweep.next_proposal()) is not None:
        assert p.config == CFG  # at the baseline's layout
        sweep.before(len(tried) + 1, p)
        tried.append(runner.knob_values["partition_method"])
        sweep.after(len(tried), p, True, {"uniform": 130.0, "type:Block": 90.0}[tried[-1]], None)
    assert tried == ["uniform", "type:Block"]  # the command's own value is the baseline's, not re-run
    sweep.before(9, Proposal(config=CFG, source="bayes"))
    assert runner.knob_values == {"partition_method": "uniform"}  # kept for every later trial
    info = json.loads((tmp_path / "knobs.json").read_text())
    assert info["kept"] == {"partition_method": "uniform"}
    assert info["measured"]["partition_method"] == {"uniform": 130.0, "type:Block": 90.0}


def test_sweep_keeps_the_commands_value_when_nothing_beats_it_or_the_trials_fail(tmp_path):
    sweep, runner = _sweep(tmp_path, "partition_method=--partition {value}")
    base = Proposal(config=CFG, source="baseline")
    sweep.after(0, base, True, 100.0, None)
    p = sweep.next_proposal()
    sweep.before(1, p)
    sweep.after(1, p, False, None, None)  # the uniform trial failed
    assert sweep.next_proposal() is None
    sweep.before(2, Proposal(config=CFG, source="bayes"))
    assert runner.knob_values == {"partition_method": "parameters"}


def test_resume_rebuilds_the_sweep_from_the_finished_trials(tmp_path):
    sweep, runner = _sweep(tmp_path, "partition_method:parameters,uniform,type:Block=--partition {value}")
    row = lambda n, src, sps: SimpleNamespace(number=n, source=src, status="ok", samples_per_second=sps,  # noqa: E731
                                              config=CFG, summary=None)
    sweep.replay([row(0, "baseline", 100.0), row(1, "knob:partition_method=uniform", 120.0)],
                 redo=[row(2, "knob:partition_method=type:Block", None)])
    assert sweep.next_proposal() is None  # uniform measured; type:Block is re-run as itself
    sweep.after(2, Proposal(config=CFG, source="knob:partition_method=type:Block"), True, 80.0, None)
    sweep.before(3, Proposal(config=CFG, source="bayes"))
    assert runner.knob_values == {"partition_method": "uniform"}


def _env() -> dict:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _autotune(cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", "run", *args], cwd=cwd, capture_output=True,
                          text=True, env=_env(), timeout=timeout)


@pytest.mark.parametrize("knob, words", [
    ("partition_method=--partition", "has no {value}"),
    ("stages=--stages {value}", "not a knob here"),
    ("x=--deepspeed_config {value}", "no values to try"),
    ("x:a,b=--deepspeed_config {value}", "where the command takes the DeepSpeed config"),
])
def test_cli_refuses_a_bad_knob_before_anything_runs(tmp_path, knob, words):
    r = autotune_in_process("run", "--budget", "2", "--study", "st", "--knob", knob, "--", "deepspeed", "--num_gpus",
                            "2", str(EXAMPLE), "--deepspeed_config", str(CONFIG), cwd=tmp_path, env=_env())
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error: --knob") and words in lines[0], lines
    assert not (tmp_path / "st").exists()


def test_cli_refuses_a_knob_without_a_command(tmp_path):
    r = autotune_in_process("run", "--budget", "1", "--study", "st", "--knob", "partition_method=--p {value}",
                            cwd=tmp_path, env=_env())
    assert r.returncode == 2
    assert r.stderr.strip() == ("autotune: error: --knob maps a model setting to a flag of your own script; "
                                "the built-in workload's are --partition-method and "
                                "--activation-checkpoint-interval")
    assert not (tmp_path / "st").exists()


@pytest.mark.slow
def test_a_mapped_knob_is_swept_in_a_real_study(tmp_path):
    r = _autotune(tmp_path, "--budget", "2", "--study", "st", "--steps", "2", "--warmup-steps", "1",
                  "--trial-timeout", "600", "--knob", "partition_method:uniform,type:Head=--partition {value}", "--",
                  "deepspeed", "--num_gpus", "2", str(EXAMPLE), "--deepspeed_config", str(CONFIG),
                  "--partition", "uniform", "--steps", "100000", "--save-dir", "ckpt", timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    db = sqlite3.connect(tmp_path / "st" / "study.db")
    trials = db.execute("SELECT number, status, source FROM trials ORDER BY number").fetchall()
    db.close()
    assert trials == [(0, "ok", "baseline"), (1, "ok", "knob:partition_method=type:Head")]
    from deepspeed.runtime.utils import partition_uniform

    parts = {}
    for number, method in ((0, "uniform"), (1, "type:Head")):
        trial = tmp_path / "st" / f"trial-{number:03d}"
        assert json.loads((trial / "knobs.json").read_text()) == {"partition_method": method}
        # the parts the script's own PipelineModule built, as the bootstrap read them from the engine
        parts[method] = json.loads((trial / "engine-rank0.json").read_text())["parts"]
    layers = parts["uniform"][-1]  # embedding, the blocks, the head
    assert parts["uniform"] == partition_uniform(num_items=layers, num_parts=2)
    assert parts["type:Head"] == [0, layers - 1, layers]  # the head alone on the last stage
    info = json.loads((tmp_path / "st" / "knobs.json").read_text())
    assert set(info["measured"]["partition_method"]) == {"type:Head"}
    assert info["kept"]["partition_method"] in ("uniform", "type:Head")
