"""The wheel and the sdist, built and installed as a user would.

The wheel goes into a fresh virtual environment with the base dependencies alone
(no torch, DeepSpeed, scikit-learn or scipy) and must run `advise` on every committed
fixture and `check`; `run` must stop before any trial with the extra to install.
Needs PyPI (or pip's cache) for the base dependencies, as a user's install does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "advise"
SHIPPED = ("autotune/data/builtin_rules.toml", "autotune/rank/workload/train.py", "autotune/py.typed",
           "exporters/sidecar.py")
HEAVY = ("torch", "deepspeed", "sklearn", "scipy", "skopt", "prometheus_client", "matplotlib")

pytestmark = pytest.mark.slow


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    # sdist first, then the wheel built from that sdist (python -m build's default), so a
    # file missing from the sdist fails here too. --no-isolation: setuptools from the venv.
    built = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)])
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheel, = out.glob("autotune-*.whl")
    sdist, = out.glob("autotune-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def test_wheel_and_sdist_ship_every_data_file_the_code_reads(dists):
    names = set(zipfile.ZipFile(dists["wheel"]).namelist())
    for f in SHIPPED:
        assert f in names, f
    with tarfile.open(dists["sdist"]) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
    for f in SHIPPED:
        assert f in members, f
    assert not any(n.startswith("tests/") for n in names)  # tests are not installed


def test_the_rules_people_edit_are_the_rules_the_package_reads():
    """rules/builtin.toml (where people read and edit them) is the packaged file, not a copy."""
    from autotune.advisor.rulebook import BUILTIN_RULES

    edited = REPO / "rules" / "builtin.toml"
    packaged = REPO / "autotune" / "data" / "builtin_rules.toml"
    assert edited.resolve() == packaged.resolve()
    assert BUILTIN_RULES.read_bytes() == packaged.read_bytes()


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory, dists) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "v"
    made = _run([sys.executable, "-m", "venv", str(venv)])
    assert made.returncode == 0, made.stderr
    inst = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(dists["wheel"])])
    assert inst.returncode == 0, inst.stdout[-3000:] + inst.stderr[-3000:]
    return venv


def test_base_install_has_none_of_the_heavy_dependencies(base_venv):
    code = f"import importlib.util as u, json; print(json.dumps([m for m in {HEAVY!r} if u.find_spec(m)]))"
    out = _run([str(base_venv / "bin" / "python"), "-c", code])
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_base_install_runs_help_advise_and_check_on_the_fixtures(base_venv, tmp_path):
    exe = str(base_venv / "bin" / "autotune")
    helped = _run([exe, "--help"], cwd=tmp_path)
    assert helped.returncode == 0 and all(c in helped.stdout for c in ("run", "advise", "check"))
    for fixture in sorted(FIXTURES.glob("*.csv")):
        advised = _run([exe, "advise", str(fixture), "--format", "json"], cwd=tmp_path)
        assert advised.returncode == 0, (fixture.name, advised.stderr[-2000:])
        assert json.loads(advised.stdout)["findings"], fixture.name
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1,
                               "zero_optimization": {"stage": 2}}))
    checked = _run([exe, "check", str(cfg), "--stages", "2", "--world-size", "4", "--format", "json"], cwd=tmp_path)
    assert checked.returncode == 1, checked.stderr  # ZeRO-2 in a pipeline job (--stages 2): a critical rule
    assert any(f["status"] == "fired" and f["severity"] == "critical"
               for f in json.loads(checked.stdout)["findings"])


def test_base_install_names_the_extra_instead_of_failing_trials(base_venv, tmp_path):
    exe = str(base_venv / "bin" / "autotune")
    ran = _run([exe, "run", "--budget", "20", "--study", "st"], cwd=tmp_path)
    assert ran.returncode == 2, ran.stdout + ran.stderr
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'autotune[tune]'" in lines[0] and "deepspeed" in lines[0]
    assert not (tmp_path / "st").exists()  # stopped before the first trial: no study made
    cfg = tmp_path / "fp16.json"
    cfg.write_text(json.dumps({"train_batch_size": 8, "fp16": {"enabled": True}}))
    checked = _run([exe, "check", str(cfg), "--device", "auto"], cwd=tmp_path)
    assert checked.returncode == 2 and "torch" in checked.stderr and "Traceback" not in checked.stderr
