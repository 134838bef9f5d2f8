"""Small real models and a training loop shared by the tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

ROOT = Path(__file__).parent.parent


@contextlib.contextmanager
def bisect_until_trial(script: Path, marker: Path, out: Path, json_path: Path, env: dict,
                       wait: float = 60) -> Iterator[tuple[subprocess.Popen, int]]:
    """``ampdoctor bisect --out OUT --json JSON SCRIPT -- MARKER`` in a process group of its own (as a
    shell's foreground job, SIGINT at its default: a test runner may ignore it), until a trial of it
    writes its pid to ``marker``: yields the bisect process and that pid. Both groups are killed on the
    way out."""
    p = subprocess.Popen([sys.executable, "-m", "ampdoctor", "bisect", "--out", out, "--json", json_path,
                          script, "--", marker], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    trial = None
    try:
        deadline = time.monotonic() + wait
        while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), p.communicate(timeout=30)
        trial = int(marker.read_text())
        yield p, trial
    finally:
        for pgid in (p.pid, trial):
            if pgid is not None:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        p.wait(timeout=30)


class Attn(nn.Module):
    """Hand-written attention whose own forward does the q @ k^T that overflows (no 1/sqrt(d))."""

    def __init__(self, d: int, gain: float = 1.0):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.gain = gain

    def forward(self, x):
        q, k = self.q(x) * self.gain, self.k(x) * self.gain
        logits = q @ k.transpose(-2, -1)
        return torch.softmax(logits.float(), -1).to(x.dtype) @ self.v(x)


class SquareNorm(nn.Module):
    """A hand-written layer norm: x * x overflows in fp16 although its input is finite (inf - inf = NaN)."""

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var + 1e-5)


def train(model, steps=3, *, scaler=True, make_x=None, lr=1e-3, autocast=True, loss_fn=None):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    losses = []
    for i in range(steps):
        x = make_x(i) if make_x else torch.randn(4, 8)
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            out = model(x)
            if loss_fn is not None:
                loss = loss_fn(out)
            else:
                loss = (out if isinstance(out, torch.Tensor) else out[0]).float().pow(2).mean()
        if sc is not None:
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class SoftCube(torch.autograd.Function):
    """A custom op whose backward overflows fp16 (``3 * x * x`` before the ``1e-6``, for |x| > 148); its forward
    is in range."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x * 0.01) ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        y = 3 * x * x  # BACKWARD LINE
        return g * y * 1e-6
