"""Warm workers (autotune/trials/warm_pool.py): the same measurement as fresh processes, a pool reused
between trials, a hung trial that restarts the pool, nothing left running. Real ranks."""

from __future__ import annotations

import json
import sqlite3
import statistics
import time
from pathlib import Path

import pytest
from builders import run_trial
from robust_helpers import FAST, FAST_CONFIG, alive_under, rows, start_cli, write_config

from autotune.core.dsconfig import DsConfig
from autotune.core.options import WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.loaders.metrics import read_trial_columns
from autotune.rank.watchdog import StallLimits
from autotune.trials.builtin import builtin_runner
from autotune.trials.launcher import group_alive, shm_buffers

pytestmark = pytest.mark.slow

A = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4)
B = TrialConfig(micro_batch_size=4, gradient_accumulation_steps=2)
STALL = StallLimits(startup_seconds=600.0)
"""Each rank's watchdog armed, as in a study (autotune/rank/watchdog.py): no thread per trial may stay."""


def losses(trial_dir: Path) -> list[float]:
    """The last stage's loss of every step, warm-up included (the one quantity free of timing noise)."""
    cols = read_trial_columns(sorted(trial_dir.glob("metrics-rank*.csv")))
    return [v for v in cols["loss"] if v is not None and v == v]


def step_seconds(trial_dir: Path) -> float:
    cols = read_trial_columns(sorted(trial_dir.glob("metrics-rank*.csv")))
    return statistics.median(s for s, w in zip(cols["step_seconds"], cols["warmup"], strict=True) if not w)


@pytest.fixture(scope="module")
def warm_and_fresh(tmp_path_factory):
    """A warm runner: A, B, A, a hung trial (timeout), A; a fresh runner: A."""
    root = tmp_path_factory.mktemp("warm")
    base = DsConfig.from_dict(FAST_CONFIG)
    wl = dict(data_parallel_size=1, steps=3, warmup_steps=1)
    warm = builtin_runner(WorkloadOptions(**wl, faults="hang@3"), base)
    groups, outcomes = {}, {}
    try:
        for n, (cfg, timeout) in enumerate([(A, 900), (B, 300), (A, 300), (A, 20), (A, 900)]):
            outcomes[n] = run_trial(warm, n, cfg, root / f"warm-{n}", timeout=timeout, stall=STALL,  # as a study runs them
                                   on_start=lambda p, n=n: groups.setdefault(n, p.pgid))
        left_while_warm = alive_under(root)
        pool = warm.warm.pool
        pool.request_stop()  # what the end of a run does before it writes its outputs
        markers = [pool.folder / f"exited-rank{r}" for r in range(pool.num_ranks)]
        deadline = time.monotonic() + 120
        while not all(m.exists() for m in markers) and time.monotonic() < deadline:
            time.sleep(0.05)
        outcomes["exited"] = [m.exists() for m in markers]
    finally:
        warm.close()
    fresh = builtin_runner(WorkloadOptions(**wl, workers="fresh"), base)
    outcomes["fresh"] = run_trial(fresh, 0, A, root / "fresh", timeout=900)
    return root, outcomes, groups, left_while_warm


def test_warm_trials_succeed_in_one_pool(warm_and_fresh):
    root, outcomes, groups, left = warm_and_fresh
    for n in (0, 1, 2, 4, "fresh"):
        assert outcomes[n].result.ok, (n, outcomes[n].failure_detail)
    assert groups[0] == groups[1] == groups[2]  # the same launch served three trials
    assert left, "the pool is alive between trials"
    memory = json.loads((root / "warm-2" / "worker-memory.json").read_text())
    assert memory["mode"] == "warm" and memory["job_in_pool"] == 2
    for r in memory["ranks"]:  # released: the third engine did not leave the process bigger by much
        assert r["rss_after_bytes"] - r["rss_before_bytes"] < 64 * 2**20, r
    # each trial's process groups are destroyed with it (autotune/rank/workload/groups.py): left alive,
    # their gloo threads made a long-lived pool's trials slower
    first = json.loads((root / "warm-0" / "worker-memory.json").read_text())
    assert [r["process_groups"] for r in memory["ranks"]] == [r["process_groups"] for r in first["ranks"]]
    # and no rank keeps a trial's engine (train.drop_autograd_graphs): the last stage's did, with
    # its grid's gloo threads (15 more after every trial) and its parameters
    grown = [(a["rank"], a["threads"], b["threads"]) for a, b in zip(first["ranks"], memory["ranks"], strict=True)
             if b["threads"] > a["threads"]]
    assert not grown, f"threads after trial 0 and after trial 2, by rank: {grown}"


def test_warm_and_fresh_train_the_same_model_on_the_same_data(warm_and_fresh):
    root, _, _, _ = warm_and_fresh
    fresh = losses(root / "fresh")
    assert len(fresh) == 4 and fresh[-1] < fresh[0]  # it trains
    for n in (0, 2, 4):  # first in a pool, after another engine in the same process, first after a restart
        assert losses(root / f"warm-{n}") == pytest.approx(fresh, rel=1e-5), n
    # micro 4 x GAS 2 trains on the same 8 samples per step as micro 2 x GAS 4 (the data stream
    # draws the same windows): the tuned knobs change the schedule, not the arithmetic
    assert losses(root / "warm-1") == pytest.approx(fresh, rel=1e-4)
    # timings: the same order of magnitude, nothing tighter (two cores shared with other jobs)
    ratio = step_seconds(root / "warm-2") / step_seconds(root / "fresh")
    assert 0.2 < ratio < 5, ratio


def test_a_hung_warm_trial_times_out_and_the_next_starts_fresh_workers(warm_and_fresh):
    root, outcomes, groups, _ = warm_and_fresh
    assert outcomes[3].result.failure_reason == "timeout"
    assert "every rank was stopped" in outcomes[3].failure_detail
    assert not group_alive(groups[0])  # the hung pool is gone...
    assert groups[4] != groups[0]  # ...and trial 4 ran in a new one
    assert (root / "warm-3" / "launcher.log").stat().st_size > 0


def test_nothing_is_left_after_close(warm_and_fresh):
    root, outcomes, groups, _ = warm_and_fresh
    # told to stop, every rank took the quick way out (no interpreter teardown), so close()
    # SIGKILLed only the two launchers: and still nothing is left
    assert outcomes["exited"] == [True, True]
    assert alive_under(root) == []
    for pgid in groups.values():
        assert not group_alive(pgid)


def test_a_warm_study_of_budget_3_completes_and_leaves_nothing(builtin_study):
    """The session's built-in study (tests/shared_studies.py): budget 3 in warm workers, the default."""
    out = builtin_study.output
    assert builtin_study.returncode == 0, out[-3000:]
    study = builtin_study.study
    rs = rows(study)
    assert [(r[0], r[1]) for r in rs] == [(0, "ok"), (1, "ok"), (2, "ok")], out[-3000:]
    assert len({r[3] for r in rs}) == 1  # one pool for the whole study
    for n in range(3):
        folder = study / f"trial-{n:03d}"
        for name in ("ds_config.json", "trial.json", "launcher.log", "worker-memory.json",
                     "metrics-rank0.csv", "metrics-rank1.csv"):
            assert (folder / name).stat().st_size > 0, (n, name)
    summary = json.loads((study / "summary.json").read_text())
    assert summary["counted_trials"] == 3 and summary["best"]["status"] == "ok"
    assert "fresh processes" not in out  # nothing fell back
    assert builtin_study.alive_after == []
    assert shm_buffers(_port(study, 0)) == []  # the pool's buffers went with it


def test_a_controller_killed_between_warm_trials_resumes_and_leaves_nothing(tmp_path):
    """The controller dies (as SIGKILL would) after trial 0 while its pool waits: the warm ranks
    notice, remove their /dev/shm buffers and exit; the resume starts a new pool."""
    cfg = write_config(tmp_path)
    args = ["run", "--budget", "2", "--study", "st", "--config", str(cfg), *FAST]
    proc = start_cli(*args, cwd=tmp_path, env={"AUTOTUNE_TEST_CRASH_AT": "after-finish:0"})
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 99, out[-3000:]
    study = tmp_path / "st"
    pgid = rows(study)[0][3]
    deadline = time.time() + 60
    while group_alive(pgid) and time.time() < deadline:
        time.sleep(0.2)
    assert not group_alive(pgid)  # they went by themselves
    proc = start_cli(*args, cwd=tmp_path)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    assert [(r[0], r[1]) for r in rows(study)] == [(0, "ok"), (1, "ok")]
    assert alive_under(tmp_path) == []
    assert shm_buffers(_port(study, 0)) == [] and shm_buffers(_port(study, 1)) == []


def _port(study: Path, number: int) -> int:
    db = sqlite3.connect(study / "study.db")
    try:
        return db.execute("SELECT master_port FROM trials WHERE number = ?", (number,)).fetchone()[0]
    finally:
        db.close()
