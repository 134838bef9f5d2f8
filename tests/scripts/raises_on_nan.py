"""Like many real scripts: raises as soon as the loss is NaN (a numerical failure, not a crash)."""
import math

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
with torch.no_grad():
    model[0].weight.mul_(50)
opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay finite: only the loss breaks
for step in range(30):
    x = torch.randn(4, 8) * (6.0 ** step)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    if math.isnan(loss.item()) or math.isinf(loss.item()):
        raise RuntimeError(f"loss is {loss.item()} at step {step}")
    loss.backward()
    for p in model.parameters():
        p.grad.nan_to_num_(0.0, 0.0, 0.0)  # keep the weights finite
    opt.step()
    opt.zero_grad()
