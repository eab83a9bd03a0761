"""A pipeline training script of the other usual shape: its own data iterator.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/pipeline_train_iter.py \
        --deepspeed_config examples/ds_config.json --steps 20

The model is a list of plain modules and lambdas, the rank comes from LOCAL_RANK
(no --local_rank argument needed), and each step passes the script's own
iterator to `engine.train_batch(data_iter=...)`. It evaluates and writes its
final weights after the loop.
"""

import argparse
import os

import deepspeed
import torch
from deepspeed.pipe import PipelineModule
from torch import nn

VOCAB, SEQ, HIDDEN = 256, 32, 64


def batches(micro_batch: int, seed: int):
    """An endless stream of (input_ids, labels) micro-batches."""
    g = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, VOCAB, (micro_batch, SEQ + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def build_model(stages: int) -> PipelineModule:
    layers = [nn.Embedding(VOCAB, HIDDEN)]
    for _ in range(4):
        layers += [nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(),
                   nn.Linear(4 * HIDDEN, HIDDEN), lambda x: x * 1.0]
    layers += [nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)]
    return PipelineModule(layers=layers, num_stages=stages, partition_method="uniform",
                          loss_fn=lambda logits, labels: nn.functional.cross_entropy(
                              logits.reshape(-1, VOCAB), labels.reshape(-1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default="final_model.pt")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    model = build_model(args.stages)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=[p for p in model.parameters()])
    dp_rank = engine.grid.get_data_parallel_rank()
    data = batches(engine.train_micro_batch_size_per_gpu(), args.seed + dp_rank)
    for step in range(args.steps):
        loss = engine.train_batch(data_iter=data)
        if engine.is_last_stage() and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    eval_loss = engine.eval_batch(data_iter=data)  # what autotune's stop must never reach
    if engine.is_last_stage():
        print(f"eval loss {eval_loss.item():.4f}", flush=True)
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save({"steps": args.steps}, args.out)


if __name__ == "__main__":
    main()
