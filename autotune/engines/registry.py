"""The engines `--engine` names: one line each. Adding an engine is its folder and its line here."""

from __future__ import annotations

from autotune.core.errors import UserError
from autotune.engines.base import Engine
from autotune.engines.deepspeed_pipe.engine import DeepSpeedPipeline
from autotune.engines.deepspeed_zero.engine import DeepSpeedZero
from autotune.engines.torch_pipe.engine import TorchPipelining

ENGINES: dict[str, Engine] = {e.name: e for e in (DeepSpeedPipeline(), DeepSpeedZero(), TorchPipelining())}
DEFAULT = "deepspeed"


def engine_named(name: str) -> Engine:
    """The engine `--engine NAME` chooses; one UserError line for a name no engine has."""
    engine = ENGINES.get(name)
    if engine is None:
        raise UserError(f"--engine {name!r}: use {' or '.join(ENGINES)}")
    return engine
