"""A DDP script (gloo, CPU, launched by torchrun): one Linear overflows fp16 around step 8."""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1))
    with torch.no_grad():
        model[2].weight.mul_(60)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(rank)
    for step in range(int(os.environ.get("STEPS", "40"))):
        x = torch.randn(8, 8, generator=g) * (1 + step) * 240
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ddp(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
