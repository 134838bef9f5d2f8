"""CPU overhead of ``ampdoctor.watch``: a small transformer encoder, fp16 CPU autocast + GradScaler
+ AdamW, step time with and without the watch (every=1, every=10), measured side by side in one
process (interleaved rounds, medians).

Run:  python benchmarks/overhead.py [--rounds 7] [--steps 10] [--layers 2] [--d 128]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Config, run_interleaved, table, watch_config  # noqa: E402
from _models import Encoder  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (a multiple of 10)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: stable numbers on a shared machine; intra-op threads of small ops "
                        "oversubscribe a loaded CPU)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = Encoder(vocab=args.vocab, d=args.d, layers=args.layers, heads=4, ffn=4 * args.d, max_len=args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(ids)
            loss = F.cross_entropy(logits.float().view(-1, args.vocab), ids.view(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    configs = [Config("baseline"), watch_config("every=1", model, 1), watch_config("every=10", model, 10)]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"# ampdoctor CPU overhead  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(f"# model: encoder d={args.d} layers={args.layers} vocab={args.vocab} ({n_params / 1e6:.2f}M params), "
          f"B={args.batch} T={args.seq}, fp16 autocast + GradScaler + AdamW; "
          f"{args.rounds} rounds x {args.steps} steps")
    for c in configs:  # warm-up round, not timed
        td = c.setup() if c.setup else None
        step()
        step()
        if td:
            td()
    res = run_interleaved(step, configs, rounds=args.rounds, steps=args.steps)
    print(table(res))


if __name__ == "__main__":
    main()
