"""Per-module-call cost of the watch's hooks, CPU: a stack of ``--layers`` ``nn.Linear(8, 8)``
(B=2), one torch thread, the fake statistics backend of ``host_overhead.py`` (no tensor is read).
Forward and backward host time per module call, median over ``--rounds`` passes, for no hooks,
the ``hooks-only`` reference (a no-op pre-hook, and a forward hook appending the output and a
tensor hook appending its gradient), ``watch`` (every step recorded) and, with ``--ab REV``, the
watch of the package at git revision REV, in the same process. Repeats ``--repeat`` times,
interleaved.

Run:  python benchmarks/hook_micro.py [--ab REV] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import import_revision  # noqa: E402
from host_overhead import fake_backend  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor import stats as _stats  # noqa: E402


def measure(model, x, rounds: int, after=lambda: None) -> tuple[float, float]:
    """(forward, backward) us per module call, medians over ``rounds`` passes."""
    n = len(model)
    fwd, bwd = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        y = model(x)
        t1 = time.perf_counter()
        loss = y.sum()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        after()
        fwd.append(t1 - t0)
        bwd.append(t3 - t2)
    return statistics.median(fwd) / n * 1e6, statistics.median(bwd) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=100)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ab", metavar="REV", default=None, help="also the watch of the package at git revision REV")
    args = p.parse_args()
    torch.set_num_threads(1)
    _stats.set_backend(fake_backend)
    pkgs = {"watch": ampdoctor}
    if args.ab:
        old = import_revision(args.ab)
        old.stats.set_backend(fake_backend)
        pkgs[f"watch at {args.ab}"] = old
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(args.layers)])
    x = torch.randn(2, 8, requires_grad=True)
    got: dict[str, list] = {}

    def bare():
        return measure(model, x, args.rounds)

    def hooks_only():
        kept: list = []
        hs = []

        def post(m, a, o):
            kept.append(o)
            o.register_hook(kept.append)

        for m in model:
            hs.append(m.register_forward_pre_hook(lambda m, a: None))
            hs.append(m.register_forward_hook(post))
        try:
            return measure(model, x, args.rounds, kept.clear)
        finally:
            for h in hs:
                h.remove()

    def watched(pkg):
        def run():
            w = pkg.watch(model, every=1, trace=os.path.join(tempfile.mkdtemp(prefix="ampdoctor-bench-"), "t.sqlite"))
            try:
                return measure(model, x, args.rounds, w.session.end_step)
            finally:
                w.remove()
        return run

    configs = {"no hooks": bare, "hooks-only": hooks_only, **{k: watched(v) for k, v in pkgs.items()}}
    for _ in range(args.repeat):
        for name, fn in configs.items():
            got.setdefault(name, []).append(fn())
    print(f"# {args.layers} x Linear(8, 8), B=2, {args.rounds} passes, {args.repeat} repeats, torch {torch.__version__}")
    print("| config | forward us/module call | backward us/module call |")
    print("|---|---|---|")
    for name, vals in got.items():
        print(f"| {name} | " + " / ".join(f"{f:.2f}" for f, _ in vals) + " | " + " / ".join(f"{b:.2f}" for _, b in vals) + " |")


if __name__ == "__main__":
    main()
