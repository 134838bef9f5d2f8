"""Where the GPU waits in a step: BERT-base of ``overhead_gpu.py`` (fp16 AMP, AdamW) under a
CUDA-only profiler, for the baseline, ``watch(every=1)`` and the ``measure-only`` reference.
Per configuration: wall ms/step, GPU busy ms/step (the union of kernel and copy intervals), the
idle time, and the largest idle gaps with the kernels on either side (which phase of the step the
host kept the GPU waiting in).

Run:  python benchmarks/gpu_idle.py [--batch 128] [--seq 512] [--steps 6] [--gaps 8]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead_gpu  # noqa: E402
from _harness import measure_only, watch_config  # noqa: E402


def _intervals(prof) -> list[tuple[float, float, str]]:
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(out)


def _busy_and_gaps(iv: list[tuple[float, float, str]]):
    busy, gaps = 0.0, []
    cur_s, cur_e, cur_n = iv[0]
    for s, e, n in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_n, n))
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
        cur_n = n if e >= cur_e else cur_n
    busy += cur_e - cur_s
    return busy, gaps


def measure(step, cfg, steps: int, ngaps: int) -> str:
    td = cfg.setup() if cfg.setup else None
    try:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / steps * 1e3
        iv = _intervals(prof)
    finally:
        if td:
            td()
    busy, gaps = _busy_and_gaps(iv)
    busy_ms = busy / steps / 1e3
    span_ms = (iv[-1][1] - iv[0][0]) / steps / 1e3
    by_pair: dict = collections.defaultdict(float)
    for g, a, b in gaps:
        by_pair[(a[:48], b[:48])] += g
    lines = [f"| {cfg.name} | {wall:.2f} | {busy_ms:.2f} | {span_ms - busy_ms:.2f} | {len(gaps) / steps:.0f} |"]
    top = sorted(by_pair.items(), key=lambda kv: -kv[1])[:ngaps]
    detail = "\n".join(f"    {v / steps / 1e3:7.3f} ms/step  after {a!r} before {b!r}" for (a, b), v in top)
    return "\n".join(lines) + "\n" + detail


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--gaps", type=int, default=8)
    a = p.parse_args()
    model, step, desc = overhead_gpu.build(a.batch, a.seq)
    print(f"B={a.batch} T={a.seq}: {desc}; torch {torch.__version__}, {torch.cuda.get_device_name()}")
    configs = [overhead_gpu.Config("baseline"), watch_config("ampdoctor every=1", model, 1),
               measure_only(model, step.opt)]
    tempfile.tempdir = tempfile.mkdtemp()
    print("| config | wall ms/step (profiled) | GPU busy ms/step | GPU idle ms/step | idle gaps/step |")
    print("|---|---|---|---|---|")
    for cfg in configs:
        print(measure(step, cfg, a.steps, a.gaps))


if __name__ == "__main__":
    main()
