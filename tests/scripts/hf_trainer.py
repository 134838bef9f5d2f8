"""A user's HF ``Trainer(fp16=True)`` fine-tune (CUDA), written without ampdoctor in mind: a small
BERT from a config (no download) on random tokens. ``--break`` scales one FFN weight
(``bert.encoder.layer.2.intermediate.dense``) by 1e5 so its fp16 output overflows; the output then
also overflows ``bert.encoder.layer.2.output.dense``'s fp16 input, so both must run in FP32.

The Trainer trains through accelerate, which wraps ``model.forward`` itself in ``torch.autocast``.

Run:  python tests/scripts/hf_trainer.py [--break] [--steps 40]
"""
import argparse

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class Tokens(Dataset):
    def __init__(self, n: int = 512, t: int = 64, vocab: int = 1000):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, t), generator=g)
        self.y = self.x[:, 0] % 2

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--break", dest="broken", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="/tmp/ampdoctor-hf-trainer")
    args = p.parse_args()
    cfg = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=512)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)
    if args.broken:
        with torch.no_grad():
            model.bert.encoder.layer[2].intermediate.dense.weight.mul_(1e5)
    targs = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=16, fp16=True,
                              logging_steps=10, report_to=[], save_strategy="no", learning_rate=1e-4,
                              dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=model, args=targs, train_dataset=Tokens()).train()


if __name__ == "__main__":
    main()
