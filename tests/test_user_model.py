"""`--model MODULE:FUNCTION`: the user's own PipelineModule in the built-in trial loop.

Bad paths are refused before any trial (one line, exit 2, no study); the example module
(examples/my_pipeline.py) is tuned for real in warm workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from launch_helpers import autotune_cli
from robust_helpers import FAST, alive_under, rows, write_config

from autotune.cli.main import cli

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

BAD = '''
from torch import nn

def plain(num_stages, seed):
    return nn.Linear(2, 2)

def raises(num_stages, seed):
    raise RuntimeError("no such weights")

NOT_A_FUNCTION = 3
'''


BAD_PATHS = [
    ("no_such_module_xyz:build", "cannot import no_such_module_xyz: ModuleNotFoundError"),
    ("bad_models:missing", "bad_models has no function missing"),
    ("bad_models:NOT_A_FUNCTION", "has no function NOT_A_FUNCTION"),
    ("bad_models:plain", "plain returned Linear, not a deepspeed.pipe.PipelineModule"),
    ("bad_models:raises", "raised RuntimeError: no such weights"),
    ("not a path", "use MODULE:FUNCTION"),
    ("broken_import:build", "cannot import broken_import: ZeroDivisionError"),
]


def _user_modules(folder: Path) -> None:
    (folder / "bad_models.py").write_text(BAD)
    (folder / "broken_import.py").write_text("x = 1 / 0\n")


@pytest.mark.parametrize("path, needle", BAD_PATHS)
def test_bad_model_paths_are_one_line_before_any_trial(tmp_path, monkeypatch, path, needle):
    """In process (click's runner): the check itself is a real subprocess that imports the user's module."""
    _user_modules(tmp_path)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["run", "--budget", "1", "--study", "st", "--model", path, *FAST])
    assert res.exit_code == 2, (res.output[-2000:], res.exception)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error: --model"), res.stderr
    assert needle in lines[0]
    assert "Traceback" not in res.output
    assert not (tmp_path / "st").exists()


def test_a_bad_model_path_through_the_entry_point(tmp_path):
    """The same refusal from the installed command (`python -m autotune`): one line on stderr, exit 2."""
    _user_modules(tmp_path)
    path, needle = BAD_PATHS[3]
    res = autotune_cli("run", "--budget", "1", "--study", "st", "--model", path, *FAST, cwd=tmp_path, timeout=300)
    assert res.returncode == 2, (res.stdout[-2000:], res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error: --model") and needle in lines[0], res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert not (tmp_path / "st").exists()


def test_the_example_model_is_tuned_in_warm_workers(tmp_path):
    """Copied as `model.py` into the working directory: a name autotune/rank/workload also has
    (the rank script's folder must not shadow the user's module)."""
    cfg = write_config(tmp_path)
    (tmp_path / "model.py").write_text((EXAMPLES / "my_pipeline.py").read_text())
    res = autotune_cli("run", "--budget", "2", "--study", "st", "--config", str(cfg),
                       "--model", "model:build_pipeline", *FAST, cwd=tmp_path, timeout=900)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    study = tmp_path / "st"
    assert [(r[0], r[1]) for r in rows(study)] == [(0, "ok"), (1, "ok")]
    settings = json.loads((study / "trial-000" / "trial.json").read_text())
    assert settings["workload"]["model"] == "model:build_pipeline"
    log = (study / "trial-000" / "launcher.log").read_text()
    assert "Block" in log and "DecoderLayerPipe" not in log  # the user's layers, not the built-in ones
    assert (study / "trial-001" / "worker-memory.json").exists()  # warm
    assert alive_under(tmp_path) == []
