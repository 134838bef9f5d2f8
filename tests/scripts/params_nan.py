"""fp16 autocast, no GradScaler, SGD with gradient clipping: at step ``--at`` (5) the batch is 1e5 times
larger, ``0`` (the first Linear) overflows fp16 to Inf, the loss is Inf and the step's update writes NaN
into every weight (clipping cannot clean a NaN gradient); the loss is NaN from then on. (It is a test of the
step the failure is reported at, not a bisect fixture: with ``0`` in FP32 the next layers overflow in turn,
and a trial still fails at the same step; a bisect of it is inconclusive.) ``--backward``:
the loss of step ``--at`` is weighted 1e8 instead, its forward stays finite and only the fp16 backward
overflows (the loss is finite at that step, NaN from the next)."""
import argparse

import torch
from torch import nn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--at", type=int, default=5)
    p.add_argument("--backward", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    import ampdoctor

    ampdoctor.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x = torch.randn(16, 8, generator=gen)
        y = x[:, :1]
        if step == args.at and not args.backward:
            x = x * 1e5
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x).float()
        loss = nn.functional.mse_loss(out, y)
        opt.zero_grad()
        (loss * (1e8 if step == args.at and args.backward else 1.0)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        print(f"step {step} loss {loss.item():.4g}", flush=True)


if __name__ == "__main__":
    main()
