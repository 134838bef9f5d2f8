"""Where the host time of GPU training under ``watch`` goes, with py-spy (CUDA machine).

``run``: trains the BERT-base of ``overhead_gpu.py`` (B x T, fp16 AMP) for SECONDS under a watch with
``--every`` (0: no watch) after a warm-up, and prints ms/step; record it with py-spy.
``summarize``: from py-spy's raw output, the shares of the training threads' samples (the main loop
and the autograd engine's thread), by function (self) and for ampdoctor's functions (inclusive).

Run:  pip install py-spy
      py-spy record -r 250 -f raw -o spy.txt -- python benchmarks/host_profile.py run --batch 32 --seq 128 --seconds 15
      python benchmarks/host_profile.py summarize spy.txt
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time


def _loop(step, seconds: float) -> int:
    n = 0
    t0 = time.time()
    while time.time() - t0 < seconds:
        step()
        n += 1
    return n


def run(args) -> None:
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from overhead_gpu import build

    import ampdoctor
    model, step, _ = build(args.batch, args.seq)
    for _ in range(3):
        step()
    w = ampdoctor.watch(model, every=args.every, trace=os.path.join(tempfile.mkdtemp(), "t.sqlite")) if args.every else None
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.time()
    n = _loop(step, args.seconds)
    torch.cuda.synchronize()
    print(f"B={args.batch} T={args.seq} every={args.every}: {(time.time() - t0) / n * 1e3:.1f} ms/step over {n} steps")
    if w:
        w.remove()


def _name(frame: str) -> str:
    func, _, where = frame.partition(" (")
    return f"{func} {where.split(':')[0]}"


def summarize(path: str, top: int, loop: str = "_loop ") -> None:
    total = 0
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        # the timed loop, or the autograd engine's thread running our hooks (its stacks start there)
        if not any(loop in f for f in frames) and "ampdoctor" not in frames[0]:
            continue
        total += int(n)
        own[_name(frames[-1])] += int(n)
        for f in {_name(f) for f in frames}:
            incl[f] += int(n)
    print(f"{total} samples of the training threads\n\n| self | function |\n|---|---|")
    for k, v in own.most_common(top):
        print(f"| {100 * v / total:.1f}% | {k} |")
    print("\n| inclusive | ampdoctor function |\n|---|---|")
    for k, v in incl.most_common():
        if "ampdoctor" in k:
            print(f"| {100 * v / total:.1f}% | {k} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--batch", type=int, default=32)
    r.add_argument("--seq", type=int, default=128)
    r.add_argument("--seconds", type=float, default=15)
    r.add_argument("--every", type=int, default=1)
    s = sub.add_parser("summarize")
    s.add_argument("raw")
    s.add_argument("--top", type=int, default=30)
    s.add_argument("--loop", default="_loop ", help="a frame of the timed loop (this script's by default)")
    a = p.parse_args()
    if a.cmd == "run":
        run(a)
    else:
        summarize(a.raw, a.top, a.loop)


if __name__ == "__main__":
    main()
