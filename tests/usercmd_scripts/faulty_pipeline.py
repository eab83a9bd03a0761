"""examples/pipeline_train.py with one fault at its third step on rank 1, as the trial contract's
cases inject into the built-in workload (autotune/core/faults.py): CONTRACT_FAULT=oom raises
torch's out-of-memory error, kill SIGKILLs the rank, hang stops stepping."""

import os
import runpy
import sys
import time
from pathlib import Path

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipeline_train.py"
FAULT = os.environ.get("CONTRACT_FAULT")
_train_batch = PipelineEngine.train_batch
_steps = [0]


def train_batch(self, *args, **kwargs):
    if FAULT and int(os.environ.get("RANK", "0")) == 1 and _steps[0] == 2:
        if FAULT == "oom":
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")
        if FAULT == "kill":
            os.kill(os.getpid(), 9)
        if FAULT == "hang":
            while True:
                time.sleep(1)
    _steps[0] += 1
    return _train_batch(self, *args, **kwargs)


PipelineEngine.train_batch = train_batch  # under autotune's own wrap of the engine's train_batch
sys.argv[0] = str(EXAMPLE)
runpy.run_path(str(EXAMPLE), run_name="__main__")
