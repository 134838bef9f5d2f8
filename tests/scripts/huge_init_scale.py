"""A healthy model whose GradScaler starts at a huge ``init_scale`` (``--init-scale-log2``, 40 by
default): every step overflows at start-up and is skipped while the scale halves from 2**40 to
where the gradients fit (~22 steps), then training goes on with no more skips. Start-up backoffs,
not a failure: ``ampdoctor bisect`` must call it ``healthy``. ``--break-at S`` makes the run
genuinely broken from step S on (the input grows until a Linear overflows fp16 every step)."""
import argparse

import torch
from torch import nn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--init-scale-log2", type=float, default=40.0)
    p.add_argument("--break-at", type=int, default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    import ampdoctor

    ampdoctor.watch(model)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** args.init_scale_log2)
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x = torch.randn(16, 8, generator=gen)
        y = x[:, :1] * 3
        if args.break_at is not None and step >= args.break_at:
            x = x * 1e5  # net.0's output overflows fp16 from here on
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4g} scale {scaler.get_scale():.3g}", flush=True)


if __name__ == "__main__":
    main()
