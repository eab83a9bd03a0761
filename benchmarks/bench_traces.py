"""Reading a 1 GB multi-rank torch.profiler trace: autotune's reader against HTA's loader.

Goal (issue 27): `autotune advise`'s reading and analysis of the traces at least 3x faster
than HTA 0.5.0's `TraceAnalysis(trace_dir=...)` load of them, with a peak memory below the
traces' size. Side by side in one run, each contender in its own process, its peak memory
the largest sum of its process tree's RSS (HTA parses ranks in worker processes).

    .venv/bin/python benchmarks/bench_traces.py              # 1 GB over 4 ranks
    .venv/bin/python benchmarks/bench_traces.py --quick      # 40 MB, for CI

The trace: HTA's own GPU trace (tests/fixtures/traces/two_rank_allreduce.json.gz, an A100
job), its steps repeated with shifted times and correlation ids until each rank's file
holds its share, written uncompressed as `tensorboard_trace_handler` writes them. The
readers compared for the choice of parser: the standard library's C scanner streamed over
4 MB blocks (autotune/traces/reader.py, what `advise` uses), ijson's yajl2_c backend
streamed into the same columns, and `json.load` of each whole file. Not a timed test:
timings depend on the machine.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "tests" / "fixtures" / "traces" / "two_rank_allreduce.json.gz"
CONTENDERS = ("autotune", "ijson", "json-load", "hta")
LABELS = {"autotune": "autotune advise (C scanner, streamed; read + analysis)",
          "ijson": "ijson yajl2_c, streamed into the same columns (read + analysis)",
          "json-load": "json.load of each file into the same columns (read + analysis)",
          "hta": "HTA 0.5.0 TraceAnalysis(trace_dir=...) (load only)"}


def write_traces(folder: Path, total_mb: int, ranks: int) -> tuple[int, int]:
    """Per-rank files of about total_mb / ranks MB each; (bytes, events) written."""
    whole = json.loads(gzip.open(TEMPLATE).read())
    events = whole.pop("traceEvents")
    stamps = [e["ts"] for e in events if "ts" in e and isinstance(e["ts"], int | float)]
    span = max(stamps) - min(stamps) + 1000.0
    corr_span = 1 + max(int((e.get("args") or {}).get("correlation", 0)) for e in events)
    step_span = 10
    meta = {k: v for k, v in whole.items() if k != "distributedInfo"}
    per_rank = total_mb * (1 << 20) // ranks
    written = n_events = 0
    for rank in range(ranks):
        info = dict(whole["distributedInfo"], rank=rank, world_size=ranks)
        path = folder / f"rank{rank}.1.pt.trace.json"
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps({**meta, "distributedInfo": info})[:-1] + ', "traceEvents": [\n')
            size, copy, first = 0, 0, True
            while size < per_rank:
                for e in events:
                    e2 = dict(e)
                    if isinstance(e2.get("ts"), int | float):
                        e2["ts"] = e2["ts"] + copy * span
                    args = e2.get("args")
                    if isinstance(args, dict) and "correlation" in args:
                        e2["args"] = dict(args, correlation=args["correlation"] + copy * corr_span)
                    name = e2.get("name", "")
                    if isinstance(name, str) and name.startswith("ProfilerStep#"):
                        e2["name"] = f"ProfilerStep#{int(name[13:]) + copy * step_span}"
                    line = ("" if first else ",\n") + json.dumps(e2)
                    first = False
                    fh.write(line)
                    size += len(line)
                    n_events += 1
                copy += 1
            fh.write("\n]}\n")
        written += path.stat().st_size
    return written, n_events


# -- the contenders, each run in its own process ------------------------------------------
def _columns_from(events, meta_path: Path):
    from autotune.traces.rank_trace import _Columns
    from autotune.traces.reader import TraceFile

    cols = _Columns()
    for ev in events:
        cols.add(ev)
    tf = TraceFile(meta_path)  # the metadata only (it precedes the events here)
    tf.close()
    return cols.finish(tf)


def contender(name: str, folder: Path) -> str:
    files = sorted(folder.glob("*.json"))
    if name == "autotune":
        from autotune.loaders import load_inputs

        s = load_inputs([str(folder)]).subjects[0]
        return f"comm/compute {s.get('comm_compute_ratio'):.4f}"
    if name == "hta":
        import logging

        logging.disable(logging.WARNING)
        from hta.trace_analysis import TraceAnalysis

        t = TraceAnalysis(trace_dir=str(folder))
        return f"{sum(len(t.t.get_trace(r)) for r in t.t.get_ranks())} rows"
    from autotune.traces.breakdown import breakdown

    out = []
    for f in files:
        if name == "ijson":
            import ijson

            with open(f, "rb") as fh:
                trace = _columns_from(ijson.items(fh, "traceEvents.item", use_float=True), f)
        else:
            with open(f, encoding="utf-8") as fh:
                trace = _columns_from(json.load(fh)["traceEvents"], f)
        out.append(breakdown(trace).comm_compute_ratio or 0.0)
    return f"comm/compute {max(out):.4f}"


def tree_rss(pid: int) -> int:
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total


def measure(name: str, folder: Path) -> tuple[float, int, str]:
    """(wall seconds, peak tree RSS bytes, what it read) of one contender in a fresh process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--contender", name, "--dir", str(folder)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    done.set()
    th.join()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return wall, peak, f"failed: {err.strip().splitlines()[-1] if err.strip() else proc.returncode}"
    return wall, peak, out.strip().splitlines()[-1] if out.strip() else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="uncompressed size of all ranks' files (default 1024)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="40 MB: a smoke run")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--contender", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.contender:
        print(contender(args.contender, Path(args.dir)))
        return 0
    if args.quick:
        args.size_mb = 40
    with tempfile.TemporaryDirectory(prefix="bench-traces-") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        size, events = write_traces(folder, args.size_mb, args.ranks)
        print(f"trace: {args.ranks} ranks, {size / (1 << 20):,.0f} MB uncompressed, {events:,} events "
              f"(written in {time.perf_counter() - t0:.0f} s)")
        results = {}
        for name in args.contenders.split(","):
            wall, peak, what = measure(name, folder)
            results[name] = (wall, peak)
            print(f"{LABELS[name]:<66}: {wall:7.1f} s, peak RSS {peak / (1 << 20):7,.0f} MB  ({what})")
        if "autotune" in results and "hta" in results:
            (ours, ours_rss), (hta, _) = results["autotune"], results["hta"]
            print(f"speed-up over HTA's load: {hta / ours:.2f}x (goal >= 3x)")
            print(f"autotune peak RSS / trace size: {ours_rss / size:.2f} (goal < 1)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
