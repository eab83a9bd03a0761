"""The rank endpoint served from a child process (exporters/sidecar.py): real processes, real HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest
from prom_helpers import scrape, synthetic_records, taken_port
from prometheus_client.parser import text_string_to_metric_families

from exporters.endpoint import MetricsEndpointWarning
from exporters.sidecar import SidecarExporter


def samples(url: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(scrape(url)) for s in f.samples
            if not s.labels.get("le")}


def wait_for(pred, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := pred()):
            return got
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is gone for our purposes
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_records_written_in_the_training_process_are_served_by_the_child(capsys):
    exp = SidecarExporter(labels={"job": "side"})
    url = exp.serve(port=0)
    try:
        assert url is not None and f"metrics: {url}" in capsys.readouterr().out
        child = exp._proc.pid
        assert child != os.getpid() and alive(child)
        records = [r for s in range(5) for r in synthetic_records(step=s, trial=2, dp=1)[:1]]
        for r in records:
            exp.write(r)
        got = wait_for(lambda: (v := samples(url)).get("autotune_steps_total") == 5 and v)
        assert got["autotune_step_seconds_count"] == sum(1 for r in records if not r.warmup)
        families = text_string_to_metric_families(scrape(url))
        labels = next(s.labels for f in families for s in f.samples if s.name == "autotune_steps_total")
        assert labels["job"] == "side" and labels["trial"] == "2"
    finally:
        exp.close()
    assert not alive(child)
    with socket.socket() as s:  # the port is free again (TIME_WAIT aside, as a server binds)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0])))


def test_the_child_ends_when_the_training_process_dies(tmp_path):
    code = (
        "import sys, time\n"
        "from exporters.sidecar import SidecarExporter\n"
        "e = SidecarExporter(labels={'job': 'x'}); e.serve(port=0)\n"
        "print('child', e._proc.pid, flush=True); time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = wait_for(lambda: next((x for x in iter(parent.stdout.readline, "") if x.startswith("child")), None))
        child = int(line.split()[1])
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_for(lambda: not alive(child))
    finally:
        parent.kill()


def test_a_dead_or_stuck_child_never_blocks_or_breaks_training():
    exp = SidecarExporter(labels={"job": "x"})
    assert exp.serve(port=0) is not None
    rec = synthetic_records(step=3, trial=0, dp=1)[0]
    try:
        os.kill(exp._proc.pid, signal.SIGSTOP)  # stuck: the pipe fills up
        t0 = time.monotonic()
        for _ in range(2000):
            exp.write(rec)
        assert time.monotonic() - t0 < 5.0 and exp.dropped > 0
        os.kill(exp._proc.pid, signal.SIGKILL)  # dead: writes warn once and stop
        exp._proc.wait()
        with pytest.warns(MetricsEndpointWarning, match="ended"):
            for _ in range(3):
                exp.write(rec)
        exp.write(rec)  # no second warning, no exception
    finally:
        exp.close()


def test_no_port_means_no_endpoint_and_no_process_left():
    with taken_port() as taken:
        exp = SidecarExporter(labels={"job": "x"})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert exp.serve(port=taken, tries=1) is None
        assert exp._proc is None
        exp.write(synthetic_records(step=0, trial=0, dp=1)[0])  # a sink without endpoint: a no-op
