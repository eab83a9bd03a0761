"""The labels autotune's own traces carry, shared by the rank that records them
(autotune/rank/trace_recorder.py) and the reader (autotune/traces/).

Inside a traced step every DeepSpeed pipeline instruction runs under a profiler range named
`deepspeed:<Instruction>` (`deepspeed:ForwardPass`, `deepspeed:SendActivation`, ...): the trace
then shows the schedule the probe times, and the reader measures it with the probe's own
definitions (compute, transfer against the wait for a peer, micro-batches per step).
"""

from __future__ import annotations

INSTRUCTION_PREFIX = "deepspeed:"
FORWARD, BACKWARD, OPTIMIZER = "ForwardPass", "BackwardPass", "OptimizerStep"
COMPUTE_INSTRUCTIONS = (FORWARD, BACKWARD, OPTIMIZER)
P2P_INSTRUCTIONS = ("SendActivation", "SendGrad", "RecvActivation", "RecvGrad")
REDUCE_INSTRUCTIONS = ("ReduceGrads", "ReduceTiedGrads")
