"""`autotune run` serves live metrics by default and lists every endpoint, with the port it really
bound, in STUDY/prometheus_targets.json while the trial runs (real DeepSpeed ranks on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from prom_helpers import free_port, scrape, taken_port

from exporters.file_sd import read_targets

pytestmark = pytest.mark.slow


def test_the_targets_file_lists_the_ports_the_ranks_bound_and_they_answer(tmp_path):
    study = tmp_path / "st"
    targets = study / "prometheus_targets.json"
    answered: dict[str, str] = {}
    with taken_port() as taken:  # rank 0's port is taken: it falls back, and the file must say where
        proc = subprocess.Popen(
            [sys.executable, "-m", "autotune", "run", "--budget", "1", "--dp", "1", "--steps", "60",
             "--warmup-steps", "1", "--fixed-steps", "--study", str(study), "--metrics-port", str(free_port()),
             "--rank-metrics-port", str(taken)],
            stdout=open(tmp_path / "run.log", "w"), stderr=subprocess.STDOUT)
        rank_targets = {}
        try:
            deadline = time.monotonic() + 900
            while len(answered) < 3 and proc.poll() is None and time.monotonic() < deadline:
                for t in read_targets(targets) if targets.is_file() else []:
                    key = t.labels.get("rank", "controller")
                    if key != "controller":
                        rank_targets[key] = t
                    if key not in answered:
                        try:
                            answered[key] = scrape(f"http://{t.address}/metrics", timeout=2)
                        except OSError:
                            pass  # not serving yet, or the rank ended between the read and the scrape
                time.sleep(0.2)
            assert proc.wait(timeout=900) == 0, (tmp_path / "run.log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert set(answered) == {"controller", "0", "1"}, (tmp_path / "run.log").read_text()[-3000:]
    assert "autotune_trials_total" in answered["controller"]
    assert rank_targets["0"].port != taken and rank_targets["0"].port == taken + 2  # base + k * local world size
    assert {t.labels["trial"] for t in rank_targets.values()} == {"0"}
    assert {r: t.labels["stage"] for r, t in rank_targets.items()} == {"0": "0", "1": "1"}
    trial = study / "trial-000"
    for r, t in rank_targets.items():
        record = json.loads((trial / f"endpoint-rank{r}.json").read_text())
        assert record["port"] == t.port  # listed where the rank said it serves
    assert read_targets(targets) == []  # the run ended: nothing listed serves any more
    log = (tmp_path / "run.log").read_text()
    assert "file_sd_configs" in log and str(targets) in log  # the printed scrape config names the file
