"""The statistics kernel's variants on the input kinds a B=128 T=512 BERT step reads, one process:
the kernel source of an older revision (``--old REV``) against this tree's with the next-vector
prefetch (``PREFETCH``) and the bin table (``BIN_LUT``) on and off. CUDA events around 10 calls in
a row of a plan built once (GPU time, not the host's), variants interleaved round by round,
medians; every variant's rows are checked equal to the torch path's.

Run:  python benchmarks/stage1_ab.py [--old REV|FILE.cu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import cuda_ms_per_call  # noqa: E402

from ampdoctor import _stats_nvrtc, get_format, stats, stats_cuda  # noqa: E402


def cases() -> dict[str, list[torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 128 * 512 * 768

    def rn(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    bert_w = []
    for _ in range(12):
        bert_w += [rn(768, 768, scale=0.02) for _ in range(4)] + [rn(3072, 768, scale=0.02), rn(768, 3072, scale=0.02)]
        bert_w += [rn(768) for _ in range(4)] + [rn(3072)]
    return {
        "50M fp32 LN-like": [rn(n)],
        "50M fp32 grad-like": [rn(n, scale=1e-3) * (torch.rand(n, device="cuda", generator=g) > 0.1)],
        "201M fp16": [rn(4 * n, dtype=torch.float16)],
        "50M bf16": [rn(n, dtype=torch.bfloat16)],
        "BERT weights fp32": bert_w,
    }


def variants(old_rev: str | None) -> dict[str, tuple[Path | None, dict]]:
    v: dict[str, tuple[Path | None, dict]] = {}
    if old_rev and Path(old_rev).is_file():  # a copy of the source (a machine without the history)
        v[f"old ({Path(old_rev).name})"] = (Path(old_rev), {})
    elif old_rev:
        src = subprocess.run(["git", "show", f"{old_rev}:ampdoctor/_stats_cuda_kernel.cu"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
        p = Path(tempfile.mkdtemp(prefix="ampdoctor-k-")) / "old.cu"
        p.write_text(src)
        v[f"{old_rev[:7]}"] = (p, {})
    for pf in (0, 1):
        for lut in (0, 1):
            v[f"PREFETCH={pf} BIN_LUT={lut}"] = (None, {"PREFETCH": pf, "BIN_LUT": lut})
    return v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default=None, help="a git revision (or a .cu file) whose kernel source runs as the first variant")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    fmt = get_format("fp16")
    cs = cases()
    ref = {k: torch.stack([stats.tensor_stats(t, fmt) for t in ts]) for k, ts in cs.items()}
    base_src, base_def = _stats_nvrtc.SOURCE, _stats_nvrtc.defines
    plans: dict[str, dict[str, dict]] = {}  # variant -> case -> planned_rows memo (its kernels)
    bad: set[tuple[str, str]] = set()
    vs = variants(a.old)
    for name, (src, over) in vs.items():
        _stats_nvrtc.SOURCE = src or base_src

        def defs(dtype, f, over=over, src=src):
            d = dict(base_def(dtype, f))
            if src is None:
                # BIN_LUT only where the tree allows it (bin codes that fit a byte)
                d.update({k: (v and d.get(k, 0)) if k == "BIN_LUT" else v for k, v in over.items()})
            return d

        _stats_nvrtc.defines = defs
        _stats_nvrtc._cache.clear()
        plans[name] = {}
        for k, ts in cs.items():
            got = stats_cuda.fused_batch_stats(ts, fmt)
            memo: dict = {}
            again = stats_cuda.planned_rows(ts, fmt, None, memo)
            if got is None or again is None or not (torch.equal(got, ref[k]) and torch.equal(again, ref[k])):
                bad.add((name, k))
            plans[name][k] = memo
    _stats_nvrtc.SOURCE, _stats_nvrtc.defines = base_src, base_def
    _stats_nvrtc._cache.clear()
    # the launches of a plan built once (as the recorder replays a step's weights): GPU time, not
    # the host's table building; variants interleaved round by round, medians
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(a.rounds):
        order = list(vs)[r % len(vs):] + list(vs)[:r % len(vs)]
        for name in order:
            for k, ts in cs.items():
                memo = plans[name][k]
                times.setdefault((name, k), []).append(
                    cuda_ms_per_call(lambda ts=ts, memo=memo: stats_cuda.planned_rows(ts, fmt, None, memo), n=10))
    amax = {k: cuda_ms_per_call(lambda ts=ts: [t.amax() for t in ts], n=20) for k, ts in cs.items()}
    print(f"median of {a.rounds} interleaved rounds, each the median of 10 x 10 launches; ms (GB/s)")
    print("| variant | " + " | ".join(cs) + " |")
    print("|---|" + "---|" * len(cs))
    for name in vs:
        row = []
        for k, ts in cs.items():
            nb = sum(t.numel() * t.element_size() for t in ts)
            ms = statistics.median(times[(name, k)])
            row.append(f"{ms:.4f} ({nb / ms / 1e6:.0f})" + (" ROWS DIFFER" if (name, k) in bad else ""))
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)
    row = [f"{amax[k]:.4f} ({sum(t.numel() * t.element_size() for t in ts) / amax[k] / 1e6:.0f})" for k, ts in cs.items()]
    print("| amax (one read, one launch a tensor) | " + " | ".join(row) + " |")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
