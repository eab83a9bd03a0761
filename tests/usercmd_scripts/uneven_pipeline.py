"""A user's pipeline script whose layers are uneven by construction (tests/test_balance_usercmd.py).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 tests/usercmd_scripts/uneven_pipeline.py \
        --deepspeed_config examples/ds_config.json --steps 20

Eight layers: an embedding, one `Looped` block that runs the same MLP `LOOPS` times
(LOOPS x a block's compute with a block's parameter count: what `parameters` cannot see),
five plain blocks and a small head. The script partitions with `uniform`, [0, 4, 8]: the
looped block and two blocks beside it on stage 0, so stage 0 does about 7 blocks' work
and stage 1 about 3.5. The balanced parts give the looped block's neighbours (layers 2
and 3, [0, 2, 8]: 5 blocks' work against 5.5; at least layer 3) to stage 1: the ground
truth of the test.
"""

import argparse

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

VOCAB, SEQ, HIDDEN, BLOCKS, LOOPS = 256, 32, 256, 6, 5
HEAVY = 1
"""The layer index of the looped block."""


class TokenDataset(torch.utils.data.Dataset):
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

    def forward(self, ids):
        return self.tok(ids)


class Block(nn.Module):
    loops = 1

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x):
        for _ in range(self.loops):
            x = x + self.mlp(self.norm(x))
        return x


class Looped(Block):
    loops = LOOPS


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x):
        return self.out(x)


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--partition", default="uniform")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(1234)
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    blocks = [LayerSpec(Looped if i == HEAVY - 1 else Block) for i in range(BLOCKS)]
    layers = [LayerSpec(Embedding), *blocks, LayerSpec(Head)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=loss_fn, partition_method=args.partition)
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        training_data=TokenDataset(1024, 1234))
    for _ in range(args.steps):
        engine.train_batch()


if __name__ == "__main__":
    main()
