"""Host-side (Python) cost of ``ampdoctor.watch`` hooks per training step, CPU only.

A 12-block BERT-like encoder (``_models.Encoder``: Linear/LayerNorm/GELU/Dropout modules) with tiny
dims (d=32, B=2, T=8, fp32, AdamW), so the step is dominated by Python overhead, as a launch-bound GPU
step is. A fake statistics backend is installed with ``ampdoctor.stats.set_backend``: it returns
``torch.zeros((len(tensors), row_width(fmt)), dtype=torch.float64)`` without reading the tensors, so
only ampdoctor's bookkeeping (hooks, slots, flags, flushes, trace rows, the writer thread) is
measured, not the statistics kernels. Configurations run interleaved in one process (medians).
``hooks-only`` is a reference floor, not ampdoctor: a no-op forward pre-hook and a forward hook on every
module, the latter appending each output and registering a tensor hook that appends its gradient, plus
a post-accumulate-grad hook on every parameter that appends (``_harness.hooks_only``, shared with
``overhead_gpu.py``; what it holds is dropped at the next forward).

The harness runs ``gc.collect()`` between rounds, so rare full (generation 2) collections, which
the recorder's allocations bring on, barely show in the table; ``--gc-steps N`` counts the garbage
collections of N steps in a row with every=1 (and without a watch) and the time spent in them.

Run:  python benchmarks/host_overhead.py [--rounds 7] [--steps 20] [--profile] [--gc-steps 600]
      python benchmarks/host_overhead.py --ab REV   # this tree against git revision REV, in one process
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import platform
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (  # noqa: E402
    Config,
    hooks_only,
    import_revision,
    measure_only,
    replay_floor,
    revision_config,
    run_interleaved,
    table,
    watch_config,
)
from _models import Encoder  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor import stats as _stats  # noqa: E402
from ampdoctor.watch import Watch  # noqa: E402


def fake_backend(tensors, fmt):
    """Rows of zeros: no tensor is read (bookkeeping only)."""
    return torch.zeros((len(tensors), _stats.row_width(fmt)), dtype=torch.float64)


def gc_report(step, model: torch.nn.Module, steps: int, *, watched: bool) -> str:
    """Collections per generation and time in the collector, per step, over ``steps`` steps."""
    w = ampdoctor.watch(model, every=1, trace=str(Path(tempfile.mkdtemp(prefix="ampdoctor-bench-")) / "t.sqlite")) \
        if watched else None
    for _ in range(3):
        step()
    gc.collect()
    counts = [0, 0, 0]
    spent = [0.0, 0.0, 0.0]
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            counts[info["generation"]] += 1
            spent[info["generation"]] += time.perf_counter() - started[0]

    gc.callbacks.append(callback)
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            step()
    finally:
        gc.callbacks.remove(callback)
    ms = (time.perf_counter() - t0) / steps * 1e3
    if w is not None:
        w.remove()
    gens = "  ".join(f"gen{g} {counts[g] / steps:.3f} ({spent[g] / steps * 1e3:.3f} ms)" for g in range(3))
    return f"{ms:.2f} ms/step;  {gens}"


def _writer_thread():
    """(switch the trace writer to its in-thread mode, switch back)."""
    import importlib
    trace_mod = importlib.import_module("ampdoctor.trace")
    saved = os.environ.get(trace_mod.WRITER_ENV)

    def restore() -> None:
        if saved is None:
            os.environ.pop(trace_mod.WRITER_ENV, None)
        else:
            os.environ[trace_mod.WRITER_ENV] = saved

    return (lambda: os.environ.__setitem__(trace_mod.WRITER_ENV, "thread")), restore


def _ablations() -> list:
    """(what is switched off, switch off, switch back on): parts of a recorded step's bookkeeping.
    Not ampdoctor configurations: they record less (or write nothing) and only show the cost."""
    import importlib
    session_mod = importlib.import_module("ampdoctor.session")
    trace_mod = importlib.import_module("ampdoctor.trace")
    out = []

    def patch(obj, name, make):
        saved = getattr(obj, name)
        return (lambda: setattr(obj, name, make(saved))), (lambda: setattr(obj, name, saved))

    out.append(("trace written from a thread (before)", *_writer_thread()))
    out.append(("no trace rows written", *patch(trace_mod.TraceWriter, "add_stat_rows",
                                                lambda f: lambda self, step, meta, rows, nf: None)))
    out.append(("no gradient hooks", *patch(Watch, "_grad_work", lambda f: lambda self, t, entries: None)))
    out.append(("no weights", *patch(Watch, "record_weights", lambda f: lambda self: None)))

    def no_attribution(f):
        def reset(self):
            f(self)
            self.attributing = False
        return reset

    out.append(("no first-non-finite attribution", *patch(session_mod.Session, "_reset_step", no_attribution)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20, help="timed steps per round (a multiple of 10)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--d", type=int, default=32)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="also a cProfile of --steps steps with every=1")
    p.add_argument("--profile-top", type=int, default=30)
    p.add_argument("--gc-steps", type=int, default=0, help="also count garbage collections over this many steps")
    p.add_argument("--ablate", action="store_true",
                   help="every=1 with one part of the bookkeeping switched off at a time (where the time goes)")
    p.add_argument("--writer", action="store_true",
                   help="every=1 with the trace written by the writer process (as shipped) against from a thread")
    p.add_argument("--not-recorded", action="store_true",
                   help="only steps that are not recorded (every=100000), hooks asleep (as shipped) against awake")
    p.add_argument("--ab", metavar="REV", default=None,
                   help="every=1 and every=10 of this tree against the package at git revision REV, side by side")
    args = p.parse_args()
    torch.set_num_threads(1)
    _stats.set_backend(fake_backend)
    old = None
    if args.ab:
        old = import_revision(args.ab)
        old.stats.set_backend(fake_backend)

    torch.manual_seed(0)
    model = Encoder(vocab=args.vocab, d=args.d, layers=args.layers, heads=2, ffn=2 * args.d, max_len=args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))

    def step() -> None:
        logits = model(ids)
        loss = F.cross_entropy(logits.view(-1, args.vocab), ids.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    configs = [Config("baseline"), hooks_only(model), measure_only(model, opt), replay_floor(model, opt),
               watch_config("every=1", model, 1), watch_config("every=10", model, 10)]
    if args.not_recorded:  # the first recorded step falls in each round's untimed warm-up step
        shipped = Watch.sleep

        def awake() -> None:
            Watch.sleep = lambda self, asleep: None

        def restore() -> None:
            Watch.sleep = shipped

        configs = [Config("baseline"), watch_config("not recorded, hooks asleep", model, 100_000),
                   watch_config("not recorded, hooks awake", model, 100_000, before=awake, after=restore)]
    if args.writer:
        on, off = _writer_thread()
        configs = [Config("baseline"), watch_config("every=1, writer process", model, 1),
                   watch_config("every=1, writer thread", model, 1, before=on, after=off)]
    if old is not None:
        configs = [Config("baseline"), watch_config("every=1", model, 1), revision_config(f"every=1 at {args.ab}", old, model, 1),
                   watch_config("every=10", model, 10), revision_config(f"every=10 at {args.ab}", old, model, 10)]
    if args.ablate:
        configs = [Config("baseline"), watch_config("every=1", model, 1)] + [
            watch_config(f"every=1, {what}", model, 1, before=on, after=off) for what, on, off in _ablations()]
    print(f"# ampdoctor host overhead (fake statistics backend)  {time.strftime('%Y-%m-%d')}  "
          f"torch {torch.__version__}  Python {platform.python_version()}  "
          f"{platform.processor() or platform.machine()}, 1 thread")
    print(f"# model: encoder d={args.d} layers={args.layers} vocab={args.vocab}, B={args.batch} T={args.seq}, "
          f"fp32 + AdamW; {args.rounds} rounds x {args.steps} steps")
    for c in configs:  # warm-up, not timed
        td = c.setup() if c.setup else None
        for _ in range(3):
            step()
        if td:
            td()
    res = run_interleaved(step, configs, rounds=args.rounds, steps=args.steps)
    print(table(res))
    if args.gc_steps:
        print(f"\n# garbage collections over {args.gc_steps} steps (per step: collections, ms in the collector)")
        for name in ("baseline", "every=1"):
            print(f"{name}: {gc_report(step, model, args.gc_steps, watched=name != 'baseline')}")
    if args.profile:
        d = tempfile.mkdtemp(prefix="ampdoctor-bench-")
        w = ampdoctor.watch(model, every=1, trace=str(Path(d) / "t.sqlite"))
        for _ in range(3):
            step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
        w.remove()
        print(f"\n# cProfile, every=1, {args.steps} steps (tottime)")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.profile_top)


if __name__ == "__main__":
    main()
