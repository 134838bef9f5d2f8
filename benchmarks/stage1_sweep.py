"""The statistics kernel's launch shape (threads per block, chunk length) against one read of the
same bytes (``amax``), on B=128 T=512-sized tensors. CUDA events around 10 calls in a row (the GPU,
not the host, bounds them), median of 20.

Run:  python benchmarks/stage1_sweep.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import cuda_ms_per_call  # noqa: E402

from ampdoctor import _stats_nvrtc, get_format, stats_cuda  # noqa: E402


def main() -> None:
    fmt = get_format("fp16")
    cases = {
        "201M fp16": [torch.randn(128 * 512 * 3072, device="cuda").half()],
        "201M fp16 half zeros": [torch.randn(128 * 512 * 3072, device="cuda").half().relu()],
        "50M fp32": [torch.randn(128 * 512 * 768, device="cuda")],
    }
    print("| NT | min chunk | " + " | ".join(f"{k} ms (GB/s)" for k in cases) + " |")
    print("|---|---|" + "---|" * len(cases))
    row = []
    for ts in cases.values():
        nb = sum(t.numel() * t.element_size() for t in ts)
        ms = cuda_ms_per_call(lambda ts=ts: [t.amax() for t in ts], n=20)
        row.append(f"{ms:.3f} ({nb / ms / 1e6:.0f})")
    print("| amax | - | " + " | ".join(row) + " |", flush=True)
    saved = _stats_nvrtc.NT, _stats_nvrtc.MIN_CHUNK
    for nt in (128, 256):
        for chunk in (1 << 15, 1 << 16, 1 << 17, 1 << 18):
            _stats_nvrtc.NT, _stats_nvrtc.MIN_CHUNK = nt, chunk
            _stats_nvrtc.defines.cache_clear()
            _stats_nvrtc._cache.clear()
            row = []
            for ts in cases.values():
                nb = sum(t.numel() * t.element_size() for t in ts)
                try:
                    ms = cuda_ms_per_call(lambda ts=ts: stats_cuda.fused_batch_stats(ts, fmt), n=20)
                except RuntimeError as e:  # 256 threads: the per-lane histograms exceed 48 KB
                    row.append(f"does not build ({str(e).strip().splitlines()[-1][:60]})")
                    continue
                row.append(f"{ms:.3f} ({nb / ms / 1e6:.0f})")
            print(f"| {nt} | {chunk >> 10}K | " + " | ".join(row) + " |", flush=True)
    _stats_nvrtc.NT, _stats_nvrtc.MIN_CHUNK = saved
    _stats_nvrtc.defines.cache_clear()
    _stats_nvrtc._cache.clear()


if __name__ == "__main__":
    main()
