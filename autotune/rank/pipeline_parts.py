"""Hand a DeepSpeed PipelineModule an explicit partition (a `parts` list).

DeepSpeed 0.19.8 has no constructor argument for it: `PipelineModule.__init__` calls
`self._partition_layers(method=partition_method)`, which sets `self.parts` and the
stage's layer bounds, before `_build()` materializes the stage's layers. So the one
place to hand over a partition is that method: `install()` wraps it (once per process,
on the class) so that

- the method string `parts:0,5,12` means those boundaries (the built-in workload and
  `autotune run --partition-method parts:...`), and
- `force(parts)` makes every PipelineModule built afterwards in this process use
  `parts` whatever method the script passes (the user-command bootstrap, for a script
  autotune does not edit; a model with a different layer count is refused loudly).

Every other method goes to DeepSpeed's own code unchanged.

What a user writes in their own code to keep a partition, without autotune installed,
is in docs/partition.md (a five-line PipelineModule subclass).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autotune.core.errors import UserError
from autotune.core.partition import check_parts, parse_parts

PREFIX = "parts:"
_state: dict[str, Any] = {"installed": False, "forced": None}


def method_for(parts: Sequence[int]) -> str:
    """The partition_method string that carries `parts`."""
    return PREFIX + ",".join(str(int(p)) for p in parts)


def check_method(method: str, stages: int, num_layers: int | None) -> list[int]:
    """The parts of a `parts:` method, checked against the stages (and layers, where known)."""
    parts = parse_parts(method[len(PREFIX):])
    if num_layers is None:
        if len(parts) < 2:
            raise UserError(f"--partition-method {method!r}: give stages + 1 boundaries")
        num_layers = parts[-1]
    try:
        return check_parts(parts, num_layers, stages)
    except UserError as exc:
        raise UserError(f"--partition-method {method!r}: {exc}") from None


def force(parts: Sequence[int] | None) -> None:
    """Every PipelineModule built from now on in this process uses `parts` (None: stop forcing)."""
    _state["forced"] = list(parts) if parts is not None else None
    install()


def install() -> None:
    """Teach PipelineModule._partition_layers the `parts:` method and the forced parts (idempotent)."""
    if _state["installed"]:
        return
    from deepspeed.runtime.pipe.module import PipelineModule

    original = PipelineModule._partition_layers

    def _partition_layers(self: Any, method: str = "uniform") -> None:
        forced = _state["forced"]
        # What partitioned this module, for the advice (DeepSpeed keeps only the parts).
        self._autotune_partition_method = method_for(forced) if forced is not None else str(method)
        if forced is None and not str(method).lower().startswith(PREFIX):
            return original(self, method=method)
        layers = len(self._layer_specs)
        parts = forced if forced is not None else parse_parts(str(method)[len(PREFIX):])
        try:
            parts = check_parts(parts, layers, self.num_stages)
        except UserError as exc:
            raise ValueError(f"autotune: partition {parts} does not fit this PipelineModule "
                             f"({layers} layers, {self.num_stages} stages): {exc}") from None
        self.parts = list(parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    _partition_layers._autotune_parts = True  # type: ignore[attr-defined]
    PipelineModule._partition_layers = _partition_layers
    _state["installed"] = True
