"""autotune/tuning/stop_signals.py with real signals: a real process that gets SIGTERM or Ctrl-C
cleans up, is not cut short by the signals that follow, and exits 143 or 130.

`autotune run` (tuning/tuner.py) and `autotune watch` (usercmd/watch.py) both stop through this
module; tests/test_resume.py and tests/test_watch.py send the signals to the whole commands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The tuner's shape: the clean-up runs inside the block, after the first signal, and waits
# until the test has sent the later ones.
CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from autotune.tuning.stop_signals import Stopped, stop_on_signals

    folder = Path(sys.argv[1])
    with stop_on_signals():
        try:
            print("ready", flush=True)
            time.sleep(120)
            sys.exit(0)
        except Stopped as stop:
            print("cleaning", stop.name, flush=True)
            deadline = time.monotonic() + 60
            while not (folder / "sent").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            (folder / "cleaned").write_text(stop.name)
            sys.exit(stop.exit_code)
""")


def _child(tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("first, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_process_cleans_up_uncut_and_exits_128_plus_the_signal(tmp_path, first, code):
    proc = _child(tmp_path)
    try:
        proc.send_signal(first)
        assert proc.stdout.readline().split() == ["cleaning", first.name]
        for later in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):  # during the clean-up
            proc.send_signal(later)
        time.sleep(0.2)  # delivered before the clean-up may end
        (tmp_path / "sent").write_text("")
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    rest = proc.stdout.read()
    assert rc == code, rest
    assert (tmp_path / "cleaned").read_text() == first.name
    assert "Traceback" not in rest


def test_the_handlers_from_before_come_back_after_the_block():
    from autotune.tuning.stop_signals import STOP_SIGNALS, stop_on_signals

    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with stop_on_signals():
        assert all(signal.getsignal(sig) != before[sig] for sig in STOP_SIGNALS)
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


def test_run_and_watch_stop_through_the_one_module():
    from autotune.tuning import stop_signals, tuner
    from autotune.usercmd import watch

    assert tuner.Stopped is stop_signals.Stopped and watch.Stopped is stop_signals.Stopped
    assert tuner.stop_on_signals is stop_signals.stop_on_signals
    assert watch.stop_on_signals is stop_signals.stop_on_signals
