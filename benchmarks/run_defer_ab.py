"""`ampdoctor run` on the CUDA fixtures twice: with a recorded step's weights read where the next
backward starts (the default on CUDA) and at each step boundary (``AMPDOCTOR_DEFER_READ=0``). The
traces (statistics rows, events, steps) must be equal. Prints SAME/DIFF per fixture and the last
lines of each run's output; exit status 1 on any difference.

Run (on a CUDA machine):  python benchmarks/run_defer_ab.py [FIXTURE ...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from ampdoctor.trace import TraceReader  # noqa: E402

FIXTURES = ["linear_overflow", "attention_overflow", "norm_overflow", "grad_underflow", "pure_half", "healthy", "crash"]


def _run(fixture: str, defer: bool) -> tuple[subprocess.CompletedProcess, str]:
    out = tempfile.mkdtemp()
    env = dict(os.environ, AMPDOCTOR_DEFER_READ="1" if defer else "0")
    cmd = [sys.executable, "-m", "ampdoctor", "run", "--out", out, os.path.join(ROOT, "fixtures", f"{fixture}.py"),
           "--", "--device", "cuda"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT), out


def _trace(folder: str) -> tuple[list, list, list]:
    r = TraceReader(os.path.join(folder, "trace.sqlite"))
    rows = sorted(r.stats(), key=lambda s: (s["step"], s["layer"], s["kind"], s["slot"], s["call"]))
    events = [(e["step"], e["kind"], e["layer"]) for e in r.events()]
    steps = [(s["step"], repr(s["loss"]), s["scale"]) for s in r.steps()]
    return rows, events, steps


def main() -> int:
    bad = 0
    for fx in sys.argv[1:] or FIXTURES:
        (a, out_a), (b, out_b) = _run(fx, True), _run(fx, False)
        ta, tb = _trace(out_a), _trace(out_b)
        same = ta == tb
        bad += not same
        print(f"== {fx}: exit {a.returncode}/{b.returncode}, rows {len(ta[0])}/{len(tb[0])}: {'SAME' if same else 'DIFF'}")
        if not same:
            print("   first differing rows:", [(x, y) for x, y in zip(ta[0], tb[0]) if x != y][:2])
        print("   " + "\n   ".join((a.stdout + a.stderr).strip().splitlines()[-4:]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
