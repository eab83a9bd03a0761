"""A small convolutional pipeline whose first stage computes about twice its second: a
user's script of the shape that used to read as "chatty" (docs/metrics.md, issue 24).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/cnn_pipeline.py \
        --deepspeed_config examples/ds_config.json --steps 20
    autotune run --budget 4 -- deepspeed --num_gpus 2 examples/cnn_pipeline.py \
        --deepspeed_config examples/ds_config.json

Twelve layers, split by count (`partition_method="uniform"`, 6 and 6): the two large
convolutions land on stage 0, the small one and the fully connected head on stage 1, so
stage 0 does about twice the work (an `autotune run --layer-costs` on 2 CPU ranks with
examples/ds_config.json measured 0.132 s against 0.071 s of forward and backward a step,
stage imbalance 1.30). The layer costs balance it as parts [0, 4, 12], which
`partition_method='type:^(Conv2d|ReLU)$'` builds.
Data parallelism is 1, so there is no gradient reduction to amortize, and stage 1's sends
mostly wait for stage 0. No tokens: images in, class labels out.
"""

import argparse

import deepspeed
import torch
from deepspeed.pipe import PipelineModule
from torch import nn

CLASSES, SIDE = 10, 64


class ImageDataset(torch.utils.data.Dataset):
    """Synthetic images and labels; each item is (image, label), as the pipeline engine expects."""

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(size, 3, SIDE, SIDE, generator=g)
        self.labels = torch.randint(0, CLASSES, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def layers() -> list[nn.Module]:
    return [nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 48, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(48 * (SIDE // 8) ** 2, 128), nn.Linear(128, CLASSES)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--partition", default="uniform", help="PipelineModule partition_method")
    parser.add_argument("--seed", type=int, default=1234)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    model = PipelineModule(layers=layers(), num_stages=args.stages, partition_method=args.partition,
                           loss_fn=nn.CrossEntropyLoss())
    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=[p for p in model.parameters()],
                                           training_data=ImageDataset(1024, args.seed))
    for step in range(args.steps):
        loss = engine.train_batch()
        if engine.is_last_stage() and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
