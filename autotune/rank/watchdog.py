"""Inside a rank: its stack in the trial folder, and its end, when start-up or a step stalls.

A rank that waits forever (in torch's extension lock, a rendezvous whose peer never
came, a collective a peer left) makes no progress, and before this the trial waited
for the controller's whole-trial timeout. Here each rank arms faulthandler's timer:
when start-up, or one step, takes longer than its limit, faulthandler writes the
stack of every thread to `hang-rankR.txt` from its own C thread (so a main thread
stuck inside C++, in gloo or a sleep, is still seen), and a few seconds later the
rank exits (code 1). The launcher then stops the other ranks, and the controller
classifies the trial as `hang`, with where it hung (autotune/trials/hangs.py).

Limits come from the controller (`StallLimits`, from this job's own measured start-up
and steps: autotune/trials/limits.py). A step's limit also grows with the slowest step
this rank has run in the trial, so a configuration slower than any before is not
mistaken for a stall. `startup-rankR.json` records the start-up this rank measured
(from its process start to its first step), which sets the next trials' limit.

A start-up that is building one of DeepSpeed's ops, or waiting for a build that is alive,
is progress, not a stall: a node whose extension cache is its own (another machine, another
ninja) compiles in its ranks for minutes however well the controller built its own copy.
A second before the start-up limit, the watchdog looks at the main thread's stack; while it
is inside torch's extension build, or in the extension lock with a live holder (or one gone
by now), the limit grows by BUILD_EXTEND_SECONDS, up to BUILD_GRACE_SECONDS in all. A lock
that no live process holds is the stall it was made to find, and is not extended.

Rank-side: imports nothing of autotune but the data model and the lock holder check, and no torch.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

HANG_FILE = "hang-rank{rank}.txt"
STARTUP_FILE = "startup-rank{rank}.json"
STEP_FACTOR = 10.0
"""A step stalls when it takes this many times the slowest step expected or seen."""
STEP_FLOOR_SECONDS = 60.0
"""No step limit below this: a collective's first call, a garbage collection, a busy machine."""
HEADER = "autotune: rank {rank} made no progress in {phase} for {limit:.0f} s"
BUILD_EXTEND_SECONDS = 60.0
"""How much a start-up limit grows each time it ends while the rank builds an op (or waits for a
live build)."""
BUILD_GRACE_SECONDS = 1800.0
"""The most a start-up limit grows for builds in all (a first GPU build of fused_adam takes minutes;
the controller's whole-trial timeout still bounds the trial)."""
CHECK_BEFORE_SECONDS = 1.0
"""The build check runs this long before faulthandler's dump is due (the poller wakes every 0.25 s)."""
REARM_EVERY_SECONDS = 1.0
"""A step re-arms the timer only when the last arm is this old (or its limit grew): re-arming
costs ~0.1 ms (faulthandler starts a thread), a GPU step may be 10 ms. A stall is then found
at most this much before its limit, which is at least 60 s."""
EXIT_GRACE_SECONDS = 5.0
"""After its dump a rank waits this long before it exits: its peers, whose limits end at about
the same moment, write theirs before the launcher stops them (the stalled rank's stack is the
cause, the peers' waits in the rendezvous the symptom)."""


@dataclass(kw_only=True, slots=True)
class StallLimits:
    """What a rank may take before it counts as stalled (the controller's; part of the rank plan)."""

    startup_seconds: float | None = None
    """From the process start (a warm worker: from taking the job) to the first step; None: no limit."""
    step_seconds: float | None = None
    """The slowest step this trial's configuration is expected to take; None: not known yet (the
    first step then has no limit, and later ones follow the steps this rank ran)."""

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> StallLimits:
        d = d or {}
        return cls(startup_seconds=d.get("startup_seconds"), step_seconds=d.get("step_seconds"))


def process_age_seconds() -> float:
    """Seconds since this process started (the interpreter's start, not the script's)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class Watchdog:
    """One rank's timer: `startup()`, then `step_started()`/`step_ended()` per step, `stop()` at the end."""

    def __init__(self, folder: str | Path, rank: int, limits: StallLimits) -> None:
        self.folder, self.rank, self.limits = Path(folder), rank, limits
        self.path = self.folder / HANG_FILE.format(rank=rank)
        self._file: IO[str] | None = None
        self._started = time.monotonic()
        self._age_at_start = 0.0
        self._step_started: float | None = None
        self._slowest_step = 0.0
        self._in_startup = False
        self._armed: tuple[str, float, float] | None = None
        """(phase, limit, when) of the timer now armed."""
        self._shown = 0.0
        """The armed phase's whole limit, as the hang file's header says it."""
        self._build_extended = 0.0
        self._lock = threading.Lock()
        """The main thread arms at each step, the exit thread when it extends a start-up."""

    # -- phases ---------------------------------------------------------------
    def startup(self, *, from_process_start: bool = True) -> None:
        """Start-up begins (counted from the process start, or from now for a warm worker's job)."""
        self._started = time.monotonic()
        self._age_at_start = process_age_seconds() if from_process_start else 0.0
        self._in_startup = True
        self._slowest_step = 0.0
        self._build_extended = 0.0
        limit = self.limits.startup_seconds
        self._arm("start-up", None if limit is None else max(1.0, limit - self._age_at_start), shown=limit)

    def step_started(self) -> None:
        if self._in_startup:
            self._in_startup = False
            self._write_startup(self._age_at_start + time.monotonic() - self._started)
        now = self._step_started = time.monotonic()
        expected = max(self.limits.step_seconds or 0.0, self._slowest_step)
        limit = max(STEP_FLOOR_SECONDS, STEP_FACTOR * expected) if expected > 0 else None
        armed = self._armed
        if (limit is not None and armed is not None and armed[0] == "a training step" and limit <= armed[1]
                and now - armed[2] < REARM_EVERY_SECONDS):
            return  # armed well enough: at most REARM_EVERY_SECONDS early, never late
        self._arm("a training step", limit)

    def step_ended(self) -> None:
        if self._step_started is not None:
            self._slowest_step = max(self._slowest_step, time.monotonic() - self._step_started)
            self._step_started = None

    def stop(self) -> None:
        """The trial ended well on this rank: no timer, no hang file."""
        with self._lock:
            _EXIT.disarm()
            self._armed = None
            faulthandler.cancel_dump_traceback_later()
        if self._file is not None:
            self._file.close()
            self._file = None
        try:
            self.path.unlink()
        except OSError:
            pass

    # -- the timer ------------------------------------------------------------
    def _arm(self, phase: str, limit: float | None, *, shown: float | None = None) -> None:
        """Arm faulthandler to fire `limit` s from now; the hang file's header says `shown` (the
        phase's whole limit: a start-up's began at the process start)."""
        with self._lock:
            self._arm_locked(phase, limit, shown)

    def _arm_locked(self, phase: str, limit: float | None, shown: float | None) -> None:
        _EXIT.disarm()
        self._armed = None
        faulthandler.cancel_dump_traceback_later()
        if limit is None:
            return
        self._armed = (phase, limit, time.monotonic())
        self._shown = shown or limit
        if self._file is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - faulthandler writes to it later
        self._file.seek(0)
        self._file.truncate()
        self._file.write(HEADER.format(rank=self.rank, phase=phase, limit=self._shown)
                         + "; the stack of every thread:\n")
        self._file.flush()
        # The dump comes from faulthandler's C thread: it is written even while the main thread
        # is stuck in C++. The exit comes from a Python thread, a grace later (see EXIT_GRACE_SECONDS).
        faulthandler.dump_traceback_later(limit, repeat=False, file=self._file, exit=False)
        now = time.monotonic()
        _EXIT.arm(now + limit + EXIT_GRACE_SECONDS,
                  check=(now + limit - CHECK_BEFORE_SECONDS, self._extend_for_build) if phase == "start-up" else None)

    def _extend_for_build(self) -> None:
        """Called by the exit thread just before a start-up's dump: grow the limit while the rank
        builds an op or waits for a live build (see the module's docstring)."""
        with self._lock:
            armed = self._armed
            if armed is None or armed[0] != "start-up" or self._build_extended >= BUILD_GRACE_SECONDS:
                return
            if building_op(main_thread_frames()) is None:
                return
            extra = min(BUILD_EXTEND_SECONDS, BUILD_GRACE_SECONDS - self._build_extended)
            self._build_extended += extra
            # The old timer's dump is a second away: the new one starts from now, so the rank
            # gets the remaining second plus `extra`, and the header counts the whole start-up.
            self._arm_locked("start-up", CHECK_BEFORE_SECONDS + extra, self._shown + extra)

    def _write_startup(self, seconds: float) -> None:
        path = self.folder / STARTUP_FILE.format(rank=self.rank)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps({"rank": self.rank, "seconds": round(seconds, 3)}) + "\n", encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            pass


def main_thread_frames() -> list[Any]:
    """The main thread's frames, innermost first (empty when it cannot be seen)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def building_op(frames: list[Any]) -> str | None:
    """What op build the frames are in, when that is progress: "building" (this rank runs the
    build), "waiting for a live build" (the lock's holder is alive, or could not be seen, or the
    lock is gone by now); None: no build, or a lock no live process holds (a stall)."""
    for frame in frames:
        code = frame.f_code
        if code.co_filename.endswith(os.path.join("torch", "utils", "file_baton.py")) and code.co_name == "wait":
            lock = getattr(frame.f_locals.get("self"), "lock_file_path", None)
            if not lock or not os.path.exists(lock):
                return "waiting for a live build"
            from autotune.rank.lock_holders import (
                holders,  # /proc reads only: no torch, no DeepSpeed
            )

            found, seen_all = holders(Path(lock))
            return "waiting for a live build" if found or not seen_all else None
    in_build = any(f.f_code.co_filename.endswith(os.path.join("torch", "utils", "cpp_extension.py")) for f in frames)
    return "building" if in_build else None


class _ExitTimer:
    """The one thread per process that ends the rank a grace after its dump (a warm worker makes
    a Watchdog per trial; a thread each would be one more thread per trial), and that runs the
    armed phase's check (a start-up's build extension) just before the dump is due."""

    def __init__(self) -> None:
        self.deadline: float | None = None
        self._check: tuple[float, Callable[[], None]] | None = None
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, *, check: tuple[float, Callable[[], None]] | None = None) -> None:
        self._check = check
        self.deadline = deadline
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="autotune-watchdog", daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        self.deadline = None
        self._check = None

    def _run(self) -> None:
        while True:
            time.sleep(0.25)
            check = self._check
            if check is not None and time.monotonic() > check[0]:
                if self._check is check:
                    self._check = None
                try:
                    check[1]()  # may re-arm: a new deadline and check
                except Exception:  # noqa: BLE001 - a failed check must not end the rank: the dump follows
                    pass
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                os._exit(1)  # the dump is on disk: faulthandler writes to the file descriptor itself


_EXIT = _ExitTimer()


def watch_steps(engine: Any, dog: Watchdog) -> None:
    """Time every `engine.train_batch` call with the watchdog (the outermost wrapper: it sees the
    whole step, the probe's own work included); a plain engine's optimizer steps in the script's
    own loop, from their first forward to the boundary's step() (autotune/rank/step_boundary.py)."""
    from autotune.rank.step_boundary import has_train_batch, plain_steps

    if not has_train_batch(engine):
        events = plain_steps(engine)
        events.begun.append(dog.step_started)
        events.ended.append(lambda loss: dog.step_ended())
        return
    inner = engine.train_batch

    def train_batch(*args: Any, **kwargs: Any) -> Any:
        dog.step_started()
        try:
            return inner(*args, **kwargs)
        finally:
            dog.step_ended()

    engine.train_batch = train_batch
