"""torch.profiler traces: read a Kineto Chrome-trace JSON and measure what it holds (issue 27).

- `reader.py`: the file, streamed (plain or gzipped): its metadata and its events, one at a
  time, so a trace larger than memory is read in a few hundred MB; one-line errors.
- `rank_trace.py`: one rank's trace kept as columns: the steps, the device's kernels by kind,
  the CPU operators and the collectives with their sizes.
- `intervals.py`: the interval arithmetic (union, intersection) every breakdown is built on.
- `breakdown.py`: per rank, HTA's temporal breakdown and compute/communication overlap, the
  per-step utilization and the communication/compute ratio; CPU-only traces from their ops.
- `pipeline.py`: for a pipeline job, each rank's stage from the send/receive pattern and the
  bubble per stage.
Controller side: imports `core` only; `autotune/loaders/trace.py` turns it into the advice's
signals, and `autotune/rank/trace_recorder.py` records a trace inside a trial's ranks.
"""
