"""LLaMA-style decoder (RMSNorm, rotary attention, SwiGLU) as PipelineModule layers.

Built from `LayerSpec`s as production LLaMA pipeline training does, so each
stage only materializes its own layers. Stage inputs and outputs are plain
tensors (hidden states) because DeepSpeed's p2p layer sends tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autotune.rank.workload.presets import ModelPreset


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary_tables(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class EmbeddingPipe(nn.Module):
    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        self.embed = nn.Embedding(preset.vocab_size, preset.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)


class DecoderLayerPipe(nn.Module):
    """Pre-norm attention + SwiGLU MLP with residuals, as in LLaMA."""

    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        h, self.heads = preset.hidden_size, preset.num_heads
        self.head_dim = h // self.heads
        self.attn_norm = RMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.out = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h)
        self.gate_up = nn.Linear(h, 2 * preset.ffn_size, bias=False)
        self.down = nn.Linear(preset.ffn_size, h, bias=False)
        cos, sin = rotary_tables(preset.seq_length, self.head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LMHeadPipe(nn.Module):
    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        self.norm = RMSNorm(preset.hidden_size)
        self.head = nn.Linear(preset.hidden_size, preset.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def build_pipeline_module(preset: ModelPreset, *, stages: int, partition_method: str = "parameters",
                          activation_checkpoint_interval: int = 0, seed: int = 1234):
    """A deepspeed.pipe.PipelineModule of the preset (deepspeed.comm must be initialized)."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    if partition_method.startswith("parts:"):  # explicit boundaries (autotune/rank/pipeline_parts.py)
        from autotune.rank.pipeline_parts import install

        install()
    specs = [LayerSpec(EmbeddingPipe, preset)]
    specs += [LayerSpec(DecoderLayerPipe, preset) for _ in range(preset.num_layers)]
    specs.append(LayerSpec(LMHeadPipe, preset))
    module = PipelineModule(
        layers=specs, num_stages=stages, loss_fn=cross_entropy_loss,
        partition_method=partition_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
        # DeepSpeed's default checkpoints every layer with parameters, the embedding too, and its
        # reentrant checkpoint cannot take integer token ids (runtime/pipe/module.py
        # `_is_checkpointable`; the trial crashed here). Only the decoder layers are checkpointed.
        checkpointable_layers=[DecoderLayerPipe.__name__],
        base_seed=seed,
    )
    return module


def build_decoder(preset: ModelPreset, *, seed: int = 1234) -> nn.Sequential:
    """The preset as one plain module (`--engine zero`): the same layers as the pipeline's, in
    order, each replica the whole model (DeepSpeed's plain engine broadcasts rank 0's weights)."""
    torch.manual_seed(seed)
    layers = [EmbeddingPipe(preset), *(DecoderLayerPipe(preset) for _ in range(preset.num_layers)),
              LMHeadPipe(preset)]
    return nn.Sequential(*layers)
