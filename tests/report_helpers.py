"""Small traces for the report tests: a real watched model, or a synthetic trace written directly."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

import ampdoctor
from ampdoctor.formats import get_format
from ampdoctor.trace import TraceWriter, hist_blob

ODD_NAME = "<script>alert('x')</script>"


class Overflowing(nn.Module):
    """An MLP whose middle Linear overflows fp16 after a few steps; one child has an HTML-hostile name."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.add_module(ODD_NAME, nn.ReLU())
        self.mid = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 1)
        nn.init.normal_(self.mid.weight, std=40.0)

    def forward(self, x):
        h = getattr(self, ODD_NAME)(self.inp(x))
        return self.out(self.norm(self.mid(h)))


def overflow_trace(path: Path, steps: int = 8) -> Path:
    """Train :class:`Overflowing` under fp16 autocast + GradScaler with a growing input until its
    ``mid`` overflows; returns the trace path."""
    torch.manual_seed(0)
    model = Overflowing()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, trace=str(path)):
        for i in range(steps):
            x = torch.randn(16, 8) * (1.0 + 40.0 * i)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return path


def fp32_trace(path: Path, fmt: str, gain: float, steps: int = 3) -> Path:
    """An FP32 run (no autocast) whose second Linear's output reaches about ``gain``, measured against ``fmt``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with torch.no_grad():
        model[1].weight.fill_(gain / 8.0)
        model[1].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ampdoctor.watch(model, trace=str(path), format=fmt):
        for _ in range(steps):
            x = torch.ones(4, 8)
            with torch.no_grad():
                model[0].weight.copy_(torch.eye(8))
                model[0].bias.zero_()
            loss = model(x).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return path


def synthetic_trace(path: Path, *, grad_exps: Sequence[tuple[int, int]], scales: Sequence[float | None],
                    skipped: Sequence[int] | None = None, fmt: str = "fp16", dtype: str = "float16",
                    losses: Sequence[float] | None = None, grad_nan: int = 0, grad_inf: int = 0) -> Path:
    """A trace written directly: one Linear, one activation row per step, and gradient rows whose
    exponent histogram holds ``count`` values in binade ``exp`` for each ``(exp, count)`` (as
    recorded, i.e. already scaled), one step per entry of ``scales`` (the scale after update).
    ``grad_nan``/``grad_inf``: NaN and +Inf values of each gradient row, besides those."""
    f = get_format(fmt)
    w = TraceWriter(path)
    w.set_meta(format=f.name, every=1, status="finished", argv=["synthetic"])
    w.add_layers([(0, "lin", "Linear", 0, 1, None)])
    for step, scale in enumerate(scales):
        hist = np.zeros(f.n_bins, dtype=np.int64)
        total = 0
        top = -1000
        for e, c in grad_exps:
            hist[e - f.min_exp + 1] += c
            total += c
            top = max(top, e)
        absmax = 2.0 ** top * 1.5
        act = np.zeros(f.n_bins, dtype=np.int64)
        act[0 - f.min_exp + 1] = 10
        w.add_stats([(step, 0, "activation", "out", 0, dtype, 10, 20, 0, 0, 0, 0, -1.5, 1.5, 1.5, 1.0, 0, 0, 0,
                      hist_blob(act)),
                     (step, 0, "gradient", "out", 0, dtype, total + grad_nan + grad_inf, 2 * (total + grad_nan + grad_inf),
                      grad_nan, grad_inf, 0, 0, -absmax, absmax, absmax,
                      2.0 ** min(e for e, _ in grad_exps), 0, 0, 0, hist_blob(hist))])
        loss = 1.0 if losses is None else losses[step]
        skip = None if scale is None else (0 if skipped is None else skipped[step])
        w.add_step((step, loss, scale, skip, step + 1, 1, float(step)))
        w.commit()
    w.close()
    return path
