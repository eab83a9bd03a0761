"""Controller crash and resume; Ctrl-C and SIGTERM. Real controllers, real ranks, real signals."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from robust_helpers import FAST, alive_under, rows, start_cli, write_config

from autotune.core.errors import StudyError
from autotune.study.store import open_study_readonly
from autotune.trials.launcher import group_alive, shm_buffers

pytestmark = pytest.mark.slow


def wait_for(pred, timeout: float = 300.0, every: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError("condition not reached in time")


def running_with_pgid(study: Path, number: int):
    if not (study / "study.db").exists():
        return None
    try:
        return next((r for r in rows(study) if r[0] == number and r[1] == "running" and r[3]), None)
    except StudyError:  # the controller is still creating it
        return None


def check_consistent(study: Path, *, current: bool = True) -> dict:
    """Every trial number counted at most once; summary.json is whole (and, unless the controller
    died before rewriting it, agrees with the database)."""
    rs = rows(study)
    counted = [r[0] for r in rs if r[1] in ("ok", "failed")]
    assert len(counted) == len(set(counted)), rs
    assert sum(1 for r in rs if r[1] == "running") <= 1
    summary = json.loads((study / "summary.json").read_text())  # never half-written
    if current:
        assert summary["counted_trials"] == len(counted)
    else:
        assert summary["counted_trials"] <= len(counted)
    return summary


def master_port(study: Path, number: int) -> int | None:
    st = open_study_readonly(study)
    try:
        return next((t.master_port for t in st.trials() if t.number == number), None)
    finally:
        st.close()


def test_controller_killed_at_several_points_resumes_to_the_budget(tmp_path):
    cfg = write_config(tmp_path)
    study = tmp_path / "st"
    # fresh processes: this test kills the controller in the middle of a trial and needs the
    # orphaned ranks to run on (warm trials last a second; tests/test_warm_workers.py kills those)
    args = ["run", "--budget", "3", "--study", "st", "--config", str(cfg), *FAST, "--workers", "fresh"]

    # 1. a real SIGKILL at a random moment while trial 1 runs: its ranks are orphaned
    proc = start_cli(*args, cwd=tmp_path)
    row = wait_for(lambda: running_with_pgid(study, 1), timeout=600)
    port = master_port(study, 1)
    wait_for(lambda: shm_buffers(port), timeout=300)  # DeepSpeed's CPU comm buffers now exist
    time.sleep(random.uniform(0.0, 3.0))
    proc.kill()
    proc.wait()
    orphan_pgid = row[3]
    assert [r[1] for r in rows(study) if r[0] == 0] == ["ok"]
    assert [r[1] for r in rows(study) if r[0] == 1] == ["running"]  # as the dead controller left it

    # 2. resume; die right after trial 1's result is committed (before the files are rewritten)
    proc = start_cli(*args, "--resume", cwd=tmp_path, env={"AUTOTUNE_TEST_CRASH_AT": "after-finish:1"})
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 99, out[-3000:]
    assert "stopped" in out or not group_alive(orphan_pgid)
    assert not group_alive(orphan_pgid)  # the old run's ranks were stopped by the stored group id
    assert shm_buffers(port) == []  # and their /dev/shm buffers removed by the stored port
    rs = rows(study)
    assert [(r[0], r[1]) for r in rs] == [(0, "ok"), (1, "interrupted"), (1, "ok")], rs

    # 3. resume (same --study, no --budget: the study keeps its own); die inside the atomic
    #    write of summary.json after trial 2 (no live metrics: the targets file is written
    #    atomically too, and would be the first write)
    proc = start_cli("run", "--study", "st", "--no-metrics", cwd=tmp_path,
                     env={"AUTOTUNE_TEST_CRASH_AT": "write:1"})
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 99, out[-3000:]
    stale = check_consistent(study, current=False)  # the old summary.json, whole
    assert stale["counted_trials"] == 1  # written after trial 0; trial 1's write never happened
    assert [r[1] for r in rows(study) if r[0] == 2] == ["ok"]

    # 4. the last resume has nothing left to run: it writes the files and ends
    proc = start_cli(*args, cwd=tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    summary = check_consistent(study)
    assert summary["counted_trials"] == 3
    assert sorted(t["trial"] for t in summary["trials"] if t["status"] in ("ok", "failed")) == [0, 1, 2]
    assert json.loads((study / "best_ds_config.json").read_text())["train_batch_size"] == 8
    assert not list(study.glob(".*.tmp"))  # the interrupted write's temp file was removed...
    assert (study / "trial-001" / "launcher.interrupted-1.log").exists()  # ...the interrupted log kept
    assert alive_under(tmp_path) == []

    # 5. raise the budget, and Ctrl-C while trial 3 runs: exit 130, its processes stopped,
    #    the study consistent and the best configuration so far still on disk
    proc = start_cli(*args[:2], "4", *args[3:], cwd=tmp_path)
    row = wait_for(lambda: running_with_pgid(study, 3), timeout=600)
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "interrupted" in out
    assert not group_alive(row[3])
    assert alive_under(tmp_path) == []
    assert [r[1] for r in rows(study) if r[0] == 3] == ["interrupted"]
    summary = check_consistent(study)
    assert summary["counted_trials"] == 3 and summary["best"] is not None
    assert json.loads((study / "best_ds_config.json").read_text())["train_batch_size"] == 8


def test_sigterm_stops_the_run_cleanly(tmp_path):
    cfg = write_config(tmp_path)
    study = tmp_path / "st"
    proc = start_cli("run", "--budget", "5", "--study", "st", "--config", str(cfg), *FAST, cwd=tmp_path)
    row = wait_for(lambda: running_with_pgid(study, 0), timeout=600)
    time.sleep(2.0)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out[-3000:]
    assert "Traceback" not in out and "interrupted (SIGTERM)" in out
    assert not group_alive(row[3])
    assert alive_under(tmp_path) == []
    assert [r[1] for r in rows(study)] == ["interrupted"]
    summary = check_consistent(study)
    assert summary["trials"][0]["status"] == "interrupted" and summary["best"] is None


def test_controller_killed_during_the_resume_clean_up_leaves_no_shm_buffers(tmp_path):
    """kill_resume_loop --seed 7 left two /dev/shm buffers of a trial whose port was stored.

    A resumed controller used to mark the dead controller's trial `interrupted` before it
    stopped the orphaned ranks and removed their buffers: killed in between, it left a row
    the next resume no longer cleaned up after. The row must stay `running` until then.
    """
    cfg = write_config(tmp_path)
    study = tmp_path / "st"
    # fresh processes: warm ranks see their controller die and remove their buffers themselves
    args = ["run", "--budget", "1", "--study", "st", "--config", str(cfg), *FAST, "--workers", "fresh"]

    # 1. the controller dies right after storing trial 0's group and port; its ranks run on
    proc = start_cli(*args, cwd=tmp_path, env={"AUTOTUNE_TEST_CRASH_AT": "during-trial:0"})
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 99, out[-3000:]
    port = master_port(study, 0)
    assert port is not None
    wait_for(lambda: shm_buffers(port), timeout=300)  # the orphaned ranks created their buffers

    # 2. the resume dies as it starts cleaning up after trial 0 (where a SIGKILL could land)
    proc = start_cli(*args, cwd=tmp_path, env={"AUTOTUNE_TEST_CRASH_AT": "recover:0"})
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 99, out[-3000:]
    assert [r[1] for r in rows(study)] == ["running"]  # still marked for clean-up

    # 3. the next resume stops the orphans, removes their buffers and runs trial 0 again
    proc = start_cli(*args, cwd=tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert shm_buffers(port) == []
    assert [(r[0], r[1]) for r in rows(study)] == [(0, "interrupted"), (0, "ok")]
    assert alive_under(tmp_path) == []
