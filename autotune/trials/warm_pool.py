"""Warm workers: the built-in workload's ranks launched once and kept alive between trials.

A fresh trial pays for the launcher, `import torch`, `import deepspeed` and the process
group on every rank, every time (25-40 s of wall time for 1-4 s of measured steps on
the CPU demo). A pool starts the ranks once through the same DeepSpeed launcher
(autotune/trials/launcher.py) running autotune/rank/workload/worker.py; each trial then writes its
folder as a fresh trial does (ds_config.json, trial.json), posts one job file, and
waits until every rank has answered. The ranks build a fresh engine per trial and
release it (autotune/rank/workload/train.py `run_trial`), so a trial measures the same
thing in both modes.

Any trial that does not end well on every rank (a rank that failed, died or hung, a
timeout, an interrupt) stops the whole pool: the launcher's ending and the log are
judged exactly as a fresh trial's (autotune/trials/judge.py), and the next trial starts fresh
workers. Cases a warm process cannot be trusted with run in fresh processes, and the
run says so: launch faults of the test seam, activation checkpointing (DeepSpeed keeps
its configuration and RNG trackers in module globals), and a change of anything but
the tuned knobs (precision, ZeRO stage: a new pool is started).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from autotune.trials.launcher import (
    POLL_SECONDS,
    LaunchOutcome,
    LaunchSpec,
    TrialProcess,
    kill_group,
    leftover_ports,
    processes_with,
    remove_shm_buffers,
    wait_for,
)

WORKER_SCRIPT = Path(__file__).resolve().parent.parent / "rank" / "workload" / "worker.py"
POOLS_DIR = "workers"
"""The pools' folder inside a study (next to the trial folders)."""
WORKER_MODES = ("warm", "fresh")
MAX_JOBS_PER_POOL = 200
"""Trials per pool before it is recycled: a bound on what a rank may still gather over many
trials. Two leaks made a pool age, and both are fixed: each trial's process groups
(autotune/rank/workload/groups.py) and the last stage's engine (`train.drop_autograd_graphs`).
Measured over 80 trials in one pool of the 4-rank demo (benchmarks/pool_drift.py): threads
and open files per rank constant, RSS +5 MB. A new pool costs one launch (20-30 s here)."""

TUNED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
"""Top-level ds_config keys a trial may change in a warm pool (plus the ZeRO bucket)."""


POOL_FREE_ZERO_KEYS = ("reduce_bucket_size", "stage", "overlap_comm", "contiguous_gradients")
"""`zero_optimization` keys a trial may change in a warm pool: every trial builds a new engine and
optimizer, and these are read there. The ZeRO stage, `overlap_comm` and `contiguous_gradients`
(the ZeRO engine's sweep) were measured in one pool against fresh processes: every trial ok, the
same speeds within the noise (2 ranks, tiny, stages 2 -> 0 -> 1 -> 3: 212/336/323/93 samples/s
warm, 208/347/298/91 fresh; docs/zero-facts.md)."""


def pool_key(ds_config: dict) -> str:
    """What must stay the same for a trial to reuse a pool: the config without the tuned knobs."""
    rest = {k: v for k, v in ds_config.items() if k not in TUNED_KEYS}
    zero = dict(rest.get("zero_optimization") or {})
    for k in POOL_FREE_ZERO_KEYS:
        zero.pop(k, None)
    rest["zero_optimization"] = zero
    return json.dumps(rest, sort_keys=True)


def describe_change(old: dict, new: dict) -> str:
    """Which untuned part of the config changed (for the run's output)."""
    changed = sorted(k for k in set(old) | set(new) if k not in TUNED_KEYS and old.get(k) != new.get(k))
    return ", ".join(changed) or "zero_optimization"


def fresh_reason(ds_config: dict, activation_checkpoint_interval: int) -> str | None:
    """Why a study's trials cannot run in warm workers at all (None: they can)."""
    from autotune.core.dsconfig import checkpoint_interval

    if activation_checkpoint_interval > 0 or "activation_checkpointing" in ds_config or checkpoint_interval(ds_config):
        return ("activation checkpointing keeps DeepSpeed state in module globals between engines "
                "(deepspeed/runtime/activation_checkpointing/checkpointing.py)")
    return None


class WarmPool:
    """One launch of warm ranks in `folder`; `run_job` runs one trial in it."""

    def __init__(self, folder: Path, num_ranks: int, *, launcher: list[str] | None = None) -> None:
        self.folder = folder
        self.num_ranks = num_ranks
        self.launcher = launcher
        self.proc: TrialProcess | None = None
        self.jobs = 0
        self.key: str | None = None
        self.config: dict | None = None
        self.started_at: float | None = None

    @property
    def log_path(self) -> Path:
        return self.folder / "launcher.log"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.proc is not None and self.proc.proc.poll() is None

    def start(self) -> str | None:
        """Launch the ranks; an error line when the launcher cannot be started."""
        self.folder.mkdir(parents=True, exist_ok=True)
        spec = LaunchSpec(num_ranks=self.num_ranks, log_path=self.log_path, timeout=0.0, script=WORKER_SCRIPT,
                          script_args=["--pool", str(self.folder), "--controller-pid", str(os.getpid())])
        if self.launcher is not None:
            spec.launcher = list(self.launcher)
        self.proc = TrialProcess(spec)
        self.started_at = time.monotonic()
        error = self.proc.start()
        if error is None:
            (self.folder / "pool.json").write_text(json.dumps(
                {"pgid": self.proc.pgid, "master_port": self.proc.master_port}) + "\n", encoding="utf-8")
        return error

    def run_job(self, trial_spec: Path, trial_dir: Path, timeout: float) -> LaunchOutcome:
        """Post one trial, wait for every rank's answer, the pool's end or the timeout.

        The pool's log from the job's start on becomes the trial's launcher.log, so the
        trial folder holds the evidence the judge reads, as with a fresh launch."""
        assert self.proc is not None and self.proc.proc is not None
        k = self.jobs
        self.jobs += 1
        offset = self.log_path.stat().st_size if k > 0 and self.log_path.exists() else 0
        started = time.monotonic() if k > 0 else (self.started_at or time.monotonic())
        _write_atomic(self.folder / f"job-{k}.json", {"trial_spec": str(trial_spec)})
        done = [self.folder / f"done-{k}-rank{r}.json" for r in range(self.num_ranks)]
        deadline = started + timeout
        rc: int | None = None
        timed_out = False
        try:
            rc, timed_out = wait_for(self.proc.proc, deadline=deadline, answered=lambda: all(p.exists() for p in done),
                                     poll=POLL_SECONDS)
        finally:
            if rc != 0:  # failed, timed out or interrupted: the processes are not trusted again
                self.stop()
            _copy_log_tail(self.log_path, offset, trial_dir / "launcher.log")
        return LaunchOutcome(returncode=rc, timed_out=timed_out, wall_seconds=time.monotonic() - started,
                             log_path=trial_dir / "launcher.log")

    def answers(self, k: int) -> list[dict]:
        """The ranks' answers of job `k` (memory before and after, losses)."""
        out = []
        for r in range(self.num_ranks):
            try:
                out.append(json.loads((self.folder / f"done-{k}-rank{r}.json").read_text(encoding="utf-8")))
            except (OSError, ValueError):
                pass
        return out

    def request_stop(self) -> None:
        """Tell the ranks to exit, without waiting (each answers `exited-rankR` as it goes)."""
        if self.proc is not None and self.proc.proc is not None and self.alive:
            try:
                (self.folder / "stop").write_text("", encoding="utf-8")
            except OSError:
                pass

    def stop(self, grace: float = 5.0) -> None:
        """Tell the ranks to exit, then end the whole process group and its /dev/shm buffers."""
        if self.proc is None or self.proc.proc is None:
            return
        if self.alive:
            self.request_stop()
            exited = [self.folder / f"exited-rank{r}" for r in range(self.num_ranks)]
            deadline = time.monotonic() + grace
            while (self.alive and time.monotonic() < deadline
                   and not all(p.exists() for p in exited)):
                time.sleep(POLL_SECONDS)
        # Once every rank has exited, only DeepSpeed's two launchers are left: they hold
        # nothing, and would take 1-2 s to notice (launch.py polls once a second) and to
        # run their own SIGTERM handlers. So they get SIGKILL; anything else gets SIGTERM first.
        ranks_gone = all((self.folder / f"exited-rank{r}").exists() for r in range(self.num_ranks))
        self.proc.stop(grace=2.0, polite=not ranks_gone)  # removes the port's /dev/shm buffers
        self.proc = None


class WarmWorkers:
    """The pools of one runner: reuses a live pool while the trials allow it, else starts one."""

    def __init__(self, num_ranks: int, *, launcher: list[str] | None = None,
                 note: Callable[[str], None] | None = None) -> None:
        self.num_ranks = num_ranks
        self.launcher = launcher
        self.note = note or (lambda text: print(text, file=sys.stderr, flush=True))
        self.pool: WarmPool | None = None
        self.pools_started = 0
        self._said: set[str] = set()
        atexit.register(self.close)  # a controller that returns without close() leaves no ranks

    def say_once(self, text: str) -> None:
        if text not in self._said:
            self._said.add(text)
            self.note(text)

    def run(self, trial_spec: Path, trial_dir: Path, ds_config: dict, timeout: float,
            on_start: Callable[[TrialProcess], None] | None = None) -> LaunchOutcome:
        key = pool_key(ds_config)
        if self.pool is not None and self.pool.alive and self.pool.key != key:
            self.note(f"      warm workers: {describe_change(self.pool.config or {}, ds_config)} changed "
                      "between trials; this trial starts fresh workers")
            self.pool.stop()
            self.pool = None
        if self.pool is not None and self.pool.alive and self.pool.jobs >= MAX_JOBS_PER_POOL:
            self.note(f"      warm workers: {self.pool.jobs} trials in one pool; this trial starts fresh workers")
            self.close()
        if self.pool is None or not self.pool.alive:
            pools = trial_dir.parent / POOLS_DIR
            if self.pools_started == 0:
                clean_up_pools(pools)  # what a killed controller of this study left there
            self.pools_started += 1
            self.pool = WarmPool(pools / f"pool-{os.getpid()}-{self.pools_started}", self.num_ranks,
                                 launcher=self.launcher)
            self.pool.key, self.pool.config = key, ds_config
            error = self.pool.start()
            if error is not None:
                self.pool = None
                (trial_dir / "launcher.log").write_text(error + "\n", encoding="utf-8")
                return LaunchOutcome(returncode=None, timed_out=False, wall_seconds=0.0,
                                     log_path=trial_dir / "launcher.log", launch_error=error)
        pool = self.pool
        if on_start is not None and pool.proc is not None:
            on_start(pool.proc)
        k = pool.jobs
        outcome = pool.run_job(trial_spec, trial_dir, timeout)
        if outcome.returncode == 0:
            _write_memory_record(trial_dir, pool.answers(k), job=k)
        if not pool.alive:
            self.pool = None
        return outcome

    def begin_close(self) -> None:
        """The run's last trial is done: the ranks start exiting while the controller writes its
        outputs; `close()` then finds them gone."""
        if self.pool is not None:
            self.pool.request_stop()

    def close(self) -> None:
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.stop()
            shutil.rmtree(pool.folder, ignore_errors=True)


def clean_up_pools(pools: Path) -> None:
    """Stop the processes of earlier pools of this study and remove their /dev/shm buffers.

    Warm ranks exit by themselves when their controller is gone; this catches the ones
    that had not yet noticed, and the buffers of those that did."""
    if not pools.is_dir():
        return
    marker = str(pools.resolve()) + os.sep
    ports = leftover_ports(marker)
    for info in pools.glob("pool-*/pool.json"):
        try:
            ports.add(int(json.loads(info.read_text(encoding="utf-8"))["master_port"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    for pid in processes_with(marker):
        try:
            group = os.getpgid(pid)
        except (ProcessLookupError, PermissionError):
            continue
        if group != os.getpgid(0):
            kill_group(group, grace=2.0)
    for port in ports:
        remove_shm_buffers(port)


def _write_memory_record(trial_dir: Path, answers: list[dict], *, job: int) -> None:
    """trial-NNN/worker-memory.json: each rank's memory before the trial's engine and after its release."""
    ranks = [{k: a.get(k) for k in ("rank", "rss_before_bytes", "rss_after_bytes", "device_before_bytes",
                                     "device_after_bytes", "open_fds", "threads", "process_groups", "seconds")} for a in answers]
    _write_atomic(trial_dir / "worker-memory.json", {"mode": "warm", "job_in_pool": job, "ranks": ranks})


def _copy_log_tail(src: Path, offset: int, dest: Path) -> None:
    try:
        with open(src, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except OSError:
        data = b""
    dest.write_bytes(data)


def _write_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data) + "\n", encoding="utf-8")
    os.replace(tmp, path)
