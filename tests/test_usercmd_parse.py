"""Reading the user's training command (autotune/usercmd/command.py): no DeepSpeed run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.core.errors import UserError
from autotune.usercmd.command import parse_command


@pytest.fixture
def job(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}\n')
    return tmp_path


@pytest.mark.parametrize("argv, config, script_args_after", [
    (["deepspeed", "--num_gpus", "2", "train.py", "--deepspeed_config", "ds.json", "--steps", "9"],
     "ds.json", ["--deepspeed_config", "/T/ds_config.json", "--steps", "9"]),
    (["deepspeed", "train.py", "--deepspeed_config=ds.json"], "ds.json",
     ["--deepspeed_config=/T/ds_config.json"]),
    (["deepspeed", "--include", "localhost:0,1", "train.py", "--deepspeed", "--deepspeed_config", "ds.json"],
     "ds.json", ["--deepspeed", "--deepspeed_config", "/T/ds_config.json"]),
    (["python", "-m", "deepspeed.launcher.runner", "--num_gpus=2", "train.py", "--deepscale_config", "ds.json"],
     "ds.json", ["--deepscale_config", "/T/ds_config.json"]),
    (["torchrun", "--nproc_per_node", "2", "--standalone", "train.py", "--ds-config", "{config}"],
     None, ["--ds-config", "/T/ds_config.json"]),
    ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "train.py", "--cfg={config}"],
     None, ["--cfg=/T/ds_config.json"]),
])
def test_forms_find_the_config_and_substitute_it(job, argv, config, script_args_after):
    cmd = parse_command(argv, cwd=job)
    assert cmd.script == "train.py"
    assert cmd.user_config == config
    out = cmd.argv_for("/T/ds_config.json", 4321)
    at = out.index("train.py")
    assert out[at + 1:] == script_args_after
    assert out[at - 2:at] == ["--master_port", "4321"]
    assert out[:len(cmd.prefix)] == list(cmd.prefix)


def test_launcher_options_kept_and_master_port_replaced(job):
    cmd = parse_command(["deepspeed", "--num_gpus", "2", "--master_port", "29500", "--include=localhost:0",
                         "train.py", "--deepspeed_config", "ds.json", "--local_rank", "0"], cwd=job)
    out = cmd.argv_for("/T/c.json", 777)
    assert out[:out.index("train.py")] == ["deepspeed", "--num_gpus", "2", "--include=localhost:0",
                                           "--master_port", "777"]
    assert "29500" not in out
    assert out[-2:] == ["--local_rank", "0"]  # the script's own args untouched
    torch_cmd = parse_command(["torchrun", "--master-port=1234", "--nproc_per_node", "2", "train.py",
                               "--deepspeed_config", "ds.json"], cwd=job)
    assert "--master-port=1234" not in torch_cmd.argv_for("/c", 5)


def test_module_script_is_not_checked_as_a_file(job):
    cmd = parse_command(["torchrun", "-m", "mypkg.train", "--deepspeed_config", "ds.json"], cwd=job)
    assert cmd.script == "mypkg.train"


@pytest.mark.parametrize("argv, words", [
    ([], "no training command"),
    (["   "], "no training command"),
    (["python", "train.py", "--deepspeed_config", "ds.json"], "not one"),
    (["accelerate", "launch", "train.py"], "not one"),
    (["deepspeed", "--num_gpus", "2"], "names no training script"),
    (["deepspeed", "--num_gpus"], "needs a value"),
    (["deepspeed", "--num_gpu", "2", "train.py", "--deepspeed_config", "ds.json"], "not an option"),
    (["deepspeed", "missing.py", "--deepspeed_config", "ds.json"], "not found"),
    (["deepspeed", "train.py", "--deepspeed_config"], "no file after it"),
    (["deepspeed", "train.py", "--deepspeed_config", "--steps"], "no file after it"),
    (["deepspeed", "train.py", "--deepspeed_config="], "has no file"),
    (["deepspeed", "train.py", "--deepspeed_config", "a.json", "--deepspeed_config=b.json"], "2 times"),
])
def test_bad_commands_are_one_line_errors(job, argv, words):
    with pytest.raises(UserError) as err:
        parse_command(argv, cwd=job)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("argv", [["deepspeed", "train.py", "--steps", "3"],
                                  ["deepspeed", "train.py", "--ds-config", "ds.json"]])
def test_a_command_that_names_no_config_builds_it_in_code(job, argv):
    """`run` reads such a script's config at deepspeed.initialize; `watch`, which reads the file,
    says it cannot find one; --config cannot reach a config built in code."""
    cmd = parse_command(argv, cwd=job)
    assert cmd.config_in_code and not cmd.uses_placeholder
    assert cmd.config_path(None, job, in_code=True) is None
    assert cmd.argv_for(None, 29500)[-len(argv) + 1:] == argv[1:]  # the script's own arguments, untouched
    with pytest.raises(UserError, match="cannot find the DeepSpeed config"):
        cmd.config_path(None, job)
    with pytest.raises(UserError, match="--config ds.json: the command names no DeepSpeed config"):
        cmd.config_path("ds.json", job, in_code=True)


def test_option_tables_match_the_installed_launchers():
    """The tables say where the script starts; a launcher upgrade that adds options must show here."""
    pytest.importorskip("deepspeed")
    code = r"""
import argparse, json
import deepspeed.launcher.runner as r
import torch.distributed.run as t
cap = {}
def grab(self, args=None, namespace=None):
    cap["p"] = self
    raise SystemExit
orig, argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_args, grab
try:
    r.parse_args([])
except SystemExit:
    pass
argparse.ArgumentParser.parse_args = orig
def split(p):
    acts = [a for a in p._actions if a.option_strings and "-h" not in a.option_strings]
    return (sorted(s for a in acts if a.nargs == 0 for s in a.option_strings),
            sorted(s for a in acts if a.nargs != 0 for s in a.option_strings))
print(json.dumps({"deepspeed": split(cap["p"]), "torchrun": split(t.get_args_parser())}))
"""
    import json

    from autotune.usercmd import command

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    real = json.loads(out.stdout.strip().splitlines()[-1])
    for launcher, (flags, valued) in real.items():
        assert set(flags) == command._LAUNCHER_FLAGS[launcher], launcher
        assert set(valued) == command._LAUNCHER_VALUED[launcher], launcher
