"""A DDP script that starts its second rank itself, as PyTorch Lightning's default launcher does:
rank 0 runs this file again with LOCAL_RANK=1 (CPU, gloo). ``--overflow``: layer ``1`` overflows
fp16 (a bisect culprit)."""
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch import nn

rank = int(os.environ.get("LOCAL_RANK", "0"))
if rank == 0:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    env = dict(os.environ, LOCAL_RANK="1", RANK="1", WORLD_SIZE="2")
    child = subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]], env=env)
dist.init_process_group("gloo", rank=rank, world_size=2)


class Boost(nn.Linear):
    """A linear layer of a large input, scaled back after: its fp16 output overflows, FP32 is fine."""

    def forward(self, x):
        return super().forward(x * 1e5) / 1e5


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), (Boost if "--overflow" in sys.argv else nn.Linear)(16, 16), nn.ReLU(),
                      nn.Linear(16, 1))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(rank)
for _ in range(8):
    x = torch.randn(4, 8, generator=g) * 10
    with torch.autocast("cpu", dtype=torch.float16):
        loss = ddp(x).float().pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
dist.destroy_process_group()
if rank == 0:
    sys.exit(child.wait())
