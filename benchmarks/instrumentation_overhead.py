"""Instrumentation overhead: the same engine, instrumentation on and off, alternated.

Goal (issue 2): median step-time ratio on/off within 2 %.

Run (2 stages, 2 ranks, CPU):
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 2 --no_local_rank \
        benchmarks/instrumentation_overhead.py --preset tiny --micro 4 --gas 8 --blocks 10
(`--quick`: 2 block pairs of 1 step, a CI smoke run whose ratio is noise.)
`--trace`: a third kind of block, instrumented and under torch.profiler as `--trace-steps`
records (record_shapes, each instruction under its `deepspeed:` range): what a traced step
costs, and the trace's size per step. Traced steps are unmeasured in a trial
(autotune/rank/trace_recorder.py), so this is the cost of the N + 2 extra steps of the two
traced trials of a study, not a bias in any trial's figures.

One process per rank; within it, blocks of steps alternate between the
instrumented engine (every pipeline instruction timed, a StepRecord per
step) and the bare engine (only a host clock around train_batch), so machine
noise hits both alike. Rank 0 prints the figures.
"""

from __future__ import annotations

import argparse
import gc
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
    ap.add_argument("--trace", action="store_true", help="also blocks under torch.profiler (--trace-steps' cost)")
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

    on, off, traced = [], [], []
    kinds = 3 if args.trace else 2
    trace_bytes = 0
    labels = None
    if args.trace:
        from autotune.rank.trace_recorder import label_instructions

        labels = label_instructions(engine)  # before the probe installs, as rank/wiring.py does
        labels.on = False
    for block in range(kinds * args.blocks):
        kind = block % kinds  # 0 instrumented, 1 bare, 2 instrumented and traced
        if kind != 1:
            probe.install()
        prof = None
        if kind == 2:
            from torch.profiler import ProfilerActivity, profile

            labels.on = True
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            prof = profile(activities=acts, record_shapes=True)
            prof.start()
        for _ in range(args.steps_per_block):
            t0 = time.perf_counter()
            engine.train_batch(data_iter=data)
            if cuda:  # both arms wait for the device, as the probe does at step end
                torch.cuda.synchronize()
            (on, off, traced)[kind].append(time.perf_counter() - t0)
        if prof is not None:
            prof.stop()
            labels.on = False
            if block == 2:  # one block's trace written out, for its size per step
                import os
                import tempfile

                with tempfile.TemporaryDirectory() as tmp:
                    path = os.path.join(tmp, "t.json")
                    prof.export_chrome_trace(path)
                    trace_bytes = os.path.getsize(path) // args.steps_per_block
            # the profiler's results freed here, not by the collector inside the next block's steps
            del prof
            gc.collect()
        probe.uninstall()

    if engine.global_rank == 0:
        m_on, m_off = statistics.median(on), statistics.median(off)
        print(f"steps: {len(on)} instrumented, {len(off)} bare; preset {args.preset}, "
              f"micro {args.micro}, GAS {args.gas}, {args.stages} stages")
        print(f"median step: instrumented {m_on * 1000:.2f} ms, bare {m_off * 1000:.2f} ms, "
              f"ratio {m_on / m_off:.4f} (goal <= 1.02)")
        if traced:
            m_tr = statistics.median(traced)
            print(f"median step: traced {m_tr * 1000:.2f} ms, traced / instrumented {m_tr / m_on:.2f}x; "
                  f"trace {trace_bytes / (1 << 20):.1f} MB per step uncompressed (rank 0)")
    # Take the process groups down before the interpreter exits: a gloo group left to the exit's
    # destructors can abort a rank ("terminate called without an active exception", seen once in CI)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
