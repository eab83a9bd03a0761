"""A transformers.Trainer job with DeepSpeed, of the usual shape: a tiny GPT-2 built from a config
(no download) trained on a text file, byte-level (no tokenizer to fetch).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/hf_trainer_train.py \
        --deepspeed examples/ds_hf_auto.json --text README.md --output_dir /tmp/hf-out \
        --per_device_train_batch_size 2 --gradient_accumulation_steps 4 --max_steps 20

Tuned unchanged by autotune (docs/hf-trainer.md):

    autotune run --budget 20 -- deepspeed --num_gpus 2 examples/hf_trainer_train.py \
        --deepspeed examples/ds_hf_auto.json --text README.md --output_dir /tmp/hf-out \
        --per_device_train_batch_size 2 --gradient_accumulation_steps 4 --max_steps 100000

The Trainer's own arguments (`TrainingArguments`, read by `HfArgumentParser`) stay as HF defines
them; the config's "auto" values are filled by the Trainer from them.
"""

from dataclasses import dataclass, field

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments

SEQ = 32


@dataclass
class DataArguments:
    text: str = field(metadata={"help": "a text file to train on, read as bytes"})
    n_layer: int = field(default=4, metadata={"help": "GPT-2 blocks"})
    n_embd: int = field(default=64, metadata={"help": "GPT-2 width"})


class ByteBlocks(torch.utils.data.Dataset):
    """The file's bytes in blocks of SEQ tokens, each its own labels (the model shifts them)."""

    def __init__(self, path: str) -> None:
        data = torch.tensor(list(open(path, "rb").read()), dtype=torch.long)
        if len(data) < SEQ:
            raise SystemExit(f"{path}: fewer than {SEQ} bytes to train on")
        self.blocks = data[: len(data) // SEQ * SEQ].view(-1, SEQ)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    data_args, args = HfArgumentParser((DataArguments, TrainingArguments)).parse_args_into_dataclasses()
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=data_args.n_embd,
                        n_layer=data_args.n_layer, n_head=4)
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=ByteBlocks(data_args.text))
    trainer.train()


if __name__ == "__main__":
    main()
