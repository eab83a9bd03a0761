"""The CUDA paths on a real NVIDIA GPU: what CI (CPU only) can never run.

Checks, each printed as one PASS/FAIL line with its figures:
  event-timing    CudaEventTimer against a synchronized wall clock (and the host
                  clock, which sees only kernel launches)
  probe-cost      host time the probe adds per timed instruction and per step
  nvml            NvmlSampler: busy GPU reads high, idle GPU reads low; which NVML
                  path answered (sample buffer or utilization rate)
  fragmentation   cuda_memory_stats on a deliberately holed allocator; the probe's
                  per-step peak reset
  pipeline        one instrumented DeepSpeed pipeline run on this GPU (NCCL, 1 rank,
                  1 stage): the CSV carries NVML utilization and allocator figures
  advise          `autotune advise` on that CSV: the host-bound rule fires (the small
                  model cannot keep an H200 busy), fragmentation is available
  overhead        benchmarks/instrumentation_overhead.py on this GPU, device probe on

Not here: `autotune run` end to end, which needs 2 stages and so 2 GPUs (NCCL
refuses two ranks on one device).

Run (one NVIDIA GPU; DeepSpeed, scikit-optimize and nvidia-ml-py importable):
    python benchmarks/gpu_check.py --out DIR
    python benchmarks/gpu_check.py --quick    # CI smoke run: shorter runs; without CUDA it says so, exit 0
Writes DIR/gpu_check.json and the runs' files. Exits 1 if a check failed.
The optimizer is torch's Adam (`torch_adam`) so no DeepSpeed op is JIT-compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS: dict[str, dict] = {}
QUICK = False
"""--quick: the DeepSpeed runs take fewer steps and the overhead figure is not judged (too few blocks)."""


def check(name: str, ok: bool, **figures: object) -> None:
    RESULTS[name] = {"ok": bool(ok), **figures}
    shown = ", ".join(f"{k} {_fmt(v)}" for k, v in figures.items())
    print(f"{'PASS' if ok else 'FAIL'} {name}: {shown}", flush=True)


def _fmt(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def matmuls(torch, x, n: int) -> None:
    for _ in range(n):
        x @ x  # noqa: B018 - the kernel is the point


def check_event_timing(torch) -> None:
    from autotune.rank.timing import CudaEventTimer, HostTimer

    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmuls(torch, x, 5)
    torch.cuda.synchronize()
    events, host = CudaEventTimer(), HostTimer()
    t0 = time.perf_counter()
    ev, ht = events.begin(), host.begin()
    matmuls(torch, x, 40)
    host.end(ht, "compute")
    events.end(ev, "compute")
    ev2 = events.begin()  # a second, interleaved category resolves separately
    matmuls(torch, x, 10)
    events.end(ev2, "optimizer")
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    got = events.collect()
    host_s = host.collect()["compute"]
    total = got["compute"] + got["optimizer"]
    tflops = 40 * 2 * 8192**3 / got["compute"] / 1e12
    check("event-timing", 0.9 < total / wall <= 1.02 and host_s < 0.5 * got["compute"]
          and 3.0 < got["compute"] / got["optimizer"] < 5.0,
          events_over_wall=total / wall, host_over_events=host_s / got["compute"],
          compute_over_optimizer=got["compute"] / got["optimizer"], bf16_tflops=tflops)


def check_probe_cost(torch) -> None:
    """Host cost of what the probe adds: per timed instruction, per step (device probe)."""
    from autotune.rank.timing import CudaEventTimer
    from exporters.devices import make_device_probe

    n = 2000
    torch.cuda.synchronize()

    def per_interval(timer) -> tuple[float, float]:
        timer.collect()
        t0 = time.perf_counter()
        for _ in range(n):
            timer.end(timer.begin(), "compute")
        t1 = time.perf_counter()
        timer.collect()
        return (t1 - t0) / n * 1e6, (time.perf_counter() - t1) / n * 1e6

    pooled = CudaEventTimer()
    per_interval(pooled)  # first step creates the events
    pooled_us, collect_us = per_interval(pooled)
    t0 = time.perf_counter()
    for _ in range(n):  # what the timer did before pooling: two new events per interval
        a = torch.cuda.Event(enable_timing=True)
        a.record()
        b = torch.cuda.Event(enable_timing=True)
        b.record()
    fresh_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    probe = make_device_probe("cuda:0")
    probe.utilization(0.2)
    t0 = time.perf_counter()
    for _ in range(50):
        probe.utilization(0.2)
        probe.memory()
    step_ms = (time.perf_counter() - t0) / 50 * 1e3
    probe.close()
    # The overhead benchmark's step: GAS 8, 1 stage -> about 27 timed instructions, ~220 ms.
    est = (27 * (pooled_us + collect_us) / 1e3 + step_ms) / 220
    check("probe-cost", est < 0.02, pooled_us_per_instruction=pooled_us,
          collect_us_per_instruction=collect_us, fresh_events_us_per_instruction=fresh_us,
          device_probe_ms_per_step=step_ms, estimated_overhead_on_220ms_step=est)


def check_nvml(torch) -> None:
    from exporters.devices import NvmlSampler

    sampler = NvmlSampler(0)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    time.sleep(2.0)
    idle = sampler.utilization(window=1.5)
    end = time.perf_counter() + 3.0
    while time.perf_counter() < end:
        matmuls(torch, x, 20)
        torch.cuda.synchronize()
    busy_samples = sampler.samples(window=2.0)
    busy = statistics.fmean(busy_samples) if busy_samples else None
    torch.cuda.synchronize()
    time.sleep(2.5)
    after = sampler.utilization(window=1.5)
    mem = sampler.memory()
    path = "nvmlDeviceGetSamples" if sampler._samples_ok else "nvmlDeviceGetUtilizationRates"
    sampler.close()
    check("nvml", busy is not None and busy > 0.8 and after is not None and after < 0.3,
          idle=idle, busy=busy, after_idle=after, busy_samples_in_2s=len(busy_samples),
          path=path, used_gib=(mem.used_bytes / 2**30 if mem else None),
          total_gib=(mem.total_bytes / 2**30 if mem else None))


def check_fragmentation(torch) -> None:
    from exporters.devices import cuda_memory_stats, make_device_probe

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # 5 MiB blocks share the allocator's 20 MiB segments: freeing every other one
    # leaves holes that stay reserved.
    blocks = [torch.empty(5 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(64)]
    del blocks[::2]
    stats = cuda_memory_stats("cuda:0")
    direct = 1 - torch.cuda.memory_allocated() / torch.cuda.memory_reserved()
    probe = make_device_probe("cuda:0")
    big = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    del big
    first = probe.memory()["peak_bytes"]
    second = probe.memory()["peak_bytes"]
    probe.close()
    del blocks
    torch.cuda.empty_cache()
    emptied = cuda_memory_stats("cuda:0")
    check("fragmentation",
          stats["fragmentation_ratio"] is not None and abs(stats["fragmentation_ratio"] - direct) < 1e-9
          and 0.3 < stats["fragmentation_ratio"] < 0.7 and stats["inactive_split_bytes"] > 0
          and first >= 512 * 2**20 and second < 512 * 2**20
          and emptied["reserved_bytes"] < stats["reserved_bytes"],
          fragmentation=stats["fragmentation_ratio"], torch_direct=direct,
          inactive_split_mib=stats["inactive_split_bytes"] / 2**20,
          peak_after_512mib_mib=first / 2**20, peak_next_step_mib=second / 2**20,
          reserved_mib=stats["reserved_bytes"] / 2**20,
          reserved_after_empty_cache_mib=emptied["reserved_bytes"] / 2**20)


def ds_config(path: Path, micro: int, gas: int) -> Path:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "train_batch_size": micro * gas, "steps_per_print": 10**9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "bf16": {"enabled": True}}
    path.write_text(json.dumps(cfg))
    return path


def one_gpu(script: Path, *args: str) -> list[str]:
    """DeepSpeed's launcher command for one rank on this GPU (the trial engine's own builder)."""
    from autotune.trials.launcher import LaunchSpec, build_command, free_port

    spec = LaunchSpec(num_ranks=1, script=script, script_args=list(args), log_path=Path(os.devnull), timeout=0)
    return build_command(spec, free_port())


def run(cmd: list[str], log: Path, timeout: float) -> int:
    print("$ " + " ".join(cmd), flush=True)
    with log.open("w") as fh:
        try:
            return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                                  cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            return 124


def check_pipeline(out: Path, preset: str) -> None:
    from autotune.core.summary import summarize_trial
    from autotune.loaders.metrics import read_records as read_metrics_csv

    d = out / "pipeline"
    d.mkdir(exist_ok=True)
    from autotune.core.options import WorkloadOptions
    from autotune.rank.workload.trial_spec import SPEC_NAME, TrialSpec

    wl = WorkloadOptions(preset=preset, pipeline_stages=1, data_parallel_size=1, steps=4 if QUICK else 8,
                         warmup_steps=1 if QUICK else 2)
    trial = TrialSpec(workload=wl, trial=-1, ds_config=str(ds_config(d / "ds_config.json", 8, 8)),
                      metrics_csv=str(d / "metrics-rank{rank}.csv"))
    rc = run(one_gpu(ROOT / "autotune/rank/workload/train.py", "--trial-spec", str(trial.write(d / SPEC_NAME))),
             d / "launcher.log", 240)
    records = read_metrics_csv(d / "metrics-rank0.csv") if (d / "metrics-rank0.csv").exists() else []
    s = summarize_trial(records) if records else None
    if rc != 0 or s is None:
        check("pipeline", False, rc=rc, log=str(d / "launcher.log"))
        return
    measured = [r for r in records if not r.warmup]
    busy = [min(1.0, r.compute_seconds / r.step_seconds) for r in measured]
    check("pipeline",
          all(r.device.startswith("cuda") for r in measured)
          and all(r.memory_fragmentation_ratio is not None and r.memory_reserved_bytes for r in measured)
          and all(r.compute_seconds <= r.step_seconds * 1.01 for r in measured)
          and all(r.utilization_from_device == 1 for r in measured) and s.host_bound_fraction is not None
          and s.loss_last < s.loss_first,
          device=measured[0].device, samples_per_second=s.samples_per_second,
          nvml_utilization=s.device_utilization_mean, busy_fraction=statistics.fmean(busy),
          host_bound_fraction=s.host_bound_fraction,
          fragmentation=s.memory_fragmentation_ratio, peak_mib=(s.memory_peak_bytes or 0) / 2**20,
          reserved_mib=(s.memory_reserved_bytes or 0) / 2**20,
          loss=f"{s.loss_first:.3f}->{s.loss_last:.3f}")


def check_advise(out: Path) -> None:
    csv_path = out / "pipeline" / "metrics-rank0.csv"
    log = out / "advise.json"
    rc = run([sys.executable, "-m", "autotune.cli.main", "advise", "--format", "json", str(csv_path)], log, 60)
    findings = json.loads(log.read_text())["findings"] if rc == 0 else []
    status = {f["rule_id"]: f["status"] for f in findings}
    fired = sorted(r for r, st in status.items() if st == "fired")
    check("advise", rc == 0 and "host-bound" in fired and status.get("fragmentation-high") != "insufficient_data",
          rc=rc, fired=fired, statuses={r: status.get(r) for r in ("host-bound", "fragmentation-high")})


def check_overhead(out: Path, preset: str) -> None:

    log = out / "overhead.log"
    size = ["--quick"] if QUICK else ["--blocks", "10"]
    rc = run(one_gpu(ROOT / "benchmarks/instrumentation_overhead.py", "--preset", preset, "--stages", "1",
                     "--micro", "8", "--gas", "8", *size, "--torch-adam"), log, 240)
    line = next((ln for ln in log.read_text().splitlines() if "ratio" in ln), "")
    ratio = float(line.split("ratio", 1)[1].split()[0]) if line else None
    check("overhead", rc == 0 and ratio is not None and (QUICK or ratio <= 1.02), rc=rc, ratio=ratio,
          line=line.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-check")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--quick", action="store_true", help="shorter DeepSpeed runs, overhead not judged (CI)")
    args = ap.parse_args()
    global QUICK
    QUICK = args.quick
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: not available on CPU (no CUDA device); nothing measured")
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    checks = {
        "event-timing": lambda: check_event_timing(torch),
        "probe-cost": lambda: check_probe_cost(torch),
        "nvml": lambda: check_nvml(torch),
        "fragmentation": lambda: check_fragmentation(torch),
        "pipeline": lambda: check_pipeline(out, args.preset),
        "advise": lambda: check_advise(out),
        "overhead": lambda: check_overhead(out, args.preset),
    }
    wanted = [c for c in args.only.split(",") if c] or list(checks)
    for name in wanted:
        t0 = time.perf_counter()
        try:
            checks[name]()
        except Exception as exc:  # one broken path must not hide the others' figures
            check(name, False, error=f"{type(exc).__name__}: {exc}")
        RESULTS[name]["seconds"] = round(time.perf_counter() - t0, 1)
        (out / "gpu_check.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
             "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES",)}, "checks": RESULTS},
            indent=2))
    failed = [n for n, r in RESULTS.items() if not r["ok"]]
    print(f"{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
