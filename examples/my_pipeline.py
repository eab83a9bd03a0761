"""An example for `autotune run --model my_pipeline:build_pipeline` (docs/warm-workers.md).

A small causal-free token model as DeepSpeed pipeline layers: the built-in synthetic token
stream feeds it ((input_ids, labels), ids below 256, the tiny preset's vocabulary).

    PYTHONPATH=examples autotune run --model my_pipeline:build_pipeline --budget 5
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, BLOCKS = 256, 64, 4


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))


def build_pipeline(num_stages: int, seed: int):
    """The contract: a PipelineModule of `num_stages` stages (deepspeed.comm is initialized)."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(Embed), *[LayerSpec(Block) for _ in range(BLOCKS)], LayerSpec(Head)]
    return PipelineModule(layers=layers, num_stages=num_stages, loss_fn=loss_fn, base_seed=seed,
                          partition_method="parameters")

