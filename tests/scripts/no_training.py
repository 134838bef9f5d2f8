import torch
from torch import nn

model = nn.Linear(4, 4)
print(model(torch.randn(2, 4)).shape)
