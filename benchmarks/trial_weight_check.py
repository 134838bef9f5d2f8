"""Cost of a bisect trial's every-step weight check (``Session._params_screen``): the same training
steps under a search trial's recorder configuration (``TrialRunner.config(lite=True)``: an oracle,
``every=LITE_EVERY``, only step 0 recorded), with the NaN/Inf check of the weights on and off,
interleaved rounds in one process (medians, and each round's ratio paired with the same round's
"check off"). There is no switch for the check in the package: the "check off" arm replaces
``Session._params_screen`` by one that returns None (what the oracle gets where nothing was checked)
for its rounds only. "unwatched" is the plain training loop, for scale. On CUDA, "check on, sums"
is the check without the NVRTC flags kernel (``stats_cuda.flags_backend`` patched to False: one
sum per weight, as on the CPU).

``--pairs`` adds a finer interleave, steadier on a shared host: one trial session, the check on and
off at alternate steps, each step timed alone (median of each, and the median ratio of adjacent
steps). The check alone (one ``_params_screen`` call and the read of its result) is timed too.

Models (random weights, nothing downloaded): an MLP of ``--mlp-layers`` Linear+ReLU layers of width
``--mlp-width``, and the encoder of ``_models.py`` (``--d``, ``--layers``, ``--vocab``, ``--seq``);
fp16 autocast, GradScaler and AdamW.

Run:  python benchmarks/trial_weight_check.py [--device cpu|cuda] [--model mlp encoder] [--rounds 7] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Config, cpu_table, run_interleaved, table  # noqa: E402
from _models import Encoder  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor import session as session_mod  # noqa: E402
from ampdoctor import stats_cuda  # noqa: E402
from ampdoctor.bisect.trials import LITE_EVERY, TrialRunner  # noqa: E402
from ampdoctor.oracle import OracleConfig  # noqa: E402

Session = session_mod.Session
REAL_SCREEN = Session._params_screen
REAL_FLAGS_BACKEND = stats_cuda.flags_backend


def trial_config(trace: Path):
    """A search trial's RunConfig, as ``ampdoctor bisect`` builds it (default oracle, nothing forced
    to FP32, no step budget, no pass_after: the oracle never passes the run early)."""
    runner = TrialRunner(None, [], trace.parent, fmt="fp16", oracle=OracleConfig().to_dict())
    cfg = runner.config([], trace=trace, pass_after=None, lite=True)
    assert cfg.every == LITE_EVERY and cfg.oracle is not None
    return cfg


def trial_arm(name: str, model: nn.Module, *, check: bool, sums: bool = False, calls: list | None = None) -> Config:
    """A fresh trial session per round (as a trial process has), the model watched in it; its step 0
    (recorded in full) falls in the round's untimed warm-up. ``check``: the weight check as shipped,
    else ``_params_screen`` returns None. ``sums``: without the NVRTC flags kernel. ``calls``: count
    the check's calls (the sanity pass only, not timed)."""

    def screen(self):
        if calls is not None:
            calls.append(self.step)
        return REAL_SCREEN(self) if check else None

    def setup():
        Session._params_screen = screen
        if sums:
            stats_cuda.flags_backend = lambda dev: False
        d = Path(tempfile.mkdtemp(prefix="ampdoctor-bench-trial-"))
        session = Session(trial_config(d / "trace.sqlite"), owned=True)
        session_mod._set_current(session)
        w = ampdoctor.watch(model)
        assert w.session is session

        def teardown():
            try:
                decided = session.decision  # (close() lets the oracle finish: a pass)
                w.remove()
                session.close()
                if decided is not None:
                    raise SystemExit(f"{name}: the oracle decided {decided} during the round (the timings would "
                                     "not be a search trial's steady state)")
            finally:
                shutil.rmtree(d, ignore_errors=True)
                session_mod._set_current(None)
                Session._params_screen = REAL_SCREEN
                stats_cuda.flags_backend = REAL_FLAGS_BACKEND

        return teardown

    return Config(name, setup)


def build(kind: str, args, dev: torch.device):
    torch.manual_seed(0)
    if kind == "mlp":
        layers = []
        for _ in range(args.mlp_layers):
            layers += [nn.Linear(args.mlp_width, args.mlp_width), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(args.mlp_width, 1)).to(dev)
        x = torch.randn(args.mlp_batch, args.mlp_width, device=dev)
        y = torch.randn(args.mlp_batch, 1, device=dev)

        def loss_fn():
            return F.mse_loss(model(x).float(), y)

        desc = f"MLP {args.mlp_layers}x{args.mlp_width}, B={args.mlp_batch}"
    else:
        model = Encoder(vocab=args.vocab, d=args.d, layers=args.layers, heads=args.heads, ffn=4 * args.d,
                        max_len=args.seq).to(dev)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)

        def loss_fn():
            return F.cross_entropy(model(ids).float().view(-1, args.vocab), ids.view(-1))

        desc = f"encoder d={args.d} layers={args.layers} heads={args.heads} vocab={args.vocab}, B={args.batch} T={args.seq}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(dev.type)

    def step() -> None:
        with torch.autocast(dev.type, dtype=torch.float16):
            loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    params = list(model.parameters())
    desc += f" ({len(params)} weight tensors, {sum(p.numel() for p in params) / 1e6:.2f}M params)"
    return model, step, desc


def screen_alone(model: nn.Module, sync, n: int = 30) -> float:
    """Milliseconds per call of the check alone (``_params_screen`` and a read of its result, as
    ``_to_host`` does), in a live trial session, median of ``n``."""
    teardown = trial_arm("alone", model, check=True).setup()
    try:
        s = session_mod.get_session(create=False)
        times = []
        for _ in range(n + 2):
            sync()
            t0 = time.perf_counter()
            pieces, _ = s._params_screen()
            for p in pieces:
                float(p)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times[2:])
    finally:
        teardown()


def alternating(model: nn.Module, step, sync, pairs: int, warmup: int) -> str:
    """One trial session, the check on and off at alternate steps (the order swaps every pair), each
    step timed alone (synced: a trial's step syncs anyway, to read its loss): adjacent steps share the
    machine's load, which drifts between rounds on a shared host."""
    on_now = [True]
    inside: list[float] = []  # ms in _params_screen itself, on the steps with the check

    def screen(self):
        if not on_now[0]:
            return None
        t0 = time.perf_counter()
        try:
            return REAL_SCREEN(self)
        finally:
            inside.append((time.perf_counter() - t0) * 1e3)

    teardown = trial_arm("alternating", model, check=True).setup()
    Session._params_screen = screen  # (teardown restores it)
    got: dict[bool, tuple[list, list]] = {True: ([], []), False: ([], [])}  # wall ms, CPU ms
    try:
        for _ in range(warmup):
            step()
        for k in range(2 * pairs):
            on_now[0] = (k % 2 == 0) != (k // 2 % 2 == 1)
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            sync()
            wall, cpu = got[on_now[0]]
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
    finally:
        teardown()
    out = [f"alternating steps, one session, {pairs} pairs (medians; paired: the median ratio of adjacent steps):"]
    for i, what in enumerate(("wall", "CPU")):
        on, off = got[True][i], got[False][i]
        m_on, m_off = statistics.median(on), statistics.median(off)
        paired = statistics.median(a / b for a, b in zip(on, off))
        out.append(f"  {what}: check on {m_on:.2f} ms, off {m_off:.2f} ms, ratio {m_on / m_off:.3f}x, "
                   f"paired {paired:.3f}x")
    out.append(f"  in those steps, _params_screen itself (host, wall): {statistics.median(inside):.3f} ms")
    return "\n".join(out)


def bench(kind: str, args, dev: torch.device, sync) -> None:
    model, step, desc = build(kind, args, dev)
    configs = [Config("unwatched"), trial_arm("check off", model, check=False), trial_arm("check on", model, check=True)]
    if dev.type == "cuda":
        configs.append(trial_arm("check on, sums", model, check=True, sums=True))
    print(f"\n## {desc}", flush=True)
    # sanity, untimed: each trial arm reaches the (patched or real) check at every step after step 0, and
    # its oracle decides nothing
    for c in configs[1:]:
        calls: list = []
        arm = trial_arm(c.name, model, check=c.name != "check off", sums="sums" in c.name, calls=calls)
        td = arm.setup()
        for _ in range(args.warmup + 3):
            step()
        sync()
        td()
        if calls != list(range(1, args.warmup + 3)):
            raise SystemExit(f"{c.name}: _params_screen called at steps {calls}, expected 1..{args.warmup + 2}")
    res = run_interleaved(step, configs, rounds=args.rounds, steps=args.steps, warmup=args.warmup, sync=sync)
    print(table(res, base="check off"))
    print()
    print(cpu_table(res, base="check off"))
    on, off = statistics.median(res["check on"].ms), statistics.median(res["check off"].ms)
    print(f"\ncheck on - check off: {on - off:+.3f} ms/step (medians); the check alone: "
          f"{screen_alone(model, sync):.3f} ms/call (screen + read of its result)", flush=True)
    if args.pairs:
        print(alternating(model, step, sync, args.pairs, args.warmup), flush=True)
    if dev.type == "cuda":  # (where "check on" ran the flags kernel; else it summed, as "check on, sums")
        print(f"NVRTC flags kernel used by \"check on\": {REAL_FLAGS_BACKEND(next(model.parameters()).device)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", nargs="+", default=["mlp", "encoder"], choices=["mlp", "encoder"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round and arm")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per round and arm (step 0 is recorded in full)")
    p.add_argument("--pairs", type=int, default=50,
                   help="also: this many pairs of adjacent steps in one trial session, the check on in one (0: not)")
    p.add_argument("--mlp-width", type=int, default=256)
    p.add_argument("--mlp-layers", type=int, default=8)
    p.add_argument("--mlp-batch", type=int, default=32)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads on the CPU (1: steadier numbers on a shared machine)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    print(f"# trial weight check  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  {where}, "
          f"{torch.get_num_threads()} torch threads, {os.cpu_count()} cores; fp16 autocast + GradScaler + AdamW; "
          f"{args.rounds} rounds x {args.steps} steps (+{args.warmup} warm-up) per arm")
    t0 = time.perf_counter()
    for kind in args.model:
        bench(kind, args, dev, sync)
    print(f"\n# total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
