"""Two independent overflows: ``0.0`` from step 11, ``0.3`` from step ``--second`` (24) of 80 steps.

Each ``Ramp`` computes ``x + (W x) * s / s`` with ``s`` doubling every step: in fp16 ``(W x) * s`` passes
65504 and turns Inf at its ``start`` step; in FP32 it stays finite (and ``/ s`` brings it back), so a
ramp forced to FP32 never breaks. Forcing ``0.0`` alone makes the run pass the baseline's failure step
plus the margin (step 16), then break again when ``0.3`` overflows: the fix needs both.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor


class Ramp(nn.Module):
    def __init__(self, dim, start):
        super().__init__()
        self.w = nn.Parameter(torch.eye(dim) + 0.01 * torch.randn(dim, dim))
        self.start = start
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        s = 2.0 ** (self.calls - self.start + 16)  # |W x| ~ 1: fp16 overflows once calls > start
        return x + F.linear(x, self.w) * s / s


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--second", type=int, default=24)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Sequential(Ramp(8, 12), nn.Linear(8, 8), nn.Linear(8, 8), Ramp(8, args.second)),
                          nn.Linear(8, 1))
    ampdoctor.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x = torch.randn(16, 8) * 0.5
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
