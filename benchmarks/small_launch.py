"""Short chunks for launches of few blocks (``_stats_nvrtc.table_chunk``): the statistics kernel's GPU
time on a step's weights (BERT-base's parameters, fp32) and on larger batches, with the shorter
chunks off (every launch at 64K-element chunks) and on at several settings. GPU time is the sum of
the ``stage1``/``stage2`` kernels' durations in a CUDA-only profiler trace (host launch time left
out), per call, median of the calls. Every setting's rows are checked equal to the unchanged
chunking's.

Run:  python benchmarks/small_launch.py [--calls 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead_gpu  # noqa: E402

from ampdoctor import _stats_nvrtc as nv  # noqa: E402
from ampdoctor import get_format, stats_cuda  # noqa: E402


def gpu_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    per_call = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    ks = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.name in ("stage1", "stage2"))
    per = len(ks) // calls
    for i in range(calls):
        per_call.append(sum(e - s for s, e in ks[i * per:(i + 1) * per]))
    return statistics.median(per_call)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=20)
    a = p.parse_args()
    stats_cuda.install()
    fmt = get_format("fp16")
    model, _, desc = overhead_gpu.build(2, 8)
    weights = [q.detach() for q in model.parameters()]
    grads = [torch.randn_like(w) * 1e-3 for w in weights]
    n_tok, d, f = 128 * 512, 768, 3072
    h = lambda k: torch.randn(k, device="cuda").half()  # noqa: E731
    layer = [h(n_tok * d) for _ in range(5)] + [h(n_tok * f), h(n_tok * f).relu()] + [h(n_tok * d) for _ in range(2)]
    layer += [torch.randn(n_tok * d, device="cuda") for _ in range(2)]
    small_layer = [h(32 * 128 * d) for _ in range(7)] + [h(32 * 128 * f) for _ in range(2)]  # B=32 T=128
    cases = {
        f"weights ({len(weights)} fp32 tensors, {desc.split(',')[0]})": weights,
        "weight gradients (the same shapes)": grads,
        "50M fp32 (a LayerNorm output at B=128 T=512)": [torch.randn(n_tok * d, device="cuda")],
        "one layer's outputs at B=128 T=512 (9 fp16 + 2 fp32)": layer,
        "one layer's outputs at B=32 T=128 (9 fp16)": small_layer,
    }
    settings = [("off (64K chunks)", 0, nv.SMALL_CHUNK), ("1024 blocks, >= 4K", 1024, 4096),
                ("2048 blocks, >= 4K", 2048, 4096), ("1024 blocks, >= 16K", 1024, 16384)]
    saved = nv.FEW_BLOCKS, nv.SMALL_CHUNK
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; GPU us per call (GB/s)")
    print("| tensors | MB | " + " | ".join(s[0] for s in settings) + " |")
    print("|---|---|" + "---|" * len(settings))
    try:
        for name, ts in cases.items():
            nb = sum(t.numel() * t.element_size() for t in ts)
            cols, ref = [], None
            for _, few, small in settings:
                nv.FEW_BLOCKS, nv.SMALL_CHUNK = few, small
                rows = stats_cuda.fused_batch_stats(ts, fmt)
                torch.cuda.synchronize()
                if ref is None:
                    ref = rows.cpu()
                elif not torch.equal(rows.cpu().nan_to_num(-7.0), ref.nan_to_num(-7.0)):
                    raise SystemExit(f"{name}: rows differ with FEW_BLOCKS={few}, SMALL_CHUNK={small}")
                us = gpu_us(lambda ts=ts: stats_cuda.fused_batch_stats(ts, fmt), a.calls)
                cols.append(f"{us:.1f} ({nb / us / 1e3:.0f})")
            print(f"| {name} | {nb / 1e6:.1f} | " + " | ".join(cols) + " |", flush=True)
    finally:
        nv.FEW_BLOCKS, nv.SMALL_CHUNK = saved


if __name__ == "__main__":
    main()
