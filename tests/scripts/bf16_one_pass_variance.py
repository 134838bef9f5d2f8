"""A pure bf16 model whose input norm computes the variance in one pass, E[x^2] - E[x]^2, on readings
around 300 (Kelvin, say): in bf16 (8 significant bits) the two terms cancel into a negative variance,
and rsqrt of it is NaN from step 0. No value comes near bf16's max: x * x is about 9e4, which is past
fp16's max but nothing to bf16. In FP32 the norm is fine."""
import torch
import torch.nn as nn


class OnePassNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight


torch.manual_seed(0)
model = nn.Sequential(OnePassNorm(16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(torch.bfloat16)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for _step in range(20):
    x = (300.0 + 1.5 * torch.randn(32, 16)).to(torch.bfloat16)
    loss = model(x).float().pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
