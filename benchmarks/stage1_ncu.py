"""The statistics kernel on one 201M-element fp16 tensor (a B=128 T=512 FFN activation), five times:
a target for Nsight Compute.

Run:  ncu --clock-control none --kernel-name stage1 --launch-skip 3 --launch-count 1 \\
          --section SpeedOfLight --section Occupancy --section ComputeWorkloadAnalysis \\
          python benchmarks/stage1_ncu.py [--dtype float16|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ampdoctor import get_format, stats_cuda  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float16")
    p.add_argument("--numel", type=int, default=128 * 512 * 3072)
    args = p.parse_args()
    x = torch.randn(args.numel, device="cuda").to(getattr(torch, args.dtype))
    for _ in range(5):
        stats_cuda.fused_batch_stats([x], get_format("fp16"))
    torch.cuda.synchronize()
    print("backend:", stats_cuda.backend())


if __name__ == "__main__":
    main()
