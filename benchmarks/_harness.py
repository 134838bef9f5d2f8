"""Side-by-side step timing for the overhead benchmarks: every configuration runs in the same
process, interleaved round by round (the order rotates), and the table gives medians."""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass
class Config:
    """``setup()`` attaches the tool (returns a ``teardown()``); ``wrap`` wraps each step."""
    name: str
    setup: Callable[[], Callable[[], None]] | None = None
    wrap: Callable[[Callable[[], None]], None] | None = None
    steps: int | None = None  # timed steps per round, if not the common number (slow tools)


@dataclass
class Result:
    ms: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # the process's CPU time per step (all threads), ms
    peak: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def watch_config(name: str, model, every: int, *, before=None, after=None, steps=None) -> Config:
    """An ampdoctor watch with a fresh trace each round (its first recorded step is warm-up)."""
    import ampdoctor

    def setup():
        if before:
            before()
        d = tempfile.mkdtemp(prefix="ampdoctor-bench-")
        w = ampdoctor.watch(model, every=every, trace=str(Path(d) / "t.sqlite"))

        def teardown():
            w.remove()
            if after:
                after()

        return teardown

    return Config(name, setup, steps=steps)


def import_revision(rev: str):
    """The package as it was at git revision ``rev`` (or the copy in folder ``rev``/ampdoctor, for
    a machine without the repository's history), imported beside this tree's as ``ampdoctor_ab``
    (its imports are relative), for an A/B in one process."""
    import importlib
    import shutil
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    d = Path(tempfile.mkdtemp(prefix="ampdoctor-ab-"))
    if (Path(rev) / "ampdoctor").is_dir():
        shutil.copytree(Path(rev) / "ampdoctor", d / "ampdoctor")
    else:
        archive = subprocess.run(["git", "archive", rev, "ampdoctor"], cwd=root, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(d)], input=archive, check=True)
    (d / "ampdoctor").rename(d / "ampdoctor_ab")
    sys.path.insert(0, str(d))
    return importlib.import_module("ampdoctor_ab")


def revision_config(name: str, pkg, model, every: int) -> Config:
    """``watch_config`` for another copy of the package (see :func:`import_revision`)."""
    def setup():
        w = pkg.watch(model, every=every, trace=str(Path(tempfile.mkdtemp(prefix="ampdoctor-bench-")) / "t.sqlite"))
        return w.remove

    return Config(name, setup)


def run_interleaved(step: Callable[[], None], configs: list[Config], *, rounds: int, steps: int,
                    warmup: int = 1, sync: Callable[[], None] = lambda: None,
                    peak: tuple[Callable[[], None], Callable[[], int]] | None = None,
                    log: Callable[[str], None] = print) -> dict[str, Result]:
    """Per round and configuration: attach, ``warmup`` steps, ``steps`` timed steps, detach.
    The mean step time of a round goes into the result (``every=N`` costs are spread over N)."""
    results = {c.name: Result() for c in configs}
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for c in order:
            teardown = c.setup() if c.setup else None
            try:
                run = (lambda c=c: c.wrap(step)) if c.wrap else step
                for _ in range(warmup):
                    run()
                sync()
                if peak:
                    peak[0]()
                t0, c0 = time.perf_counter(), time.process_time()
                n = c.steps or steps
                for _ in range(n):
                    run()
                sync()
                dt = (time.perf_counter() - t0) / n * 1e3
                results[c.name].ms.append(dt)
                results[c.name].cpu.append((time.process_time() - c0) / n * 1e3)
                if peak:
                    results[c.name].peak.append(peak[1]())
            finally:
                if teardown:
                    teardown()
            gc.collect()
        log(f"  round {r + 1}/{rounds}: " + "  ".join(f"{c.name} {results[c.name].ms[-1]:.1f}" for c in configs))
    return results


def cpu_table(results: dict[str, Result], base: str = "baseline") -> str:
    """The process's CPU time per step (``time.process_time``: every thread of the process, not
    the trace's writer process), medians over rounds and paired with the baseline as ``table``.
    Where the host is the bottleneck and shared, wall time moves with other tenants' load; CPU time
    moves much less, so it shows the host work each configuration adds more steadily."""
    b = statistics.median(results[base].cpu)
    lines = ["| config | CPU ms/step | CPU ratio | paired CPU ratio |", "|---|---|---|---|"]
    for name, res in results.items():
        m = statistics.median(res.cpu)
        paired = statistics.median(x / y for x, y in zip(res.cpu, results[base].cpu))
        lines.append(f"| {name} | {m:.2f} | {m / b:.3f}x | {paired:.3f}x |")
    return "\n".join(lines)


def table(results: dict[str, Result], base: str = "baseline", *, extra_cols: tuple[str, ...] = ()) -> str:
    b = statistics.median(results[base].ms)
    bpeak = max(results[base].peak) if results[base].peak else None
    head = "| config | median ms/step | ratio | paired ratio | min..max ms |" + ("" if bpeak is None else " peak MiB | extra peak |")
    head += "".join(f" {c} |" for c in extra_cols)
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, res in results.items():
        m = statistics.median(res.ms)
        # each round's ratio to the baseline of the same round, median over rounds: robust to a host
        # whose speed drifts between rounds
        paired = statistics.median(x / y for x, y in zip(res.ms, results[base].ms))
        row = f"| {name} | {m:.2f} | {m / b:.3f}x | {paired:.3f}x | {min(res.ms):.2f}..{max(res.ms):.2f} |"
        if bpeak is not None:
            p = max(res.peak)
            row += f" {p / 2**20:.0f} | {100 * (p - bpeak) / bpeak:+.2f}% |"
        row += "".join(f" {res.extra.get(c, '')} |" for c in extra_cols)
        lines.append(row)
    return "\n".join(lines)


def hooks_only(model, *, read: bool = False) -> Config:
    """Reference floors, not ampdoctor. ``hooks-only``: a no-op forward pre-hook and a forward hook
    on every module, the latter appending the output and registering a tensor hook that appends its
    gradient, and a post-accumulate-grad hook on every parameter that appends. ``read-once``: the
    same hooks on leaf modules only, each reading its tensor once (one ``amax`` reduction kept in a
    list, no sync):
    the cost of one pass over every leaf output, output gradient and weight gradient."""
    import torch

    def setup():
        got: list = []
        handles = []
        keep = (lambda t: got.append(t.detach().amax())) if read else got.append

        def post(mod, args, out):
            if isinstance(out, torch.Tensor):
                keep(out)
                if out.requires_grad:
                    out.register_hook(keep)
            elif not read:
                got.append(out)

        mods = [m for m in model.modules() if not read or not any(True for _ in m.children())]
        for m in mods:
            if not read:
                handles.append(m.register_forward_pre_hook(lambda mod, args: None))
            handles.append(m.register_forward_hook(post))
        for p in model.parameters():
            handles.append(p.register_post_accumulate_grad_hook(lambda p: keep(p.grad)) if read
                           else p.register_post_accumulate_grad_hook(got.append))

        def clear(*_):
            got.clear()

        handles.append(model.register_forward_pre_hook(clear))

        def teardown():
            for h in handles:
                h.remove()
            got.clear()

        return teardown

    return Config("read-once" if read else "hooks-only", setup)


class _Budget:
    """The byte budget of ampdoctor's batches (``rows.RowPolicy``), for the reference floors: 3% of
    the CUDA peak so far (16 MiB..1 GiB; 64 MiB without CUDA), and a batch past it may grow by two
    budgets at a time while allocated memory stays that far under the peak."""

    def __init__(self) -> None:
        import torch

        self.budget, self.peak = 64 << 20, 0
        if torch.cuda.is_available() and torch.cuda.max_memory_allocated():
            self.peak = torch.cuda.max_memory_allocated()
            self.budget = int(min(1 << 30, max(16 << 20, 0.03 * self.peak)))
        self.reset()

    def reset(self) -> None:
        self.held, self.check_at = 0, self.budget

    def full(self, t) -> bool:
        """Count ``t``'s bytes; whether the batch must be measured now."""
        from ampdoctor.rows import _allocated

        self.held += t.numel() * t.element_size()
        if self.held <= self.check_at:
            return False
        if self.peak and self.held <= self.peak // 4 and _allocated(t.device) + 2 * self.budget <= self.peak:
            self.check_at = self.held + 2 * self.budget
            return False
        return True


def measure_only(model, opt, fmt: str = "fp16") -> Config:
    """Reference floor, not ampdoctor: what a step under ``watch`` measures, with the same
    statistics kernels and batching, and no bookkeeping. A forward hook on every leaf module hands
    its floating outputs to a batch and registers a tensor hook that hands over their gradient; the
    batch is measured (``ampdoctor.stats.batch_stats``: one fused launch on CUDA) past ampdoctor's
    batch budget (CUDA: 3% of the peak memory so far, within 16 MiB..1 GiB) unless, as ampdoctor's
    batches do (``rows.RowPolicy.room``), it may keep growing while allocated memory stays two
    budgets under that peak; and before the optimizer step, with the weight gradients; the weights
    after it. No slots, no first-non-finite flags, no rows on the host, no trace; the results stay on
    the device (dropped at the next step)."""
    import torch

    from ampdoctor import stats as _stats
    from ampdoctor.formats import get_format

    f = get_format(fmt)
    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    params = [p for p in model.parameters()]

    def setup():
        batch: list = []
        blocks: list = []
        handles = []
        budget = _Budget()

        def flush():
            if batch:
                blocks.append(_stats.batch_stats(batch, f))
                batch.clear()
                budget.reset()

        def take(t):
            batch.append(t)
            if budget.full(t):
                flush()

        def post(mod, args, out):
            outs = out if isinstance(out, tuple) else (out,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                    take(t)
                    if t.requires_grad:
                        t.register_hook(take)

        for m in leaves:
            handles.append(m.register_forward_hook(post))

        def before_step(*_):
            flush()
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                blocks.append(_stats.batch_stats(grads, f))

        def after_step(*_):
            blocks.append(_stats.batch_stats(params, f))

        def new_step(*_):
            flush()  # a step whose optimizer step was skipped (GradScaler)
            blocks.clear()

        handles += [opt.register_step_pre_hook(before_step), opt.register_step_post_hook(after_step),
                    model.register_forward_pre_hook(new_step)]

        def teardown():
            for h in handles:
                h.remove()
            batch.clear()
            blocks.clear()

        return teardown

    return Config("measure-only", setup)


def replay_floor(model, opt, fmt: str = "fp16") -> Config:
    """Reference floor, not ampdoctor: the least a recorder that *replays* a plan would do on a
    recorded step that follows it (benchmarks/README, tenth session). Over ``measure-only`` it adds
    what such a recorder could not drop:

    * a forward hook on every module, containers too (their outputs are the first-non-finite
      flags' tensors), each checking its call against the plan (the module expected at this position)
      and appending the output and its ``_version``; no pre-hooks;
    * gradient hooks registered without a ``RemovableHandle`` (``ampdoctor.watch._new_hook``, as the
      watch does), one pre-built callable per module;
    * the statistics launches with the step's gate, and the gated NaN/Inf check of the containers'
      outputs (``stats_cuda.fused_nonfinite``) at each flush;
    * at the step's end: the rows in one device buffer, one non-blocking copy to pinned memory, the
      previous step's copy waited for (the step's one sync), its version checks, and its rows handed to
      a trace writer with the row descriptions built once (the writer process does the rest).

    What it leaves out (a replaying recorder would still pay for them): checking a call's inputs, the
    first recorded step's full bookkeeping, falling back when a step departs from the plan, and
    first-non-finite attribution of a step that holds a NaN/Inf."""
    import torch

    from ampdoctor import stats as _stats
    from ampdoctor.formats import get_format
    from ampdoctor.trace import TraceWriter
    from ampdoctor.watch import _new_hook

    f = get_format(fmt)
    mods = list(model.modules())
    leaf = [not any(True for _ in m.children()) for m in mods]
    params = [p for p in model.parameters()]
    n_fields = _stats.N_FIELDS

    def setup():
        import ampdoctor.stats_cuda as sc

        dev = next(model.parameters()).device
        cuda = dev.type == "cuda"
        gate = torch.zeros(1, dtype=torch.int32, device=dev)
        plan: list = []       # module index per hook call, learned on the first step
        pos = [0]
        rows: list = []       # leaf outputs, then their gradients (the rows' tensors)
        vers: list = []       # their _version when handed over (checked at the flush)
        flags: list = []      # container outputs (flag-only tensors)
        blocks: list = []
        fblocks: list = []
        budget = _Budget()
        pinned: list = [None, None]   # (host buffer, its copy's event or None) of the last step's rows
        meta: list = []
        writer = TraceWriter(Path(tempfile.mkdtemp(prefix="ampdoctor-replay-")) / "t.sqlite")
        step_no = [0]
        handles = []

        def flush():
            if rows:
                ok = [t for t, v in zip(rows, vers) if t._version == v]  # changed in place since: not measured
                if ok:
                    blocks.append(_stats.batch_stats(ok, f, gate) if cuda else _stats.batch_stats(ok, f))
                rows.clear()
                vers.clear()
            if flags and cuda:
                fblocks.append(sc.fused_nonfinite(flags, gate))
            flags.clear()
            budget.reset()

        def take(t):
            rows.append(t)
            vers.append(t._version)
            if budget.full(t):
                flush()

        def make_post(i, is_leaf):
            grad_take = take

            def post(mod, args, out):
                k = pos[0]
                pos[0] = k + 1
                if k < len(plan):
                    if plan[k] != i:  # a step that departs from the plan: the full bookkeeping would run
                        return
                else:
                    plan.append(i)
                if type(out) is torch.Tensor and out.dtype.is_floating_point:
                    if is_leaf:
                        take(out)
                        if out.requires_grad:
                            _new_hook(out, grad_take)
                    else:
                        flags.append(out)

            return post

        for i, (m, is_leaf) in enumerate(zip(mods, leaf)):
            handles.append(m.register_forward_hook(make_post(i, is_leaf)))

        def before_step(*_):
            flush()
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                blocks.append(_stats.batch_stats(grads, f, gate) if cuda else _stats.batch_stats(grads, f))

        def after_step(*_):
            blocks.append(_stats.batch_stats(params, f, gate) if cuda else _stats.batch_stats(params, f))
            out = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
            host, ev = pinned
            if host is not None:  # the previous step's rows: the one sync, then to the writer
                if ev is not None:
                    ev.synchronize()
                if not meta:
                    meta.extend((0, "activation", "out", j, "float16", 1, 2) for j in range(host.shape[0]))
                writer.add_stat_rows(step_no[0] - 1, meta[:host.shape[0]], host.numpy(), n_fields)
            if cuda:
                buf = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                buf.copy_(out, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                pinned[0], pinned[1] = buf, ev
            else:
                pinned[0], pinned[1] = out.clone(), None
            blocks.clear()
            fblocks.clear()
            gate.zero_()
            pos[0] = 0
            step_no[0] += 1

        def new_step(*_):  # a step whose optimizer step was skipped (GradScaler): start the plan again
            if pos[0]:
                flush()
                blocks.clear()
                fblocks.clear()
                pos[0] = 0

        handles += [opt.register_step_pre_hook(before_step), opt.register_step_post_hook(after_step),
                    model.register_forward_pre_hook(new_step)]

        def teardown():
            for h in handles:
                h.remove()
            rows.clear()
            flags.clear()
            blocks.clear()
            writer.close()

        return teardown

    return Config("replay-floor", setup)


def cuda_ms_per_call(fn, n: int = 10, reps: int = 10) -> float:
    """Milliseconds per call of ``fn``: ``reps`` calls back to back between two CUDA events (so the
    host's launch work overlaps the GPU's, as in training), median of ``n``."""
    import torch

    fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[n // 2]
