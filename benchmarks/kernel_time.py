"""Where the GPU time of a recorded step goes: BERT-base of ``overhead_gpu.py`` (fp16 AMP, AdamW)
under a CUDA-only profiler, baseline and ``watch(every=1)``.

1. Kernel time per step by kernel name, with and without the watch, and the difference: what the
   watch adds to the GPU's work, kernel by kernel.
2. The statistics launches (NVRTC ``stage1``/``stage2``, the flags kernel ``nonfinite``), matched in
   order to the launches the host made, each tagged with what it measured (forward outputs, output
   gradients, weight gradients, weights) and its bytes: GPU ms, GB and GB/s per tag, and the
   slowest launches.

Run:  python benchmarks/kernel_time.py [--batch 128] [--seq 512] [--steps 4] [--slowest 12]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead_gpu  # noqa: E402
from gpu_idle import _intervals as _kernels  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor import _stats_nvrtc as nv  # noqa: E402

_ELSIZE = {0: 2, 1: 2, 2: 4}
_tag = ["forward"]
_launches: list[tuple[str, str, int, int, int]] = []  # (kernel, tag, grid, tensors, bytes)


def _instrument() -> None:
    """Wrap the launch paths so that each launch the host makes is logged with what it reads."""
    add, packed = nv.Plan._add, nv._Kernel.launch_packed

    # id of a launch's argument buffer -> (the buffer, kernel, tensors, bytes); the buffer is kept
    # alive here, so its id is not reused by another launch's (the flags kernel packs one per call)
    what: dict[int, tuple] = {}

    def _add(self, k, grid, block, args):
        add(self, k, grid, block, args)
        t, m = list(args[0]), args[1]
        arr = self._launches[-1][3]
        if not isinstance(args[2], ctypes_void):  # stage1: (table, m, g0, g1, c0, acc)
            g0, g1 = args[2], args[3]
            what[id(arr)] = (arr, "stage1", g1 - g0, sum(t[nv.MAXT + g] * _ELSIZE[t[5 * nv.MAXT + 1 + g]] for g in range(g0, g1)))
        else:  # stage2: (table, m, acc, out, width, gate)
            what[id(arr)] = (arr, "stage2", m, 0)

    def launch_packed(self, grid, block, arr, stream):
        got = what.get(id(arr))
        if got is not None:  # (the flags kernel's launches are logged by run_flags below)
            tag = _tag[0] if torch._C._current_graph_task_id() == -1 or _tag[0] != "forward" else "backward"
            _launches.append((got[1], tag, grid, got[2], got[3]))
        return packed(self, grid, block, arr, stream)

    run_flags = nv.run_flags

    def flags(numel, ptr, kinds, gate, out):
        tag = "flags (" + ("backward" if torch._C._current_graph_task_id() != -1 else _tag[0]) + ")"
        n = len(numel)
        for lo in range(0, n, nv.FMAXT):
            hi = min(lo + nv.FMAXT, n)
            nbytes = sum(int(numel[i]) * _ELSIZE[int(kinds[i])] for i in range(lo, hi))
            if nbytes:
                _launches.append(("nonfinite", tag, 0, hi - lo, nbytes))
        return run_flags(numel, ptr, kinds, gate, out)

    nv.Plan._add = _add
    nv._Kernel.launch_packed = launch_packed
    nv.run_flags = flags

    def tagged(fn, tag):
        def inner(*a, **k):
            old, _tag[0] = _tag[0], tag
            try:
                return fn(*a, **k)
            finally:
                _tag[0] = old
        return inner

    watch_mod.Watch.record_weights = tagged(watch_mod.Watch.record_weights, "weights")
    watch_mod.Watch.record_weight_grads = tagged(watch_mod.Watch.record_weight_grads, "weight grads")


ctypes_void = nv.ctypes.c_void_p
watch_mod = sys.modules["ampdoctor.watch"]  # (ampdoctor.watch is the function)


def profile(step, steps: int) -> list[tuple[float, float, str]]:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    _launches.clear()  # (a recorded step's weights are launched where the next backward starts:
    # the first profiled ones are the last warm-up step's, those of the last profiled step come after)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return _kernels(prof)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--slowest", type=int, default=12)
    a = p.parse_args()
    model, step, desc = overhead_gpu.build(a.batch, a.seq)
    print(f"B={a.batch} T={a.seq}: {desc}; torch {torch.__version__}, {torch.cuda.get_device_name()}")
    base = profile(step, a.steps)
    _instrument()
    tempfile.tempdir = tempfile.mkdtemp()
    w = ampdoctor.watch(model, every=1, trace=os.path.join(tempfile.tempdir, "t.sqlite"))
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    watched = profile(step, a.steps)
    logged_all = list(_launches)
    w.remove()
    # the launches logged during the two warm-up steps inside profile() come first: drop them
    ours = [k for k in watched if k[2] in ("stage1", "stage2", "nonfinite")]
    # each kernel's profiled launches are the ones logged for it, in order (one stream)
    matched = []
    counts = {}
    for name in ("stage1", "stage2", "nonfinite"):
        prof_k = [k for k in ours if k[2] == name]
        log_k = [x for x in logged_all if x[0] == name]
        counts[name] = (len(prof_k), len(log_k))
        if len(log_k) == len(prof_k):
            matched += list(zip(prof_k, log_k))

    def by_name(ks):
        d: dict = collections.defaultdict(float)
        for s, e, n in ks:
            d[n[:70]] += (e - s) / 1e3 / a.steps
        return d

    b, wd = by_name(base), by_name(watched)
    print(f"\nkernel ms/step: baseline {sum(b.values()):.2f}, watch {sum(wd.values()):.2f}")
    print("| kernel | baseline ms/step | watch ms/step | difference |")
    print("|---|---|---|---|")
    for n in sorted(set(b) | set(wd), key=lambda n: -abs(wd.get(n, 0) - b.get(n, 0)))[:20]:
        print(f"| {n} | {b.get(n, 0):.3f} | {wd.get(n, 0):.3f} | {wd.get(n, 0) - b.get(n, 0):+.3f} |")
    print(f"\nstatistics launches (profiled, logged; unequal: left out): {counts}")
    per: dict = collections.defaultdict(lambda: [0.0, 0, 0, 0])
    rows = []
    for (s, e, _n), (name, tag, grid, ntens, nbytes) in matched:
        ms = (e - s) / 1e3
        r = per[(name, tag)]
        r[0] += ms / a.steps
        r[1] += nbytes / a.steps
        r[2] += 1
        r[3] += ntens
        rows.append((ms, name, tag, grid, ntens, nbytes))
    print("\n| kernel | measures | launches/step | tensors/step | GPU ms/step | GB/step | GB/s |")
    print("|---|---|---|---|---|---|---|")
    for (name, tag), (ms, nb, cnt, nt) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        gbs = f"{nb / 1e6 / ms:.0f}" if nb and ms and name != "nonfinite" else ""  # (gated: see below)
        print(f"| {name} | {tag} | {cnt / a.steps:.0f} | {nt / a.steps:.0f} | {ms:.3f} | {nb / 1e9:.2f} | {gbs} |")
    # (the flags kernel's bytes are what its gated check would read: with the gate closed it reads nothing)
    rows_k = [v for (name, _), v in per.items() if name != "nonfinite"]
    tot_ms = sum(v[0] for v in rows_k)
    tot_gb = sum(v[1] for v in rows_k) / 1e9
    if tot_ms:
        print(f"\nstage1 + stage2: {tot_ms:.2f} ms/step, {tot_gb:.2f} GB/step, {tot_gb / tot_ms * 1e3:.0f} GB/s")
    print("\nslowest launches for their bytes (GB/s, at least 1 MB):")
    print("| GPU us | kernel | measures | grid | tensors | MB | GB/s |")
    print("|---|---|---|---|---|---|---|")
    sel = [r for r in rows if r[5] >= 1e6 and r[1] != "nonfinite"]
    for ms, name, tag, grid, ntens, nbytes in sorted(sel, key=lambda r: r[5] / r[0])[:a.slowest]:
        print(f"| {ms * 1e3:.1f} | {name} | {tag} | {grid} | {ntens} | {nbytes / 1e6:.1f} | {nbytes / 1e6 / ms:.0f} |")


if __name__ == "__main__":
    main()
