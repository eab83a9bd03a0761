"""A user's own pipeline model for the built-in trial loop: `--model MODULE:FUNCTION`.

The contract (docs/warm-workers.md, "Your own model"):

    def build_pipeline(num_stages: int, seed: int) -> deepspeed.pipe.PipelineModule | tuple

returns a PipelineModule with `num_stages` stages (deepspeed.comm is initialized when it
is called, as in any PipelineModule construction), or a pair `(module, batches)` where
`batches(micro_batch_size: int, seed: int)` returns an endless iterator of
`(inputs, labels)` micro-batches for `engine.train_batch`. Without `batches`, the
built-in synthetic token stream is used: `(input_ids, labels)` int64 tensors of shape
(micro_batch_size, seq_length) with ids below the preset's vocabulary (`--preset` sets
both; the tiny preset: 256 ids, 64 tokens).

MODULE is imported from the controller's working directory or PYTHONPATH, in every rank.
Before any trial the controller checks the path in a short subprocess
(`python -m autotune.rank.workload.user_model MODULE:FUNCTION`): importing user code may
import torch and DeepSpeed, which the controller keeps out of its own process. The check
calls FUNCTION(num_stages=1, seed) in a one-process world and requires a PipelineModule.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from autotune.core.errors import UserError

_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
CHECK_TIMEOUT = 300.0
EXIT_BAD_MODEL = 3


class BadModel(Exception):
    """The path does not lead to a function that builds a PipelineModule (one line)."""


def parse_model_path(path: str) -> tuple[str, str]:
    if not _PATH.match(path):
        raise UserError(f"--model {path!r}: use MODULE:FUNCTION, e.g. mypkg.model:build_pipeline")
    module, _, func = path.partition(":")
    return module, func


def load_builder(path: str) -> Callable[..., Any]:
    module_name, func = parse_model_path(path)
    # A rank script's own folder (autotune/rank/workload, sys.path[0] in a rank) would shadow a user
    # module named model, data, ...: the user's code is looked up in the working directory
    # (the ranks start in the controller's) and PYTHONPATH instead.
    ours = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != ours]
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure of user code at import is one line
        raise BadModel(f"--model {path}: cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise BadModel(f"--model {path}: {module_name} has no function {func}")
    return fn


def build_user_pipeline(path: str, *, num_stages: int, seed: int) -> tuple[Any, Callable | None]:
    """(PipelineModule, batches or None) from the user's function; BadModel when it returns anything else."""
    from deepspeed.pipe import PipelineModule

    fn = load_builder(path)
    try:
        got = fn(num_stages=num_stages, seed=seed)
    except Exception as exc:  # noqa: BLE001 - the user's function failed: said in one line
        raise BadModel(f"--model {path}: {fn.__name__}(num_stages={num_stages}, seed={seed}) raised "
                       f"{type(exc).__name__}: {exc}") from None
    batches = None
    if isinstance(got, tuple) and len(got) == 2:
        got, batches = got
        if not callable(batches):
            raise BadModel(f"--model {path}: the second item returned must be batches(micro_batch_size, seed)")
    if not isinstance(got, PipelineModule):
        raise BadModel(f"--model {path}: {fn.__name__} returned {type(got).__name__}, not a "
                       "deepspeed.pipe.PipelineModule")
    return got, batches


def _check_main(argv: list[str]) -> int:
    path, seed = argv[0], int(argv[1])
    import deepspeed

    deepspeed.init_distributed(verbose=False)
    try:
        build_user_pipeline(path, num_stages=1, seed=seed)
    except (BadModel, UserError) as exc:
        print(f"autotune-model: {exc}", flush=True)
        return EXIT_BAD_MODEL
    return 0


if __name__ == "__main__":
    sys.exit(_check_main(sys.argv[1:]))
