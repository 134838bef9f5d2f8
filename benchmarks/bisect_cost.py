"""How many trials and how much time bisect costs, against n candidate layers (issue 3).

Runs fixtures/deep_mlp.py with n = 8..64 layers and one planted culprit, three ways:
bisect as shipped (the baseline trace points at the culprit), bisect with --no-hints (pure
hierarchical group testing), and a linear one-at-a-time search (counted: 2 controls + the
culprit's position + 1). Also times one plain run of the script up to its failure step, and
reports bisect's wall time as a multiple of it.

    python benchmarks/bisect_cost.py [--sizes 8 16 32 64] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "deep_mlp.py"


def bisect(n: int, k: int, device: str, hints: bool, drill: bool) -> tuple[dict, float]:
    out = Path(tempfile.mkdtemp(prefix=f"bisect-cost-{n}-"))
    cmd = [sys.executable, "-m", "ampdoctor", "bisect", "--out", str(out)]
    if not hints:
        cmd.append("--no-hints")
    if not drill:
        cmd.append("--no-drill")
    cmd += [str(FIXTURE), "--", "--layers", str(n), "--culprit", str(k), "--device", device]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.perf_counter() - t0
    res = json.loads((out / "bisect.json").read_text())
    if res["verdict"] != "culprit" or res["culprits"] != [f"layers.{k}"]:
        raise SystemExit(f"n={n}: wrong result {res['verdict']} {res['culprits']}\n{p.stdout}\n{p.stderr}")
    return res, wall


def plain_run(n: int, k: int, device: str, steps: int) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(FIXTURE), "--layers", str(n), "--culprit", str(k), "--device", device,
                    "--steps", str(steps)], capture_output=True, cwd=ROOT, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    rows = []
    for n in args.sizes:
        k = (2 * n) // 3
        res, wall = bisect(n, k, args.device, hints=True, drill=True)
        search = [t for t in res["trials"]][:-1]  # the last trial is the drill-down
        res_nh, wall_nh = bisect(n, k, args.device, hints=False, drill=False)
        fail_step = res["failure"]["step"]
        # the oracle needs K=3 non-finite steps: a plain run to the decided failure
        one = plain_run(n, k, args.device, fail_step + 3)
        rows.append({
            "n": n, "culprit": f"layers.{k}", "fail_step": fail_step,
            "trials_hinted": len(search), "trials_no_hints": len(res_nh["trials"]),
            "target": 2 + math.ceil(math.log2(n)) + 1, "linear": 2 + k + 1,
            "one_run_s": one, "bisect_s": wall, "bisect_no_hints_s": wall_nh,
        })
        r = rows[-1]
        print(f"n={n:3d}: hinted {r['trials_hinted']} trials {wall:.1f}s ({wall / one:.1f}x one run of {one:.1f}s); "
              f"no hints {r['trials_no_hints']} trials {wall_nh:.1f}s; linear {r['linear']}", flush=True)
    print()
    print("| n | culprit | trials (trace-guided) | trials (--no-hints) | target 2+ceil(log2 n)+1 | linear one-at-a-time "
          "| one run to failure | bisect wall (x one run) | --no-hints --no-drill wall (x one run) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['culprit']} | {r['trials_hinted']} | {r['trials_no_hints']} | {r['target']} | {r['linear']} "
              f"| {r['one_run_s']:.1f} s | {r['bisect_s']:.1f} s ({r['bisect_s'] / r['one_run_s']:.1f}x) "
              f"| {r['bisect_no_hints_s']:.1f} s ({r['bisect_no_hints_s'] / r['one_run_s']:.1f}x) |")


if __name__ == "__main__":
    main()
