"""A contrastive-style loss computed under autocast: ``z @ z.T`` of the model's (normalised, scaled) output.
Under autocast that matmul runs in fp16 whatever its inputs, and its entries reach 9e4 > 65504: Inf from
step 0. Keeping every layer (the whole model) in FP32 does not help, as the matmul is the script's own code;
with autocast off the script trains."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for _step in range(30):
    x = torch.randn(64, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        z = F.normalize(model(x).float(), dim=1) * 300.0
        sim = z @ z.t()  # the diagonal is 9e4
        loss = (sim.float() / 1e5).pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
