"""examples/zero_train.py with its DeepSpeed config built in code, as many public examples do:
a dict passed as `config=` to `deepspeed.initialize`, no file on the command line.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/zero_train_dict.py --steps 20
    autotune run --budget 20 -- deepspeed --num_gpus 2 examples/zero_train_dict.py --steps 100000

autotune reads the dict at `deepspeed.initialize` during its start-up check (the baseline), hands
each trial its own there, and writes best_ds_config.json as this dict with the tuned values.
"""

import argparse
import os
import sys

import deepspeed
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_train import SEQ, VOCAB, TinyGPT  # noqa: E402  (the same model)

DS_CONFIG = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
    "steps_per_print": 10**6,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--save-dir", default="checkpoints")
    args = parser.parse_args()
    torch.manual_seed(1234)
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    model = TinyGPT()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
    rank = int(os.environ.get("RANK", 0))
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            tokens = torch.randint(0, VOCAB, (engine.train_micro_batch_size_per_gpu(), SEQ + 1), generator=g)
            loss = nn.functional.cross_entropy(engine(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    engine.save_checkpoint(args.save_dir)  # what autotune's stop must never reach


if __name__ == "__main__":
    main()
