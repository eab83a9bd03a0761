"""Every benchmark command the README cites, in its quick mode, as a real subprocess.

A README figure that no command can reproduce any more is caught the day it happens:
each test runs one cited command (same interpreter) with `--quick`, checks exit code 0
and parses the figure line the README quotes. The figures are only checked to be finite
and plausible: quick modes are too small for the goals. The GPU benchmarks must say
"not available on CPU" and exit 0 where there is no CUDA device.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.trials.launcher import free_port, remove_shm_buffers

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


CUDA = cuda_available()


def run(args: list[str], *, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run a cited command from the repository root; returns its stdout (exit code 0 asserted)."""
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    print(f"{' '.join(args[1:4])}: {time.monotonic() - t0:.1f} s")  # shown with pytest -s
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.stdout


def figure(out: str, pattern: str, low: float, high: float) -> float:
    """The number the README quotes from `pattern`'s first group: finite, in [low, high]."""
    m = re.search(pattern, out, re.M)
    assert m, f"no line matching {pattern!r} in:\n{out[-3000:]}"
    value = float(m.group(1).replace(",", ""))
    assert math.isfinite(value) and low <= value <= high, (pattern, value)
    return value


def test_tuning_gain(tmp_path):
    out = run([sys.executable, "benchmarks/tuning_gain.py", "--quick", "--out", str(tmp_path)], timeout=900)
    figure(out, r"gain over baseline: ([\d.]+)x", 0.05, 100)
    figure(out, r"in-study gain ([\d.]+)x", 0.05, 100)
    assert re.search(r"tuned / sweep best: (the same configuration|[\d.]+%)", out), out[-2000:]


def test_model_accuracy(tmp_path):
    out = run([sys.executable, "benchmarks/model_accuracy.py", "--quick", "--out", str(tmp_path)], timeout=900)
    figure(out, r"step-time MAPE over 1 unseen configurations: ([\d.]+) %", 0, 200)
    figure(out, r"peak memory per stage: mean error ([\d.]+) %", 0, 100)


def test_trial_cost(tmp_path):
    out = run([sys.executable, "benchmarks/trial_cost.py", "--quick", "--out", str(tmp_path)], timeout=900)
    figure(out, r"wall / step time: before ([\d.]+)x", 1, 10_000)
    figure(out, r"wall / step time: before [\d.]+x, now ([\d.]+)x", 1, 10_000)
    figure(out, r"speed-up of the whole run \(before wall / now wall\): ([\d.]+)x", 0.05, 100)
    assert re.search(r"now pick / before pick: (the same configuration|[\d.]+%)", out), out[-2000:]


def test_partition_balance(tmp_path):
    out = run([sys.executable, "benchmarks/partition_balance.py", "--quick", "--out", str(tmp_path)], timeout=900)
    figure(out, r"2 stages: balanced imbalance ([\d.]+)", 0.9, 10)
    figure(out, r"throughput vs best built-in ([\d.]+)x", 0.05, 20)
    assert "mode: warm workers" in out, out[-2000:]  # the default: every partition in one pool
    figure(out, r"per round: median ([\d.]+)", 0.05, 20)


def test_instrumentation_overhead():
    # The README's CPU command (2 stages on 2 ranks, gloo) or its GPU one (1 stage, 1 GPU).
    port = free_port()
    ranks, size = (["--num_gpus", "1"], ["--stages", "1", "--torch-adam"]) if CUDA else (["--num_gpus", "2"], [])
    env = {"OMP_NUM_THREADS": "1"} if CUDA else {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    try:
        out = run([sys.executable, "-m", "deepspeed.launcher.runner", *ranks, "--no_local_rank",
                   "--master_port", str(port), "benchmarks/instrumentation_overhead.py", "--quick", "--trace",
                   *size],
                  timeout=600, env=env)
    finally:
        remove_shm_buffers(port)  # DeepSpeed's CPU comm op never removes its buffers
    figure(out, r"median step: instrumented ([\d.]+) ms", 1e-3, 1e5)
    figure(out, r"ratio ([\d.]+) \(goal <= 1\.02\)", 0.2, 5.0)
    figure(out, r"traced / instrumented ([\d.]+)x", 0.2, 50.0)
    figure(out, r"trace ([\d.]+) MB per step", 0.001, 1e4)


def test_bench_traces():
    out = run([sys.executable, "benchmarks/bench_traces.py", "--quick"], timeout=600)
    figure(out, r"speed-up over HTA's load: ([\d.]+)x", 0.05, 1000)
    figure(out, r"autotune peak RSS / trace size: ([\d.]+)", 0.001, 100)


def test_tuner_benchmark():
    out = run([sys.executable, "-m", "benchmarks.tuner_benchmark", "--quick"], timeout=600)
    figure(out, r"^(\d+) runs \(", 1, 10_000)
    figure(out, r"\| hybrid \| ([\d.]+) \|", 0.0, 1.0 + 1e-9)  # score @5: a share of the optimum


def test_bench_advise():
    out = run([sys.executable, "benchmarks/bench_advise.py", "--quick"], timeout=600)
    figure(out, r"pandas\.read_csv\s*: ([\d.]+) s", 0.0, 600)
    figure(out, r"ratio advise / read_csv\s*: ([\d.]+)x", 0.05, 100)


def test_scrape_load():
    out = run([sys.executable, "benchmarks/scrape_load.py", "--quick"], timeout=300)
    assert figure(out, r"rank endpoint:\s+scrapes: (\d+) ok", 0, 1e9) > 0
    assert figure(out, r"rank endpoint:\s+scrapes: \d+ ok, (\d+) failed", 0, 1e9) == 0
    figure(out, r"step-time ratio scraped/unscraped: ([\d.]+)", 0.2, 5.0)


def test_fuzz_loaders():
    out = run([sys.executable, "benchmarks/fuzz_loaders.py", "--quick"], timeout=300)
    assert figure(out, r"fuzz_loaders: (\d+) random cases", 1, 1e6) > 0
    assert figure(out, r"and (\d+) column-sweep cases", 1, 1e6) > 0  # every column emptied / non-numeric
    assert figure(out, r"total non-AutotuneError exceptions: (\d+)", 0, 1e6) == 0


def test_kill_resume_loop():
    out = run([sys.executable, "benchmarks/kill_resume_loop.py", "--quick"], timeout=900)
    assert figure(out, r"consistency failures: (\d+)", 0, 1e6) == 0
    assert re.search(r"^\s+1 controller-random\s", out, re.M), out[-3000:]
    assert re.search(r"^\s+2 controller\+rank-aimed:op-load\s", out, re.M), out[-3000:]  # the round a lock can outlive
    counted = figure(out, r"counted trials (\d+) \(budget", 0, 1e6)
    assert counted == figure(out, r"\(budget (\d+)\)", 1, 1e6)
    figure(out, r"^final run: rc 0 in (\d+) s", 0, 600)
    assert figure(out, r"processes left (\d+)", 0, 1e6) == 0
    assert figure(out, r"locks left (\d+)", 0, 1e6) == 0
    assert figure(out, r"shm buffers left (\d+)", 0, 1e6) == 0


def test_ext_lock_window():
    out = run([sys.executable, "benchmarks/ext_lock_window.py", "--quick"], timeout=300)
    for op in ("deepspeed_shm_comm", "fused_adam"):
        row = re.search(rf"^{op}\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
        assert row is not None, out[-2000:]
        assert int(row[1]) == 3  # every load took the lock, and the sampler saw it
        assert float(row[3]) < 0.05  # its creator holds it open until just before it removes it
    figure(out, r"= 10\.0: (\d+)x the longest stretch", 1, 1e9)


def test_gpu_check(tmp_path):
    out = run([sys.executable, "benchmarks/gpu_check.py", "--quick", "--out", str(tmp_path)], timeout=900)
    if not CUDA:
        assert "gpu_check: not available on CPU" in out, out
        return
    passed = figure(out, r"(\d+) of \d+ checks passed", 0, 100)
    assert passed == figure(out, r"\d+ of (\d+) checks passed", 1, 100)


def test_gpu_bucket_memory(tmp_path):
    out = run(["bash", "benchmarks/gpu_bucket_memory.sh", "--quick", str(tmp_path)], timeout=600,
              env={"PYTHON": sys.executable})
    if not CUDA:
        assert "gpu_bucket_memory: not available on CPU" in out, out
        return
    peaks = re.findall(r"peak MiB \[([\d, ]+)\]", out)
    assert len(peaks) == 2, out
    assert all(0 < int(v) < 10**7 for p in peaks for v in p.split(",")), peaks


def test_launch_noise(tmp_path):
    out = run([sys.executable, "benchmarks/launch_noise.py", "--quick", "--out", str(tmp_path)], timeout=900)
    figure(out, r"^fresh: within-trial ±([\d.]+) %", 0.0, 1000)
    figure(out, r"^warm: within-trial ±[\d.]+ %, between launches CV ([\d.]+) %", 0.0, 1000)


def test_pool_drift():
    out = run([sys.executable, "benchmarks/pool_drift.py", "--quick"], timeout=900)
    figure(out, r"^run 1: last third / first third \(medians\): ([\d.]+)", 0.05, 20)
    assert re.search(r"process groups per rank \[\d+(, \d+)*\]", out), out


def test_torch_schedules(tmp_path):
    out = run([sys.executable, "benchmarks/torch_schedules.py", "--quick", "--out", str(tmp_path)], timeout=900)
    figure(out, r"^1F1B\s+2\s+([\d.]+)", 1, 1e6)  # the landscape's row: samples/s
    figure(out, r"gain of the tuned schedule and count over the config's 1F1B: ([\d.]+)x", 0.05, 100)


def test_torch_script_gain(tmp_path):
    venv_bin = os.path.dirname(sys.executable)  # the study's `torchrun` is the one next to this Python
    out = run([sys.executable, "-m", "benchmarks.torch_script_gain", "--quick", "--out", str(tmp_path)], timeout=900,
              env={"PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"})
    figure(out, r"wall / steps ([\d.]+)x", 1, 1000)
    figure(out, r"^tuned / own: ([\d.]+)x", 0.05, 100)
