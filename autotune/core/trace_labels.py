"""The labels autotune's own traces carry, shared by the rank that records them
(autotune/rank/trace_recorder.py) and the reader (autotune/traces/).

Inside a traced step every DeepSpeed pipeline instruction runs under a profiler range named
`deepspeed:<Instruction>` (`deepspeed:ForwardPass`, `deepspeed:SendActivation`, ...): the trace
then shows the schedule the probe times, and the reader measures it with the probe's own
definitions (compute, transfer against the wait for a peer, micro-batches per step).

A plain DeepSpeedEngine (ZeRO, no pipeline) is traced the same way: its phases and its ZeRO
collectives each under a `deepspeed:` range (`PLAIN_PHASES`, `is_plain_collective`).

A torch.distributed.pipelining job's own trace (a user's script under torch.profiler) carries
torch's labels instead, read as the same instructions (`pipeline_instruction`): the actions of
`_PipelineScheduleRuntime` (the interleaved, V and zero-bubble schedules) as
`PP:<stage><action><microbatch>`, and GPipe's and 1F1B's `Forward <i>` and `Backward <i>`.
"""

from __future__ import annotations

import re

INSTRUCTION_PREFIX = "deepspeed:"
FORWARD, BACKWARD, OPTIMIZER = "ForwardPass", "BackwardPass", "OptimizerStep"
COMPUTE_INSTRUCTIONS = (FORWARD, BACKWARD, OPTIMIZER)
P2P_INSTRUCTIONS = ("SendActivation", "SendGrad", "RecvActivation", "RecvGrad")
REDUCE_INSTRUCTIONS = ("ReduceGrads", "ReduceTiedGrads")

PLAIN_FORWARD, PLAIN_BACKWARD, PLAIN_STEP = "forward", "backward", "step"
PLAIN_PHASES = (PLAIN_FORWARD, PLAIN_BACKWARD, PLAIN_STEP)
"""A plain DeepSpeedEngine's phases as its ranges name them (`deepspeed:forward`, ...: the engine
face's names, autotune/rank/engine_face.py); its collectives run inside them, each under its own
`deepspeed:<op>` range (`deepspeed:reduce_scatter_fn`, `deepspeed:all_gather_into_tensor`, ...)."""
PIPELINE_NAMES = frozenset((*COMPUTE_INSTRUCTIONS, *P2P_INSTRUCTIONS, *REDUCE_INSTRUCTIONS))


def is_plain_collective(name: str) -> bool:
    """A `deepspeed:` range that is neither a pipeline instruction nor a plain engine's phase:
    one of the communication backend's collectives the plain engine face wraps."""
    return name not in PIPELINE_NAMES and name not in PLAIN_PHASES


TORCH_ACTIONS = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD, "W": BACKWARD, "SEND_F": "SendActivation",
                 "SEND_B": "SendGrad", "RECV_F": "RecvActivation", "RECV_B": "RecvGrad"}
"""torch 2.13's `_ComputationType` values -> the instruction they are: the input (I) and weight (W)
halves of a split backward are both backward compute. Its other actions (UNSHARD, RESHARD,
REDUCE_GRAD, OVERLAP_F_B) are not read."""
_TORCH_ACTION = re.compile(r"^PP:(\d+)(" + "|".join(sorted(TORCH_ACTIONS, key=len, reverse=True)) + r")(\d+)$")
_TORCH_SINGLE = re.compile(r"^(Forward|Backward) (\d+)$")


def pipeline_instruction(label: str) -> tuple[str, int | None] | None:
    """(instruction, micro-batch or None) of a profiler range's label, None where it is no
    pipeline instruction: autotune's `deepspeed:` ranges and torch's own labels (the module's
    docstring). Torch's receive waits run inside the action that needs them (`_wait_batch_p2p`),
    so its compute ranges hold that waiting too (docs/torch-pipelining-facts.md)."""
    if label.startswith(INSTRUCTION_PREFIX):
        return label[len(INSTRUCTION_PREFIX):], None
    m = _TORCH_ACTION.match(label)
    if m:
        return TORCH_ACTIONS[m.group(2)], int(m.group(3))
    m = _TORCH_SINGLE.match(label)
    if m:
        return (FORWARD if m.group(1) == "Forward" else BACKWARD), int(m.group(2))
    return None
