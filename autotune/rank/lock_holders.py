"""Who holds torch's extension lock: /proc reads only (no torch, no DeepSpeed).

Asked by the controller's pre-flight (autotune/trials/ext_locks.py: is a lock stale?) and by
a rank's watchdog (autotune/rank/watchdog.py: is this start-up waiting for a live build?).
"""

from __future__ import annotations

import os
from pathlib import Path

BUILD_TOOLS = frozenset({"ninja", "c++", "g++", "gcc", "cc", "cc1plus", "clang++", "ld", "nvcc", "cicc",
                         "ptxas", "fatbinary", "hipcc", "sh"})
"""Programs of a build: a process of one of these whose working folder cannot be read (another
user's) is taken as a possible builder, so its lock is never removed."""


def holders(lock: Path) -> tuple[list[int], bool]:
    """(live processes that hold `lock` open or work in its build folder, whether every process
    that could hold it was seen). A build tool whose folder this user may not read is counted as
    a holder; a Python whose descriptors this user may not read makes the answer uncertain (the
    age rule then applies). Other unreadable processes (an init, a daemon) cannot hold it."""
    target_dir = os.path.realpath(lock.parent)
    target = os.path.join(target_dir, lock.name)
    found, seen_all = [], True
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except (OSError, IndexError):
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except PermissionError:
            program = _program(entry)
            if program in BUILD_TOOLS:
                found.append(int(entry.name))
            elif program.startswith("python"):
                seen_all = False
            continue
        except OSError:
            continue
        if cwd == target_dir or cwd.startswith(target_dir + os.sep):
            found.append(int(entry.name))
            continue
        held = _holds_open(entry, target)
        if held is None and _program(entry).startswith("python"):
            seen_all = False
        elif held:
            found.append(int(entry.name))
    return found, seen_all


def _holds_open(proc: Path, target: str) -> bool | None:
    """Whether the process has `target` open; None when its descriptors cannot be read."""
    try:
        fds = list((proc / "fd").iterdir())
    except PermissionError:
        return None
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) == target:
                return True
        except OSError:
            continue
    return False


def _program(proc: Path) -> str:
    try:
        argv0 = (proc / "cmdline").read_bytes().split(b"\0", 1)[0].decode("utf-8", "replace")
    except OSError:
        return ""
    return os.path.basename(argv0)
