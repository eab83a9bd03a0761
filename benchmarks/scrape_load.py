"""Scrape load test: does serving /metrics to 50 concurrent scrapers slow a training rank?

A CPU workload loop runs "training steps" (fixed numpy matmul work, one StepRecord
written to a RankExporter per step) while 50 scraper threads in a *separate process*
(as a Prometheus would be) GET the rank's endpoint for `--seconds`. Scraped and
unscraped phases alternate (U S C U S C ...) so drift hits all; the report gives failed
scrapes and the ratio of median step times (scraped / unscraped).

Phase C is the control: the same scrapers hit a decoy endpoint in another process
that serves the rank's last exposition as fixed bytes. On a small machine the
scrapers themselves take CPU from the training loop; C shows how much. S / C is
the part the rank's own endpoint costs (its server thread, the GIL, rendering).

    .venv/bin/python benchmarks/scrape_load.py                  # 50 scrapers, each every 1 s
    .venv/bin/python benchmarks/scrape_load.py --interval 0     # back-to-back stress
    .venv/bin/python benchmarks/scrape_load.py --uncached       # render on every scrape, to compare
    .venv/bin/python benchmarks/scrape_load.py --url http://127.0.0.1:9710/metrics  # a real rank

With --url the workload is not run: only scrape counts, failures and latency are reported
(compare the rank's own step times with and without the load).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core for the "training" thread
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import multiprocessing as mp  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from autotune.schema import StepRecord  # noqa: E402
from exporters.prometheus_rank import RankExporter  # noqa: E402


def scraper_process(url: str, n: int, seconds: float, interval: float, out: mp.Queue) -> None:
    """n threads GET url until `seconds` elapse; put (ok, failed, latencies) on out."""
    ok, failed, lat = [0], [0], []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def loop(offset: float) -> None:
        next_t = time.monotonic() + offset
        while time.monotonic() < deadline:
            if interval > 0:
                time.sleep(max(0.0, next_t - time.monotonic()))
                next_t += interval
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    good = r.status == 200 and b"autotune_" in r.read()
            except OSError:
                good = False
            with lock:
                lat.append(time.perf_counter() - t0)
                if good:
                    ok[0] += 1
                else:
                    failed[0] += 1

    threads = [threading.Thread(target=loop, args=((i / n) * interval,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((ok[0], failed[0], lat))


def decoy_process(body: bytes, port_out: mp.Queue) -> None:
    """Serve `body` at any path until terminated: the control endpoint (no rendering)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    port_out.put(server.server_address[1])
    server.serve_forever()


def run_steps(exporter: RankExporter, seconds: float, size: int) -> list[float]:
    """Training-like steps for `seconds`; each writes one StepRecord. Returns step times."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((size, size)), rng.standard_normal((size, size))
    times, deadline, step = [], time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        for _ in range(8):
            a = np.tanh(a @ b)
        dt = time.perf_counter() - t0
        times.append(dt)
        exporter.write(StepRecord(
            time=time.time(), trial=0, rank=0, stage=0, step=step, warmup=0, step_seconds=dt,
            samples_per_second=32 / dt, tokens_per_second=32 * 128 / dt, compute_seconds=dt,
            comm_seconds=0.0, wait_seconds=0.0, data_seconds=0.0, device_utilization=1.0,
            micro_batch_size=8, gradient_accumulation_steps=4, pipeline_stages=1,
            data_parallel_size=1, seq_length=128))
        step += 1
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="50 concurrent scrapers vs an unscraped run")
    p.add_argument("--scrapers", type=int, default=50)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between one scraper's requests (0 = back-to-back)")
    p.add_argument("--rounds", type=int, default=2, help="U/S phase pairs")
    p.add_argument("--size", type=int, default=384,
                   help="matmul size: 384 gives ~40 ms steps on one core, like a small pipeline stage")
    p.add_argument("--url", help="scrape this endpoint instead (no workload)")
    p.add_argument("--uncached", action="store_true",
                   help="render on every scrape (a registry the exporter does not own), for comparison")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")

    def scrape_phase(url: str) -> tuple[ctx.Process, mp.Queue]:
        q = ctx.Queue()
        proc = ctx.Process(target=scraper_process,
                           args=(url, args.scrapers, args.seconds + 1.0, args.interval, q))
        proc.start()
        return proc, q

    if args.url:
        proc, q = scrape_phase(args.url)
        ok, failed, lat = q.get()
        proc.join()
        _report_scrapes(ok, failed, lat)
        return 0 if failed == 0 else 1

    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry() if args.uncached else None  # a shared registry: no render cache
    exporter = RankExporter(labels={"job": "scrape-load"}, registry=registry)
    url = exporter.serve(port=0)
    if url is None:
        return 1
    run_steps(exporter, 1.0, args.size)  # warm-up
    with urllib.request.urlopen(url, timeout=5) as r:
        body = r.read()
    port_q = ctx.Queue()
    decoy = ctx.Process(target=decoy_process, args=(body, port_q), daemon=True)
    decoy.start()
    decoy_url = f"http://127.0.0.1:{port_q.get(timeout=30)}/metrics"
    phases: dict[str, list[float]] = {"unscraped": [], "scraped": [], "control": []}
    totals = {"scraped": [0, 0, []], "control": [0, 0, []]}
    server_cpu = 0.0  # CPU seconds of this process outside the training thread while scraped
    for i in range(args.rounds):
        phases["unscraped"] += (u := run_steps(exporter, args.seconds, args.size))
        medians = [f"unscraped {statistics.median(u) * 1e3:.2f} ms"]
        for name, target in (("scraped", url), ("control", decoy_url)):
            proc, q = scrape_phase(target)
            time.sleep(0.5)  # let the scraper process start its threads
            cpu0, thread0 = time.process_time(), time.thread_time()
            phases[name] += (st := run_steps(exporter, args.seconds, args.size))
            if name == "scraped":
                server_cpu += (time.process_time() - cpu0) - (time.thread_time() - thread0)
            ok, failed, lat = q.get()
            proc.join()
            totals[name][0] += ok
            totals[name][1] += failed
            totals[name][2] += lat
            medians.append(f"{name} {statistics.median(st) * 1e3:.2f} ms")
        # Per-round medians show how much of the difference is machine noise.
        print(f"round {i}: " + ", ".join(medians), flush=True)
    decoy.terminate()
    exporter.close()
    print("rank endpoint:    ", end="")
    _report_scrapes(*totals["scraped"])
    print("control endpoint: ", end="")
    _report_scrapes(*totals["control"])
    mu, ms, mc = (statistics.median(phases[k]) for k in ("unscraped", "scraped", "control"))
    print(f"steps: unscraped {len(phases['unscraped'])} median {mu * 1e3:.2f} ms | "
          f"scraped {len(phases['scraped'])} median {ms * 1e3:.2f} ms | "
          f"control {len(phases['control'])} median {mc * 1e3:.2f} ms")
    print(f"step-time ratio scraped/unscraped: {ms / mu:.4f} ({(ms / mu - 1) * 100:+.2f} %)")
    print(f"step-time ratio control/unscraped: {mc / mu:.4f} (the scrapers' own CPU on this machine)")
    print(f"step-time ratio scraped/control:   {ms / mc:.4f} (what the rank endpoint itself costs)")
    scrapes = totals["scraped"][0] + totals["scraped"][1]
    print(f"rank endpoint CPU in the training process: {server_cpu / max(1, scrapes) * 1e3:.3f} ms per scrape, "
          f"{server_cpu / (args.rounds * args.seconds) * 100:.2f} % of a core")
    return 0 if totals["scraped"][1] == 0 else 1


def _report_scrapes(ok: int, failed: int, lat: list[float]) -> None:
    lat = sorted(lat) or [0.0]
    print(f"scrapes: {ok} ok, {failed} failed; latency p50 {lat[len(lat) // 2] * 1e3:.1f} ms, "
          f"p99 {lat[int(len(lat) * 0.99)] * 1e3:.1f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
