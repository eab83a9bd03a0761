"""Scrape load test: does serving /metrics to 50 concurrent scrapers slow a training rank?

A CPU workload loop runs "training steps" (fixed numpy matmul work, one StepRecord
written to the rank's exporter per step; by default the child-process endpoint that
`instrument()` uses). 50 scraper threads in a *separate process* (as a
Prometheus would be) GET the rank's endpoint. Three kinds of phase alternate in short
slices, in a rotating order, so that the drift of a shared machine hits all alike:

- U, unscraped;
- S, scraped: the scrapers hit the rank's endpoint;
- C, control: the same scrapers hit a decoy endpoint in another process that serves the
  rank's last exposition as fixed bytes. On a small machine the scrapers themselves
  take CPU from the training loop; C shows how much, and S / C is the part the rank's
  own endpoint costs (its server thread, the GIL, rendering).

The scraper processes start once and are switched on and off between slices. The
report gives failed scrapes, the median step time of each kind, the ratios, and the
endpoint's CPU inside the training process per scrape.

    .venv/bin/python benchmarks/scrape_load.py                  # 50 scrapers, each every 1 s
    .venv/bin/python benchmarks/scrape_load.py --interval 0     # back-to-back stress
    .venv/bin/python benchmarks/scrape_load.py --in-process     # endpoint in the training process
    .venv/bin/python benchmarks/scrape_load.py --uncached       # ... and render on every scrape
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
from autotune.core.schema import StepRecord  # noqa: E402
from exporters.prometheus_rank import RankExporter  # noqa: E402
from exporters.sidecar import SidecarExporter  # noqa: E402


def scraper_process(url: str, n: int, interval: float, go, stop, out: mp.Queue) -> None:
    """n threads GET url while `go` is set, until `stop`; put (ok, failed, latencies) on out."""
    ok, failed, lat = [0], [0], []
    lock = threading.Lock()

    def loop(offset: float) -> None:
        next_t = None
        while not stop.is_set():
            if not go.wait(0.05):
                next_t = None  # paused: pace afresh when switched on again
                continue
            if interval > 0:
                next_t = time.monotonic() + offset if next_t is None else next_t
                time.sleep(max(0.0, next_t - time.monotonic()))
                next_t += interval
                if not go.is_set():
                    continue
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
    p.add_argument("--seconds", type=float, default=10.0, help="scraped seconds in all (S phases)")
    p.add_argument("--slice", type=float, default=1.0, help="seconds of one U, S or C phase")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between one scraper's requests (0 = back-to-back)")
    p.add_argument("--size", type=int, default=384,
                   help="matmul size: 384 gives 25-40 ms steps on one core, like a small pipeline stage")
    p.add_argument("--url", help="scrape this endpoint instead (no workload)")
    p.add_argument("--uncached", action="store_true",
                   help="render on every scrape (a registry the exporter does not own), for comparison")
    p.add_argument("--in-process", action="store_true",
                   help="serve from a thread of the training process (RankExporter) instead of the "
                        "child process `instrument()` uses by default (exporters/sidecar.py)")
    p.add_argument("--quick", action="store_true",
                   help="10 scrapers, 3 scraped seconds in 0.5-s slices: a smoke run (CI)")
    args = p.parse_args(argv)
    if args.quick:
        args.scrapers, args.seconds, args.slice = 10, 3.0, 0.5
    ctx = mp.get_context("spawn")
    stop = ctx.Event()

    def scrapers(url: str) -> tuple:
        go, q = ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=scraper_process, args=(url, args.scrapers, args.interval, go, stop, q))
        proc.start()
        return go, q, proc

    def results(q: mp.Queue, proc) -> tuple[int, int, list[float]]:
        got = q.get()
        proc.join()
        return got

    if args.url:
        go, q, proc = scrapers(args.url)
        go.set()
        time.sleep(args.seconds)
        stop.set()
        _report_scrapes(*results(q, proc))
        return 0

    from prometheus_client import CollectorRegistry

    if args.in_process or args.uncached:
        registry = CollectorRegistry() if args.uncached else None  # a shared registry: no render cache
        exporter = RankExporter(labels={"job": "scrape-load"}, registry=registry)
    else:
        exporter = SidecarExporter(labels={"job": "scrape-load"})
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
    gates = {"scraped": scrapers(url), "control": scrapers(decoy_url)}
    time.sleep(1.0)  # the scraper processes import and start their threads
    steps: dict[str, list[float]] = {"unscraped": [], "scraped": [], "control": []}
    server_cpu = 0.0  # CPU seconds of this process outside the training thread while scraped (>= 0)
    orders = [("unscraped", "scraped", "control"), ("scraped", "control", "unscraped"),
              ("control", "unscraped", "scraped")]
    rounds = max(1, round(args.seconds / args.slice))
    for i in range(rounds):
        for kind in orders[i % 3]:
            gate = gates.get(kind)
            if gate is not None:
                gate[0].set()
            cpu0, thread0 = time.process_time(), time.thread_time()
            steps[kind] += run_steps(exporter, args.slice, args.size)
            if kind == "scraped":
                server_cpu += max(0.0, (time.process_time() - cpu0) - (time.thread_time() - thread0))
            if gate is not None:
                gate[0].clear()
    stop.set()
    totals = {kind: results(q, proc) for kind, (_, q, proc) in gates.items()}
    decoy.terminate()
    exporter.close()
    where = "child process" if isinstance(exporter, SidecarExporter) else (
        "training process, render on every scrape" if args.uncached else "training process")
    print(f"{rounds} rounds of U, S and C slices of {args.slice:g} s, {args.scrapers} scrapers "
          f"each every {args.interval:g} s; rank endpoint served from the {where}")
    print("rank endpoint:    ", end="")
    _report_scrapes(*totals["scraped"])
    print("control endpoint: ", end="")
    _report_scrapes(*totals["control"])
    mu, ms, mc = (statistics.median(steps[k]) for k in ("unscraped", "scraped", "control"))
    print(f"steps: unscraped {len(steps['unscraped'])} median {mu * 1e3:.2f} ms | "
          f"scraped {len(steps['scraped'])} median {ms * 1e3:.2f} ms | "
          f"control {len(steps['control'])} median {mc * 1e3:.2f} ms")
    print(f"step-time ratio scraped/unscraped: {ms / mu:.4f} ({(ms / mu - 1) * 100:+.2f} %)")
    print(f"step-time ratio control/unscraped: {mc / mu:.4f} (the scrapers' own CPU on this machine)")
    print(f"step-time ratio scraped/control:   {ms / mc:.4f} (what the rank endpoint itself costs)")
    scrapes = totals["scraped"][0] + totals["scraped"][1]
    print(f"rank endpoint CPU in the training process: {server_cpu / max(1, scrapes) * 1e3:.3f} ms per scrape, "
          f"{server_cpu / (rounds * args.slice) * 100:.2f} % of a core")
    return 0 if totals["scraped"][1] == 0 else 1


def _report_scrapes(ok: int, failed: int, lat: list[float]) -> None:
    lat = sorted(lat) or [0.0]
    print(f"scrapes: {ok} ok, {failed} failed; latency p50 {lat[len(lat) // 2] * 1e3:.1f} ms, "
          f"p99 {lat[int(len(lat) * 0.99)] * 1e3:.1f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
