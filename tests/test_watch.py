"""`autotune watch -- COMMAND`: the user's job unchanged and watched, with real DeepSpeed ranks on CPU
and a real Prometheus that finds them through the watch's file_sd targets file."""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from prom_helpers import prometheus_server
from robust_helpers import alive_under

from autotune.traces.rank_trace import read_rank_trace
from autotune.trials.launcher import free_port, shm_buffers
from exporters.file_sd import read_targets

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
USER_CONFIG = EXAMPLES / "ds_config.json"
JOB = "watchtest"


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _watch(cwd: Path, *args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autotune", "watch", *args], cwd=cwd, env=_env(),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.prometheus
def test_a_real_prometheus_scrapes_every_rank_through_file_sd_and_ctrl_c_stops_them_all(tmp_path):
    script = shutil.copy(EXAMPLES / "pipeline_train.py", tmp_path / "train.py")  # its ranks name tmp_path
    config = shutil.copy(USER_CONFIG, tmp_path / "ds_config.json")
    port = free_port()  # the job's own master port, kept: its /dev/shm buffers are named by it
    log = tmp_path / "watch.log"
    targets = tmp_path / "w" / "prometheus_targets.json"
    targets.parent.mkdir()
    targets.write_text("[]\n")  # Prometheus starts before the watch: the file exists from the start
    traces = tmp_path / "w" / "run-001" / "traces"
    proc = _watch(tmp_path, "--out", "w", "--job", JOB, "--interval", "1", "--trace-steps", "2", "--",
                  "deepspeed", "--num_gpus", "2", "--master_port", str(port), str(script),
                  "--deepspeed_config", str(config), "--steps", "100000", "--save-dir", "ckpt", log=log)
    try:
        with prometheus_server([], file_sd=[targets]) as prom:
            def ranks_and_findings_scraped() -> bool:
                assert proc.poll() is None, log.read_text()[-3000:]
                ranks = prom.query(f'autotune_steps_total{{job="{JOB}"}}')
                evaluated = prom.query(f'autotune_watch_evaluations_total{{job="{JOB}"}} > 0')
                traced = len(list(traces.glob("rank*.pt.trace.json.gz"))) == 2
                return len(ranks) == 2 and bool(evaluated) and traced

            prom.wait_until(ranks_and_findings_scraped, timeout=600,
                            what="both ranks and the findings scraped, both ranks traced")
            series = {(s["metric"]["rank"], s["metric"]["stage"], s["metric"]["trial"])
                      for s in prom.query(f'autotune_steps_total{{job="{JOB}"}}')}
            assert series == {("0", "0", "-1"), ("1", "1", "-1")}  # per rank, its stage, outside a study
            listed = {t.labels.get("rank"): t.port for t in read_targets(targets)}
            bound = {s["metric"]["rank"]: int(s["metric"]["instance"].rsplit(":", 1)[1])
                     for s in prom.query(f'autotune_steps_total{{job="{JOB}"}}')}
            assert bound == {r: p for r, p in listed.items() if r is not None}  # scraped where the file says
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    assert "stopped (SIGINT)" in out
    assert alive_under(tmp_path) == []  # launcher, ranks and their endpoint children: all gone
    assert shm_buffers(port) == []
    assert read_targets(targets) == []  # nothing listed serves any more
    run = tmp_path / "w" / "run-001"
    assert len((run / "metrics-rank1.csv").read_text().splitlines()) > 2
    assert not (tmp_path / "ckpt").exists()  # stopped, not run to its end
    # --trace-steps 2: both ranks traced after the 2 warm-up steps; the traced steps, the
    # profiler's warm-up and the settling step are left out of the summaries like the warm-up
    with open(run / "metrics-rank0.csv", newline="") as fh:
        warm = [r["warmup"] for r in csv.DictReader(fh)]
    assert warm[:7] == ["1"] * 6 + ["0"]
    assert all(len(read_rank_trace(f).steps) == 2 for f in traces.glob("rank*.pt.trace.json.gz"))


@pytest.mark.slow
def test_the_jobs_exit_code_is_passed_through(tmp_path):
    (tmp_path / "fail.py").write_text("import sys\nprint('exiting with 3', flush=True)\nsys.exit(3)\n")
    (tmp_path / "ds.json").write_text('{"train_batch_size": 2}\n')
    log = tmp_path / "watch.log"
    proc = _watch(tmp_path, "--no-metrics", "--", "deepspeed", "--num_gpus", "1", "fail.py",
                  "--deepspeed_config", "ds.json", log=log)
    assert proc.wait(timeout=300) == 3, log.read_text()[-3000:]
    run = tmp_path / "autotune-watch" / "run-001"
    assert "exiting with 3" in (run / "launcher.log").read_text()
    assert "exiting with 3" in log.read_text()  # echoed as it ran
    assert not (tmp_path / "autotune-watch" / "prometheus_targets.json").exists()  # --no-metrics
    # a second watch writes a new run folder: the first one's files stay as they are
    proc = _watch(tmp_path, "--no-metrics", "--", "deepspeed", "--num_gpus", "1", "fail.py",
                  "--deepspeed_config", "ds.json", log=log)
    assert proc.wait(timeout=300) == 3
    assert (tmp_path / "autotune-watch" / "run-002" / "launcher.log").is_file()
    assert (run / "launcher.log").is_file()


@pytest.fixture
def job(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}\n')
    (tmp_path / "bad.json").write_text('{"train_micro_batch_size_per_gpu": \n')
    return tmp_path


@pytest.mark.parametrize("command, message", [
    ([], "no training command after `--`"),
    (["deepspeed"], "names no training script"),
    (["deepspeed", "{job}/missing.py", "--deepspeed_config", "{job}/ds.json"], "training script"),
    (["deepspeed", "{job}/train.py", "--deepspeed_config", "{job}/nope.json"], "nope.json not found"),
    (["deepspeed", "{job}/train.py", "--deepspeed_config", "{job}/bad.json"], "not valid JSON"),
    (["deepspeed", "{job}/train.py", "--ds", "{config}"], "--config FILE"),
    (["python", "{job}/train.py"], "is not one"),
])
def test_bad_input_is_one_line_and_exit_2_and_starts_nothing(job, command, message):
    from autotune.cli.main import cli

    argv = [a.replace("{job}", str(job)) for a in command]
    result = CliRunner().invoke(cli, ["watch", "--out", str(job / "w"), "--", *argv])
    assert result.exit_code == 2, result.output
    assert message in result.output and result.output.startswith("autotune: error: ")
    assert result.output.count("\n") == 1
    assert not (job / "w").exists()


@pytest.mark.parametrize("options, message", [
    (["--metrics-port", "0"], "--metrics-port must be a port 1-65535, got 0"),
    (["--rank-metrics-port", "70000"], "--rank-metrics-port must be a port 1-65535, got 70000"),
    (["--metrics-addr", "a b;rm -rf"], "--metrics-addr 'a b;rm -rf': use an IP address or a host name"),
])
def test_bad_endpoint_options_are_refused_as_run_refuses_them(job, options, message):
    from autotune.cli.main import cli

    command = ["deepspeed", str(job / "train.py"), "--deepspeed_config", str(job / "ds.json")]
    result = CliRunner().invoke(cli, ["watch", "--out", str(job / "w"), *options, "--", *command])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"autotune: error: {message}")
    assert result.output.count("\n") == 1
    assert not (job / "w").exists()
    run = CliRunner().invoke(cli, ["run", "--study", str(job / "s"), *options])
    assert run.exit_code == 2 and message in run.output, run.output
