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


def test_cli_without_a_config_in_the_command_runs_the_start_up_check_and_stops_there(job):
    """No config in the command: the script may build its own; this one never calls
    deepspeed.initialize, which its start-up check says before any trial."""
    from autotune.cli.main import cli

    result = CliRunner().invoke(cli, ["run", "--budget", "2", "--study", str(job / "st"), "--",
                                      "deepspeed", str(job / "train.py"), "--steps", "3"])
    assert result.exit_code == 2, result.output
    assert "(no_engine)" in result.output and "the DeepSpeed config the script builds" in result.output
    assert not (job / "st").exists()


def test_cli_placeholder_without_config_option_is_exit_2(job):
    from autotune.cli.main import cli

    result = CliRunner().invoke(cli, ["run", "--study", str(job / "st"), "--", "deepspeed",
                                      str(job / "train.py"), "--ds-config", "{config}"])
    assert result.exit_code == 2, result.output
    assert "--config" in result.output
    assert not (job / "st").exists()


def _run_with_config(job, name: str):
    """`autotune run -- deepspeed train.py --deepspeed_config JOB/NAME` in-process."""
    from autotune.cli.main import cli

    return CliRunner().invoke(cli, ["run", "--study", str(job / "st"), "--", "deepspeed",
                                    str(job / "train.py"), "--deepspeed_config", str(job / name)])


def test_cli_config_that_cannot_be_parsed_is_exit_2(job):
    (job / "bad.json").write_text("{not json")
    result = _run_with_config(job, "bad.json")
    assert result.exit_code == 2, result.output
    assert "not valid JSON" in result.output
    missing = _run_with_config(job, "nope.json")
    assert missing.exit_code == 2 and "no such file" in missing.output
    assert not (job / "st").exists()


def test_cli_hf_auto_values_without_a_trainer_are_exit_2_before_the_start_up_check(job):
    (job / "auto.json").write_text('{"train_micro_batch_size_per_gpu": "auto", // HF Trainer fills it\n}')
    result = _run_with_config(job, "auto.json")
    assert result.exit_code == 2, result.output
    assert 'HF Trainer\'s "auto" at train_micro_batch_size_per_gpu' in result.output
    assert "start-up check" not in result.output and not (job / "st").exists()


def test_cli_launcher_not_on_path_is_exit_2(job, monkeypatch):
    from autotune.cli.main import cli

    monkeypatch.setenv("PATH", str(job))
    result = CliRunner().invoke(cli, ["run", "--study", str(job / "st"), "--", "deepspeed",
                                      str(job / "train.py"), "--deepspeed_config", str(job / "ds.json")])
    assert result.exit_code == 2, result.output
    assert "'deepspeed' not found on PATH" in result.output
    assert not (job / "st").exists()


def test_cli_command_for_a_study_of_the_built_in_workload_is_refused_and_the_study_kept(job):
    import sqlite3

    from autotune.cli.main import cli
    from autotune.study.store import Study

    Study.open(job / "st", create=True, meta={"settings": {}}).close()
    before = (job / "st" / "study.db").read_bytes()
    result = CliRunner().invoke(cli, ["run", "--study", str(job / "st"), "--", "deepspeed",
                                      str(job / "train.py"), "--deepspeed_config", str(job / "ds.json")])
    assert result.exit_code == 2, result.output
    assert "study of the built-in workload" in result.output
    assert (job / "st" / "study.db").read_bytes() == before
    sqlite3.connect(job / "st" / "study.db").execute("SELECT count(*) FROM trials").fetchone()


# -- what a user-command study says it ran (issue 24, finding 4) --------------------------------
COMMAND_FACTS = {"parameters": 123_456, "pipeline_stages": 2, "data_parallel_size": 2, "micro_batch_size": 1,
                 "gradient_accumulation_steps": 16}


def _finished_user_study(job: Path, stored_facts: dict) -> tuple[Path, list[str]]:
    """A user-command study whose budget is spent, built through the real Study API; `stored_facts`
    is what its start-up check stored beside the command ({} for argv, cwd, parameters only: a study
    stored before the other fields)."""
    import json
    from dataclasses import asdict

    from html_study import CFGS, SPACE, ok_trial

    from autotune.core.options import RunOptions
    from autotune.study.job_record import META_KEY
    from autotune.study.store import Study

    (job / "ds.json").write_text(json.dumps({
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 16,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 1}}))
    argv = ["deepspeed", "--num_gpus", "2", "train.py", "--deepspeed_config", "ds.json", "-p", "2",
            "--backend", "gloo"]  # as the user typed it, in its folder
    opts = RunOptions(budget=3, config=str(job / "ds.json"), no_metrics=True)
    opts.workload.pipeline_stages, opts.workload.data_parallel_size = 2, 2
    opts.workload.steps, opts.workload.warmup_steps = 4, 1
    user = {"argv": argv, "cwd": str(job), "parameters": 123_456, **stored_facts}
    study = Study.open(job / "st", create=True, meta={
        "settings": opts.to_dict(), "budget": 3, "space": SPACE, "workload": asdict(opts.workload),
        META_KEY: user})
    for number, (cfg, speed) in enumerate([(CFGS[0], 20.0), (CFGS[1], 35.0), (CFGS[3], 50.0)]):
        ok_trial(study, number, cfg, speed)
    study.close()
    return job / "st", argv


COMMAND = "deepspeed --num_gpus 2 train.py --deepspeed_config ds.json -p 2 --backend gloo"


@pytest.fixture(scope="module", params=[COMMAND_FACTS, {}], ids=["start-up-facts", "older-study"])
def finished_run(request, tmp_path_factory):
    """`autotune run --study ST` on a finished user-command study: no trial runs, every output is
    written again. Returns (study folder, the run's output, what the reports must say)."""
    pytest.importorskip("matplotlib", reason="report.html: pip install 'autotune[report]'")
    from autotune.cli.main import cli

    folder = tmp_path_factory.mktemp("usercmd-outputs")
    (folder / "train.py").write_text("print('hi')\n")
    root, _ = _finished_user_study(folder, request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        result = CliRunner().invoke(cli, ["run", "--study", str(root), "--budget", "3", "--no-metrics"])
    assert result.exit_code == 0, result.output
    micro = ", micro-batch 1 x GAS 16 in its config" if request.param else ""  # an older study: not stored
    facts = f"(start-up check: 123,456 parameters, 2 pipeline stages x 2 data-parallel = 4 ranks{micro})"
    return root, result.output, facts


def test_the_runs_first_lines_name_the_users_command_not_a_preset(finished_run):
    _, output, facts = finished_run
    header = next(line for line in output.splitlines() if line.startswith("study: "))
    assert f"  |  the command {COMMAND} {facts}  |  tuner: hybrid, budget 3" in header
    assert "workload" not in header and "tiny" not in header


def test_summary_json_names_the_users_command_and_what_its_check_read(finished_run):
    import json

    root, _, facts = finished_run
    summary = json.loads((root / "summary.json").read_text())
    assert summary["job"] == f"the command {COMMAND} {facts}"
    assert summary["user_command"]["argv"] == COMMAND.split() and summary["user_command"]["parameters"] == 123_456
    assert summary["workload"]["preset"] is None  # the options' default preset never ran


def test_report_md_names_the_users_command(finished_run):
    root, _, facts = finished_run
    report = (root / "report.md").read_text()
    assert f"On: the command `{COMMAND}` {facts}." in report.splitlines()
    assert "tiny" not in report


def test_report_html_on_line_names_the_users_command(finished_run):
    root, _, facts = finished_run
    page = (root / "report.html").read_text()
    on = page.split("<dt>On</dt><dd>", 1)[1].split("</dd>", 1)[0]
    assert on.startswith(f"the command {COMMAND} {facts}")
    assert on.endswith("; 4 measured + 1 warm-up steps per trial")
    assert "tiny" not in on and "None" not in on and "?" not in on  # what is known, never a placeholder


def test_a_very_long_command_is_cut_after_a_word_saying_how_much_was_left_out():
    from autotune.study.job_record import COMMAND_SHOWN, describe_job, short_command

    argv = ["deepspeed", "--num_gpus", "8", "train.py", "--name", "a b"] + [f"--flag{i}=" + "x" * 20 for i in range(12)]
    shown = short_command(argv)
    assert len(shown) <= COMMAND_SHOWN
    assert shown.startswith("deepspeed --num_gpus 8 train.py --name 'a b' --flag0=")  # as typed, quoted as typed
    kept = shown.split(" ... ")[0].split(" ")
    assert shown.endswith(f" ... ({len(argv) - len(kept) + 1} more arguments)")  # 'a b' is one argument
    assert short_command(["/" + "p" * 300]) == "/" + "p" * 300  # the launcher is always named
    # a built-in study says its preset, as before; a stored command without facts names the command only
    assert describe_job(None, {"preset": "tiny", "pipeline_stages": 2, "data_parallel_size": 2}) == (
        "workload tiny, 2 pipeline stages x 2 data-parallel = 4 ranks")
    assert describe_job({"argv": ["torchrun", "t.py"]}, {}) == "the command torchrun t.py"


def test_cli_a_zero_key_deepspeed_refuses_is_exit_2_before_anything_runs(job):
    """DeepSpeed's ZeRO section forbids unknown keys: every trial would fail at initialize."""
    (job / "typo.json").write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, '
                                   '"overlap_com": true}}')
    result = _run_with_config(job, "typo.json")
    assert result.exit_code == 2, result.output
    assert "zero_optimization.overlap_com" in result.output and "did you mean overlap_comm?" in result.output
    assert "start-up check" not in result.output and not (job / "st").exists()
    from click.testing import CliRunner

    from autotune.cli.main import cli

    (job / "typo1.json").write_text('{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", '
                                    '"params": {"lr": 0.001}}, "zero_optimization": {"stage": 1, "overlap_com": true}}')
    built_in = CliRunner().invoke(cli, ["run", "--study", str(job / "st2"), "--config", str(job / "typo1.json"),
                                        "--no-metrics"])
    assert built_in.exit_code == 2 and "did you mean overlap_comm?" in built_in.output, built_in.output
    assert not (job / "st2").exists()


@pytest.mark.parametrize(("options", "needle"), [
    (["--engine", "torch"], "--engine: shapes the built-in workload only"),
    (["--schedule", "GPipe"], "--schedule: shapes"),
    (["--virtual-stages", "4"], "--virtual-stages: shapes"),
    (["--preset", "small", "--stages", "4"], "--preset, --stages: shape the built-in workload only"),
    (["--dp", "1"], "--dp: shapes"),
])
def test_cli_a_built_in_workload_option_with_a_command_is_refused_not_dropped(job, options, needle):
    """Issue 43: `--engine torch`, `--schedule`, `--virtual-stages` (and the other options that shape
    the built-in workload only) given with a command were dropped without a word, and the run then
    failed its start-up check as no_engine. Now one line, exit 2, before the start-up check runs."""
    from autotune.cli.main import cli

    result = CliRunner().invoke(cli, ["run", "--study", str(job / "st"), *options, "--", "deepspeed",
                                      str(job / "train.py"), "--deepspeed_config", str(job / "ds.json")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.output
    assert "start-up check: running" not in result.output and "Traceback" not in result.output
    assert ("sweep the schedule classes" in lines[0]) == any(o in options for o in ("--engine", "--schedule", "--virtual-stages"))
    assert not (job / "st").exists()
