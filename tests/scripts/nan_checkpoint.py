"""Training resumed from a checkpoint saved after a run broke: one weight is already NaN."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
with torch.no_grad():
    model[2].weight[0, 3] = float("nan")  # (as torch.load of the broken run's state_dict would leave it)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for _ in range(20):
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
