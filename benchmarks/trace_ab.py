"""The same trainings under two packages, this tree's ``ampdoctor`` and the one at git revision REV
(or a folder holding that ``ampdoctor/``, imported beside it), and their traces compared field by
field: every statistics row (with its histogram), step and event, and the layers. For changes that
must not change what is recorded. Exit status 1 on any difference.

Scenarios: fp16 autocast with and without GradScaler, every=3 and every=4, gradient accumulation
with unscale_ and clipping, zero_grad(set_to_none=False), an Inf input (first non-finite events),
tuple/dict outputs, multi-input modules, a reused module, an inplace ReLU, a leaf that changes its
input in place, tied weights, a frozen layer, a bare root parameter, an encoder with AdamW.

Run:  python benchmarks/trace_ab.py REV [--device cuda]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import import_revision  # noqa: E402
from _models import Encoder  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor.trace import TraceReader  # noqa: E402

DEV = "cpu"

class Mutator(nn.Module):
    """A leaf that changes its input in place, with no ``inplace`` attribute."""

    def forward(self, x):
        x.mul_(2.0)
        return x * 1.0


class Multi(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x, y):
        return self.a(x) + self.b(y), x


class Pair(nn.Module):
    def forward(self, x, y):
        return x * y


class TupleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = Multi()
        self.pair = Pair()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        self.mut = Mutator()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h, x2 = self.m(x, x * 2)
        h = self.pair(h, x2)
        h = self.lin(self.lin(h))  # a reused module
        h = self.act(h)
        h = self.mut(h + 0)
        return self.out(h), {"aux": h.sum()}


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.bias = nn.Parameter(torch.zeros(8))
        self.mid = nn.Linear(8, 8)

    def forward(self, x):
        h = self.frozen(self.emb(x)) + self.bias
        return F.gelu(self.mid(h)) @ self.emb.weight.t()


def seq():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))


def scenario(name, make_model, steps, every=1, scaler=True, autocast=True, accum=1, clip=False,
             set_to_none=True, inf_at=None, opt="sgd", inp="x8"):
    def run(pkg, trace):
        torch.manual_seed(0)
        model = make_model().to(DEV)
        w = pkg.watch(model, every=every, trace=trace)
        o = (torch.optim.SGD if opt == "sgd" else torch.optim.AdamW)(model.parameters(), lr=1e-3)
        sc = torch.amp.GradScaler(DEV, init_scale=2.0 ** 16) if scaler else None
        for i in range(steps):
            for _ in range(accum):
                if inp == "ids":
                    x = torch.randint(0, 16, (4, 6))
                else:
                    x = torch.randn(4, 8)
                    if inf_at is not None and i == inf_at:
                        x[0, 0] = float("inf")
                x = x.to(DEV)
                with torch.autocast(DEV, dtype=torch.float16, enabled=autocast):
                    out = model(x)
                    out = out[0] if isinstance(out, tuple) else out
                    loss = out.float().pow(2).mean() / accum
                (sc.scale(loss) if sc else loss).backward()
            if sc:
                if clip:
                    sc.unscale_(o)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                sc.step(o)
                sc.update()
            else:
                o.step()
            o.zero_grad(set_to_none=set_to_none)
        w.remove()
    return name, run


def enc():
    return Encoder(vocab=16, d=16, layers=2, heads=2, ffn=32, max_len=6)


SCENARIOS = [
    scenario("seq gradscaler", seq, 5),
    scenario("seq sgd no scaler", seq, 4, scaler=False),
    scenario("seq every=3", seq, 7, every=3),
    scenario("seq accum 4 + clip", seq, 3, accum=4, clip=True),
    scenario("seq set_to_none=False", seq, 4, set_to_none=False),
    scenario("seq inf at step 2", seq, 5, inf_at=2),
    scenario("seq inf at 5 every=4", seq, 14, every=4, inf_at=5, scaler=False, autocast=False),
    scenario("tuple/dict/reused/mutator", TupleNet, 5),
    scenario("tuple inf", TupleNet, 4, inf_at=1),
    scenario("tied/frozen/root param", Tied, 4, inp="ids"),
    scenario("encoder adamw", enc, 4, opt="adamw", inp="ids"),
]


def dump(path):
    r = TraceReader(path)
    def clean(rows):
        out = []
        for d in rows:
            d = {k: v.tolist() if hasattr(v, "tolist") else ("nan" if isinstance(v, float) and math.isnan(v) else v)
                 for k, v in d.items()}
            d.pop("wall", None)
            out.append(d)
        return out
    ev = clean(r.events())
    for e in ev:
        e.pop("id", None)
    return {"stats": clean(r.stats(with_hist=True)), "steps": clean(r.steps()), "events": ev,
            "layers": clean(r.layers())}


def main() -> None:
    global DEV
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev", help="git revision, or a folder holding ampdoctor/")
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    DEV = a.device
    old = import_revision(a.rev)
    bad = 0
    for name, run in SCENARIOS:
        got = []
        for pkg in (old, ampdoctor):
            d = tempfile.mkdtemp(prefix="ampdoctor-eq-")
            run(pkg, os.path.join(d, "t.sqlite"))
            got.append(dump(os.path.join(d, "t.sqlite")))
        diffs = [k for k in got[0] if got[0][k] != got[1][k]]
        print(f"{'SAME' if not diffs else 'DIFF'}  {name}: {len(got[1]['stats'])} rows, {len(got[1]['events'])} events"
              + (f"  differs in {diffs}" if diffs else ""))
        if diffs:
            bad += 1
            for k in diffs:
                a_, b_ = got[0][k], got[1][k]
                first = next((i for i, (x, y) in enumerate(zip(a_, b_)) if x != y), None)
                if first is None:
                    print(f"   {k}: {len(a_)} against {len(b_)} entries")
                else:
                    print(f"   {k}[{first}]:\n    {a_[first]}\n    {b_[first]}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
