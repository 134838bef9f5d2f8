"""Small real models and a training loop shared by the tests."""

from __future__ import annotations

import torch
from torch import nn


class Attn(nn.Module):
    """Hand-written attention whose own forward does the q @ k^T that overflows (no 1/sqrt(d))."""

    def __init__(self, d: int, gain: float = 1.0):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.gain = gain

    def forward(self, x):
        q, k = self.q(x) * self.gain, self.k(x) * self.gain
        logits = q @ k.transpose(-2, -1)
        return torch.softmax(logits.float(), -1).to(x.dtype) @ self.v(x)


class SquareNorm(nn.Module):
    """A hand-written layer norm: x * x overflows in fp16 although its input is finite (inf - inf = NaN)."""

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var + 1e-5)


def train(model, steps=3, *, scaler=True, make_x=None, lr=1e-3, autocast=True, loss_fn=None):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    losses = []
    for i in range(steps):
        x = make_x(i) if make_x else torch.randn(4, 8)
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            out = model(x)
            if loss_fn is not None:
                loss = loss_fn(out)
            else:
                loss = (out if isinstance(out, torch.Tensor) else out[0]).float().pow(2).mean()
        if sc is not None:
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
