"""Full-batch curve fit with LBFGS: optimizer.step(closure) calls the closure (forward and backward)
many times a step. Prints each step's loss as step() returns it, one per line: `loss <value>`."""
import torch
from torch import nn

torch.manual_seed(0)
X = torch.linspace(-3, 3, 200)[:, None]
Y = torch.sin(2 * X) + 0.05 * torch.randn_like(X)
model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=20, line_search_fn="strong_wolfe")


def closure():
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(X), Y)
    loss.backward()
    return loss


for _ in range(3):
    print(f"loss {opt.step(closure).item()!r}")
