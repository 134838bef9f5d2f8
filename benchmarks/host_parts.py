"""Where a recorded step's host time goes, part by part, on a CUDA machine: BERT-base of
``overhead_gpu.py`` (B x T, fp16 AMP, AdamW) trained without a watch, then with ``watch(every=1)``,
with the host time of each phase of a step (forward, backward, optimizer step, GradScaler update)
and, under the watch, wall-clock timers around the recorder's entry points: the module hooks (leaf
post-hooks, container pre- and post-hooks), the gradient hooks, where a backward pass ends (weight
gradients), the step boundary (weights), the deferred write of the last step, the flushes and,
inside them, the measuring (the NVRTC launch path, the NaN/Inf checks) and the allocator look-ups
that decide whether a batch may grow.

The times are inclusive (a flush started by a hook counts in both) and each timer adds about a
microsecond to what it wraps, so the step is slower than without them: read the parts against
each other, and the totals from ``overhead_gpu.py``.

Run:  python benchmarks/host_parts.py [--batch 32] [--seq 128] [--steps 30]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead_gpu  # noqa: E402

import ampdoctor  # noqa: E402

_acc: dict[str, float] = collections.defaultdict(float)
_cnt: collections.Counter = collections.Counter()
_pc = time.perf_counter


def _timed(name: str, fn):
    def wrap(*a, **k):
        t0 = _pc()
        try:
            return fn(*a, **k)
        finally:
            _acc[name] += _pc() - t0
            _cnt[name] += 1
    return wrap


def _instrument() -> None:
    S = importlib.import_module("ampdoctor.session")
    W = importlib.import_module("ampdoctor.watch")
    R = importlib.import_module("ampdoctor.rows")
    SC = importlib.import_module("ampdoctor.stats_cuda")
    NV = importlib.import_module("ampdoctor._stats_nvrtc")
    T = importlib.import_module("ampdoctor.trace")
    parts = [
        (S.Session, ["on_backward", "_write_deferred", "end_step", "on_scaler_update", "add_param_rows", "_flush_soon",
                     "_start_copy", "_reset_step", "_end_step", "settle_boundary"]),
        (W.Watch, ["record_weight_grads", "record_weights", "prune_pre_hooks", "sleep", "snapshot_grads",
                     "mark_weights", "weights_changed"]),
        (W._GradWork, ["__call__"]),
        (R.StepRows, ["flush", "add_now", "_measure", "_measure_flags", "finish"]),
        (R.RowPolicy, ["room"]),
        (SC, ["fused_nonfinite"]),
        (NV, ["run", "tables", "run_flags"]),
        (NV._Kernel, ["__call__"]),
        (T.TraceWriter, ["commit", "add_step", "add_stat_rows"]),
    ]
    for owner, names in parts:
        for n in names:
            if hasattr(owner, n):
                setattr(owner, n, _timed(f"{getattr(owner, '__name__', '')}.{n}", getattr(owner, n)))


def _time_hooks(model: torch.nn.Module) -> None:
    for m in model.modules():
        kind = "leaf" if not any(True for _ in m.children()) else "container"
        for d, tag in ((m._forward_pre_hooks, "pre-hook"), (m._forward_hooks, "post-hook")):
            for k in list(d):
                d[k] = _timed(f"module {tag}, {kind}", d[k])


def _loop(step, n: int, tag: str, parts: bool) -> float:
    overhead_gpu.PHASES = []
    _acc.clear()
    _cnt.clear()
    torch.cuda.synchronize()
    t0 = _pc()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    dt = (_pc() - t0) / n * 1e3
    ph = overhead_gpu.PHASES
    med = [statistics.median((p[i + 1] - p[i]) * 1e3 for p in ph) for i in range(4)]
    print(f"\n{tag}: {dt:.1f} ms/step; host ms per phase (medians): forward {med[0]:.2f}, backward {med[1]:.2f}, "
          f"optimizer step {med[2]:.2f}, update {med[3]:.2f}")
    if parts:
        print("\n| part (inclusive) | ms/step | calls/step | us/call |\n|---|---|---|---|")
        for k, v in sorted(_acc.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v / n * 1e3:.2f} | {_cnt[k] / n:.0f} | {v / max(_cnt[k], 1) * 1e6:.1f} |")
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    model, step, desc = overhead_gpu.build(a.batch, a.seq)
    print(f"# {desc}, B={a.batch} T={a.seq}; torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for _ in range(3):
        step()
    _loop(step, a.steps, "baseline", False)
    _instrument()
    w = ampdoctor.watch(model, every=1, trace=os.path.join(tempfile.mkdtemp(), "t.sqlite"))
    _time_hooks(model)  # (after the first recorded step some leaves lose their pre-hook: see Watch.prune_pre_hooks)
    for _ in range(5):
        step()
    _loop(step, a.steps, "every=1 (with the timers)", True)
    w.remove()
    _loop(step, a.steps, "baseline again", False)


if __name__ == "__main__":
    main()
