"""Host time of one statistics launch on CUDA (``fused_batch_stats``) and of its parts, as a B=32 T=128
batch sees them: what a flush costs the host, whatever the GPU does.

Run:  python benchmarks/flush_host.py
"""

from __future__ import annotations

import statistics
import time

import torch

from ampdoctor import _stats_nvrtc, rows, stats_cuda
from ampdoctor.formats import get_format


def host_us(fn, n: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if i % 20 == 19:
            torch.cuda.synchronize()
    return statistics.median(out) * 1e6


def main() -> None:
    fmt = get_format("fp16")
    stats_cuda.install()
    dev = torch.device("cuda")
    ts = []
    for i in range(60):  # fp16 H=768 and FFN activations, fp32 LayerNorm outputs
        shape = (32 * 128, 3072 if i % 4 == 2 else 768)
        ts.append(torch.randn(shape, device=dev) if i % 4 == 3 else torch.randn(shape, device=dev).half())
    stream = _stats_nvrtc.raw_stream(dev)
    k2 = _stats_nvrtc._kernel("stage2", torch.float16, fmt, dev)
    acc = _stats_nvrtc._accumulators(dev, stream, _stats_nvrtc.hist_width(fmt) + 4)
    out = torch.empty((60, 80), dtype=torch.float64, device=dev)
    table = _stats_nvrtc._Table.from_buffer(_stats_nvrtc.tables([0], [ts[0].data_ptr()], [0], [0])[0])
    cases = {
        "fused_batch_stats, 60 tensors": lambda: stats_cuda.fused_batch_stats(ts, fmt),
        "fused_batch_stats, 8 tensors": lambda: stats_cuda.fused_batch_stats(ts[:8], fmt),
        "fused_batch_stats, 1 tensor": lambda: stats_cuda.fused_batch_stats(ts[:1], fmt),
        "launch tables for 60 tensors (numpy)": lambda: _stats_nvrtc.tables(
            [t.numel() for t in ts], [t.data_ptr() for t in ts], list(range(60)), [0] * 60),
        "one kernel launch through ctypes": lambda: k2(1, _stats_nvrtc.NT2, (table, 0, acc, out, 80), stream),
        "one torch kernel launch (add_)": lambda: ts[0].add_(0),
        "dtype/numel/data_ptr/is_contiguous of 60 tensors": lambda: [
            (t.dtype, t.numel(), t.data_ptr(), t.is_contiguous()) for t in ts],
        "torch.cuda.current_stream": lambda: torch.cuda.current_stream(dev),
        "_stats_nvrtc.raw_stream (its handle)": lambda: _stats_nvrtc.raw_stream(dev),
        "torch.empty (the rows)": lambda: torch.empty((60, 80), dtype=torch.float64, device=dev),
        "rows._allocated (raw allocator counters)": lambda: rows._allocated(dev),
        "torch.cuda.memory_allocated": lambda: torch.cuda.memory_allocated(dev),
    }
    print("| what | host us (median of 200) |\n|---|---|")
    for name, fn in cases.items():
        print(f"| {name} | {host_us(fn):.1f} |")


if __name__ == "__main__":
    main()
