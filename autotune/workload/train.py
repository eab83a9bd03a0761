"""One trial rank: build the workload, instrument the engine, train N steps.

Launched by DeepSpeed's launcher (`deepspeed --num_gpus N train.py ...`), one
process per rank. Exit codes tell the controller what happened (see
autotune.launcher.EXIT_*); the metrics CSV is the result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

EXIT_NONFINITE_LOSS = 42
EXIT_OOM = 43
EXIT_LOSS_SCALE = 44
"""fp16 dynamic loss scale collapsed: at its minimum and the gradients still overflow."""
LOSS_SCALE_MESSAGE = "loss scale already at minimum"
LOSS_SCALE_PATIENCE = 3
"""Overflowing steps in a row at the minimum loss scale that count as a collapse."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ds-config", required=True)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="measured steps after warm-up")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--trial", type=int, default=-1)
    p.add_argument("--metrics-csv", required=True, help="path; {rank} is replaced by the global rank")
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--metrics-addr", default="127.0.0.1")
    p.add_argument("--job", default="autotune")
    p.add_argument("--partition-method", default="parameters")
    p.add_argument("--activation-checkpoint-interval", type=int, default=0)
    p.add_argument("--tokens", default=None, help="token file (.npy, .bin uint16, or raw bytes)")
    p.add_argument("--slow-stage", type=int, default=None)
    p.add_argument("--slow-factor", type=int, default=1)
    p.add_argument("--slow-every", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--fault", default=None, help=argparse.SUPPRESS)  # test-only fault injection
    p.add_argument("--fault-rank", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--step-sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fault == "nometrics":  # test-only: every rank exits 0 at once, no metrics written
        return 0
    import torch

    torch.set_num_threads(args.threads)
    import deepspeed

    from autotune.instrument import instrument
    from autotune.workload.data import batches, load_token_file, synthetic_tokens
    from autotune.workload.model import build_pipeline_module
    from autotune.workload.presets import get_preset
    from autotune.workload.slowdown import stretch_compute

    preset = get_preset(args.preset)
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    module = build_pipeline_module(
        preset, stages=args.stages, partition_method=args.partition_method,
        activation_checkpoint_interval=args.activation_checkpoint_interval, seed=args.seed,
    )
    with open(args.ds_config, encoding="utf-8") as fh:
        ds_config = json.load(fh)
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
        config=ds_config,
    )
    rank = engine.global_rank
    if args.slow_stage is not None and engine.stage_id == args.slow_stage:
        stretch_compute(engine, args.slow_factor, args.slow_every)  # before instrument(): the probe times it
    probe = instrument(engine, csv_path=args.metrics_csv, metrics_port=args.metrics_port,
                       metrics_addr=args.metrics_addr, trial=args.trial, job=args.job,
                       warmup_steps=args.warmup_steps, seq_length=preset.seq_length)
    tokens = (load_token_file(args.tokens, preset.vocab_size) if args.tokens
              else synthetic_tokens(preset.vocab_size, 200_000, seed=args.seed))
    dp_rank = engine.grid.get_data_parallel_rank()
    data = batches(tokens, micro_batch=engine.train_micro_batch_size_per_gpu(),
                   seq=preset.seq_length, seed=args.seed + dp_rank)

    total = args.warmup_steps + args.steps
    collapsed_steps, skipped = 0, getattr(engine, "skipped_steps", 0)
    for step in range(total):
        _maybe_fault(args, engine, rank, step, total)
        try:
            loss = engine.train_batch(data_iter=data)
        except torch.OutOfMemoryError as exc:
            print(f"autotune: out of memory on rank {rank}: {exc}", file=sys.stderr, flush=True)
            return EXIT_OOM
        except Exception as exc:  # DeepSpeed raises a bare Exception when fp16 scaling gives up
            if LOSS_SCALE_MESSAGE not in str(exc):
                raise
            print(f"autotune: fp16 loss scale collapsed on rank {rank} at step {step}: {exc}",
                  file=sys.stderr, flush=True)
            return EXIT_LOSS_SCALE
        if args.step_sleep:
            time.sleep(args.step_sleep)
        scale, floor = _loss_scale(engine)
        now_skipped = getattr(engine, "skipped_steps", 0)
        overflowed, skipped = now_skipped > skipped, now_skipped
        collapsed_steps = collapsed_steps + 1 if (overflowed and scale is not None and floor is not None
                                                  and scale <= floor) else 0
        if collapsed_steps >= LOSS_SCALE_PATIENCE:
            print(f"autotune: fp16 loss scale collapsed on rank {rank}: {LOSS_SCALE_MESSAGE} ({scale}) "
                  f"and the gradients overflowed {collapsed_steps} steps in a row", file=sys.stderr, flush=True)
            return EXIT_LOSS_SCALE
        value = float(loss.mean().item()) if loss is not None else 0.0
        if not math.isfinite(value):
            print(f"autotune: non-finite loss {value} at step {step} on rank {rank}",
                  file=sys.stderr, flush=True)
            return EXIT_NONFINITE_LOSS
    for sink in probe.sinks:
        getattr(sink, "close", lambda: None)()
    return 0


def _loss_scale(engine) -> tuple[float | None, float | None]:
    """(current, minimum) dynamic fp16 loss scale, or Nones when the run does not scale the loss."""
    opt = getattr(engine, "optimizer", None)
    cfg = getattr(opt, "loss_scale_config", None)  # DeepSpeed's FP16_Optimizer
    if cfg is not None:
        if not getattr(cfg, "dynamic_loss_scale", False):
            return None, None
        cur, floor = getattr(cfg, "cur_scale", None), getattr(cfg, "min_loss_scale", None)
    else:
        scaler = getattr(opt, "loss_scaler", None)  # ZeRO optimizers
        if scaler is None or not getattr(scaler, "dynamic", False):
            return None, None
        cur, floor = getattr(scaler, "cur_scale", None), getattr(scaler, "min_scale", None)
    return (float(cur) if cur is not None else None), (float(floor) if floor is not None else None)


def _maybe_fault(args: argparse.Namespace, engine, rank: int, step: int, total: int) -> None:
    """Test-only faults, injected on purpose by the fault-handling tests."""
    at = 0 if args.fault == "overflow" else min(2, total - 1)
    if args.fault is None or rank != args.fault_rank or step != at:
        return
    import torch

    if args.fault == "oom":
        raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")
    if args.fault == "hang":
        while True:
            time.sleep(1)
    if args.fault == "kill":
        os.kill(os.getpid(), 9)
    if args.fault == "nan":  # a real NaN: poison a weight, the loss computed from it is NaN
        with torch.no_grad():
            next(p for p in engine.module.parameters() if p.is_floating_point()).fill_(float("nan"))
    if args.fault == "overflow":  # every gradient overflows from now on (fp16: the loss scale collapses)
        for p in engine.module.parameters():
            if p.requires_grad:
                p.register_hook(lambda g: g * float("inf"))


if __name__ == "__main__":
    sys.exit(main())
