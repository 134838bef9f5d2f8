"""A Poisson loss computed in fp16 in the user's code: ``exp(out)`` passes 65504 (Inf) from step 0 while
every layer's output is finite (about 11.5); in FP32 the loss is about 1e5 and training goes on.
Forcing the last Linear to FP32 passes too, only because its FP32 output makes ``exp`` run in FP32."""
import argparse

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
a = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
nn.init.constant_(model[2].bias, 11.5)
opt = torch.optim.SGD(model.parameters(), lr=1e-9)
scaler = torch.amp.GradScaler("cpu")
for _step in range(a.steps):
    x = torch.randn(64, 16) * 0.1
    y = torch.poisson(torch.full((64, 1), 3.0))
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
        loss = (torch.exp(out) - y * out).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
