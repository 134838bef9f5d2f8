"""The loss is NaN from the first forward (net.0's output overflows fp16: Inf, then Inf - Inf) and the
script leaves out every step on a non-finite loss, so no optimizer step ever runs. In FP32 it trains."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
with torch.no_grad():
    model[0].weight.mul_(1e4)
opt = torch.optim.SGD(model.parameters(), lr=1e-9)
for _ in range(20):
    x = torch.randn(32, 8) * 10
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x).float()
        loss = (out - out).mean()  # 0 where out is finite, NaN where it is Inf
    if not torch.isfinite(loss):
        continue
    opt.zero_grad()
    loss.backward()
    opt.step()
