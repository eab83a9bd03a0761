"""A small GPT-style training script of the usual ZeRO shape: a plain module, no pipeline.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/zero_train.py \
        --deepspeed_config examples/ds_zero2.json --steps 20

Tuned unchanged by autotune:

    autotune run --budget 20 -- deepspeed --num_gpus 2 examples/zero_train.py \
        --deepspeed_config examples/ds_zero2.json --steps 100000

`deepspeed.initialize` returns a plain DeepSpeedEngine (ZeRO stage from the config), the loop
calls `engine(x)`, `engine.backward(loss)` and `engine.step()` per micro-batch, as HF Trainer
and most scripts do; at the end it saves a checkpoint, as real jobs do.
"""

import argparse
import os

import deepspeed
import torch
from torch import nn

VOCAB, SEQ, HIDDEN, LAYERS = 256, 32, 64, 4


class Block(nn.Module):
    """Pre-norm self-attention and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, num_heads=4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))
        self.register_buffer("mask", torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1), persistent=False)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.zeros(SEQ, HIDDEN))
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.norm, self.out = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        return self.out(self.norm(self.blocks(self.tok(ids) + self.pos)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save-dir", default="checkpoints")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    model = TinyGPT()
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    rank = int(os.environ.get("RANK", 0))
    g = torch.Generator().manual_seed(args.seed + rank)
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            tokens = torch.randint(0, VOCAB, (micro, SEQ + 1), generator=g)
            logits = engine(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    engine.save_checkpoint(args.save_dir)  # what autotune's stop must never reach
    if rank == 0:
        print(f"trained {args.steps} steps; checkpoint in {args.save_dir}", flush=True)


if __name__ == "__main__":
    main()
