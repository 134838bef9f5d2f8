"""How fast the statistics kernel reads against the DRAM's practical limit, on B=128 T=512-sized
tensors: the NaN/Inf flags kernel (a plain 16-byte streaming read with next to no arithmetic, gate
open) stands for that limit; ``amax`` is one torch read. Also the fp32 chunk length of the
statistics kernel (``_stats_nvrtc.MIN_CHUNK_FP32``): a 50M-element fp32 tensor (a LayerNorm output)
makes only 763 blocks of 64K elements, less than one wave at 8 blocks an SM. CUDA events around
10 calls in a row, median of 20.

Run:  python benchmarks/read_roofline.py
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
    n_tok, d, f = 128 * 512, 768, 3072
    h = lambda k: torch.randn(k, device="cuda").half()  # noqa: E731
    layer = [h(n_tok * d) for _ in range(5)] + [h(n_tok * f), h(n_tok * f).relu()] + [h(n_tok * d) for _ in range(2)]
    layer += [torch.randn(n_tok * d, device="cuda") for _ in range(2)]
    cases = {
        "201M fp16": [h(n_tok * f)],
        "50M fp32": [torch.randn(n_tok * d, device="cuda")],
        "2 x 50M fp32": [torch.randn(n_tok * d, device="cuda") for _ in range(2)],
        "one layer's outputs (9 fp16 + 2 fp32)": layer,
    }
    gate = torch.ones(1, dtype=torch.int32, device="cuda")
    print(f"# {torch.cuda.get_device_properties(0).name}, torch {torch.__version__}")
    print("| case | GB | flags kernel ms (GB/s) | amax ms (GB/s) | stats 64K fp32 chunks ms (GB/s) | stats 32K | stats 16K |")
    print("|---|---|---|---|---|---|---|")
    for name, ts in cases.items():
        nb = sum(t.numel() * t.element_size() for t in ts)
        cols = []
        for fn in (lambda ts=ts: stats_cuda.fused_nonfinite(ts, gate), lambda ts=ts: [t.amax() for t in ts]):
            ms = cuda_ms_per_call(fn, n=20)
            cols.append(f"{ms:.3f} ({nb / ms / 1e6:.0f})")
        for chunk in (1 << 16, 1 << 15, 1 << 14):
            _stats_nvrtc.MIN_CHUNK_FP32 = chunk
            ms = cuda_ms_per_call(lambda ts=ts: stats_cuda.fused_batch_stats(ts, fmt), n=20)
            cols.append(f"{ms:.3f} ({nb / ms / 1e6:.0f})")
        _stats_nvrtc.MIN_CHUNK_FP32 = _stats_nvrtc.MIN_CHUNK
        print(f"| {name} | {nb / 1e9:.2f} | " + " | ".join(cols) + " |", flush=True)


if __name__ == "__main__":
    stats_cuda.install()
    main()
