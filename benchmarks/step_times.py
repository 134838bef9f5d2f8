"""Wall time of each step of GPU training (BERT-base of ``overhead_gpu.py``, fp16 AMP) under a watch
with ``--every N``, next to the baseline: where the cost of ``every=N`` lands (the recorded steps, the
step after each, the others) in steady state, past the first recorded step (calibration, and the
kernels' compilation in the first repetition). Repetitions alternate baseline and watch.

Run:  python benchmarks/step_times.py [--batch 32 --seq 128 --every 10 --steps 60 --reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead_gpu import build  # noqa: E402

import ampdoctor  # noqa: E402


def run(step, model, n: int, every: int | None) -> list[float]:
    w = ampdoctor.watch(model, every=every, trace=os.path.join(tempfile.mkdtemp(), "t.sqlite")) if every else None
    times = []
    t = time.perf_counter()
    for _ in range(n):
        step()
        now = time.perf_counter()
        times.append((now - t) * 1e3)
        t = now
    torch.cuda.synchronize()
    if w:
        w.remove()
    torch.cuda.synchronize()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    model, step, desc = build(a.batch, a.seq)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    base, watched = [], []
    for _ in range(a.reps):
        base.append(run(step, model, a.steps, None))
        watched.append(run(step, model, a.steps, a.every))
    e, skip = a.every, 2 * a.every
    print(f"# B={a.batch} T={a.seq}, {desc}; every={e}, {a.steps} steps x {a.reps} repetitions")
    print(f"first {e + 3} steps under the watch (ms), each repetition:")
    for r in watched:
        print("   " + " ".join(f"{x:6.1f}" for x in r[:e + 3]))
    print(f"\nsteady state (steps {skip}..{a.steps - 1}), ms/step, per repetition:")
    print("| | " + " | ".join(f"rep {i + 1}" for i in range(a.reps)) + " |")
    print("|---|" + "---|" * a.reps)
    rows = {
        "baseline": [statistics.mean(r[skip:]) for r in base],
        f"every={e}": [statistics.mean(r[skip:]) for r in watched],
        "recorded steps": [statistics.mean(r[i] for i in range(skip, a.steps) if i % e == 0) for r in watched],
        "the step after": [statistics.mean(r[i] for i in range(skip, a.steps) if i % e == 1 % e) for r in watched],
        "the others": [statistics.mean(r[i] for i in range(skip, a.steps) if i % e not in (0, 1 % e)) or float("nan")
                       for r in watched] if e > 2 else None,
    }
    for k, v in rows.items():
        if v is not None:
            print(f"| {k} | " + " | ".join(f"{x:.1f}" for x in v) + " |")
    print(f"| every={e} / baseline | " + " | ".join(f"{y / x:.3f}x" for x, y in zip(rows["baseline"], rows[f"every={e}"])) + " |")


if __name__ == "__main__":
    main()
