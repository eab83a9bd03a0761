"""Where a stalled rank hung: read the stacks its watchdog wrote (autotune/rank/watchdog.py).

A `hang` trial's detail names the place in words a user can act on, most telling first:
torch's extension lock (with the lock file that exists now), the process-group
rendezvous, a collective, a pipeline send or receive; else the innermost frame of the
rank's main thread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from autotune.trials.ext_locks import extension_roots, locks

FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
HEADER = re.compile(r"made no progress in (?P<phase>.+?) for (?P<limit>\d+) s")
COLLECTIVES = frozenset({"all_reduce", "broadcast", "barrier", "all_gather", "reduce_scatter", "all_to_all",
                         "all_gather_into_tensor", "reduce_scatter_tensor", "reduce", "gather", "scatter",
                         "monitored_barrier"})
RENDEZVOUS = frozenset({"rendezvous", "_create_c10d_store", "init_process_group", "_store_based_barrier",
                        "_env_rendezvous_handler", "_tcp_rendezvous_handler", "TCPStore"})


@dataclass(kw_only=True, slots=True)
class Hang:
    rank: int
    phase: str
    """"start-up" or "a training step"."""
    limit_seconds: float
    where: str
    path: Path

    @property
    def in_startup(self) -> bool:
        return self.phase == "start-up"

    def describe(self) -> str:
        return (f"rank {self.rank} made no progress in {self.phase} for {self.limit_seconds:.0f} s: "
                f"{self.where}; its stack is in {self.path}")


DESCRIBED = re.compile(r"^rank -?\d+ made no progress in (?P<phase>.+?) for \d+ s: (?P<where>.+); its stack is in ")


def startup_place(detail: str | None) -> str | None:
    """Where a `hang` trial's detail (Hang.describe) says its start-up stalled; None otherwise."""
    m = DESCRIBED.match(detail or "")
    return m["where"] if m and m["phase"] == "start-up" else None


def read_hang(trial_dir: Path) -> Hang | None:
    """The most telling of the stacks the trial's ranks wrote when they stalled; None when none did."""
    found = [h for p in sorted(trial_dir.glob("hang-rank*.txt")) if (h := _read_one(p)) is not None]
    if not found:
        return None
    return min(found, key=lambda h: (_rank_of_where(h.where), h.rank))


def _read_one(path: Path) -> Hang | None:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    frames = [(m["file"], m["func"], int(m["line"])) for line in text.splitlines() if (m := FRAME.match(line))]
    if not frames:  # only the header: the timer was armed and never fired
        return None
    head = HEADER.search(text)
    rank_m = re.search(r"rank (\d+)", text)
    return Hang(rank=int(rank_m.group(1)) if rank_m else -1, phase=head["phase"] if head else "a step",
                limit_seconds=float(head["limit"]) if head else 0.0, where=where_hung(text), path=path)


def where_hung(dump: str) -> str:
    """Words for the place a faulthandler dump shows (all threads; the main thread is 'Current')."""
    frames = [(m["file"], m["func"], int(m["line"])) for line in dump.splitlines() if (m := FRAME.match(line))]
    files_funcs = [(Path(f).name, fn) for f, fn, _ in frames]
    if any(name == "file_baton.py" and fn == "wait" for name, fn in files_funcs):
        held = [str(p) for p in locks(extension_roots())]
        lock = f" {', '.join(held)}" if held else " (gone by now)"
        return f"waiting for torch's extension lock{lock} (a process killed while it loaded a DeepSpeed op left it)"
    if any(fn in RENDEZVOUS for _, fn in files_funcs):
        return "in the process-group rendezvous (init_process_group): a peer rank never arrived"
    for name, fn in files_funcs:
        if name == "p2p.py" and fn in ("send", "recv", "_send", "_recv"):
            return f"in a pipeline {fn.strip('_')} (deepspeed/runtime/pipe/p2p.py): the peer stage stopped"
    for _, fn in files_funcs:
        if fn in COLLECTIVES:
            return f"in a collective ({fn}): a peer rank stopped or is stuck"
    main = _main_thread_frames(dump)
    waiting = next(((f, fn) for f, fn, _ in main if "/torch/distributed/" in f or "/deepspeed/comm/" in f), None)
    if waiting is not None:  # creating a group, a store wait: every rank must arrive
        return f"in torch.distributed ({waiting[1]}): waiting for a peer rank"
    if main:
        f, fn, line = main[0]
        return f"at {f}:{line} in {fn}"
    return "at an unknown place (no Python frame)"


def _main_thread_frames(dump: str) -> list[tuple[str, str, int]]:
    """The main thread's frames, innermost first (faulthandler's order).

    A dump from faulthandler's own timer thread marks no thread 'Current' and lists the
    newest thread first, so the main thread is the last block; the watchdog's own exit
    thread is never the answer."""
    blocks: list[tuple[bool, list[tuple[str, str, int]]]] = []
    for line in dump.splitlines():
        if line.startswith("Current thread") or line.startswith("Thread "):
            blocks.append((line.startswith("Current thread"), []))
            continue
        m = FRAME.match(line)
        if m and blocks:
            blocks[-1][1].append((m["file"], m["func"], int(m["line"])))
    blocks = [(cur, fr) for cur, fr in blocks if fr and not any(f.endswith("watchdog.py") for f, _, _ in fr)]
    current = [fr for cur, fr in blocks if cur]
    return current[0] if current else (blocks[-1][1] if blocks else [])


def _rank_of_where(where: str) -> int:
    """Causes before symptoms: a rank waiting on the lock, or stuck in its own code, is why its
    peers wait for it in a send, a collective or the rendezvous."""
    for i, prefixes in enumerate((("waiting for torch's extension lock",), ("at ",), ("in a pipeline",),
                                  ("in a collective",), ("in the process-group rendezvous", "in torch.distributed"))):
        if where.startswith(prefixes):
            return i
    return 9
