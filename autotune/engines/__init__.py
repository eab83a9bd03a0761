"""The training engines autotune tunes, one plug-in each (docs/architecture.md, "Adding an engine").

An engine is what builds and steps the model inside the ranks: DeepSpeed's PipelineEngine
(`deepspeed_pipe/`), torch.distributed.pipelining (`torch_pipe/`). Each folder holds one
implementation of `base.Engine`: its launch (which launcher starts which rank entry), its part
of the space, its refusals and checks, its setting steps, whether the performance model
follows its schedule, and its words in the run's header and reports. `registry.py` names them
for `--engine`. Nothing outside this folder asks which engine runs.

What runs inside a rank stays under `autotune/rank/` (the process boundary comes first): an
engine names its rank entry here and offers the probe its face there (`rank/engine_face.py`).
"""
