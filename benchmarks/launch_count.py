"""How a recorded step is measured on the GPU: statistics launches (``batch_stats`` calls) per step,
tensors and MiB per launch, allocator look-ups, the batch budget and the peak it grows under
(BERT-base of ``overhead_gpu.py``, fp16 AMP, every=1).

Run:  python benchmarks/launch_count.py [--regimes 32x128,128x512]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead_gpu import build  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor import rows as rows_mod  # noqa: E402
from ampdoctor import stats as _stats  # noqa: E402


def count(batch: int, seq: int, steps: int) -> None:
    model, step, _ = build(batch, seq)
    for _ in range(2):
        step()
    w = ampdoctor.watch(model, every=1, trace=os.path.join(tempfile.mkdtemp(), "t.sqlite"))
    for _ in range(3):
        step()
    calls: list[tuple[int, int]] = []
    looks = [0]
    batch_stats, allocated = _stats.batch_stats, rows_mod._allocated

    def counting(ts, fmt):
        calls.append((len(ts), sum(t.numel() * t.element_size() for t in ts)))
        return batch_stats(ts, fmt)

    def counting_allocated(dev):
        looks[0] += 1
        return allocated(dev)

    _stats.batch_stats, rows_mod._allocated = counting, counting_allocated
    try:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    finally:
        _stats.batch_stats, rows_mod._allocated = batch_stats, allocated
    pol = w.session._row_policy
    one = calls[: len(calls) // steps]
    print(f"B={batch} T={seq}: {len(calls) / steps:.1f} launches/step, {looks[0] / steps:.1f} allocator "
          f"look-ups/step, budget {pol.budget / 2**20:.0f} MiB, first recorded step's peak "
          f"{max(pol.peaks.values()) / 2**20:.0f} MiB, keys measured at once {len(pol.volatile)}")
    print(f"  tensors per launch: {[n for n, _ in one]}")
    print(f"  MiB per launch: {[round(b / 2**20) for _, b in one]}")
    w.remove()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--regimes", default="32x128,128x512")
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    for regime in a.regimes.split(","):
        batch, seq = (int(v) for v in regime.split("x"))
        count(batch, seq, a.steps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
