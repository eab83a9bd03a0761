"""A user's own torch.distributed.pipelining training script, as torchtitan-style jobs write them.

The model is split by hand into one `PipelineStage` per rank, the schedule class is picked by
name from the command line, and the script calls `schedule.step(...)` in its own loop. It knows
nothing of autotune (docs/torch-pipelining.md: what `autotune run -- torchrun ...` reads of it).

    torchrun --nproc-per-node 2 examples/torch_pipeline_train.py --schedule 1F1B --n-microbatches 4
    torchrun --nproc-per-node 2 examples/torch_pipeline_train.py --schedule Interleaved1F1B --stages-per-rank 2
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.profiler
import torch.utils.checkpoint
from torch.distributed.pipelining import PipelineStage, schedules


def blocks(layers: int, hidden: int) -> list[torch.nn.Module]:
    return [torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh()) for _ in range(layers)]


class Checkpointed(torch.nn.Module):
    """A stage's blocks with activation checkpointing: each block's activations recomputed in the backward."""

    def __init__(self, inner: torch.nn.Sequential) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.inner:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--schedule", default="1F1B", help="a torch schedule class, without 'Schedule': GPipe, 1F1B, ...")
    ap.add_argument("--n-microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="samples per step (split into the micro-batches)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--activation-checkpoint", type=int, choices=(0, 1), default=0,
                    help="1: recompute each block's activations in the backward")
    ap.add_argument("--stages-per-rank", type=int, default=1,
                    help="stages each rank holds, looped (rank r: r, r + ranks, ...); more than 1 needs a "
                         "multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble)")
    ap.add_argument("--dp", type=int, default=1,
                    help="data-parallel replicas of the pipeline (torchtitan's mesh: the pipeline innermost, "
                         "ranks r*pp .. r*pp+pp-1 form replica r); the gradients are all-reduced over them")
    ap.add_argument("--profile-dir", default=None,
                    help="trace steps 2-3 with torch.profiler into this folder (one file per rank)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    pp = world // args.dp
    replica, rank = divmod(dist.get_rank(), pp)  # `rank`: the place in this replica's pipeline
    pipes = [dist.new_group(list(range(r * pp, (r + 1) * pp))) for r in range(args.dp)]  # every rank makes each
    replicas = [dist.new_group(list(range(i, world, pp))) for i in range(pp)]
    torch.manual_seed(args.seed)
    every = blocks(args.layers, args.hidden)  # the same weights on every rank: each keeps its share
    total = pp * args.stages_per_rank  # looped: rank r holds stages r, r + pp, ...
    per = args.layers // total
    stages = []
    for index in range(rank, total, pp):
        mine: torch.nn.Module = torch.nn.Sequential(*every[index * per:(index + 1) * per])
        if args.activation_checkpoint:
            mine = Checkpointed(mine)
        stages.append(PipelineStage(mine, index, total, torch.device("cpu"), group=pipes[replica]))
    kind = getattr(schedules, f"Schedule{args.schedule}")
    held = stages if issubclass(kind, schedules.PipelineScheduleMulti) else stages[0]  # Multi: the list
    schedule = kind(held, n_microbatches=args.n_microbatches, loss_fn=torch.nn.functional.mse_loss)
    optimizer = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.01)
    data = torch.Generator().manual_seed(args.seed + replica)  # each replica its own samples
    profiler = None
    if args.profile_dir:  # as scripts do: wait 1 step, warm up 1, record 2
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(args.profile_dir, worker_name=f"rank{rank}"))
        profiler.start()
    for step in range(args.steps):
        x = torch.randn(args.batch, args.hidden, generator=data)
        y = torch.tanh(x.flip(1))
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == pp - 1:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
            if replica == 0:
                print(f"step {step} loss {torch.stack(losses).mean().item():.5f}", flush=True)
        else:
            schedule.step()
        if args.dp > 1:  # the replicas' gradients averaged (torch's schedules leave this to the script)
            for p in (p for s in stages for p in s.submod.parameters()):
                dist.all_reduce(p.grad, group=replicas[rank])
                p.grad /= args.dp
        optimizer.step()
        if profiler is not None:
            profiler.step()
    if profiler is not None:
        profiler.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
