"""A ds_config asking for a precision the devices lack is refused before any trial.

Which precisions a CPU runs depends on its model (DeepSpeed's CPU accelerator asks oneDNN
for fp16), so the refusal path runs through the probe's testing seam on every machine,
and the probe itself is checked against DeepSpeed's own answer on the machine at hand.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from robust_helpers import FAST_CONFIG

from autotune.cli.main import cli
from autotune.core.dsconfig import DsConfig
from autotune.core.errors import ConfigError
from autotune.trials.precision import (
    TEST_OVERRIDE_ENV,
    DeviceSupport,
    check_precision,
    probe_devices,
    requested_precisions,
)

NO_FP16 = DeviceSupport(device="a test CPU", supported={"fp16": False, "bf16": True},
                        why_not={"fp16": "no fp16 units"})


def _cfg(**extra) -> DsConfig:
    return DsConfig.from_dict({**FAST_CONFIG, **extra})


@pytest.mark.parametrize(("extra", "want"), [
    ({}, []),
    ({"fp16": {"enabled": True}}, ["fp16"]),
    ({"fp16": {"enabled": False, "initial_scale_power": 8}}, []),
    ({"bf16": {"enabled": True}}, ["bf16"]),
    ({"bfloat16": {"enabled": True}}, ["bf16"]),  # DeepSpeed's old spelling
    ({"fp16": {"enabled": "auto"}}, []),  # HF's placeholder, not a DeepSpeed value
])
def test_requested_precisions_read_the_config_as_deepspeed_does(extra, want):
    assert requested_precisions(_cfg(**extra)) == want


def test_check_refuses_with_one_line_naming_precision_and_device():
    with pytest.raises(ConfigError) as err:
        check_precision(_cfg(fp16={"enabled": True}), NO_FP16)
    msg = str(err.value)
    assert "\n" not in msg and "fp16" in msg and "a test CPU" in msg and "no fp16 units" in msg
    assert "set fp16.enabled to false" in msg
    check_precision(_cfg(bf16={"enabled": True}), NO_FP16)  # bf16 is fine on that device
    check_precision(_cfg(), NO_FP16)


def test_probe_agrees_with_deepspeeds_cpu_accelerator():
    """The mirror of DeepSpeed's decision, checked against DeepSpeed itself on this CPU."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    env.pop(TEST_OVERRIDE_ENV, None)
    code = ("from deepspeed.accelerator import get_accelerator as g; import json; a = g(); "
            "print(json.dumps({'fp16': bool(a.is_fp16_supported()), 'bf16': bool(a.is_bf16_supported())}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    deepspeed_says = json.loads(out.stdout.strip().splitlines()[-1])
    ours = probe_devices("cpu")
    assert ours.supported == deepspeed_says
    assert "CPU" in ours.device
    assert all(p in ours.why_not for p, ok in ours.supported.items() if not ok)


def _study_rows(study: Path) -> list[tuple]:
    db = sqlite3.connect(study / "study.db")
    try:
        return db.execute("SELECT * FROM trials ORDER BY id").fetchall() + \
            db.execute("SELECT * FROM meta ORDER BY key").fetchall()
    finally:
        db.close()


@pytest.fixture
def fp16_on_a_device_without_it(tmp_path, monkeypatch):
    """A config enabling fp16, and devices that answer (through the testing seam) fp32 only."""
    monkeypatch.setenv(TEST_OVERRIDE_ENV, "fp32")
    probe_devices.cache_clear()
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps({**FAST_CONFIG, "fp16": {"enabled": True}}))
    yield cfg
    probe_devices.cache_clear()


def test_run_refuses_before_the_first_trial_and_leaves_a_study_alone(tmp_path, fp16_on_a_device_without_it):
    cfg = fp16_on_a_device_without_it
    runner = CliRunner()
    new = runner.invoke(cli, ["run", "--study", str(tmp_path / "new"), "--config", str(cfg), "--dp", "1"])
    assert new.exit_code == 2, new.output
    assert "fp16" in new.output and "test device" in new.output and "Traceback" not in new.output
    assert not (tmp_path / "new").exists()  # no study folder made for a run that cannot run

    # An existing study (made by the real Study API) is left exactly as it was.
    from autotune.study.store import Study

    study = Study.open(tmp_path / "old", create=True, meta={"settings": {"x": 1}})
    study.close()
    before = _study_rows(tmp_path / "old")
    files_before = sorted(p.name for p in (tmp_path / "old").iterdir())
    old = runner.invoke(cli, ["run", "--study", str(tmp_path / "old"), "--config", str(cfg), "--dp", "1"])
    assert old.exit_code == 2, old.output
    assert _study_rows(tmp_path / "old") == before
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == files_before


def test_check_says_the_same_when_it_knows_the_device(fp16_on_a_device_without_it):
    cfg = fp16_on_a_device_without_it
    known = CliRunner().invoke(cli, ["check", str(cfg), "--device", "auto", "--format", "json"])
    assert known.exit_code == 1, known.output  # a critical finding, as check reports them
    finding = next(f for f in json.loads(known.output)["findings"] if f["rule_id"] == "precision-unsupported")
    assert finding["severity"] == "critical" and "fp16" in finding["explanation"]
    assert finding["changes"][0]["target"] == "fp16.enabled" and finding["changes"][0]["new"] is False
    unknown = CliRunner().invoke(cli, ["check", str(cfg)])
    assert unknown.exit_code == 0, unknown.output
    assert "not checked against any device" in unknown.output


def test_check_refuses_to_ask_a_cuda_device_this_machine_does_not_have(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the refusal is for machines without one")
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({**FAST_CONFIG, "fp16": {"enabled": True}}))
    res = CliRunner().invoke(cli, ["check", str(cfg), "--device", "cuda"])
    assert res.exit_code == 2 and "no CUDA device" in res.output

