"""Layer-cost hooks' overhead: the same instrumented engine with and without them, alternated.

Why `--layer-costs` is off by default: it costs a hook call per layer, micro-batch and
direction. This prints the median step-time ratio hooks-on / hooks-off.

Run (2 stages, 2 ranks, CPU):
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 2 --no_local_rank \
        benchmarks/layer_cost_overhead.py --preset wide-vocab --micro 4 --gas 8 --blocks 6
(`--quick`: 2 block pairs of 1 step, a smoke run whose ratio is noise.)

Within one process per rank, blocks of steps alternate between the probe alone and the
probe plus the layer-cost sink (autotune/rank/layer_costs.py), so machine noise hits both alike.
Each rank prints the wall-time ratio and the thread-CPU-time ratio (the hooks' own work,
without the waits for peers and cores that make wall time noisy on shared cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="wide-vocab")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--gas", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=6, help="on/off block pairs")
    ap.add_argument("--steps-per-block", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 block pairs of 1 step: a smoke run (CI)")
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.steps_per_block = 2, 1

    import deepspeed
    import torch

    from autotune.rank.instrument import PipelineProbe
    from autotune.rank.layer_costs import LayerCostSink
    from autotune.rank.workload.data import batches, synthetic_tokens
    from autotune.rank.workload.model import build_pipeline_module
    from autotune.rank.workload.presets import get_preset

    torch.set_num_threads(1)
    preset = get_preset(args.preset)
    deepspeed.init_distributed()
    module = build_pipeline_module(preset, stages=args.stages)
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    data = batches(synthetic_tokens(preset.vocab_size, 100_000, seed=1), micro_batch=args.micro,
                   seq=preset.seq_length, seed=1 + engine.grid.get_data_parallel_rank())
    probe = PipelineProbe(engine, sinks=[], seq_length=preset.seq_length).install()
    for _ in range(2):  # warm-up
        engine.train_batch(data_iter=data)
    out = Path(tempfile.mkdtemp(prefix="layer-cost-overhead-"))
    on, off = [], []
    cpu_on, cpu_off = [], []
    for block in range(2 * args.blocks):
        hooked = block % 2 == 0
        sink = None
        if hooked:
            sink = LayerCostSink(engine, out / f"layer-costs-rank{engine.global_rank}.csv")
            probe.sinks.append(sink)
        for _ in range(args.steps_per_block):
            t0, c0 = time.perf_counter(), time.thread_time()
            engine.train_batch(data_iter=data)
            (on if hooked else off).append(time.perf_counter() - t0)
            (cpu_on if hooked else cpu_off).append(time.thread_time() - c0)
        if sink is not None:
            sink.detach()
            probe.sinks.remove(sink)
    m_on, m_off = statistics.median(on), statistics.median(off)
    c_on, c_off = statistics.median(cpu_on), statistics.median(cpu_off)
    if engine.global_rank == 0:
        print(f"steps: {len(on)} with layer-cost hooks, {len(off)} without; preset {args.preset}, "
              f"micro {args.micro}, GAS {args.gas}, {args.stages} stages")
    # Every rank: the stages hold different layers. The CPU-time ratio is the hooks' own work
    # on this rank (a wait for a peer or for a core does not count); the wall ratio also
    # carries the machine's noise.
    print(f"rank {engine.global_rank}: median step wall {m_on * 1000:.2f} ms with hooks, {m_off * 1000:.2f} ms "
          f"without, ratio {m_on / m_off:.3f}; thread CPU {c_on * 1000:.2f} vs {c_off * 1000:.2f} ms, "
          f"ratio {c_on / c_off:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
