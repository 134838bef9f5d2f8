"""Python-level calls per recorded step, CPU: a count that does not depend on how busy the machine
is. The encoder of ``host_overhead.py`` (d=32, 12 blocks, B=2, T=8, fp32, AdamW) with its fake
statistics backend (no tensor is read), trained with no watch, with this tree's ``watch(every=1)``
and, with ``--ab REV``, with the watch of the package at git revision REV (or a folder holding it);
cProfile's call count over ``--steps`` steps after a warm-up. Also the host time of registering a
gradient hook the way the watch does (``watch._new_hook``) against ``Tensor.register_hook``.

Run:  python benchmarks/call_count.py [--ab REV] [--steps 10]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import os
import pstats
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import import_revision  # noqa: E402
from _models import Encoder  # noqa: E402
from host_overhead import fake_backend  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor.watch import _new_hook  # noqa: E402


def calls_per_step(pkg, steps: int) -> float:
    torch.manual_seed(0)
    model = Encoder(vocab=64, d=32, layers=12, heads=2, ffn=64, n_out=2)
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 64, (2, 8))
    y = torch.randint(0, 2, (2,))

    def step():
        loss = F.cross_entropy(model(ids).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    w = None
    if pkg is not None:
        importlib.import_module(pkg.__name__ + ".stats").set_backend(fake_backend)
        w = pkg.watch(model, every=1, trace=os.path.join(tempfile.mkdtemp(), "t.sqlite"))
    try:
        for _ in range(5):
            step()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            step()
        pr.disable()
    finally:
        if w is not None:
            w.remove()
    return pstats.Stats(pr, stream=io.StringIO()).total_calls / steps


def hook_us(register, n: int = 2000, rounds: int = 20) -> float:
    x = torch.ones(4, requires_grad=True)
    best = float("inf")
    for _ in range(rounds):
        ts = [x * 2 for _ in range(n)]
        t0 = time.perf_counter()
        for t in ts:
            register(t)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ab", metavar="REV", default=None)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    torch.set_num_threads(1)
    rows = [("no watch", calls_per_step(None, a.steps)), ("every=1", calls_per_step(ampdoctor, a.steps))]
    if a.ab:
        rows.append((f"every=1 at {a.ab}", calls_per_step(import_revision(a.ab), a.steps)))
    print(f"# torch {torch.__version__}; cProfile calls per step, {a.steps} steps\n| config | calls/step |\n|---|---|")
    for name, n in rows:
        print(f"| {name} | {n:.0f} |")

    def fn(_):
        return None

    print("\n| gradient hook registration | us a call (best of 20 x 2000) |\n|---|---|")
    print(f"| Tensor.register_hook | {hook_us(lambda t: t.register_hook(fn)):.2f} |")
    print(f"| watch._new_hook | {hook_us(lambda t: _new_hook(t, fn)):.2f} |")


if __name__ == "__main__":
    main()
