"""Model presets by name. `tiny` trains on two CPU cores; the LLaMA shapes are real."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.core.errors import UserError


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelPreset:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_size: int
    """SwiGLU inner size (LLaMA: about 8/3 x hidden, rounded)."""
    seq_length: int


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(name="tiny", vocab_size=256, hidden_size=64, num_layers=4, num_heads=4,
                    ffn_size=176, seq_length=64),
        ModelPreset(name="small", vocab_size=256, hidden_size=128, num_layers=8, num_heads=4,
                    ffn_size=352, seq_length=64),
        # Compute-bound on a CPU (a step of 8 sequences takes about 1.3 s on 2 ranks): the
        # bubble's share of the step is compute, not per-micro-batch overhead, so schedules and
        # micro-batch counts move it the way their theory says (benchmarks/torch_schedules.py).
        ModelPreset(name="medium", vocab_size=256, hidden_size=512, num_layers=8, num_heads=8,
                    ffn_size=1408, seq_length=128),
        # Unbalanced the way real models are: the LM head over a large vocabulary costs several
        # decoder layers while the embedding (same parameter count) costs almost nothing, so
        # `parameters` and `uniform` both leave the last stage the slowest (docs/partition.md).
        ModelPreset(name="wide-vocab", vocab_size=8192, hidden_size=64, num_layers=24, num_heads=4,
                    ffn_size=176, seq_length=64),
        ModelPreset(name="llama-7b", vocab_size=32000, hidden_size=4096, num_layers=32,
                    num_heads=32, ffn_size=11008, seq_length=2048),
        ModelPreset(name="llama-13b", vocab_size=32000, hidden_size=5120, num_layers=40,
                    num_heads=40, ffn_size=13824, seq_length=2048),
    )
}


def parameter_count(preset: ModelPreset) -> int:
    """Parameters of the built-in model (autotune/rank/workload/model.py), without building it.

    Embedding v*h; per decoder layer 2 RMSNorms (2h), qkv + out (4h^2), SwiGLU
    gate_up + down (3 h ffn); final RMSNorm h and LM head h*v (no biases, untied).
    """
    h, v, f = preset.hidden_size, preset.vocab_size, preset.ffn_size
    return v * h + preset.num_layers * (2 * h + 4 * h * h + 3 * h * f) + h + h * v


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown workload preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
