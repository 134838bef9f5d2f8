"""Trains, then SIGKILLs itself at step --kill-at (no chance to flush anything)."""
import argparse
import os
import signal

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--kill-at", type=int, default=10)
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
for step in range(100):
    if step == args.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
