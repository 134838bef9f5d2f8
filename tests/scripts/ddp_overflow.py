"""A DDP script launched by torchrun: one Linear overflows fp16 around step 8. On the CPU with gloo;
with ``DDP_DEVICE=cuda``, one GPU per rank with NCCL; with ``DDP_DEVICE=cuda DDP_BACKEND=gloo`` as well,
the ranks share the GPUs there are (gloo, unlike NCCL, lets two ranks use one GPU)."""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    device = os.environ.get("DDP_DEVICE", "cpu")
    dist.init_process_group(os.environ.get("DDP_BACKEND") or ("nccl" if device == "cuda" else "gloo"))
    rank = dist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1))
    with torch.no_grad():
        model[2].weight.mul_(60)
    model = model.to(device)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device)
    g = torch.Generator().manual_seed(rank)
    for step in range(int(os.environ.get("STEPS", "40"))):
        x = (torch.randn(8, 8, generator=g) * (1 + step) * 240).to(device)
        with torch.autocast(device, dtype=torch.float16):
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
