"""SIGINT and SIGTERM as a clean stop, for `autotune run` (tuning/tuner.py) and `autotune watch` (usercmd/watch.py).

Inside `stop_on_signals()` the first SIGINT or SIGTERM raises `Stopped`; the caller stops
what runs (the trial's or the job's whole process group), cleans up, and returns
`Stopped.exit_code`: 128 + the signal, as a shell reports a job killed by it (130 after
Ctrl-C, 143 after SIGTERM). From that first signal on, later ones are ignored, so a second
Ctrl-C cannot cut the clean-up short and leave ranks or /dev/shm buffers behind.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """128 + the signal: the shell's exit code of a process the signal ended (130, 143)."""
    return 128 + int(signum)


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: unwind, stopping what runs on the way."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @classmethod
    def of(cls, exc: KeyboardInterrupt) -> Stopped:
        """The stop a KeyboardInterrupt stands for: a plain one (Python's own handler) is Ctrl-C."""
        return exc if isinstance(exc, Stopped) else cls(signal.SIGINT)

    @property
    def name(self) -> str:
        """SIGINT or SIGTERM."""
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


Handlers = dict[signal.Signals, Any]


def ignore_stop_signals() -> Handlers:
    """Ignore later SIGINT/SIGTERM: the clean-up after a stop is not cut short. Returns the
    handlers it replaced, for `restore_stop_signals`."""
    return {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}


def restore_stop_signals(previous: Handlers) -> None:
    """The handlers from before `ignore_stop_signals` (after a clean-up, with nothing left to
    protect): not SIG_DFL, which would take Python's KeyboardInterrupt from a caller that had it."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT/SIGTERM raise Stopped once; later ones are ignored until the block is left,
    when the handlers from before it come back. Off the main thread (where Python cannot
    set handlers) the signals are left alone."""
    def handler(signum: int, _frame: Any) -> None:
        ignore_stop_signals()
        raise Stopped(signum)

    try:
        old = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
