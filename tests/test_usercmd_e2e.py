"""`autotune run -- COMMAND` end to end: the example scripts, unchanged, as real DeepSpeed jobs on CPU."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import autotune_cli
from shared_studies import TRACE_STEPS, copy_study

from autotune.trials.launcher import free_port, remove_shm_buffers

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
SCRIPTS = Path(__file__).resolve().parent / "usercmd_scripts"
USER_CONFIG = EXAMPLES / "ds_config.json"
FAST = ("--steps", "2", "--warmup-steps", "1", "--fixed-steps", "--trial-timeout", "600")


def _env() -> dict[str, str]:
    # `deepspeed` is the one next to this Python, as in the user's activated environment
    return {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return autotune_cli("run", *args, cwd=cwd, env=_env())


def _trials(study: Path) -> list[tuple]:
    db = sqlite3.connect(study / "study.db")
    try:
        return db.execute("SELECT number, status, source, failure_reason, micro_batch_size, "
                          "gradient_accumulation_steps FROM trials ORDER BY number").fetchall()
    finally:
        db.close()


@pytest.fixture(scope="module")
def loader_study(usercmd_study):
    """The session's user-command study (tests/shared_studies.py): the engine-owned-loader example
    through `deepspeed`, budget 3."""
    proc = usercmd_study
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.root, proc.study, list(proc.command), proc


def test_every_trial_ran_the_users_script_and_succeeded(loader_study):
    cwd, study, _, proc = loader_study
    rows = _trials(study)
    assert [r[0] for r in rows] == [0, 1, 2]
    assert all(r[1] == "ok" for r in rows), rows
    assert rows[0][2] == "baseline" and (rows[0][4], rows[0][5]) == (2, 8)  # the user's micro 2 x GAS 8
    assert all(r[4] * r[5] == 16 for r in rows)  # their train_batch_size 16 is the fixed global batch (dp 1)
    assert "2 pipeline stages x 1 data-parallel" in proc.stdout  # measured, not asked for
    for n in range(3):
        d = study / f"trial-{n:03d}"
        assert sorted(p.name for p in d.glob("metrics-rank*.csv")) == ["metrics-rank0.csv", "metrics-rank1.csv"]
        traced = TRACE_STEPS + 2 if (d / "traces").is_dir() else 0  # + the profiler's warm-up and settling
        assert len((d / "metrics-rank1.csv").read_text().splitlines()) == 1 + 3 + traced  # header + warm-up + 2 steps


def test_the_outputs_name_the_users_command_and_what_its_start_up_check_read(loader_study):
    """Not the built-in preset (`workload tiny`): the header, summary.json, report.md, report.html."""
    import re

    from autotune.study.job_record import short_command

    _, study, command, proc = loader_study
    db = sqlite3.connect(study / "study.db")
    try:
        stored = json.loads(db.execute("SELECT value FROM meta WHERE key = 'user_command'").fetchone()[0])
    finally:
        db.close()
    said = re.search(r"the job: .* ([\d,]+) parameters, micro 2 x GAS 8", proc.stdout)  # the check's own note
    assert said and stored["parameters"] == int(said.group(1).replace(",", "")) > 0
    assert (stored["pipeline_stages"], stored["data_parallel_size"]) == (2, 1)
    assert (stored["micro_batch_size"], stored["gradient_accumulation_steps"]) == (2, 8)  # examples/ds_config.json
    shown = short_command(command)
    assert shown.startswith("deepspeed --num_gpus 2 ")
    facts = (f"(start-up check: {stored['parameters']:,} parameters, 2 pipeline stages x 1 data-parallel = 2 ranks, "
             "micro-batch 2 x GAS 8 in its config)")
    header = next(line for line in proc.stdout.splitlines() if line.startswith("study: "))
    assert f"  |  the command {shown} {facts}  |  tuner: " in header and "tiny" not in header
    summary = json.loads((study / "summary.json").read_text())
    assert summary["job"] == f"the command {shown} {facts}" and summary["workload"]["preset"] is None
    assert f"On: the command `{shown}` {facts}." in (study / "report.md").read_text()
    if (study / "report.html").is_file():  # the report extra installed
        page = (study / "report.html").read_text()
        assert "workload tiny" not in page and f"<dt>On</dt><dd>the command {shown} {facts}" in page.replace(
            "&#x27;", "'")


def test_the_scripts_sequence_length_is_read_from_its_token_input(loader_study):
    """pipeline_train.py feeds (2 x 32) token ids: its first stage reads 32 off the input; the last
    stage never sees the input and leaves the cells empty; the summary has the tokens."""
    from autotune.loaders.metrics import read_records as read_metrics_csv

    _, study, _, _ = loader_study
    for n in range(3):
        d = study / f"trial-{n:03d}"
        first, last = (read_metrics_csv(d / f"metrics-rank{r}.csv") for r in (0, 1))
        assert {r.seq_length for r in first} == {32}
        assert all(r.tokens_per_second == pytest.approx(r.samples_per_second * 32) for r in first)
        assert {(r.seq_length, r.tokens_per_second) for r in last} == {(None, None)}
    db = sqlite3.connect(study / "study.db")
    try:
        summaries = [json.loads(s) for (s,) in db.execute("SELECT summary_json FROM trials ORDER BY number")]
    finally:
        db.close()
    assert len(summaries) == 3
    assert all(s["tokens_per_second"] == pytest.approx(s["samples_per_second"] * 32) for s in summaries)


def test_trial_0_is_the_users_config_unchanged_and_the_others_keep_everything_else(loader_study):
    _, study, _, _ = loader_study
    user = json.loads(USER_CONFIG.read_text())
    assert json.loads((study / "trial-000" / "ds_config.json").read_text()) == user
    for n in (1, 2):
        cfg = json.loads((study / f"trial-{n:03d}" / "ds_config.json").read_text())
        assert cfg["gradient_clipping"] == user["gradient_clipping"]
        assert cfg["optimizer"] == user["optimizer"]
        assert cfg["train_batch_size"] == 16


def test_the_stop_never_reached_the_scripts_checkpoint_and_left_nothing_running(loader_study):
    cwd, study, _, _ = loader_study
    assert not (cwd / "ckpt").exists()  # the script saves a checkpoint after its loop
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(study.resolve()) not in ps


def test_best_config_trains_the_script_on_its_own(loader_study, tmp_path):
    _, study, _, _ = loader_study
    cwd = tmp_path  # its checkpoint goes here, not beside the shared study
    best = study / "best_ds_config.json"
    summary = json.loads((study / "summary.json").read_text())
    assert summary["best"] is not None and (study / "report.md").is_file()
    port = free_port()  # its own port, so its /dev/shm buffers (DeepSpeed never unlinks them) go after
    try:
        proc = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(port),
                               str(EXAMPLES / "pipeline_train.py"), "--deepspeed_config", str(best),
                               "--steps", "2", "--save-dir", "own"],
                              cwd=cwd, capture_output=True, text=True, timeout=900, env={**os.environ, **_env()})
    finally:
        remove_shm_buffers(port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (cwd / "own").is_dir()  # unstopped, the script reaches its own checkpoint


def test_a_different_command_for_the_study_is_refused_and_the_study_kept(loader_study, tmp_path):
    _, _, command, shared = loader_study
    study = copy_study(shared, tmp_path)  # a refusal that went wrong must not touch the shared one
    before = (study / "study.db").read_bytes()
    proc = _run(tmp_path, "--study", study.name, "--", *command[:-1], "other")
    assert proc.returncode == 2, proc.stderr
    assert "created for another command" in proc.stderr and proc.stderr.count("\n") == 1
    assert (study / "study.db").read_bytes() == before


def test_own_iterator_script_through_torchrun(tmp_path):
    """The other shape: plain modules and lambdas, LOCAL_RANK, its own iterator in train_batch(data_iter=...)."""
    proc = _run(tmp_path, "--budget", "2", "--study", "st", *FAST, "--",
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                str(EXAMPLES / "pipeline_train_iter.py"), "--deepspeed_config", str(USER_CONFIG),
                "--steps", "100000", "--out", "final.pt")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _trials(tmp_path / "st")
    assert [(r[0], r[1]) for r in rows] == [(0, "ok"), (1, "ok")], rows
    assert not (tmp_path / "final.pt").exists()  # nor its evaluation and final save


@pytest.mark.parametrize("script, reason, words", [
    ("crash_at_import.py", "crash", "No module named 'no_such_module_for_autotune'"),
    ("no_deepspeed.py", "no_engine", "exited without calling deepspeed.initialize"),
])
def test_scripts_that_cannot_be_tuned_are_classified_before_any_trial(tmp_path, script, reason, words):
    config = tmp_path / "ds.json"  # no train_batch_size: valid for the plain engine's dp 2 too
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}))
    proc = _run(tmp_path, "--study", "st", *FAST, "--", "deepspeed", "--num_gpus", "2", str(SCRIPTS / script),
                "--deepspeed_config", str(config))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"({reason})" in proc.stderr and words in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "st").exists()


def test_script_that_ends_before_the_trial_steps_is_a_classified_trial(tmp_path):
    proc = _run(tmp_path, "--budget", "1", "--study", "st", *FAST, "--", "deepspeed", "--num_gpus", "2",
                str(EXAMPLES / "pipeline_train.py"), "--deepspeed_config", str(USER_CONFIG), "--steps", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _trials(tmp_path / "st")
    assert [(r[1], r[3]) for r in rows] == [("failed", "ended_early")]
    assert "after 1 train_batch() call(s)" in proc.stdout
