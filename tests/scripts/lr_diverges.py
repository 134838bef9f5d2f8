"""A learning rate too high, not a precision problem. Two Linear heads summed (a linear regression, so
the loss is quadratic and its curvature fixed) trained by full-batch SGD with a rate above the stability
limit 2 / lambda_max: the error grows by ``--growth`` (1.5) per step, in any precision. The fp16 run
breaks first (the GradScaler backs off until its scale collapses, then the output passes 65504), the
same run in FP32 later (its loss passes float32's max around step 105). ``--growth 0.5`` trains."""
import argparse

import torch
from torch import nn


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x):
        return self.a(x) + self.b(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--growth", type=float, default=1.5, help="|1 - lr * lambda_max|: > 1 diverges")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TwoHeads()
    import ampdoctor

    ampdoctor.watch(model)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    y = x[:, :1] * 0.5
    feats = torch.cat([x, torch.ones(64, 1)], 1).repeat(1, 2)  # the parameters' features: [x, 1] per head
    lam = torch.linalg.eigvalsh(2 * feats.T @ feats / 64).max().item()  # mse's Hessian, largest eigenvalue
    opt = torch.optim.SGD(model.parameters(), lr=(1 + args.growth) / lam)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4g} scale {scaler.get_scale():.3g}", flush=True)


if __name__ == "__main__":
    main()
