import time

import torch
from torch import nn

model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(2, 4)).sum().backward()
opt.step()
time.sleep(600)
