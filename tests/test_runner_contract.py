"""The trial contract (autotune/trials/contract.py): every runner through the same cases.

As Optuna runs every storage through one suite (optuna/testing/pytest_storages.py), each
implementation here (fresh processes, warm workers, the user's own command) runs the same
two real trials on 2 stages, and the same launch failure. What the tuner relies on is
asserted once for all three:
- a trial ends ok with a summary, in its folder: ds_config.json is `ds_config_for(config)`,
  one metrics CSV per rank, the launcher's log;
- `on_start` receives the running process group (the study stores its id and port);
- the request is what the trial runs with: the layer-cost hooks on, the stage boundaries
  the partition step asked for (read back from the ranks' own layer-cost files);
- a launcher that cannot start is a `launcher_missing` outcome with its line in the log,
  not an exception;
- a rank that runs out of memory or is killed ends the trial as a failed outcome with that
  reason, and nothing of it is left running: for the three runners and the torch engine's
  launch (torchrun) too;
- a Ctrl-C while a trial's ranks step unwinds through the runner, which stops every rank;
- after `close()`, nothing of the runner is left running.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from robust_helpers import FAST_CONFIG, alive_under

from autotune.core.dsconfig import DsConfig
from autotune.core.options import WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.rank.layer_costs import read_trial_layer_costs
from autotune.rank.watchdog import StallLimits
from autotune.trials.builtin import BuiltinRunner, WarmRunner, builtin_runner
from autotune.trials.contract import Runner, TrialRequest
from autotune.trials.user_command import UserCommandRunner
from autotune.usercmd.command import parse_command

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
KINDS = ("fresh", "warm", "user-command")
FIRST = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4)
SECOND = TrialConfig(micro_batch_size=4, gradient_accumulation_steps=2)


def make_runner(kind: str, folder: Path, *, launcher: str | None = None, fault: str | None = None) -> Runner:
    """`fault`: injected at the third step of rank 1 (the built-in workload's --fault; the user's
    command: tests/usercmd_scripts/faulty_pipeline.py, told by CONTRACT_FAULT)."""
    base = DsConfig.from_dict(dict(FAST_CONFIG))
    if kind == "torch":  # the torch engine's launch (torchrun, its rank), fresh processes
        from autotune.engines.registry import engine_named

        engine = engine_named("torch")
        wl = WorkloadOptions(engine="torch", data_parallel_size=1, steps=3, warmup_steps=1, workers="fresh",
                             faults=f"{fault}@0" if fault else None)
        return builtin_runner(wl, base, launch=engine.launch, workload_knobs=engine.workload_knobs,
                              note=lambda _t: None)
    if kind in ("fresh", "warm"):
        wl = WorkloadOptions(data_parallel_size=1, steps=3, warmup_steps=1, workers=kind,
                             faults=f"{fault}@0" if fault else None)
        runner = builtin_runner(wl, base, launcher=[launcher] if launcher else None, note=lambda _t: None)
        assert isinstance(runner, WarmRunner if kind == "warm" else BuiltinRunner)
        return runner
    config = folder / "ds_config.json"
    config.write_text(json.dumps(FAST_CONFIG))
    script = REPO / "tests" / "usercmd_scripts" / "faulty_pipeline.py" if fault else REPO / "examples" / "pipeline_train.py"
    command = parse_command([launcher or "deepspeed", "--num_gpus", "2", str(script),
                             "--deepspeed_config", str(config), "--steps", "100000"], cwd=folder)
    return UserCommandRunner(command, base, cwd=folder, data_parallel_size=1, steps=3, warmup_steps=1)


@pytest.fixture(scope="module", params=KINDS)
def two_trials(request, tmp_path_factory):
    """Trial 0 with the layer-cost hooks at the job's own partition; trial 1 at other stage
    boundaries; then `close()`. What every case below reads."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind.replace("-", "_"))
    mp = pytest.MonkeyPatch()
    mp.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # its deepspeed
    mp.setenv("DS_ACCELERATOR", "cpu")
    runner = make_runner(kind, root)
    assert isinstance(runner, Runner)  # the protocol's members, checked at run time
    started: list[tuple[int | None, int | None]] = []
    try:
        first = runner.run(TrialRequest(number=0, config=FIRST, trial_dir=root / "trial-000", timeout=600,
                                        layer_costs=True, on_start=lambda p: started.append((p.pgid, p.master_port))))
        own = read_trial_layer_costs(root / "trial-000")
        assert own is not None, first.failure_detail
        moved = [own.parts[0], own.parts[1] + (1 if own.parts[1] + 1 < own.parts[2] else -1), own.parts[2]]
        second = runner.run(TrialRequest(number=1, config=SECOND, trial_dir=root / "trial-001", timeout=600,
                                         layer_costs=True, parts=moved))
        left_open = alive_under(root) if kind == "warm" else []
    finally:
        runner.close()
        mp.undo()
    yield {"kind": kind, "root": root, "runner": runner, "outcomes": [first, second], "started": started,
           "own": own.parts, "moved": moved, "left_open": left_open, "left": alive_under(root)}


def test_a_trial_ends_ok_with_its_evidence_in_its_folder(two_trials):
    runner, root = two_trials["runner"], two_trials["root"]
    for n, (outcome, config) in enumerate(zip(two_trials["outcomes"], (FIRST, SECOND), strict=True)):
        assert outcome.result.ok, (two_trials["kind"], n, outcome.failure_detail)
        assert outcome.summary is not None and outcome.summary.samples_per_second > 0
        folder = root / f"trial-{n:03d}"
        assert json.loads((folder / "ds_config.json").read_text()) == runner.ds_config_for(config)
        assert len(list(folder.glob("metrics-rank*.csv"))) == 2  # 2 stages x 1 dp
        assert (folder / "launcher.log").is_file()


def test_on_start_receives_the_running_process_group(two_trials):
    [(pgid, port)] = two_trials["started"]
    assert isinstance(pgid, int) and pgid > 1
    assert isinstance(port, int) and port > 0


def test_the_request_is_what_the_trial_runs_with(two_trials):
    moved = read_trial_layer_costs(two_trials["root"] / "trial-001")
    assert moved is not None  # the hooks were on because the request asked
    assert two_trials["moved"] != two_trials["own"]
    assert moved.parts == two_trials["moved"]  # the stage boundaries the request named


def test_nothing_is_left_running_after_close(two_trials):
    assert two_trials["left"] == []
    if two_trials["kind"] == "warm":  # ... while the pool did stay up between its trials
        assert two_trials["left_open"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_launcher_that_cannot_start_is_an_outcome_not_an_exception(kind, tmp_path):
    runner = make_runner(kind, tmp_path, launcher=str(tmp_path / "no-such-launcher" / "deepspeed"))
    try:
        outcome = runner.run(TrialRequest(number=0, config=FIRST, trial_dir=tmp_path / "trial-000", timeout=60))
    finally:
        runner.close()
    assert not outcome.result.ok and outcome.result.failure_reason == "launcher_missing"
    assert "no-such-launcher" in outcome.failure_detail
    assert "no-such-launcher" in (tmp_path / "trial-000" / "launcher.log").read_text()


FAILURES = {"oom": "oom", "kill": "killed"}
"""The fault injected on rank 1 -> the reason its trial must end with. A rank that stops
stepping is tests/test_stall_watchdog.py's and tests/test_faults.py's (its limit is at least a
minute: one case costs that much per runner)."""


@pytest.mark.parametrize("fault", sorted(FAILURES))
@pytest.mark.parametrize("kind", [*KINDS, "torch"])
def test_a_rank_that_fails_ends_the_trial_with_its_reason_and_leaves_nothing(kind, fault, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("CONTRACT_FAULT", fault)  # the user's command's script reads it
    runner = make_runner(kind, tmp_path, fault=fault)
    try:
        outcome = runner.run(TrialRequest(number=0, config=FIRST, trial_dir=tmp_path / "trial-000", timeout=300,
                                          stall=StallLimits(startup_seconds=240.0)))
    finally:
        runner.close()
    assert not outcome.result.ok and outcome.result.failure_reason == FAILURES[fault], \
        (kind, fault, outcome.result.failure_reason, outcome.failure_detail)
    assert outcome.failure_detail
    assert alive_under(tmp_path) == []


@pytest.mark.parametrize("kind", KINDS)
def test_an_interrupt_during_a_trial_stops_every_rank(kind, tmp_path, monkeypatch):
    """A Ctrl-C (SIGINT, the tuner's `stop_on_signals`) while a trial's ranks step unwinds through
    the runner, which stops every one of them on the way. The ranks hang at their third step (the
    `hang` fault) so the interrupt lands there, past the ops' load: a rank killed while it holds
    torch's extension lock would cost the next launch its stale-lock wait."""
    import signal
    import threading
    import time

    from autotune.tuning.stop_signals import Stopped, stop_on_signals

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("CONTRACT_FAULT", "hang")
    runner = make_runner(kind, tmp_path, fault="hang")
    trial_dir = tmp_path / "trial-000"
    sent: list[float] = []

    def interrupt_once_stepping() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            csvs = list(trial_dir.glob("metrics-rank*.csv"))
            if csvs and all(len(p.read_text().splitlines()) >= 2 for p in csvs):  # a step recorded on every rank
                sent.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.1)

    threading.Thread(target=interrupt_once_stepping, daemon=True).start()
    try:
        with pytest.raises(Stopped), stop_on_signals():
            runner.run(TrialRequest(number=0, config=FIRST, trial_dir=trial_dir, timeout=300))
    finally:
        runner.close()
    assert sent and alive_under(tmp_path) == []
