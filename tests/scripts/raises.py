import torch
from torch import nn

model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
raise RuntimeError("boom in the user's script")
