"""Instrumentation overhead: the same engine, instrumentation on and off, alternated.

Goal (issue 2): median step-time ratio on/off within 2 %.

Run (2 stages, 2 ranks, CPU):
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 2 --no_local_rank \
        benchmarks/instrumentation_overhead.py --preset tiny --micro 4 --gas 8 --blocks 10
(`--quick`: 2 block pairs of 1 step, a CI smoke run whose ratio is noise.)

One process per rank; within it, blocks of steps alternate between the
instrumented engine (every pipeline instruction timed, a StepRecord per
step) and the bare engine (only a host clock around train_batch), so machine
noise hits both alike. Rank 0 prints the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--gas", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=10, help="on/off block pairs")
    ap.add_argument("--steps-per-block", type=int, default=3)
    ap.add_argument("--torch-adam", action="store_true",
                    help="torch's Adam instead of DeepSpeed's (no JIT-compiled op on a fresh GPU machine)")
    ap.add_argument("--quick", action="store_true", help="2 block pairs of 1 step: a smoke run (CI)")
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.steps_per_block = 2, 1

    import deepspeed
    import torch

    from autotune.rank.instrument import PipelineProbe, engine_device_probe
    from autotune.rank.workload.data import batches, synthetic_tokens
    from autotune.rank.workload.model import build_pipeline_module
    from autotune.rank.workload.presets import get_preset

    torch.set_num_threads(1)
    preset = get_preset(args.preset)
    deepspeed.init_distributed()
    module = build_pipeline_module(preset, stages=args.stages)
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, **({"torch_adam": True} if args.torch_adam else {})}},
           "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    data = batches(synthetic_tokens(preset.vocab_size, 100_000, seed=1), micro_batch=args.micro,
                   seq=preset.seq_length, seed=1 + engine.grid.get_data_parallel_rank())
    # On a GPU the device probe (NVML samples, allocator stats) is part of the cost.
    probe = PipelineProbe(engine, sinks=[], seq_length=preset.seq_length, device=engine_device_probe(engine))
    cuda = engine.device.type == "cuda"
    for _ in range(2):  # warm-up
        engine.train_batch(data_iter=data)

    on, off = [], []
    for block in range(2 * args.blocks):
        instrumented = block % 2 == 0
        if instrumented:
            probe.install()
        for _ in range(args.steps_per_block):
            t0 = time.perf_counter()
            engine.train_batch(data_iter=data)
            if cuda:  # both arms wait for the device, as the probe does at step end
                torch.cuda.synchronize()
            (on if instrumented else off).append(time.perf_counter() - t0)
        probe.uninstall()

    if engine.global_rank == 0:
        m_on, m_off = statistics.median(on), statistics.median(off)
        print(f"steps: {len(on)} instrumented, {len(off)} bare; preset {args.preset}, "
              f"micro {args.micro}, GAS {args.gas}, {args.stages} stages")
        print(f"median step: instrumented {m_on * 1000:.2f} ms, bare {m_off * 1000:.2f} ms, "
              f"ratio {m_on / m_off:.4f} (goal <= 1.02)")
    # Take the process groups down before the interpreter exits: a gloo group left to the exit's
    # destructors can abort a rank ("terminate called without an active exception", seen once in CI)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
