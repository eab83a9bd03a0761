"""Training data for the built-in workload: a synthetic token stream, or a user's token file.

The synthetic stream has learnable structure (each token has a few likely
successors), so the loss falls within a short trial: a quick sanity check
that a tuned configuration still trains.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from autotune.core.errors import InputFileError


def synthetic_tokens(vocab: int, length: int, *, seed: int, branching: int = 4) -> np.ndarray:
    """A Markov chain over `vocab` tokens where each token has `branching` successors."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, vocab, size=(vocab, branching))
    choice = rng.integers(0, branching, size=length)
    out = np.empty(length, dtype=np.int64)
    out[0] = rng.integers(0, vocab)
    for i in range(1, length):
        out[i] = table[out[i - 1], choice[i]]
    return out


def load_token_file(path: str | Path, vocab: int) -> np.ndarray:
    """`.npy` (integer array), `.bin` (uint16, as nanoGPT writes), anything else read as bytes (vocab 256)."""
    p = Path(path)
    try:
        if p.suffix == ".npy":
            arr = np.load(p, allow_pickle=False)
        elif p.suffix == ".bin":
            arr = np.fromfile(p, dtype=np.uint16)
        else:
            arr = np.frombuffer(p.read_bytes(), dtype=np.uint8)
    except FileNotFoundError:
        raise InputFileError(f"{p}: token file not found") from None
    except (OSError, ValueError) as exc:
        raise InputFileError(f"{p}: cannot read token file ({exc})") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise InputFileError(f"{p}: token file must hold a 1-D integer array, got {arr.dtype} {arr.shape}")
    arr = arr.astype(np.int64)
    if arr.size < 2:
        raise InputFileError(f"{p}: token file has fewer than 2 tokens")
    if arr.min() < 0 or arr.max() >= vocab:
        raise InputFileError(f"{p}: token ids must lie in [0, {vocab}), found [{arr.min()}, {arr.max()}]; "
                             f"use a preset with a larger vocabulary")
    return arr


def batches(tokens: np.ndarray, *, micro_batch: int, seq: int, seed: int) -> Iterator[tuple]:
    """Endless (input_ids, labels) micro-batches of random windows, deterministic per seed.

    Stage 0 and the last stage of one data-parallel replica draw the same
    sequence because they share the seed.
    """
    import torch

    if tokens.size < seq + 1:
        tokens = np.tile(tokens, (seq + 1) // tokens.size + 1)
    rng = np.random.default_rng(seed)
    high = tokens.size - seq - 1
    while True:
        starts = rng.integers(0, high + 1, size=micro_batch)
        window = np.stack([tokens[s:s + seq + 1] for s in starts])
        x = torch.from_numpy(window[:, :-1].copy())
        y = torch.from_numpy(window[:, 1:].copy())
        yield x, y
