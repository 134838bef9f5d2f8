"""Does the recorder's per-tensor bookkeeping cost less done in one loop than in each hook?
CUDA machine, BERT-base of ``overhead_gpu.py`` (B x T, fp16 AMP, AdamW). Not ampdoctor: a forward
hook on every leaf module, which does, for its output, the kind of work a watch does for a new
slot (a weak reference and a dict entry keyed by ``id``, a pending entry, a row description with
the output's dtype, size and bytes, a version read), either

* ``inline``: in the hook itself, as the watch does now, or
* ``batched``: the hook only appends the output, and one loop does the same work for all of them
  when the forward ends (a forward hook on the root),

against ``append``: the hook only appends (the floor of both), and no hooks at all. Host time of
the forward (medians over ``--rounds`` x ``--steps``, interleaved), and of the work alone measured
inside the loop of ``batched`` (per tensor).

Run:  python benchmarks/warm_loop.py [--batch 32] [--seq 128] [--rounds 5] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import weakref

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead_gpu  # noqa: E402

_pc = time.perf_counter


def _work(state: dict, lid: int, t: torch.Tensor) -> None:
    """What a watch does for a new slot of an output, roughly (``StepRows._new_slot`` and the row)."""
    slot = state["n"]
    state["n"] = slot + 1
    ver = t._version
    state["seen"][id(t)] = (weakref.ref(t), ver, slot)
    dev = t.device
    if dev not in state["devices"]:
        state["devices"].add(dev)
    n = t.numel()
    nbytes = n * t.element_size()
    state["pending"].append((slot, t, ver, (lid, "activation", "out"), False, dev))
    state["bytes"] += nbytes
    state["meta"].append((lid, "activation", "out", 0, str(t.dtype), n, nbytes))
    state["slots"].append(slot)
    state["flags"].append((slot,))


def _new_state() -> dict:
    return {"n": 0, "seen": {}, "devices": set(), "pending": [], "bytes": 0, "meta": [], "slots": [], "flags": []}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    model, step, desc = overhead_gpu.build(a.batch, a.seq)
    leaves = [(i, m) for i, m in enumerate(model.modules()) if not any(True for _ in m.children())]
    state = {"s": _new_state(), "log": [], "loop_s": 0.0, "loop_n": 0}

    def inline_hook(lid):
        def hook(mod, args, out):
            if type(out) is torch.Tensor:
                _work(state["s"], lid, out)
        return hook

    def append_hook(lid):
        def hook(mod, args, out):
            if type(out) is torch.Tensor:
                state["log"].append((lid, out))
        return hook

    def drain(mod, args, out):
        t0 = _pc()
        s = state["s"]
        for lid, t in state["log"]:
            _work(s, lid, t)
        state["loop_s"] += _pc() - t0
        state["loop_n"] += len(state["log"])
        state["log"] = []

    def clear(mod, args):
        state["s"] = _new_state()
        state["log"] = []

    def setup(kind):
        hs = [model.register_forward_pre_hook(clear)]
        for lid, m in leaves:
            if kind == "inline":
                hs.append(m.register_forward_hook(inline_hook(lid)))
            elif kind in ("append", "batched"):
                hs.append(m.register_forward_hook(append_hook(lid)))
        if kind == "batched":
            hs.append(model.register_forward_hook(drain))
        return hs

    kinds = ["none", "append", "inline", "batched"]
    fwd: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(3):
        step()
    for r in range(a.rounds):
        for k in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            hs = setup(k)
            try:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                overhead_gpu.PHASES = []
                for _ in range(a.steps):
                    step()
                torch.cuda.synchronize()
                fwd[k] += [(ph[1] - ph[0]) * 1e3 for ph in overhead_gpu.PHASES]
            finally:
                for h in hs:
                    h.remove()
    print(f"# {desc}, B={a.batch} T={a.seq}; {len(leaves)} leaf modules; torch {torch.__version__}")
    print("| hooks | forward host ms (median) | over no hooks |\n|---|---|---|")
    base = statistics.median(fwd["none"])
    for k in kinds:
        m = statistics.median(fwd[k])
        print(f"| {k} | {m:.2f} | {m - base:+.2f} |")
    if state["loop_n"]:
        print(f"\nthe batched loop: {state['loop_s'] / state['loop_n'] * 1e6:.2f} us a tensor")


if __name__ == "__main__":
    main()
