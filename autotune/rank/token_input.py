"""The sequence length of a pipeline's input, read from the first micro-batch the engine loads.

A user's own script (`autotune run -- COMMAND`, `autotune watch`, `instrument()` without
`seq_length=`) does not tell autotune its sequence length. Where the first stage's input is
a token sequence, a 2-D integer tensor of shape (micro-batch, sequence), the shape says it.
Anything else (images, float features, a shape whose first dimension is not the
micro-batch) has no tokens: the length stays None, and tokens per second is "not
available" (empty in the CSV, no Prometheus series), never 0.

Measured once, after the first LoadMicroBatch instruction of a first-stage rank, from the
input buffer that instruction filled; nothing of the engine is patched beyond the probe's
own instance instruction map. Only the first stage loads the model's input, so the other
stages' rows leave the length empty and the trial summary takes it from the first stage's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def token_seq_length(inputs: Any, micro_batch_size: int) -> int | None:
    """The sequence length when `inputs` (or the first of a tuple of inputs) is batch x seq integer ids."""
    if isinstance(inputs, (tuple, list)):
        inputs = inputs[0] if inputs else None
    dtype = getattr(inputs, "dtype", None)
    shape = tuple(getattr(inputs, "shape", ()))
    if dtype is None or len(shape) != 2 or shape[0] != micro_batch_size or shape[1] < 1:
        return None
    if dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
        return None
    return int(shape[1])


def measure_seq_length(load: Callable, engine: Any, found: Callable[[int | None], None]) -> Callable:
    """`load` (a LoadMicroBatch entry of the instruction map) that, once, reports the input's length.

    `found` gets the length or None. Only a first-stage rank has the model's input; on the
    others `load` comes back unchanged. A failure to read the buffer reads as "not a token
    model" and never reaches the training loop.
    """
    if not engine.is_first_stage():
        return load
    done = False

    def load_and_measure(engine_self: Any, **kwargs: Any) -> Any:
        nonlocal done
        out = load(engine_self, **kwargs)
        if not done:
            done = True
            try:
                inputs = engine_self.pipe_buffers["inputs"][kwargs["buffer_id"]]
                length = token_seq_length(inputs, int(engine_self.train_micro_batch_size_per_gpu()))
            except Exception:  # noqa: BLE001 - an engine of another shape: not known, the step goes on
                length = None
            found(length)
        return out

    return load_and_measure
