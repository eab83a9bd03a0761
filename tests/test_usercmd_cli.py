"""`autotune run -- COMMAND` refusals that need no DeepSpeed run: exit 2, no study touched."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner


@pytest.fixture
def job(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}\n')
    return tmp_path


def test_cli_without_a_config_in_the_command_is_exit_2_before_any_trial(job):
    from autotune.cli import cli

    result = CliRunner().invoke(cli, ["run", "--budget", "2", "--study", str(job / "st"), "--",
                                      "deepspeed", str(job / "train.py"), "--steps", "3"])
    assert result.exit_code == 2, result.output
    assert "cannot find the DeepSpeed config" in result.output
    assert not (job / "st").exists()


def test_cli_placeholder_without_config_option_is_exit_2(job):
    from autotune.cli import cli

    result = CliRunner().invoke(cli, ["run", "--study", str(job / "st"), "--", "deepspeed",
                                      str(job / "train.py"), "--ds-config", "{config}"])
    assert result.exit_code == 2, result.output
    assert "--config" in result.output
    assert not (job / "st").exists()


def test_cli_config_that_cannot_be_parsed_is_exit_2(job):
    from autotune.cli import cli

    (job / "bad.json").write_text("{not json")
    result = CliRunner().invoke(cli, ["run", "--study", str(job / "st"), "--", "deepspeed",
                                      str(job / "train.py"), "--deepspeed_config", str(job / "bad.json")])
    assert result.exit_code == 2, result.output
    assert "not valid JSON" in result.output
    missing = CliRunner().invoke(cli, ["run", "--study", str(job / "st"), "--", "deepspeed",
                                       str(job / "train.py"), "--deepspeed_config", str(job / "nope.json")])
    assert missing.exit_code == 2 and "no such file" in missing.output
    assert not (job / "st").exists()


def test_cli_launcher_not_on_path_is_exit_2(job, monkeypatch):
    from autotune.cli import cli

    monkeypatch.setenv("PATH", str(job))
    result = CliRunner().invoke(cli, ["run", "--study", str(job / "st"), "--", "deepspeed",
                                      str(job / "train.py"), "--deepspeed_config", str(job / "ds.json")])
    assert result.exit_code == 2, result.output
    assert "'deepspeed' not found on PATH" in result.output
    assert not (job / "st").exists()


def test_cli_command_for_a_study_of_the_built_in_workload_is_refused_and_the_study_kept(job):
    import sqlite3

    from autotune.cli import cli
    from autotune.study import Study

    Study.open(job / "st", create=True, meta={"settings": {}}).close()
    before = (job / "st" / "study.db").read_bytes()
    result = CliRunner().invoke(cli, ["run", "--study", str(job / "st"), "--", "deepspeed",
                                      str(job / "train.py"), "--deepspeed_config", str(job / "ds.json")])
    assert result.exit_code == 2, result.output
    assert "study of the built-in workload" in result.output
    assert (job / "st" / "study.db").read_bytes() == before
    sqlite3.connect(job / "st" / "study.db").execute("SELECT count(*) FROM trials").fetchone()
