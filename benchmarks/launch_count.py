"""How a recorded step is measured on the GPU: statistics launches (``batch_stats`` calls) per step,
tensors and MiB per launch, allocator look-ups, the batch budget and the peak it grows under, and
the bytes measured for statistics rows against those measured only for a first-non-finite flag
(a tensor no recorded row concerns: a module input that no module outputs, or its gradient)
(BERT-base of ``overhead_gpu.py``, fp16 AMP, every=1). Works on the CPU too (``--device cpu``: the
small encoder of ``_models.py``, launches are the torch path's batches).

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
    new_slot, add_now, finish = rows_mod.StepRows._new_slot, rows_mod.StepRows.add_now, rows_mod.StepRows.finish
    sizes: dict[int, dict[int, int]] = {}  # id(StepRows) -> slot -> bytes (slots made in hooks)
    split = [0, 0, 0]  # bytes a step: rows of hooked tensors, rows of weights/weight gradients, flags alone

    def counting_new_slot(self, t, key, nbytes=None):
        slot = new_slot(self, t, key, nbytes)
        sizes.setdefault(id(self), {})[slot] = t.numel() * t.element_size()
        return slot

    def counting_add_now(self, metas, tensors):
        split[1] += sum(t.numel() * t.element_size() for t in tensors)
        return add_now(self, metas, tensors)

    def counting_finish(self):
        rows = set(self.slots)
        for slot, b in sizes.pop(id(self), {}).items():
            split[0 if slot in rows else 2] += b
        return finish(self)

    def counting(ts, fmt):
        calls.append((len(ts), sum(t.numel() * t.element_size() for t in ts)))
        return batch_stats(ts, fmt)

    def counting_allocated(dev):
        looks[0] += 1
        return allocated(dev)

    _stats.batch_stats, rows_mod._allocated = counting, counting_allocated
    cls = rows_mod.StepRows
    cls._new_slot, cls.add_now, cls.finish = counting_new_slot, counting_add_now, counting_finish
    try:
        for _ in range(steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        _stats.batch_stats, rows_mod._allocated = batch_stats, allocated
        cls._new_slot, cls.add_now, cls.finish = new_slot, add_now, finish
    pol = w.session._row_policy
    one = calls[: len(calls) // steps]
    print(f"B={batch} T={seq}: {len(calls) / steps:.1f} launches/step, {looks[0] / steps:.1f} allocator "
          f"look-ups/step, budget {pol.budget / 2**20:.0f} MiB, first recorded step's peak "
          f"{max(pol.peaks.values(), default=0) / 2**20:.0f} MiB, keys measured at once {len(pol.volatile)}")
    print(f"  tensors per launch: {[n for n, _ in one]}")
    print(f"  MiB per launch: {[round(b / 2**20) for _, b in one]}")
    rows_b, params_b, flags_b = (v / steps / 2**20 for v in split)
    total = rows_b + params_b + flags_b
    print(f"  MiB measured a step: {total:.0f}: rows of activations and their gradients {rows_b:.0f}, weights and "
          f"weight gradients {params_b:.0f}, first-non-finite flags alone {flags_b:.0f} ({100 * flags_b / total:.1f}%)")
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
