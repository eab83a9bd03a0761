"""Bad input everywhere a user types or points: one line, exit 2, no traceback, nothing overwritten.

Also the engine's small guarantees that need no DeepSpeed: fault specs, the derived
timeout, leftover-process cleanup, the study lock, results recorded once.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders import not_a_study
from click.testing import CliRunner

from autotune.cli.main import cli
from autotune.core.dsconfig import DsConfig
from autotune.core.errors import UserError
from autotune.core.faults import parse_faults
from autotune.core.options import WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.study.store import STATUS_OK, Study, stored_budget
from autotune.trials.builtin import builtin_runner
from autotune.trials.contract import TrialRequest
from autotune.trials.launcher import group_alive, processes_with, stop_leftovers

REPO = Path(__file__).resolve().parents[1]


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=True)


def assert_user_error(res, *needles: str) -> None:
    out = res.output
    assert res.exit_code == 2, (res.exit_code, out, res.exception)
    assert "Traceback" not in out
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, out
    for n in needles:
        assert n in out, out


def folder_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("args, needle", [
    (["--budget", "0"], "--budget must be >= 1"),
    (["--budget", "-3"], "--budget must be >= 1"),
    (["--metrics-port", "-1"], "--metrics-port must be a port"),
    (["--rank-metrics-port", "70000"], "--rank-metrics-port must be a port"),
    (["--rank-metrics-port", "65535"], "passes port 65535"),
    (["--micro-min", "8", "--micro-max", "2"], "swap them"),
    (["--gas-min", "9", "--gas-max", "3"], "swap them"),
    (["--bucket-min", "1e8", "--bucket-max", "1e5"], "swap them"),
    (["--bucket-min", "nan"], "--bucket-min must be a finite"),
    (["--bucket-max", "inf"], "--bucket-max must be a finite"),
    (["--trial-timeout", "0"], "--trial-timeout"),
    (["--trial-timeout", "nan"], "--trial-timeout"),
    (["--stages", "1"], "--stages 1: a pipeline needs at least 2 stages"),
    (["--stages", "0"], "--stages must be >= 1"),
    (["--dp", "0"], "--dp must be >= 1"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--preset", "gpt-17"], "gpt-17"),
    (["--partition-method", "random"], "--partition-method"),
    (["--partition-method", "type:(["], "bad regular expression"),
    (["--metrics-addr", "--evil"], "--metrics-addr"),
    (["--metrics-addr", "a b;rm -rf"], "--metrics-addr"),
    (["--global-batch", "0"], "--global-batch"),
    (["--global-batch", "7"], "--global-batch 7"),
    (["--tuner", "magic"], "unknown proposer"),
    (["--seed", "-1"], "--seed"),
    (["--fault", "meteor@1"], "unknown fault"),
    (["--activation-checkpoint-interval", "-2"], "activation-checkpoint-interval"),
    (["--workers", "lukewarm"], "--workers 'lukewarm': use warm or fresh"),
    (["--step-precision", "0"], "--step-precision must be > 0"),
    (["--step-precision", "0.9"], "--step-precision must be <= 0.5"),
    (["--step-precision", "nan"], "--step-precision must be a finite number"),
    (["--max-steps", "0"], "--max-steps must be >= 1"),
    (["--steps", "6", "--max-steps", "3"], "--max-steps 3 is below --steps 6"),
    (["--trace-every-trial"], "--trace-every-trial needs --trace-steps N"),
    (["--trace-steps", "-1"], "--trace-steps must be >= 0"),
])
def test_run_arguments_out_of_range(tmp_path, args, needle):
    study = tmp_path / "st"
    res = invoke("run", "--study", str(study), *args)
    assert_user_error(res, needle)
    assert not study.exists(), "a rejected run must not create a study"


def write(p: Path, data: bytes | str) -> Path:
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (b"\xff\xfe\x00garbage", "cannot read"),
    ('{"train_batch_size": -4}', "positive integer"),
    ('{"train_micro_batch_size_per_gpu": "two"}', "positive integer"),
    ('{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}',
     "train_batch_size 10"),
    ('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}', "stage 3"),
    ('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": 5}', "zero_optimization"),
    # the built-in workload builds no optimizer: every trial would crash in deepspeed.initialize
    ('{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}', 'no "optimizer" section'),
    # HF Trainer's placeholders, with no Trainer to fill them (issue 42)
    ('{"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "Adam", "params": {"lr": "auto"}}}',
     'HF Trainer\'s "auto" at train_micro_batch_size_per_gpu, optimizer.params.lr'),
    ('{"train_micro_batch_size_per_gpu": 1, "train_micro_batch_size_per_gpu": 2}', "duplicate keys"),
])
def test_run_with_malformed_ds_config(tmp_path, content, needle):
    cfg = write(tmp_path / "ds.json", content)
    res = invoke("run", "--study", str(tmp_path / "st"), "--config", str(cfg))
    assert_user_error(res, needle)
    assert not (tmp_path / "st").exists()


def test_run_with_missing_and_unreadable_config(tmp_path):
    assert_user_error(invoke("run", "--study", str(tmp_path / "s"), "--config", str(tmp_path / "nope.json")),
                      "no such file")
    folder = tmp_path / "adir.json"
    folder.mkdir()
    res = invoke("run", "--study", str(tmp_path / "s"), "--config", str(folder))
    assert res.exit_code == 2 and "Traceback" not in res.output


@pytest.mark.parametrize("content, name, needle", [
    (b"", "t.bin", "fewer than 2 tokens"),
    (b"\x01\x00" * 10, "t.bin", "shorter than one sequence"),
    (b"\xff\xff" * 100, "t.bin", "token ids must lie"),
    (b"not numpy", "t.npy", "cannot read token file"),
])
def test_run_with_bad_token_file(tmp_path, content, name, needle):
    tok = write(tmp_path / name, content)
    res = invoke("run", "--study", str(tmp_path / "st"), "--tokens", str(tok))
    assert_user_error(res, needle)


def test_missing_token_file(tmp_path):
    assert_user_error(invoke("run", "--study", str(tmp_path / "st"), "--tokens", str(tmp_path / "x.bin")),
                      "token file not found")


def make_study(root: Path, **meta) -> Path:
    st = Study.open(root, create=True, meta={"settings": {"budget": 2}})
    st.start_trial(0, TrialConfig(micro_batch_size=1, gradient_accumulation_steps=4), "baseline", "")
    with st._db:
        for k, v in meta.items():
            st._db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (k, v))
    st.close()
    (root / "summary.json").write_text("{}")
    return root


@pytest.mark.parametrize("kind, needle", [
    ("other-format", "study format 99"),
    ("bad-settings", "stored settings"),
    ("not-a-study-folder", "not an autotune study"),
    ("garbage-db", "not a readable SQLite"),
    ("foreign-sqlite", "not an autotune study database"),
    ("empty-db", "empty study database"),
    ("a-file", "is not a folder"),
])
def test_study_folder_from_elsewhere_is_refused_untouched(tmp_path, kind, needle):
    root = tmp_path / "st"
    if kind == "other-format":
        make_study(root, format="99")
    elif kind == "bad-settings":
        make_study(root, settings=json.dumps({"budget": 2, "warp_drive": True}))
    else:
        not_a_study(root, {"not-a-study-folder": "plain", "foreign-sqlite": "foreign-db",
                           "a-file": "file"}.get(kind, kind))
    before = folder_hash(root) if root.is_dir() else root.read_bytes()
    assert_user_error(invoke("run", "--study", str(root), "--budget", "2"), needle)
    assert_user_error(invoke("run", "--study", str(root), "--budget", "2", "--resume"))
    after = folder_hash(root) if root.is_dir() else root.read_bytes()
    assert before == after


def test_resume_without_study(tmp_path):
    assert_user_error(invoke("run", "--study", str(tmp_path / "none"), "--resume"), "nothing to resume")
    assert not (tmp_path / "none").exists()


def test_a_study_in_use_is_refused(tmp_path):
    first = Study.open(tmp_path / "st", create=True, meta={})
    try:
        with pytest.raises(UserError, match="in use by another autotune run"):
            Study.open(tmp_path / "st", create=False)
    finally:
        first.close()
    Study.open(tmp_path / "st", create=False).close()  # released with its holder


def test_a_result_is_recorded_once_and_counted_once(tmp_path):
    st = Study.open(tmp_path / "st", create=True, meta={"budget": 4})
    cfg = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4)
    tid = st.start_trial(0, cfg, "baseline", "")
    kw = dict(samples_per_second=None, failure_reason=None, failure_detail=None, summary=None,
              rules_fired=[], wall_seconds=1.0)
    st.finish_trial(tid, status=STATUS_OK, **{**kw, "samples_per_second": 10.0})
    st.finish_trial(tid, status="failed", **{**kw, "failure_reason": "oom"})  # a late second write
    assert [(t.status, t.samples_per_second) for t in st.trials()] == [("ok", 10.0)]
    tid2 = st.start_trial(1, cfg, "explore", "")
    assert [t.number for t in st.interrupt_running()] == [1]
    st.finish_trial(tid2, status=STATUS_OK, **kw)  # a trial marked interrupted stays interrupted
    assert [t.status for t in st.trials()] == ["ok", "interrupted"]
    assert [t.number for t in st.counted()] == [0]
    st.close()
    assert stored_budget(tmp_path / "st") == 4
    assert stored_budget(tmp_path / "nothing") is None


def test_fault_specs(tmp_path):
    assert parse_faults("oom@1,kill@3") == {1: "oom", 3: "kill"}
    assert parse_faults("nan") == {None: "nan"}
    assert parse_faults("") == {}
    for bad in ("oom@x", "boom", "oom@-1"):
        with pytest.raises(UserError):
            parse_faults(bad)
    wl = WorkloadOptions(faults="oom@1,nolauncher@2")
    runner = builtin_runner(wl, DsConfig.from_dict({"train_micro_batch_size_per_gpu": 1}))
    told = {n: runner.describe(TrialRequest(number=n, config=TrialConfig(micro_batch_size=1, gradient_accumulation_steps=1),
                                            trial_dir=tmp_path / f"trial-{n}", timeout=60.0),
                               tmp_path / f"trial-{n}").fault for n in (0, 1, 2)}
    assert told[1] == "oom"
    assert told[2] is None  # a controller-side fault never reaches the rank
    assert told[0] is None


def test_derived_timeout_follows_the_slowest_finished_trial(tmp_path):
    from autotune.trials.limits import (
        FIRST_TIMEOUT,
        MIN_TIMEOUT,
        STARTUP_BEFORE_MEASURED,
        TIMEOUT_FACTOR,
        limits_for,
    )

    st = Study.open(tmp_path / "st", create=True, meta={})
    cfg = TrialConfig(micro_batch_size=1, gradient_accumulation_steps=1)
    assert limits_for(cfg, st.trials()).timeout == FIRST_TIMEOUT
    for n, wall in enumerate((10.0, 50.0)):
        tid = st.start_trial(n, cfg, "x", "")
        st.finish_trial(tid, status=STATUS_OK, samples_per_second=1.0, failure_reason=None,
                        failure_detail=None, summary=None, rules_fired=[], wall_seconds=wall)
    # the slowest trial's start-up and steps with a margin, and never less than a start-up's limit
    # and a minimum for the steps
    assert limits_for(cfg, st.trials()).timeout == max(TIMEOUT_FACTOR * 50.0, STARTUP_BEFORE_MEASURED + MIN_TIMEOUT)
    assert limits_for(cfg, st.trials(), trial_timeout=7.0).timeout == 7.0
    st.close()


def test_stop_leftovers_kills_by_group_and_by_command_line(tmp_path):
    marker = str(tmp_path / "trial-007" / "ds_config.json")
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', sys.argv[1]]); time.sleep(120)"
    leader = subprocess.Popen([sys.executable, "-c", code, marker], start_new_session=True)
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker])  # other group
    deadline = time.time() + 20
    while len(processes_with(marker)) < 3 and time.time() < deadline:
        time.sleep(0.1)
    assert len(processes_with(marker)) == 3
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        # a stored group id that is not this trial's (recycled) is left alone
        assert stop_leftovers(unrelated.pid, marker, grace=2.0) == 3
        assert processes_with(marker) == []
        assert not group_alive(leader.pid)
        assert unrelated.poll() is None
    finally:
        for p in (leader, stray, unrelated):
            p.kill()
            p.wait()


def test_no_shell_and_loopback_defaults():
    sources = [p for d in ("autotune", "exporters", "benchmarks") for p in (REPO / d).rglob("*.py")]
    offenders = [str(p) for p in sources if re.search(r"shell\s*=\s*True|os\.system\(|os\.popen\(", p.read_text())]
    assert offenders == []
    from autotune.core.options import RunOptions

    assert RunOptions().metrics_addr == "127.0.0.1" and WorkloadOptions().metrics_addr == "127.0.0.1"
    help_text = invoke("run", "--help").output
    assert "127.0.0.1" in help_text


def test_rule_files_are_data_not_code(tmp_path):
    from autotune.advisor.rulebook import load_rule_file

    canary = tmp_path / "pwned"
    evil = tmp_path / "evil.toml"
    evil.write_text(f'''[[rule]]
id = "evil"
title = "__import__('os').system('touch {canary}')"
severity = "info"
signal = "__import__('os').system('touch {canary}')"
op = ">"
threshold = 0
explanation = "x"
''')
    with pytest.raises(UserError):
        load_rule_file(evil)
    assert not canary.exists()
