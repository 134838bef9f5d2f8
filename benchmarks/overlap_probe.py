"""Can a statistics pass hide behind the training's own kernels? A feasibility probe for issue 5's
B=128 every=1 target (the recorded step's kernels take 1.098x of the baseline's kernel time, so a
1.10x wall-time ratio needs the statistics to overlap the model's kernels).

Not ampdoctor: a Triton reader (abs-max, count above the FP16 max, count of nonzero values below its
smallest normal, over every element; a persistent grid of ``G`` programs, each looping over the
tensor) is run on every leaf module's output, every output gradient and every weight gradient, in
forward hooks and tensor hooks, as the recorder reads them. Arms, interleaved in one process:

* ``baseline``: no hooks;
* ``read-once``: one ``amax`` per tensor on the training's stream (``_harness.hooks_only(read=True)``);
* ``main G=…``: the Triton reader on the training's stream;
* ``side G=…``: the Triton reader on a second stream (waits for the training's stream at each hook,
  ``record_stream`` keeps the tensor), so that it may run beside the next kernels; the SM-limited
  grids leave most SMs to the model.

If ``side`` with a small grid stays near ``baseline`` while ``main`` costs ~1.10x, overlapping is the
way to the target; if ``side`` costs what ``main`` costs, the reads and the model contend for memory
bandwidth and overlap cannot help.

Run:  python benchmarks/overlap_probe.py [--batch 128] [--seq 512] [--rounds 5] [--steps 6] [--grids 16,33,66,132]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from _harness import Config, hooks_only, run_interleaved, table, watch_config  # noqa: E402
from overhead_gpu import build  # noqa: E402


@triton.jit
def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    amax = tl.zeros([BLOCK], tl.float32)
    over = tl.zeros([BLOCK], tl.int32)
    sub = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        v = tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32))
        amax = tl.maximum(amax, v)
        over += (v > 65504.0).to(tl.int32)
        sub += ((v > 0) & (v < 6.103515625e-05)).to(tl.int32)
    tl.atomic_max(out_ptr, tl.max(amax, 0))
    tl.atomic_add(out_ptr + 1, (tl.sum(over, 0) + tl.sum(sub, 0)).to(tl.float32))


def reader_config(name: str, model, grid: int, side: bool) -> Config:
    def setup():
        dev = torch.device("cuda")
        out = torch.zeros(2, device=dev)
        stream = torch.cuda.Stream(dev) if side else None
        handles = []

        def read(t):
            if not t.is_floating_point() or not t.numel():
                return
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            n = t.numel()
            g = min(grid, triton.cdiv(n, 4096))
            if stream is None:
                _read[(g,)](t, out, n, BLOCK=4096)
                return
            main = torch.cuda.current_stream(dev)
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                _read[(g,)](t, out, n, BLOCK=4096)
            t.record_stream(stream)

        def post(mod, args, o):
            if isinstance(o, torch.Tensor):
                read(o)
                if o.requires_grad:
                    o.register_hook(lambda g: read(g))

        for m in model.modules():
            if not any(True for _ in m.children()):
                handles.append(m.register_forward_hook(post))
        for p in model.parameters():
            handles.append(p.register_post_accumulate_grad_hook(lambda p: read(p.grad)))

        def teardown():
            for h in handles:
                h.remove()
            if stream is not None:
                torch.cuda.current_stream(dev).wait_stream(stream)

        return teardown

    return Config(name, setup)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--grids", default="16,33,66,132")
    a = ap.parse_args()
    model, step, desc = build(a.batch, a.seq)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# overlap probe  B={a.batch} T={a.seq}  {desc}  {torch.cuda.get_device_name()} ({sms} SMs)  "
          f"torch {torch.__version__} triton {triton.__version__}")
    grids = [int(g) for g in a.grids.split(",")]
    configs = [Config("baseline"), watch_config("ampdoctor every=1", model, 1), hooks_only(model, read=True),
               reader_config(f"main G={8 * sms}", model, 8 * sms, False), reader_config("main G=33", model, 33, False)]
    for g in grids:
        configs.append(reader_config(f"side G={g}", model, g, True))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    res = run_interleaved(step, configs, rounds=a.rounds, steps=a.steps, warmup=2, sync=torch.cuda.synchronize)
    print(table(res))
    base = statistics.median(res["baseline"].ms)
    print(f"baseline {base:.1f} ms/step")


if __name__ == "__main__":
    main()
