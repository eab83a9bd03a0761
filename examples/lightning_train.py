"""A Lightning job with DeepSpeedStrategy, of the usual shape: the strategy builds the engine inside
`trainer.fit`, the micro-batch is the DataLoader's batch size and gradient accumulation the
Trainer's `accumulate_grad_batches` (Lightning refuses `gradient_accumulation_steps` in the config).

    python examples/lightning_train.py --devices 8 --stage 2 --batch-size 4 --accumulate 2

Tuned by autotune on a CUDA machine, with the batch mapped to the script's own flags
(docs/lightning.md):

    autotune run --budget 20 --knob 'micro:1,2,4,8=--batch-size {value}' \\
        --knob 'gas:1,2,4=--accumulate {value}' -- torchrun --nproc_per_node 8 \\
        examples/lightning_train.py --devices 8 --stage 2 --max-steps 100000

Lightning 2.6 runs DeepSpeedStrategy on CUDA GPUs only: elsewhere `trainer.fit` raises "The
DeepSpeed strategy is only supported on CUDA GPUs but `CPUAccelerator` is used."
"""

import argparse

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn

VOCAB, SEQ, HIDDEN = 256, 32, 64


class TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(),
                                 nn.Linear(4 * HIDDEN, VOCAB))

    def training_step(self, batch, _):
        (tokens,) = batch
        logits = self.net(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--accelerator", default="auto", help="Lightning's: gpu, cpu, auto")
    ap.add_argument("--stage", type=int, default=2, help="ZeRO stage")
    ap.add_argument("--batch-size", type=int, default=4, help="the micro-batch per rank")
    ap.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    ap.add_argument("--max-steps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (4096, SEQ + 1)))
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices,
                        strategy=DeepSpeedStrategy(stage=args.stage), max_steps=args.max_steps,
                        accumulate_grad_batches=args.accumulate, logger=False, enable_checkpointing=False)
    trainer.fit(TinyLM(), torch.utils.data.DataLoader(data, batch_size=args.batch_size))


if __name__ == "__main__":
    main()
