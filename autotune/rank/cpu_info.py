"""py-cpuinfo's answer, asked once per CPU instead of twice in every rank process.

DeepSpeed's CPU op builders ask `cpuinfo.get_cpu_info()` for the -march and SIMD flags each
time an op is loaded: FusedAdam on the CPU accelerator asks twice per process (`cpu_arch`,
`simd_width`), and each answer starts a fresh Python (about 1.2 CPU-seconds). That is
2.4 CPU-seconds per rank at the first engine build, in every warm pool's start and in every
fresh trial: measured, about 2.2 s of a 4-rank pool's start on 2 cores (docs/warm-workers.md).

`install()` makes `cpuinfo.get_cpu_info` answer from a file under the user's cache folder,
written by the first process that asked. The file is named by what the kernel says about the
CPU (its model and flags, read from /proc/cpuinfo without a subprocess), so another CPU
under the same home folder (another node of a shared home, a VM moved to another host)
asks py-cpuinfo again instead of reading a wrong answer. Ranks that start together wait
on one lock for the first one's answer instead of each asking. Anything unexpected (no
py-cpuinfo, an unreadable or unwritable cache) falls back to asking, as DeepSpeed would.

Rank side: imports only the standard library until a caller asks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

CACHE_ENV = "AUTOTUNE_CACHE_DIR"
"""Overrides the cache folder ($XDG_CACHE_HOME/autotune, else ~/.cache/autotune)."""
CPUINFO = Path("/proc/cpuinfo")


def cache_dir(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "autotune"


def cpu_key(cpuinfo_text: str | None = None) -> str | None:
    """A short name for this CPU: its architecture, model and flags (None when unknown)."""
    if cpuinfo_text is None:
        try:
            cpuinfo_text = CPUINFO.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
    first = cpuinfo_text.split("\n\n", 1)[0]  # the first processor's block names the model
    wanted = ("vendor_id", "model name", "flags", "features", "cpu family", "model", "cpu model", "isa")
    lines = sorted(line.strip() for line in first.splitlines()
                   if line.split(":", 1)[0].strip().lower() in wanted)
    if not lines:
        return None
    text = "\n".join([platform.machine(), *lines])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_answer(ask: Callable[[], dict[str, Any]], path: Path) -> dict[str, Any]:
    """The answer stored at `path`, else `ask()`'s, stored there for the next process."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(path.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        return ask()
    try:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks starting together: one asks, the rest read
        stored = _read(path)
        if stored is not None:
            return stored
        answer = ask()
        if answer.get("flags"):  # py-cpuinfo answers {} when its subprocess failed: not kept
            # Not core.fileio.write_atomic: its crash seam counts a process's writes
            # (AUTOTUNE_TEST_CRASH_AT=write:K, inherited by the ranks), and whether this write
            # happens depends on the cache, not on the run; no fsync either, a lost entry is asked again.
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            try:
                tmp.write_text(json.dumps(answer), encoding="utf-8")
                os.replace(tmp, path)
            except OSError:
                pass
        return answer
    finally:
        os.close(lock)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and value.get("flags") else None


def install() -> bool:
    """Answer `cpuinfo.get_cpu_info()` from the cache in this process; False when it cannot."""
    key = cpu_key()
    try:
        import cpuinfo
    except ImportError:
        return False
    if key is None:
        return False
    if getattr(cpuinfo.get_cpu_info, "autotune_cached", False):
        return True  # already installed in this process
    ask = cpuinfo.get_cpu_info
    path = cache_dir() / f"cpu-info-{key}.json"

    @functools.cache
    def answer() -> dict[str, Any]:
        return cached_answer(ask, path)

    def get_cpu_info() -> dict[str, Any]:
        return json.loads(json.dumps(answer()))  # a fresh copy each time, as py-cpuinfo gives

    get_cpu_info.autotune_cached = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info
    if hasattr(cpuinfo, "cpuinfo"):  # the package re-exports the function of its module
        cpuinfo.cpuinfo.get_cpu_info = get_cpu_info
    return True
