"""The ranks' start-up hook (autotune/rank/bootstrap): chained, inert outside a trial, patches
deepspeed.initialize when the script imports deepspeed. Real interpreters, no training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autotune
from autotune.core.rank_plan import RankPlan
from autotune.rank.hook import ENV, BootstrapSettings
from autotune.trials.user_command import BOOTSTRAP_DIR, rank_env

PROBE = ("import sys, json; import deepspeed; "
         "print(json.dumps({'wrapped': getattr(deepspeed.initialize, '_autotune_wrapped', False), "
         "'chained': 'chained' in sys.modules.get('builtins').__dict__.get('_marks', [])}))")


SOURCE_ROOT = str(Path(autotune.__file__).resolve().parent.parent)
"""Last on the child's path: the autotune under test, not another checkout's editable install."""


def _python(code: str, env: dict[str, str], tmp: Path) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in (ENV, "RANK", "PYTHONPATH")}
    env = {**env, "PYTHONPATH": os.pathsep.join([*filter(None, [env.get("PYTHONPATH")]), SOURCE_ROOT])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tmp, env={**base, "DS_ACCELERATOR": "cpu", **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def other_site(tmp_path: Path) -> Path:
    """A sitecustomize the environment already had: it must still run."""
    d = tmp_path / "site"
    d.mkdir()
    (d / "sitecustomize.py").write_text("import builtins\nbuiltins._marks = ['chained']\n")
    return d


def test_bootstrap_ships_a_sitecustomize():
    assert (BOOTSTRAP_DIR / "sitecustomize.py").is_file()
    env = rank_env(BootstrapSettings(plan=RankPlan(trial_dir="/x", trial=3)))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(BOOTSTRAP_DIR)
    assert BootstrapSettings.from_env(env[ENV]).plan.trial == 3


def test_rank_of_a_trial_gets_deepspeed_initialize_wrapped_and_the_old_sitecustomize_runs(tmp_path, other_site):
    settings = BootstrapSettings(plan=RankPlan(trial_dir=str(tmp_path))).to_env()
    got = _python(PROBE, {"PYTHONPATH": f"{BOOTSTRAP_DIR}{os.pathsep}{other_site}", ENV: settings,
                          "RANK": "0"}, tmp_path)
    assert got == {"wrapped": True, "chained": True}


def test_launcher_processes_and_other_pythons_are_left_alone(tmp_path, other_site):
    path = f"{BOOTSTRAP_DIR}{os.pathsep}{other_site}"
    settings = BootstrapSettings(plan=RankPlan(trial_dir=str(tmp_path))).to_env()
    no_rank = _python(PROBE, {"PYTHONPATH": path, ENV: settings}, tmp_path)
    assert no_rank == {"wrapped": False, "chained": True}
    no_trial = _python(PROBE, {"PYTHONPATH": path, "RANK": "0"}, tmp_path)
    assert no_trial == {"wrapped": False, "chained": True}
