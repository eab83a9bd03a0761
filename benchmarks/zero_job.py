"""The ZeRO job of benchmarks/vs_ds_autotuner.py: autotune's built-in tiny decoder as a plain
module under `deepspeed.initialize`, the usual forward/backward/step loop on synthetic tokens.

Both tuners run this one script unchanged: DeepSpeed's autotuner (`deepspeed --autotuning tune
... benchmarks/zero_job.py --deepspeed --deepspeed_config ds.json`, whose engine exits after its
profile steps) and `autotune run -- deepspeed ... benchmarks/zero_job.py --deepspeed_config ds.json`.
"""

import argparse
import os

import deepspeed
import torch

from autotune.rank.workload.data import batches, synthetic_tokens
from autotune.rank.workload.model import build_decoder, cross_entropy_loss
from autotune.rank.workload.presets import get_preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--preset", default="tiny")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    preset = get_preset(args.preset)
    model = build_decoder(preset, seed=1234)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    rank = int(os.environ.get("RANK", 0))
    data = batches(synthetic_tokens(preset.vocab_size, 200_000, seed=1234),
                   micro_batch=engine.train_micro_batch_size_per_gpu(), seq=preset.seq_length, seed=1234 + rank)
    for _ in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, labels = next(data)
            loss = cross_entropy_loss(engine(inputs), labels)
            engine.backward(loss)
            engine.step()


if __name__ == "__main__":
    main()
