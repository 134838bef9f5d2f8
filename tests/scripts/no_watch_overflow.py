"""A user script that never imports ampdoctor: one Linear overflows fp16 at a known step."""
import argparse

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.hidden = nn.Linear(32, 32)
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(torch.relu(self.inp(x)))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.hidden.weight.mul_(40)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x = torch.randn(16, 8) * (4.0 ** step)  # the input grows until hidden's output overflows
        with torch.autocast("cpu", dtype=torch.float16):
            loss = net(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.4g}")


if __name__ == "__main__":
    main()
