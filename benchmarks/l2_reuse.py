"""Does measuring a tensor right after the op that wrote it (part of it still in the L2 cache) cost
less GPU time than measuring it later, once evicted? A GEMM writes a B=128 T=512 activation (H=768:
101 MB, FFN 3072: 403 MB, fp16); then the statistics kernel (stage 1) or one ``amax`` reads it, either
at once or after a 2 GiB copy that evicts the L2. Kernel times from the profiler, medians of 20.

Run:  python benchmarks/l2_reuse.py
"""

from __future__ import annotations

import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from ampdoctor import stats_cuda
from ampdoctor.formats import get_format


def main() -> None:
    fmt = get_format("fp16")
    stats_cuda.install()
    n = 128 * 512
    a = torch.randn(n, 768, device="cuda", dtype=torch.half) * 0.1
    big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    readers = {"stats kernel": lambda y: stats_cuda.fused_batch_stats([y], fmt), "amax": lambda y: y.amax()}
    print("| activation | reader | right after the GEMM, us | after evicting the L2, us |\n|---|---|---|---|")
    for width in (768, 3072):
        w = torch.randn(768, width, device="cuda", dtype=torch.half) * 0.03
        y = a @ w
        for rname, read in readers.items():
            got = []
            for evict in (False, True):
                def rounds(k: int, w=w, y=y, read=read, evict=evict) -> None:
                    for _ in range(k):
                        torch.matmul(a, w, out=y)
                        if evict:
                            big2.copy_(big)
                        read(y)
                    torch.cuda.synchronize()

                rounds(3)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    rounds(20)
                times = [e.device_time for e in prof.events() if e.device_type.name == "CUDA"
                         and ("stage1" in e.name or "reduce_kernel" in e.name)]
                got.append(statistics.median(times))
            print(f"| {n * width * 2 / 1e6:.0f} MB fp16 | {rname} | {got[0]:.1f} | {got[1]:.1f} |")


if __name__ == "__main__":
    main()
