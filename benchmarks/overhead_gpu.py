"""GPU overhead of ``ampdoctor.watch`` on a BERT-base-sized encoder (random weights, nothing
downloaded), fp16 autocast + GradScaler + AdamW, next to HF ``DebugUnderflowOverflow`` and
``torch.autograd.detect_anomaly``; all configurations interleaved in one process (medians).
Also counts host syncs and device-to-host copies per step (profiler) and peak memory.

Run:  python benchmarks/overhead_gpu.py [--regimes 128x512,32x128] [--rounds 5] [--ablations] [--profile DIR]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (  # noqa: E402
    Config,
    cpu_table,
    cuda_ms_per_call,
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
from ampdoctor import rows as rows_mod  # noqa: E402
from ampdoctor import session as session_mod  # noqa: E402
from ampdoctor import stats_cuda  # noqa: E402
from ampdoctor.attribution import Attribution  # noqa: E402

SYNC_APIS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def build(batch: int, seq: int):
    """(model, step, description): BertForSequenceClassification from BertConfig() when
    transformers is installed, else the equivalent encoder of _models.py."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ids = torch.randint(0, 30522, (batch, seq), device=dev)
    labels = torch.randint(0, 2, (batch,), device=dev)
    try:
        from transformers import BertConfig, BertForSequenceClassification
        model = BertForSequenceClassification(BertConfig(num_labels=2)).to(dev)
        desc = "transformers BertForSequenceClassification(BertConfig()), random init"

        def loss_fn():
            return model(input_ids=ids, labels=labels).loss
    except ImportError:
        model = Encoder(n_out=2).to(dev)
        desc = "own BERT-base-sized encoder (benchmarks/_models.py), random init"

        def loss_fn():
            return F.cross_entropy(model(ids).float(), labels)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scaler = torch.amp.GradScaler("cuda")

    def step() -> None:
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        scaler.scale(loss).backward()
        t2 = time.perf_counter()
        scaler.step(opt)
        t3 = time.perf_counter()
        scaler.update()
        if PHASES is not None:
            PHASES.append((t0, t1, t2, t3, time.perf_counter()))

    step.opt = opt  # type: ignore[attr-defined]
    return model, step, desc


PHASES: list | None = None  # (start, forward done, backward done, optimizer step done, update done) per step


def phase_times(step, configs: list[Config], rounds: int, steps: int) -> str:
    """Host wall time of each phase of a step, median over ``rounds`` x ``steps`` steps per
    configuration (interleaved). At B=32 the host runs behind the GPU, so forward and backward
    are the host's own time; the optimizer step holds GradScaler's one sync (waiting for the GPU)."""
    global PHASES
    got: dict[str, list] = {c.name: [] for c in configs}
    for r in range(rounds):
        for c in configs[r % len(configs):] + configs[:r % len(configs)]:
            td = c.setup() if c.setup else None
            try:
                step()
                torch.cuda.synchronize()
                PHASES = []
                for _ in range(steps):
                    step()
                torch.cuda.synchronize()
                got[c.name] += PHASES
            finally:
                PHASES = None
                if td:
                    td()
    lines = ["| config | forward ms | backward ms | optimizer step ms | update ms | step ms |", "|---|---|---|---|---|---|"]
    for name, ts in got.items():
        cols = [statistics.median((t[i + 1] - t[i]) * 1e3 for t in ts) for i in range(4)]
        total = statistics.median((t[4] - t[0]) * 1e3 for t in ts)
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in cols) + f" | {total:.2f} |")
    return "\n".join(lines)


def hf_debug_config(model, steps):
    try:
        from transformers.debug_utils import DebugUnderflowOverflow
    except ImportError:
        return None

    def setup():
        before = {id(m): set(m._forward_hooks) for m in model.modules()}
        DebugUnderflowOverflow(model)

        def teardown():  # it keeps no handles: drop the hooks it added
            for m in model.modules():
                for k in list(m._forward_hooks):
                    if k not in before[id(m)]:
                        del m._forward_hooks[k]

        return teardown

    return Config("HF DebugUnderflowOverflow", setup, steps=steps)


def anomaly_config(steps):
    def wrap(step):
        with torch.autograd.detect_anomaly():
            step()

    return Config("detect_anomaly", wrap=wrap, steps=steps)


def _torch_path():
    os.environ[stats_cuda.ENV_DISABLE] = "0"
    stats_cuda.uninstall()


def _fused_path():
    os.environ.pop(stats_cuda.ENV_DISABLE, None)


def _no_defer():
    session_mod.DEFER_HOST_READ = False


def _defer():
    session_mod.DEFER_HOST_READ = True


_DONE = Attribution.done


def _no_flags():
    """No first-non-finite attribution (no input/output flags, so no tensor measured for a flag
    alone: a residual sum no module outputs, its gradient): what the flags cost."""
    Attribution.done = lambda self, scaled: True


def _flags():
    Attribution.done = _DONE


def _ungated():
    """Tensors measured only for a flag get full statistics rows, read every step (as before the
    seventh session), instead of the gated NaN/Inf check."""
    rows_mod.GATED_FLAGS = False


def _gated():
    rows_mod.GATED_FLAGS = True


def count_syncs(step, config: Config, n: int) -> dict:
    """Host syncs and device-to-host copies per step, from a profiler trace and from
    ``torch.cuda.set_sync_debug_mode('warn')``."""
    td = config.setup() if config.setup else None
    run = (lambda: config.wrap(step)) if config.wrap else step
    try:
        run()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(n):
                run()
            torch.cuda.synchronize()
        names = collections.Counter(e.name for e in prof.events())
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as ws:
                warnings.simplefilter("always")
                for _ in range(n):
                    run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    finally:
        if td:
            td()
    syncs = sum(names[k] for k in SYNC_APIS) - 1  # the profiler's own closing synchronize
    dtoh = sum(v for k, v in names.items() if "DtoH" in k or "Device -> Pinned" in k or "Device -> Pageable" in k)
    warned = sum("synchroniz" in str(w.message).lower() for w in ws)
    launches = sum(v for k, v in names.items() if k in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                         "cudaLaunchKernelExC"))
    return {"syncs/step": f"{syncs / n:.1f}", "DtoH/step": f"{dtoh / n:.1f}",
            "sync warnings/step": f"{warned / n:.1f}", "launches/step": f"{launches / n:.0f}"}


def profile_every(step, model, n: int, out_dir: str, tag: str, every: int = 1) -> None:
    """Where the time of a watch goes: kernel and CPU-op tables, and the Python profile."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = watch_config(f"every={every}", model, every)
    td = cfg.setup()
    try:
        step()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / n * 1e3
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        pr.disable()
    finally:
        td()
    s = io.StringIO()
    ps = pstats.Stats(pr, stream=s).sort_stats("tottime")
    ps.print_stats(30)
    ps.sort_stats("cumulative").print_stats("ampdoctor", 40)
    ps.print_callers("item|pin_memory")
    with open(os.path.join(out_dir, f"profile_{tag}.txt"), "w") as f:
        busy = sum(e.self_device_time_total for e in prof.key_averages()) / n / 1e3
        f.write(f"# {n} steps, every={every}: {wall:.1f} ms/step under the profiler, GPU kernels {busy:.1f} ms/step "
                f"(the GPU idles about {max(wall - busy, 0):.1f} ms/step)\n")
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
        f.write("\n\n")
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        f.write("\n\n# cProfile\n")
        f.write(s.getvalue())


def kernel_throughput() -> None:
    """The fused statistics kernels alone (NVRTC and Triton), against one read of the same
    bytes (``amax``: a single pass, one launch per tensor). Ten calls back to back between two
    CUDA events, so the host's launch work overlaps the GPU's, as in training."""
    fmt = ampdoctor.get_format("fp16")
    cases = {
        "1 x 201M fp16 (B=128 T=512 FFN activation)": [torch.randn(128 * 512 * 3072, device="cuda").half()],
        "1 x 201M fp16, half zeros (GELU grad-like)": [torch.randn(128 * 512 * 3072, device="cuda").half().relu()],
        "100 x 3.1M fp16 (B=32 T=128 FFN activation)": [torch.randn(32 * 128 * 768, device="cuda").half()
                                                       for _ in range(100)],
        "1 x 50M fp32 (LayerNorm output)": [torch.randn(128 * 512 * 768, device="cuda")],
        "1 x 50M bf16": [torch.randn(128 * 512 * 768, device="cuda").bfloat16()],
        "200 x 768 fp32 + 200 x 590K fp32 (biases, weights)": (
            [torch.randn(768, device="cuda") for _ in range(200)] +
            [torch.randn(768 * 768, device="cuda") for _ in range(200)]),
    }
    print("\n## fused statistics kernels alone (CUDA events around 10 calls, median of 10; fp16 format)")
    print("| tensors | NVRTC ms | NVRTC GB/s | Triton ms | one read (amax) ms | read GB/s |")
    print("|---|---|---|---|---|---|")

    old = os.environ.get(stats_cuda.ENV_BACKEND)
    try:
        for name, ts in cases.items():
            nbytes = sum(t.numel() * t.element_size() for t in ts)
            res = []
            for which in ("nvrtc", "triton"):
                os.environ[stats_cuda.ENV_BACKEND] = which
                stats_cuda._state["which"].clear()  # fused_batch_stats remembers the backend per device
                if stats_cuda.backend() != which:
                    res.append(float("nan"))
                    continue
                res.append(cuda_ms_per_call(lambda ts=ts: stats_cuda.fused_batch_stats(ts, fmt)))
            res.append(cuda_ms_per_call(lambda ts=ts: [t.amax() for t in ts]))
            print(f"| {name} | {res[0]:.3f} | {nbytes / res[0] / 1e6:.0f} | {res[1]:.3f} | {res[2]:.3f} | "
                  f"{nbytes / res[2] / 1e6:.0f} |", flush=True)
    finally:
        if old is None:
            os.environ.pop(stats_cuda.ENV_BACKEND, None)
        else:
            os.environ[stats_cuda.ENV_BACKEND] = old
    del cases
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--regimes", default="128x512,32x128", help="BxT,BxT,...")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", default="10,20", help="timed steps per round, per regime (multiples of 10)")
    p.add_argument("--slow-steps", type=int, default=3, help="timed steps per round for the slow tools")
    p.add_argument("--no-others", action="store_true", help="skip HF DebugUnderflowOverflow and detect_anomaly")
    p.add_argument("--ablations", action="store_true", help="also every=1 with a blocking host read, with no attribution flags, "
                   "and with the flags' tensors measured as full rows (not gated)")
    p.add_argument("--torch-path", action="store_true",
                   help="also every=1 with the torch-ops statistics (slow: minutes per step at B=128 T=512)")
    p.add_argument("--sync-steps", type=int, default=10)
    p.add_argument("--profile", default=None, help="folder for every=1 profiles")
    p.add_argument("--kernel", action="store_true", help="also time the statistics kernel alone")
    p.add_argument("--floors", action="store_true",
                   help="also the reference floors: hooks that only append, hooks that read each tensor once, "
                        "and what a watch measures with no bookkeeping (measure-only)")
    p.add_argument("--ab", metavar="REV", default=None,
                   help="also every=1 and every=10 of the package at git revision REV, imported side by side")
    p.add_argument("--phases", type=int, default=0, metavar="STEPS",
                   help="also the host time of each phase of a step (forward, backward, optimizer step, update)")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message=".*[Aa]nomaly.*")
    old = import_revision(args.ab) if args.ab else None

    regimes = [tuple(int(v) for v in r.split("x")) for r in args.regimes.split(",")]
    steps = [int(v) for v in args.steps.split(",")]
    props = torch.cuda.get_device_properties(0)
    print(f"# ampdoctor GPU overhead  {time.strftime('%Y-%m-%d')}  {props.name}  torch {torch.__version__}  "
          f"triton {_triton_version()}  fused stats: {stats_cuda.backend()}")
    if args.kernel:
        kernel_throughput()
    for (batch, seq), k in zip(regimes, steps + steps[-1:] * len(regimes)):
        model, step, desc = build(batch, seq)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"\n## B={batch} T={seq}: {desc} ({n_params / 1e6:.1f}M params), fp16 autocast + GradScaler + "
              f"AdamW; {args.rounds} rounds x {k} steps (slow tools {args.slow_steps})", flush=True)
        configs = [Config("baseline"), watch_config("ampdoctor every=1", model, 1),
                   watch_config("ampdoctor every=10", model, 10)]
        if old is not None:
            configs += [revision_config(f"every=1 at {args.ab}", old, model, 1),
                        revision_config(f"every=10 at {args.ab}", old, model, 10)]
        if args.floors:
            configs += [hooks_only(model), hooks_only(model, read=True), measure_only(model, step.opt),
                        replay_floor(model, step.opt)]
        if args.ablations:
            configs += [watch_config("every=1, blocking read", model, 1, before=_no_defer, after=_defer),
                        watch_config("every=1, no attribution flags", model, 1, before=_no_flags, after=_flags),
                        watch_config("every=1, flags not gated", model, 1, before=_ungated, after=_gated)]
        if args.torch_path:
            configs += [watch_config("every=1, torch path", model, 1, before=_torch_path, after=_fused_path)]
        if not args.no_others:
            hf = hf_debug_config(model, args.slow_steps)
            configs += [c for c in (hf, anomaly_config(args.slow_steps)) if c is not None]
        for c in configs:  # warm-up (compiles the kernels), not timed
            t0 = time.perf_counter()
            td = c.setup() if c.setup else None
            for _ in range(2):
                (c.wrap(step) if c.wrap else step())
            if td:
                td()
            torch.cuda.synchronize()
            print(f"  warm-up {c.name}: {time.perf_counter() - t0:.1f} s", flush=True)
        torch.cuda.synchronize()
        peak = (torch.cuda.reset_peak_memory_stats, torch.cuda.max_memory_allocated)
        res = run_interleaved(step, configs, rounds=args.rounds, steps=k, sync=torch.cuda.synchronize, peak=peak)
        for c in configs:
            if c.name.startswith(("baseline", "ampdoctor")):
                res[c.name].extra.update(count_syncs(step, c, args.sync_steps))
        print(table(res, extra_cols=("syncs/step", "DtoH/step", "sync warnings/step", "launches/step")), flush=True)
        print("\n### host CPU time per step (all threads of the process)\n" + cpu_table(res), flush=True)
        if args.phases:
            print(f"\n### host time per phase ({args.phases} steps x 3 rounds, medians)")
            print(phase_times(step, [c for c in configs if c.name.startswith(("baseline", "ampdoctor", "every=", "hooks"))],
                              3, args.phases), flush=True)
        if args.profile:
            profile_every(step, model, 5, args.profile, f"{batch}x{seq}")
            profile_every(step, model, 20, args.profile, f"{batch}x{seq}_every10", every=10)
        del model, step
        torch.cuda.empty_cache()


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "none"


if __name__ == "__main__":
    main()
