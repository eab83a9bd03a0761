"""Not a pipeline: deepspeed.initialize on a plain module gives a DeepSpeedEngine."""

import argparse

import deepspeed
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
model = torch.nn.Linear(8, 8)
engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
for _ in range(100000):  # would train for ever
    loss = engine(torch.randn(2, 8)).sum()
    engine.backward(loss)
    engine.step()
