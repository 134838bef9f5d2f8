"""An independent numpy reference for the statistics (float64 arithmetic on the exact values)."""

from __future__ import annotations

import math

import numpy as np


def reference_stats(values: np.ndarray, fmt) -> dict:
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    a = np.abs(x)
    fin = np.isfinite(x)
    nz = fin & (a > 0)
    out = {
        "numel": x.size,
        "nan": int(np.isnan(x).sum()),
        "posinf": int(np.isposinf(x).sum()),
        "neginf": int(np.isneginf(x).sum()),
        "zero": int((x == 0).sum()),
        "min": float(x[fin].min()) if fin.any() else math.inf,
        "max": float(x[fin].max()) if fin.any() else -math.inf,
        "absmax": float(a[fin].max()) if fin.any() else 0.0,
        "nzmin": float(a[nz].min()) if nz.any() else math.inf,
        "overflow": int((fin & (a > fmt.max)).sum()),
        "subnormal": int(((a >= fmt.smallest_subnormal) & (a < fmt.smallest_normal)).sum()),
        "flush_to_zero": int((nz & (a < fmt.smallest_subnormal)).sum()),
    }
    hist = np.zeros(fmt.n_bins, dtype=np.int64)
    for v in a[nz]:
        m, e = math.frexp(float(v))  # v = m * 2**e, m in [0.5, 1)
        b = (e - 1) - fmt.min_exp + 1
        hist[min(max(b, 0), fmt.n_bins - 1)] += 1
    out["hist"] = hist.tolist()
    return out
