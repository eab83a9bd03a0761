"""Torch's JIT-extension locks, checked in the controller before any rank starts.

Every rank of a DeepSpeed job on the CPU accelerator loads two ops at start-up
(`deepspeed_shm_comm` in `deepspeed.init_distributed`, `fused_adam` when the optimizer
is Adam or AdamW), and a GPU rank loads `fused_adam` the same way. Each load goes
through `torch.utils.cpp_extension.load`, which takes a `FileBaton`: it creates
`<extensions root>/<op>/lock` with O_EXCL, runs ninja (a no-op once built) and deletes
the file. A process killed between the two leaves the file, and from then on every
load on the machine waits in `FileBaton.wait` forever. autotune kills ranks routinely
(hangs, timeouts, pool recycling, Ctrl-C, resume clean-ups), so before each launch:

- a lock with no live builder is removed, and the run says so. "No live builder": no
  process holds the lock file open (torch's FileBaton keeps the descriptor of the file it
  created until it removes it) and none has its working folder in the op's build folder
  (ninja and the compilers run there). Where some process's descriptors cannot be read
  (another user's), the lock must also be older than `YOUNG_SECONDS`;
- a lock with a live builder (another job on a shared node building the op) is never
  touched: the run waits for it with a progress line, then stops with the reason;
- an op the ranks will load that is not built yet is built here, in a short child
  process that no trial clean-up kills, instead of inside the first trial's ranks.

Nothing but a lock file judged stale is ever removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from autotune.core.errors import UserError
from autotune.rank.lock_holders import holders

CPU_OPS = ("deepspeed_shm_comm", "fused_adam")
"""What a DeepSpeed 0.19.8 rank JIT-loads on the CPU accelerator (comm/torch.py build_shm_op,
ops/adam/fused_adam.py): the ops whose locks a launch waits for and that are built before it."""
GPU_OPS = ("fused_adam",)
"""What a rank loads on a CUDA device with DeepSpeed's Adam (the default optimizer path)."""
BUILDERS = {"deepspeed_shm_comm": "ShareMemCommBuilder", "fused_adam": "FusedAdamBuilder"}
"""DeepSpeed's op builder of each op (accelerator.create_op_builder names)."""
YOUNG_SECONDS = 10.0
"""Where a holder could hide (a process whose descriptors this user may not read), a lock
younger than this with no process in its build folder may still be held between taking it
and starting ninja: wait, do not remove. The longest such moment measured here was 47 ms
beside a CPU burner (docs/robustness.md, benchmarks/ext_lock_window.py)."""
BUILD_WAIT_SECONDS = 600.0
"""How long a launch waits for someone else's running build before it stops with the reason."""
PREBUILD_TIMEOUT = 1800.0
"""A first build of an op on a slow machine; a GPU build of fused_adam takes minutes."""
PROGRESS_EVERY = 15.0


class ExtensionLockBusy(UserError):
    """Someone else's build of an op holds its lock and did not finish in time."""


def extension_roots(env: Mapping[str, str] | None = None) -> list[Path]:
    """The folders torch builds extensions in for this environment (torch's `_get_build_directory`).

    TORCH_EXTENSIONS_DIR is used as it is; otherwise torch adds a `py311_cpu`-style folder
    (Python version, then cpu, cuXYZ or rocmXYZ) under the user's cache. All of those are
    returned, so the controller need not import torch to know which one the ranks use."""
    env = os.environ if env is None else env
    if env.get("TORCH_EXTENSIONS_DIR"):
        return [Path(env["TORCH_EXTENSIONS_DIR"])]
    cache = Path(env.get("XDG_CACHE_HOME") or Path(env.get("HOME") or Path.home()) / ".cache")
    base = Path(os.path.realpath(cache / "torch_extensions"))
    tag = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_"
    return sorted(p for p in base.glob(tag + "*") if p.is_dir()) if base.is_dir() else []


def rank_ops(env: Mapping[str, str]) -> tuple[str, ...]:
    return CPU_OPS if env.get("DS_ACCELERATOR") == "cpu" else GPU_OPS


@dataclass(kw_only=True, slots=True)
class LockState:
    path: Path
    age_seconds: float
    builders: list[int] = field(default_factory=list)
    """Live processes that hold the lock open or work in the op's build folder."""
    seen_all: bool = True
    """Every process's descriptors could be read: no holder can hide, age does not matter."""

    @property
    def op(self) -> str:
        return self.path.parent.name

    @property
    def stale(self) -> bool:
        return not self.builders and (self.seen_all or self.age_seconds >= YOUNG_SECONDS)


def locks(roots: list[Path]) -> list[Path]:
    """Every extension lock file under the roots, of any op."""
    return sorted(p for root in roots for p in root.glob("*/lock"))


def inspect(lock: Path, *, now: float | None = None) -> LockState | None:
    """The lock's age and its possible builders; None when it is gone."""
    try:
        mtime = lock.stat().st_mtime
    except OSError:
        return None
    builders, seen_all = holders(lock)
    return LockState(path=lock, age_seconds=max(0.0, (now or time.time()) - mtime), builders=builders,
                     seen_all=seen_all)


def builders_in(build_dir: Path) -> list[int]:
    """Live processes working in `build_dir` or holding its lock (see `holders`)."""
    return holders(build_dir / "lock")[0]


def clear_stale_locks(env: Mapping[str, str], note: Callable[[str], None], *,
                      wait_limit: float = BUILD_WAIT_SECONDS) -> list[Path]:
    """Remove every stale lock; wait for a live build of an op the ranks load. Returns the removed.

    Raises ExtensionLockBusy (one line, exit 2) when a live build holds a lock the ranks need
    for longer than `wait_limit`."""
    needed = set(rank_ops(env))
    removed: list[Path] = []
    for lock in locks(extension_roots(env)):
        started = last_said = time.monotonic()
        said = False
        while (state := inspect(lock)) is not None:
            if state.stale:
                try:
                    lock.unlink()
                except FileNotFoundError:
                    break
                removed.append(lock)
                note(f"      removed a stale lock of torch's extension build: {lock} (no process holds it or "
                     f"builds in its folder, {state.age_seconds:.0f} s old: a process killed while it loaded "
                     "the op left it)")
                break
            if not state.builders:  # young: its holder may not have started ninja yet
                time.sleep(0.2)
                continue
            if state.op not in needed:
                break  # someone else's build of an op these ranks do not load: not ours to wait for
            waited = time.monotonic() - started
            if waited >= wait_limit:
                raise ExtensionLockBusy(
                    f"torch's extension lock {lock} is held by a running build (pid "
                    f"{', '.join(map(str, state.builders[:3]))}) that did not finish within {wait_limit:.0f} s; "
                    f"wait for it to end, or stop that build and remove {lock}")
            if not said or time.monotonic() - last_said >= PROGRESS_EVERY:
                said = True
                note(f"      waiting for a running build of {state.op} (pid {state.builders[0]}) that holds "
                     f"{lock}: {waited:.0f} s of at most {wait_limit:.0f} s")
                last_said = time.monotonic()
            time.sleep(0.5)
    return removed


def unbuilt_ops(env: Mapping[str, str]) -> list[str]:
    """The ops the ranks load that no extension root holds an up-to-date build of.

    A library alone is not enough: a rank killed while it compiled leaves its objects deleted
    and ninja's log behind, and the next load compiles again (a minute here) inside a rank
    that has a start-up limit. So ninja itself is asked (`ninja -n`: no work to do)."""
    roots = extension_roots(env)
    return [op for op in rank_ops(env) if not any(is_built(root / op, op, env) for root in roots)]


def is_built(build_dir: Path, op: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether the ninja the ranks would run (the first on their PATH, as torch runs it) has no work."""
    if not (build_dir / f"{op}.so").is_file() or not (build_dir / "build.ninja").is_file():
        return False
    path = (env or os.environ).get("PATH") or os.environ.get("PATH")
    ninja = shutil.which("ninja", path=path) or str(Path(sys.executable).with_name("ninja"))
    try:
        out = subprocess.run([ninja, "-C", str(build_dir), "-n"], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return True  # no ninja to ask: the library is there, the ranks' own load decides
    return out.returncode == 0 and "no work to do" in out.stdout


def build_ops(ops: list[str], env: Mapping[str, str], note: Callable[[str], None], *,
              python: str = sys.executable, timeout: float = PREBUILD_TIMEOUT) -> list[str]:
    """Build `ops` in one child process of the controller (never a trial's); the ops it could not
    build (an op the device cannot run is left to DeepSpeed to refuse in the ranks)."""
    names = [BUILDERS[op] for op in ops if op in BUILDERS]
    if not names:
        return []
    note(f"      building DeepSpeed's {', '.join(ops)} op(s) once for this machine before the ranks start "
         "(a first build takes a minute or more)")
    script = ("import sys\nfrom deepspeed.accelerator import get_accelerator\nacc = get_accelerator()\n"
              "failed = []\nfor name in sys.argv[1:]:\n    b = acc.create_op_builder(name)\n"
              "    try:\n        ok = b is not None and b.is_compatible(verbose=False)\n"
              "    except TypeError:\n        ok = b is not None and b.is_compatible()\n"
              "    if not ok:\n        failed.append(name); continue\n"
              "    try:\n        b.load(verbose=False)\n    except Exception as exc:\n"
              "        print(exc, file=sys.stderr); failed.append(name)\n"
              "print(' '.join(failed))\n")
    started = time.monotonic()
    try:
        out = subprocess.run([python, "-c", script, *names], env=dict(env), capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        note(f"      could not build the ops before the ranks start ({exc}); the ranks build them")
        return list(ops)
    failed_builders = set(out.stdout.split()) if out.returncode == 0 else set(names)
    failed = [op for op in ops if BUILDERS.get(op) in failed_builders]
    done = [op for op in ops if op not in failed]
    if done:
        note(f"      built {', '.join(done)} in {time.monotonic() - started:.0f} s")
    return failed


class Preflight:
    """What the controller does before every launch of ranks: stale locks out, the ops built.

    Before every launch: the lock check (a few stat calls, one walk of /proc when a lock exists)
    and ninja's dry run per op (about 10 ms). An op that failed to build is not tried again."""

    def __init__(self, note: Callable[[str], None] | None = None, *, wait_limit: float = BUILD_WAIT_SECONDS,
                 build: bool = True) -> None:
        self.note = note or (lambda text: print(text.strip(), file=sys.stderr, flush=True))
        self.wait_limit = wait_limit
        self.build = build
        self._failed: set[tuple[str, str]] = set()

    def __call__(self, env: Mapping[str, str]) -> None:
        clear_stale_locks(env, self.note, wait_limit=self.wait_limit)
        if not self.build:
            return
        where = env.get("TORCH_EXTENSIONS_DIR", "")
        missing = [op for op in unbuilt_ops(env) if (where, op) not in self._failed]
        if missing:
            for op in build_ops(missing, env, self.note):
                self._failed.add((where, op))
            clear_stale_locks(env, self.note, wait_limit=self.wait_limit)  # a build cut short


PREFLIGHT = Preflight()
"""The one pre-flight of this controller process; a run points its notes at its display."""
