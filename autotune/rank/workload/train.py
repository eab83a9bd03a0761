"""One trial rank: build the workload, instrument the engine, train N steps.

Launched by DeepSpeed's launcher (`deepspeed --num_gpus N train.py ...`), one
process per rank. Exit codes tell the controller what happened (see
autotune.trials.launcher.EXIT_*); the metrics CSV is the result.

`setup_process` is what a rank does once (torch threads, the process group);
`run_trial` is one trial (model, engine, steps). A fresh rank (this script) does
both once; a warm worker (autotune/rank/workload/worker.py) sets up once and runs
`run_trial` for every trial, so both modes measure with the same code.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import dataclass

from autotune.rank.engine_face import layout_of
from autotune.rank.workload.trial_spec import TrialSpec

EXIT_NONFINITE_LOSS = 42
EXIT_OOM = 43
EXIT_LOSS_SCALE = 44
"""fp16 dynamic loss scale collapsed: at its minimum and the gradients still overflow."""
LOSS_SCALE_MESSAGE = "loss scale already at minimum"
LOSS_SCALE_PATIENCE = 3
"""Overflowing steps in a row at the minimum loss scale that count as a collapse."""


def parse_args(argv: list[str] | None = None) -> TrialSpec:
    """The trial description the controller wrote (autotune/rank/workload/trial_spec.py)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trial-spec", required=True, help="trial.json written by the controller")
    return TrialSpec.read(p.parse_args(argv).trial_spec)


def main(argv: list[str] | None = None) -> int:
    from autotune.rank import launcher_ranks

    launcher_ranks.adopt()  # started by mpirun or srun: RANK and the rest from their variables
    spec = parse_args(argv)
    if spec.fault == "nometrics":  # testing seam: every rank exits 0 at once, no metrics written
        return 0
    from autotune.rank.wiring import rank_watchdog

    dog = rank_watchdog(spec.plan)
    if dog is not None:
        dog.startup()  # from this process's start: the launcher's fork, the imports, the op load, the rendezvous
    startup_fault(spec)
    setup_process(spec.workload.threads)
    return run_trial(spec, watchdog=dog).exit_code


def startup_fault(spec: TrialSpec) -> None:
    from autotune.core.faults import inject_startup_fault
    from autotune.rank.wiring import process_rank

    inject_startup_fault(spec.fault, fault_rank=spec.fault_rank, rank=process_rank())


def setup_process(threads: int) -> None:
    """Once per rank process: torch's threads, DeepSpeed's process group, py-cpuinfo's one answer."""
    import torch

    from autotune.rank import cpu_info

    cpu_info.install()  # before the first op load asks py-cpuinfo (autotune/rank/cpu_info.py)

    torch.set_num_threads(threads)
    import deepspeed

    deepspeed.init_distributed()


@dataclass(kw_only=True, slots=True)
class TrialRun:
    """How one trial ended on this rank."""

    exit_code: int
    losses: list[float]
    """The loss of every step (0.0 on ranks that do not compute it)."""


def run_trial(spec: TrialSpec, *, release: bool = False, watchdog=None) -> TrialRun:
    """One trial on this rank: a fresh model and engine from `spec`, warm-up and measured steps.

    `release=True` (a warm worker): the engine, the model and the optimizer state are let go
    afterwards, so the next trial starts from the memory this one started from. `watchdog`
    (autotune/rank/watchdog.py) times every step and is stopped when the trial ends well."""
    import deepspeed
    import torch

    from autotune.rank.wiring import wire
    from autotune.rank.workload import groups as process_groups
    from autotune.rank.workload.data import batches, load_token_file, synthetic_tokens
    from autotune.rank.workload.presets import get_preset
    from autotune.rank.workload.slowdown import stretch_compute

    wl = spec.workload
    losses: list[float] = []
    if spec.fault == "nometrics":  # testing seam: no step, no metrics
        return TrialRun(exit_code=0, losses=losses)
    preset = get_preset(wl.preset)
    groups_before = process_groups.existing() if release else set()
    torch.manual_seed(wl.seed)  # the same seed in every trial, warm or fresh: the same model and data
    build = MODELS.get(wl.engine)
    if build is None:  # a runner handed this entry another engine's trial (its launch is that engine's)
        raise ValueError(f"--engine {wl.engine}: not a DeepSpeed-launched engine ({', '.join(MODELS)}); its "
                         "trials start from its own rank entry (autotune/engines/ RankLaunch)")
    module, user_batches, as_engine = build(spec, preset)
    if wl.slow_layer is not None:  # test hook: before the layer-cost hooks, which then time it
        from autotune.rank.workload.slowdown import stretch_layer

        stretch_layer(module, wl.slow_layer, wl.slow_factor)
    with open(spec.ds_config, encoding="utf-8") as fh:
        ds_config = json.load(fh)
    built, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
        config=ds_config,
    )
    engine = as_engine(built)
    wiring = None
    try:
        layout = layout_of(engine)
        if wl.slow_stage is not None and layout.stage == wl.slow_stage:
            stretch_compute(engine, wl.slow_factor, wl.slow_every)  # before the probe: the probe times it
        wiring = wire(engine, spec.plan, seq_length=preset.seq_length)  # probe, records, endpoint, budget
        tokens = (None if user_batches is not None else load_token_file(wl.tokens, preset.vocab_size)
                  if wl.tokens else synthetic_tokens(preset.vocab_size, 200_000, seed=wl.seed))
        dp_rank = layout.data_parallel_rank
        micro = engine.train_micro_batch_size_per_gpu()
        data = (iter(user_batches(micro, wl.seed + dp_rank)) if user_batches is not None
                else batches(tokens, micro_batch=micro, seq=preset.seq_length, seed=wl.seed + dp_rank))
        return TrialRun(exit_code=steps_then_close(spec, engine, wiring, data, watchdog, losses), losses=losses)
    finally:
        if release:
            if wiring is not None:
                wiring.probe.uninstall()
            engine.destroy()
            drop_autograd_graphs(engine)
            if built is not engine:  # a plain engine behind its stepper (autotune/rank/zero/engine.py)
                drop_autograd_graphs(built)
            del engine, built, module, wiring
            gc.collect()  # DeepSpeed's cycles that still hold the trial's groups
            process_groups.destroy(process_groups.existing() - groups_before)  # their gloo threads end
            release_memory()


def _pipeline_model(spec: TrialSpec, preset):
    """`--engine deepspeed`: the preset as a PipelineModule, or the user's own (`--model`,
    autotune/rank/workload/user_model.py) with its batches; DeepSpeed's engine is the engine."""
    wl = spec.workload
    if wl.model:
        from autotune.rank.workload.user_model import build_user_pipeline

        module, user_batches = build_user_pipeline(wl.model, num_stages=wl.pipeline_stages, seed=wl.seed)
        return module, user_batches, _as_is
    from autotune.rank.workload.model import build_pipeline_module

    module = build_pipeline_module(preset, stages=wl.pipeline_stages, partition_method=wl.partition_method,
                                   activation_checkpoint_interval=wl.activation_checkpoint_interval, seed=wl.seed)
    return module, None, _as_is


def _plain_model(spec: TrialSpec, preset):
    """`--engine zero`: the preset as one plain module, its DeepSpeedEngine stepped by
    autotune/rank/zero/engine.py `ZeroEngine`."""
    from autotune.rank.workload.model import build_decoder, cross_entropy_loss
    from autotune.rank.zero.engine import ZeroEngine

    return build_decoder(preset, seed=spec.workload.seed), None, lambda e: ZeroEngine(e, cross_entropy_loss)


def _as_is(engine):
    return engine


MODELS = {"deepspeed": _pipeline_model, "zero": _plain_model}
"""The model a DeepSpeed-launched rank builds per `--engine` (the torch engine's ranks are
autotune/rank/torch_pp/train.py), and how its engine is stepped."""


def steps_then_close(spec: TrialSpec, engine, wiring, data, watchdog, losses: list[float]) -> int:
    """The trial's tail on a rank of any engine (this workload's, autotune/rank/torch_pp/train.py),
    once `wire` instrumented its engine: the watchdog on the steps, the steps (`_train`), then on
    success the step record and the watchdog stopped, and the wiring closed on every way out (the
    CSV written before a failed rank ends, perhaps without an interpreter shutdown). 0, or the
    exit code of the way the trial failed."""
    import torch

    from autotune.core.faults import inject_rank_fault

    rank = layout_of(engine).rank
    try:
        wiring.watch_steps(engine, watchdog)
        try:
            code = _train(spec, engine, data, rank, losses, inject_rank_fault, wiring)
        except torch.OutOfMemoryError as exc:  # outside a step's own handler (a schedule's set-up)
            print(f"autotune: out of memory on rank {rank}: {exc}", file=sys.stderr, flush=True)
            code = EXIT_OOM
        if code == 0:
            wiring.write_step_record(rank)
            if watchdog is not None:
                watchdog.stop()
        return code
    finally:
        wiring.close()


def _train(spec: TrialSpec, engine, data, rank: int, losses: list[float], inject_rank_fault, wiring) -> int:
    """The trial's steps, as many as `wiring.go_on` decides (collectively: the budget's measured
    steps, then the layer-cost block); 0, or the exit code of the way it failed."""
    import torch

    total = spec.plan.unmeasured_steps + spec.plan.step_cap + wiring.cost_steps
    collapsed_steps, skipped = 0, getattr(engine, "skipped_steps", 0)
    for step in range(total):
        inject_rank_fault(spec.fault, fault_rank=spec.fault_rank, engine=engine, rank=rank, step=step,
                          total=total)
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
        if spec.step_sleep:
            time.sleep(spec.step_sleep)
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
        losses.append(value)
        if not math.isfinite(value):
            print(f"autotune: non-finite loss {value} at step {step} on rank {rank}",
                  file=sys.stderr, flush=True)
            return EXIT_NONFINITE_LOSS
        if not wiring.go_on():
            break
    return 0


def drop_autograd_graphs(engine) -> None:
    """Let go of the engine's tensors that still hold an autograd graph (on the last stage,
    `pipe_buffers` and `loss`).

    DeepSpeed hooks every forward output (`register_output_backward_hooks`) with closures over
    the engine's bound methods. The hook lives in the graph's C++ nodes, where the cycle
    collector cannot see it, so engine -> tensor -> graph -> hook -> engine is never freed:
    the last stage's engine, with its parameters, optimizer state, grid and the grid's gloo
    threads (15 a trial), outlived every trial of a warm worker."""
    import torch

    def holds_graph(value, depth: int = 0) -> bool:
        if isinstance(value, torch.Tensor):
            return value.grad_fn is not None
        if depth < 3 and isinstance(value, (list, tuple)):
            return any(holds_graph(v, depth + 1) for v in value)
        if depth < 3 and isinstance(value, dict):
            return any(holds_graph(v, depth + 1) for v in value.values())
        return False

    for name, value in list(vars(engine).items()):
        if holds_graph(value):
            setattr(engine, name, None)


def release_memory() -> None:
    """Give freed memory back: Python's cycles, the CUDA cache, glibc's free lists."""
    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    try:  # glibc keeps freed blocks in its arenas; RSS would not show the release otherwise
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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


if __name__ == "__main__":
    sys.exit(main())
