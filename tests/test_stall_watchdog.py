"""A rank that makes no progress writes its stack and ends (autotune/rank/watchdog.py), and the
controller says where it hung (autotune/trials/hangs.py) and how long the next may take
(autotune/trials/limits.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from builders import RecordingDisplay, ScriptedRunner

from autotune.core.space import TrialConfig
from autotune.core.trial_result import TrialResult
from autotune.rank.watchdog import STEP_FLOOR_SECONDS, StallLimits, Watchdog, building_op
from autotune.study.store import STATUS_OK, Study
from autotune.trials.hangs import read_hang, where_hung
from autotune.trials.judge import TrialOutcome, failed
from autotune.trials.limits import FIRST_TIMEOUT, STARTUP_BEFORE_MEASURED, limits_for
from autotune.tuning.tuner import StartupStalls

WAIT_ON_LOCK = """
import sys
from autotune.rank.watchdog import StallLimits, Watchdog
# torch first: on a loaded machine its import alone outlasted the limit, and the hang then
# named the import, not the lock
from torch.utils.file_baton import FileBaton  # torch's own lock, as cpp_extension.load takes it
dog = Watchdog(sys.argv[1], 1, StallLimits(startup_seconds=float(sys.argv[3])))
dog.startup(from_process_start=False)
FileBaton(sys.argv[2]).wait()
"""


def test_a_rank_waiting_on_a_stale_extension_lock_ends_as_a_hang_that_names_the_lock(tmp_path, monkeypatch):
    ext = tmp_path / "ext"
    (ext / "deepspeed_shm_comm").mkdir(parents=True)
    lock = ext / "deepspeed_shm_comm" / "lock"
    lock.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    trial = tmp_path / "trial-000"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", WAIT_ON_LOCK, str(trial), str(lock), "4"],
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 1  # faulthandler's exit: the launcher then stops the other ranks
    assert 4 <= took < 60
    hang = read_hang(trial)
    assert hang is not None and hang.rank == 1 and hang.in_startup and hang.limit_seconds == 4
    assert hang.where.startswith("waiting for torch's extension lock") and str(lock) in hang.where
    assert "hang-rank1.txt" in hang.describe()


WAIT_FOR_A_LIVE_BUILD = """
import sys, time
import autotune.rank.watchdog as w
# torch first: on a loaded machine its import alone outlasted the limit (the check then saw an
# import, not a build, and the rank ended as a hang): the wait is what this test is about
from torch.utils.file_baton import FileBaton
w.BUILD_EXTEND_SECONDS = 3.0
dog = w.Watchdog(sys.argv[1], 1, w.StallLimits(startup_seconds=float(sys.argv[3])))
dog.startup(from_process_start=False)
FileBaton(sys.argv[2]).wait()  # the holder below keeps the lock open, then removes it
dog.step_started(); dog.step_ended(); dog.stop()
"""

HOLD_THE_LOCK = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR)  # as torch's FileBaton takes it
time.sleep(float(sys.argv[2]))
os.remove(sys.argv[1]); os.close(fd)
"""


def test_a_start_up_waiting_for_a_live_build_outlasts_its_limit_and_goes_on(tmp_path):
    lock = tmp_path / "ext" / "fused_adam" / "lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(lock), "15"])
    try:
        while not lock.exists():
            time.sleep(0.05)
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", WAIT_FOR_A_LIVE_BUILD, str(tmp_path / "trial"), str(lock), "5"],
                              capture_output=True, text=True, timeout=120)
        took = time.monotonic() - started
    finally:
        holder.wait(timeout=60)
    assert proc.returncode == 0, proc.stderr  # 5 s of start-up limit, 15 s of someone else's build
    assert took > 10
    assert read_hang(tmp_path / "trial") is None and not list((tmp_path / "trial").glob("hang-rank*.txt"))


def _frames(*places: tuple[str, str], baton: object = None) -> list[SimpleNamespace]:
    return [SimpleNamespace(f_code=SimpleNamespace(co_filename=f, co_name=fn),
                            f_locals={"self": baton} if fn == "wait" else {}) for f, fn in places]


def test_a_build_is_progress_and_a_lock_nobody_holds_is_not(tmp_path):
    build = ("/v/torch/utils/cpp_extension.py", "_run_ninja_build"), ("/v/deepspeed/ops/op_builder/builder.py", "load")
    assert building_op(_frames(("/usr/lib/python3.11/subprocess.py", "run"), *build)) == "building"
    stale = tmp_path / "lock"
    stale.write_text("")  # no process holds it open or works in its folder
    baton = SimpleNamespace(lock_file_path=str(stale))
    assert building_op(_frames(("/v/torch/utils/file_baton.py", "wait"), *build, baton=baton)) is None
    gone = SimpleNamespace(lock_file_path=str(tmp_path / "released"))
    assert building_op(_frames(("/v/torch/utils/file_baton.py", "wait"), *build, baton=gone)) == "waiting for a live build"
    assert building_op(_frames(("/v/torch/distributed/rendezvous.py", "_create_c10d_store"))) is None


def test_a_step_far_slower_than_the_ranks_own_steps_is_a_stall(tmp_path):
    code = """
import sys, time
import autotune.rank.watchdog as w
w.STEP_FLOOR_SECONDS = 0.5
dog = w.Watchdog(sys.argv[1], 0, w.StallLimits(startup_seconds=30))
dog.startup(from_process_start=False)
for seconds in (0.01, 0.02, 0.01):
    dog.step_started(); time.sleep(seconds); dog.step_ended()
dog.step_started()
time.sleep(30)  # 10x the slowest step (0.2 s) but at least the floor (0.5 s): ends well before this
"""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, timeout=60)
    assert proc.returncode == 1 and time.monotonic() - started < 20
    hang = read_hang(tmp_path)
    assert hang is not None and hang.phase == "a training step" and not hang.in_startup
    assert json.loads((tmp_path / "startup-rank0.json").read_text())["seconds"] < 30


def test_a_trial_that_ends_well_leaves_no_hang_file_and_records_its_start_up(tmp_path):
    dog = Watchdog(tmp_path, 0, StallLimits(startup_seconds=60, step_seconds=1.0))
    dog.startup(from_process_start=False)
    time.sleep(0.05)
    for _ in range(3):
        dog.step_started()
        dog.step_ended()
    dog.stop()
    assert not list(tmp_path.glob("hang-rank*.txt"))
    assert read_hang(tmp_path) is None
    assert 0.04 <= json.loads((tmp_path / "startup-rank0.json").read_text())["seconds"] < 5


def test_an_armed_timer_that_never_fired_is_not_a_hang(tmp_path):
    (tmp_path / "hang-rank0.txt").write_text("autotune: rank 0 made no progress in start-up for 120 s; "
                                              "the stack of every thread:\n")
    assert read_hang(tmp_path) is None


@pytest.mark.parametrize(("frames", "expected"), [
    ([("torch/distributed/rendezvous.py", "_create_c10d_store"), ("torch/distributed/distributed_c10d.py", "init_process_group")],
     "in the process-group rendezvous"),
    ([("torch/distributed/distributed_c10d.py", "all_reduce"), ("deepspeed/comm/comm.py", "all_reduce")],
     "in a collective (all_reduce)"),
    ([("deepspeed/runtime/pipe/p2p.py", "recv"), ("deepspeed/runtime/pipe/engine.py", "_exec_recv_activations")],
     "in a pipeline recv"),
    ([("/home/u/train.py", "load_checkpoint"), ("/home/u/train.py", "main")], "at /home/u/train.py:"),
    ([("/v/torch/distributed/distributed_c10d.py", "_new_process_group_helper"),
      ("/v/deepspeed/runtime/pipe/module.py", "__init__")], "in torch.distributed (_new_process_group_helper)"),
])
def test_where_a_rank_hung_is_said_in_words(frames, expected):
    dump = "Thread 0x00007f00 (most recent call first):\n" + "".join(
        f'  File "{f}", line {i + 10} in {fn}\n' for i, (f, fn) in enumerate(frames))
    assert where_hung(dump).startswith(expected)


def test_a_rank_stuck_in_its_own_code_is_named_before_its_peer_waiting_for_it(tmp_path):
    stacks = {0: [("/v/torch/distributed/distributed_c10d.py", "_new_process_group_helper")],
              1: [("/v/autotune/faults.py", "inject_startup_fault"), ("/v/autotune/workload/worker.py", "main")]}
    for rank, frames in stacks.items():
        (tmp_path / f"hang-rank{rank}.txt").write_text(
            f"autotune: rank {rank} made no progress in start-up for 20 s; the stack of every thread:\n"
            "Thread 0x1 (most recent call first):\n" + "".join(f'  File "{f}", line 3 in {fn}\n' for f, fn in frames))
    hang = read_hang(tmp_path)
    assert hang is not None and hang.rank == 1 and hang.where.startswith("at /v/autotune/faults.py:3")


def test_the_lock_is_named_before_the_rendezvous_its_peers_wait_in(tmp_path):
    for rank, (f, fn) in enumerate([("torch/distributed/rendezvous.py", "_create_c10d_store"),
                                    ("torch/utils/file_baton.py", "wait")]):
        (tmp_path / f"hang-rank{rank}.txt").write_text(
            f"autotune: rank {rank} made no progress in start-up for 20 s; the stack of every thread:\n"
            f'Thread 0x1 (most recent call first):\n  File "{f}", line 3 in {fn}\n')
    hang = read_hang(tmp_path)
    assert hang is not None and hang.rank == 1 and "extension lock" in hang.where


def _finish(st: Study, n: int, cfg: TrialConfig, *, wall: float, sps: float, startup: float | None) -> None:
    tid = st.start_trial(n, cfg, "x", "")
    st.finish_trial(tid, status=STATUS_OK, samples_per_second=sps, failure_reason=None, failure_detail=None,
                    summary={"startup_seconds": startup, "data_parallel_size": 1}, rules_fired=[],
                    wall_seconds=wall)


def test_limits_follow_the_jobs_own_measured_start_up_and_steps(tmp_path):
    st = Study.open(tmp_path / "st", create=True, meta={})
    small = TrialConfig(micro_batch_size=1, gradient_accumulation_steps=2)
    large = TrialConfig(micro_batch_size=8, gradient_accumulation_steps=4)
    first = limits_for(small, st.trials())
    assert first.timeout == FIRST_TIMEOUT
    assert first.stall == StallLimits(startup_seconds=STARTUP_BEFORE_MEASURED, step_seconds=None)
    _finish(st, 0, small, wall=30.0, sps=4.0, startup=12.0)
    _finish(st, 1, small, wall=32.0, sps=5.0, startup=9.0)
    lim = limits_for(small, st.trials())
    assert lim.stall.startup_seconds == 24.0  # 2x the slowest measured start-up
    assert lim.stall.step_seconds == pytest.approx(2 / 4.0)  # the batch at the slowest speed seen
    grown = limits_for(large, st.trials())
    assert grown.stall.step_seconds == pytest.approx(32 / 4.0)  # 16x the batch: 16x the step
    assert grown.timeout > lim.timeout  # the trial's steps scale with its batch, start-up does not
    assert grown.timeout == pytest.approx(4 * (9.0 + (32.0 - 9.0) * 16))
    user = limits_for(small, st.trials(), trial_timeout=50.0, startup_timeout=300.0)
    assert user.timeout == 50.0 and user.stall.startup_seconds == 300.0
    assert STEP_FLOOR_SECONDS >= 30  # a step limit is never tighter than this
    st.close()


# ---- the tuning loop: limits reach the runner, the same start-up wall twice stops the run -------

class StallingRunner(ScriptedRunner):
    """Trial answers scripted per number; records what limits each trial was given."""

    def __init__(self, plan: dict[int, TrialOutcome]) -> None:
        self.plan, self.given = plan, {}

    def answer(self, request) -> TrialOutcome:
        number, timeout, stall = request.number, request.timeout, request.stall
        self.given[number] = (timeout, stall)
        return self.plan.get(number) or TrialOutcome(
            result=TrialResult(status=STATUS_OK, samples_per_second=10.0),
            summary=None, failure_detail=None, wall_seconds=20.0)

    def ds_config_for(self, config: TrialConfig) -> dict:
        return {"train_micro_batch_size_per_gpu": config.micro_batch_size}


def _hang(where: str) -> TrialOutcome:
    return failed("hang", f"rank 1 made no progress in start-up for 120 s: {where}; its stack is in x", 121.0)


def _tune(root, runner, budget=4):
    from autotune.core.space import SearchSpace
    from autotune.tuning.proposers.hybrid import HybridProposer
    from autotune.tuning.tuner import Tuner

    sp = SearchSpace.build(pipeline_stages=2, data_parallel_size=1, zero_stage=1, global_batch=16)
    study = Study.open(root, create=True)
    try:
        return Tuner(study=study, runner=runner, space=sp, note=RecordingDisplay().note, budget=budget,
                     baseline=TrialConfig(micro_batch_size=1, gradient_accumulation_steps=16),
                     proposer=HybridProposer(sp, seed=0, moves=None, budget=budget), stop_early=False).run()
    finally:
        study.close()


def test_the_same_start_up_stall_twice_in_a_row_stops_the_run_with_where(tmp_path):
    runner = StallingRunner({1: _hang("at /u/train.py:3 in load"), 2: _hang("at /u/train.py:3 in load")})
    with pytest.raises(StartupStalls) as err:
        _tune(tmp_path / "st", runner)
    assert "at /u/train.py:3 in load" in str(err.value) and "--resume" in str(err.value)
    assert sorted(runner.given) == [0, 1, 2]  # no third trial ran into the same wall
    st = Study.open(tmp_path / "st", create=False)
    try:
        assert [t.status for t in st.trials()] == ["ok", "failed", "failed"]  # nothing left running
    finally:
        st.close()
    assert (tmp_path / "st" / "summary.json").exists()


def test_different_stalls_or_one_stall_do_not_stop_the_run_and_limits_reach_the_runner(tmp_path):
    runner = StallingRunner({1: _hang("at /u/train.py:3 in load"), 2: _hang("in a collective (all_reduce)")})
    result = _tune(tmp_path / "st", runner, budget=4)
    assert result.exit_code == 0 and sorted(runner.given) == [0, 1, 2, 3]
    first_timeout, first_stall = runner.given[0]
    assert first_timeout == FIRST_TIMEOUT and first_stall.startup_seconds == STARTUP_BEFORE_MEASURED
    later_timeout, later_stall = runner.given[3]
    assert later_timeout < FIRST_TIMEOUT and later_stall.step_seconds is not None  # from trial 0's measurement
