"""A small GPT-style pipeline training script of the usual shape (engine-owned data loader).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/pipeline_train.py \
        --deepspeed_config examples/ds_config.json --steps 20

Tuned unchanged by autotune:

    autotune run --budget 20 -- deepspeed --num_gpus 2 examples/pipeline_train.py \
        --deepspeed_config examples/ds_config.json --steps 100000

The model is built from `LayerSpec`s, the training data is handed to
`deepspeed.initialize` (the engine builds and owns the loader) and the loop calls
`engine.train_batch()`; at the end it saves a checkpoint, as real jobs do.
"""

import argparse
import os

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

VOCAB, SEQ, HIDDEN, LAYERS = 256, 32, 64, 4


class TokenDataset(torch.utils.data.Dataset):
    """Synthetic token sequences; each item is (input_ids, labels), as the pipeline engine expects."""

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i, :-1], self.tokens[i, 1:]


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.zeros(SEQ, HIDDEN))

    def forward(self, ids):
        return self.tok(ids) + self.pos


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


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, x):
        return self.out(self.norm(x))


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save-dir", default="checkpoints")
    parser.add_argument("--partition", default="parameters",
                        help="PipelineModule partition_method: parameters, uniform or type:REGEX")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    layers = [LayerSpec(Embedding), *[LayerSpec(Block) for _ in range(LAYERS)], LayerSpec(Head)]
    model = PipelineModule(layers=layers, num_stages=args.stages, loss_fn=loss_fn,
                           partition_method=args.partition)
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        training_data=TokenDataset(4096, args.seed),
    )
    rank = int(os.environ.get("RANK", 0))
    for step in range(args.steps):
        loss = engine.train_batch()
        if engine.is_last_stage() and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    engine.save_checkpoint(args.save_dir)  # what autotune's stop must never reach
    if rank == 0:
        print(f"trained {args.steps} steps; checkpoint in {args.save_dir}", flush=True)


if __name__ == "__main__":
    main()
