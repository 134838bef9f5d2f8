"""Trace size on disk per recorded step: an MLP of N Linear+ReLU blocks (2N+1 leaf modules) trained
with watch(every=E) on the CPU, fp16 autocast + GradScaler.

    python benchmarks/trace_size.py --blocks 2,250 --steps 50 --every 1,10
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch import nn

import ampdoctor


def run(blocks: int, steps: int, every: int, width: int) -> tuple[int, float]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    path = os.path.join(tempfile.mkdtemp(), "t.sqlite")
    with ampdoctor.watch(model, trace=path, every=every):
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, width)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    size = sum(os.path.getsize(path + s) for s in ("", "-wal") if os.path.exists(path + s))
    recorded = len(range(0, steps, every))
    return 2 * blocks + 1, size / recorded


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", default="2,250")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--every", default="1,10")
    p.add_argument("--width", type=int, default=32)
    a = p.parse_args()
    print("| leaf modules | every | recorded steps | bytes per recorded step |")
    print("|---|---|---|---|")
    for b in map(int, a.blocks.split(",")):
        for e in map(int, a.every.split(",")):
            leaves, per = run(b, a.steps, e, a.width)
            print(f"| {leaves} | {e} | {len(range(0, a.steps, e))} | {per / 1024:.1f} KB |")


if __name__ == "__main__":
    main()
