"""leftover_ports: the master port read off a dead controller's leftover processes."""

from __future__ import annotations

import subprocess
import sys
import time

from autotune.trials.launcher import leftover_ports, processes_with


def test_leftover_ports_reads_both_spellings_of_the_port(tmp_path):
    marker = str(tmp_path / "trial-000" / "ds_config.json")
    sleeper = "import time; time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", sleeper, "--master_port", "41001", marker]),
             subprocess.Popen([sys.executable, "-c", sleeper, "--master_port=41002", marker]),
             subprocess.Popen([sys.executable, "-c", sleeper, "--master_port", "x", marker])]
    try:
        deadline = time.monotonic() + 30
        while len(processes_with(marker)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leftover_ports(marker) == {41001, 41002}
        assert leftover_ports(str(tmp_path / "trial-001")) == set()
    finally:
        for p in procs:
            p.kill()
            p.wait()
