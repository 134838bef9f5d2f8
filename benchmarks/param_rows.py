"""Host time of the weights' rows at the step boundary, with and without the kept launch plan
(``StepRows.add_now(..., memo)``, :func:`ampdoctor.stats_cuda.planned_rows`), in one process, on
the parameters of BERT-base (``overhead_gpu.py``'s model): the rows are checked equal, then each
form is timed in alternating rounds (host time per call; the GPU is synchronised outside the
timed calls).

Run:  python benchmarks/param_rows.py [--calls 200] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead_gpu  # noqa: E402

from ampdoctor import stats  # noqa: E402
from ampdoctor.formats import get_format  # noqa: E402
from ampdoctor.rows import RowPolicy, StepRows  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    model, _, desc = overhead_gpu.build(32, 128)
    ts = [q.detach() for q in model.parameters()]
    fmt = get_format("fp16")
    pol = RowPolicy(fmt)
    pol.calibrated = True
    metas = [(0, "weight", str(i), 0, "float32", t.numel(), 4 * t.numel()) for i, t in enumerate(ts)]
    memo: dict = {}

    def rows_of(m):
        r = StepRows(pol)
        r.add_now(metas, ts, m)
        return r

    a_rows, b_rows = rows_of(memo), rows_of(None)
    assert torch.equal(a_rows.blocks[0][0], b_rows.blocks[0][0]) and "plan" in memo
    assert torch.equal(a_rows.blocks[0][0], torch.stack([stats.tensor_stats(t, fmt) for t in ts]))
    times: dict[str, list[float]] = {"planned": [], "batch": []}
    for _ in range(a.rounds):
        for name, m in (("planned", memo), ("batch", None)):
            total = 0.0
            for i in range(a.calls):
                if i % 20 == 0:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                rows_of(m)
                total += time.perf_counter() - t0
            times[name].append(total / a.calls * 1e6)
    print(f"# {desc}: {len(ts)} parameters; torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| weights' rows (StepRows.add_now) | us/call, median of rounds | min..max |\n|---|---|---|")
    for k, v in times.items():
        print(f"| {k} | {statistics.median(v):.0f} | {min(v):.0f}..{max(v):.0f} |")


if __name__ == "__main__":
    main()
