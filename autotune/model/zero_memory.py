"""Model-states memory per rank of a plain DeepSpeedEngine at each ZeRO stage, and whether a
stage fits the device: the out-of-memory cliff along the stage axis (issue 42).

Model states are the weights, gradients and Adam's state: what a rank holds before any
activation. With mixed precision (fp16 or bf16, as DeepSpeed's estimators assume), per
parameter: 2 bytes of half-precision weights, 2 of half-precision gradients, and 16 of fp32
state the optimizer keeps (4 of weights, 4 of gradients, 8 of the two moments). Each stage
partitions more of it over the dp ranks (N):

- ZeRO-0: nothing partitioned: 20 bytes each;
- ZeRO-1: the 16 bytes of optimizer state: 4 + 16/N;
- ZeRO-2: the half-precision gradients too: 2 + 18/N (DeepSpeed's
  `estimate_zero2_model_states_mem_needs`, deepspeed/runtime/zero/stage_1_and_2.py);
- ZeRO-3: the weights too; the largest layer is gathered whole in fp32 while it runs:
  4 x largest + 18/N (`estimate_zero3_model_states_mem_needs`, deepspeed/runtime/zero/stage3.py).

The optimizer offloaded to the CPU leaves the half-precision copies on the device: ZeRO-1
4 bytes, ZeRO-2 2, ZeRO-3 4 x largest + 2/N. tests/test_zero_memory.py pins these against the
installed DeepSpeed's functions. fp32 training (no fp16/bf16 section: the CPU here) keeps other
copies, which those functions do not cover: it is not modelled, and nothing is predicted for it.
"""

from __future__ import annotations

from dataclasses import dataclass

HALF_WEIGHTS, HALF_GRADS, FP32_STATE = 2, 2, 16
"""Bytes per parameter under mixed precision; FP32_STATE: the optimizer's fp32 weights 4, fp32
gradients 4 and Adam's two moments 8 (with the half-precision gradients, DeepSpeed's 18)."""
LARGEST_LAYER_BYTES = 4
"""ZeRO-3 gathers one layer's parameters whole while it runs: 4 bytes each (DeepSpeed's figure)."""
HEADROOM = 0.10
"""Share of the device a stage must leave free to count as fitting (fragmentation, workspaces)."""


def model_states_bytes(params: int, stage: int, dp: int, *, largest_layer_params: int = 0,
                       offload_optimizer: bool = False) -> int:
    """Bytes of model states one rank holds at `stage` over `dp` ranks, mixed precision."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage}: 0-3")
    if dp < 1 or params < 0:
        raise ValueError(f"params {params}, dp {dp}: need params >= 0 and dp >= 1")
    if offload_optimizer:  # the fp32 state and its update on the CPU
        if stage == 0:
            raise ValueError("optimizer offload needs ZeRO stage 1-3")
        return {1: (HALF_WEIGHTS + HALF_GRADS) * params, 2: HALF_WEIGHTS * params,
                3: LARGEST_LAYER_BYTES * largest_layer_params + int(HALF_WEIGHTS * params / dp)}[stage]
    partitioned = HALF_GRADS + FP32_STATE  # DeepSpeed's 18
    if stage == 0:
        return (HALF_WEIGHTS + partitioned) * params
    if stage == 1:
        return (HALF_WEIGHTS + HALF_GRADS) * params + int(FP32_STATE * params / dp)
    if stage == 2:
        return HALF_WEIGHTS * params + int(partitioned * params / dp)
    return LARGEST_LAYER_BYTES * largest_layer_params + int(partitioned * params / dp)


@dataclass(frozen=True, slots=True)
class StageFit:
    """A stage's predicted peak against the device, from a measured peak at another stage."""

    stage: int
    predicted_peak_bytes: float
    limit_bytes: float

    @property
    def fits(self) -> bool:
        return self.predicted_peak_bytes <= self.limit_bytes

    def why_not(self) -> str:
        return (f"predicted to need {self.predicted_peak_bytes / 2**30:.1f} GiB per rank at ZeRO-{self.stage}, over "
                f"{self.limit_bytes / 2**30:.1f} GiB ({1 - HEADROOM:.0%} of the device): the measured peak less "
                "the baseline stage's model states plus this stage's (autotune/model/zero_memory.py)")


def stage_fit(stage: int, *, measured_peak_bytes: float, measured_stage: int, capacity_bytes: float,
              params: int, dp: int, largest_layer_params: int = 0) -> StageFit:
    """Moving from `measured_stage` to `stage` changes only the model states (the activations
    and the rest of the measured peak stay): the predicted peak is the measured one less the
    measured stage's states plus the new stage's."""
    states = {s: model_states_bytes(params, s, dp, largest_layer_params=largest_layer_params) for s in (stage, measured_stage)}
    peak = measured_peak_bytes - states[measured_stage] + states[stage]
    return StageFit(stage=stage, predicted_peak_bytes=float(peak), limit_bytes=capacity_bytes * (1 - HEADROOM))
