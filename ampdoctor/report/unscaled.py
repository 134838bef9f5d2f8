"""Gradient exponent histograms from the trace, unscaled, for the loss-scale advisor.

Gradients are recorded *as scaled* by the GradScaler; :func:`unscaled_hists` unscales each step's
histograms with the scale that step's backward used: the previous step's scale after
``update()`` (the first step's is inferred: twice its post-update scale when it was skipped).
Only clean steps count (finite loss, not skipped, no NaN/Inf gradient).
"""

from __future__ import annotations

import math
from pathlib import Path

from ..formats import Format
from ..trace import TraceReader
from .model import Report

__all__ = ["HIGH_PRECISION", "GRAD_KINDS", "grad_layers", "unscaled_hists"]

HIGH_PRECISION = ("float32", "float64")
GRAD_KINDS = ("gradient", "weight_grad")


def _used_scales(report: Report) -> dict[int, float]:
    """Scale each step's backward ran with (see the module doc)."""
    tl = {t["step"]: t for t in report.timeline}
    out: dict[int, float] = {}
    for s in sorted(tl):
        prev = tl.get(s - 1)
        if prev is not None and prev.get("scale"):
            out[s] = float(prev["scale"])
        elif tl[s].get("scale"):
            out[s] = float(tl[s]["scale"]) * (2.0 if tl[s].get("skipped") else 1.0)
        else:
            out[s] = 1.0
    return out


def grad_layers(report: Report) -> set[str] | None:
    """Layers whose gradients live in the low-precision format (None: all of them, a readiness run)."""
    acts = report.rows("activation")
    if not acts or all(r.dtype in HIGH_PRECISION for r in acts):
        return None
    return {r.layer for r in acts if r.dtype not in HIGH_PRECISION}


def unscaled_hists(report: Report) -> tuple[dict[str, dict[int, int]], int] | None:
    """Per layer: unscaled exponent -> count, from clean steps (finite loss, no NaN/Inf gradient),
    and the number of steps used. None when the trace file is gone."""
    path = Path(report.trace)
    if not path.exists():
        return None
    fmt = report.fmt
    scales = _used_scales(report)
    bad_steps = {t["step"] for t in report.timeline if t["loss"] is not None and not math.isfinite(t["loss"])}
    bad_steps |= {t["step"] for t in report.timeline if t.get("skipped")}
    keep = grad_layers(report)
    rows = []
    with TraceReader(path) as reader:
        names = {row["id"]: (row["name"] or "(root)") for row in reader.layers()}
        for kind in GRAD_KINDS:
            rows += reader.stats(kind=kind, with_hist=True)
    for r in rows:
        if r["nan"] or r["posinf"] or r["neginf"]:
            bad_steps.add(r["step"])
    out: dict[str, dict[int, int]] = {}
    steps = set()
    for r in rows:
        name = names.get(r["layer"], f"#{r['layer']}")
        if r["step"] in bad_steps or (keep is not None and name not in keep) or len(r["hist"]) != fmt.n_bins:
            continue
        shift = int(round(math.log2(scales.get(r["step"], 1.0))))
        acc = out.setdefault(name, {})
        for e, c in _row_exponents(r, fmt).items():
            acc[e - shift] = acc.get(e - shift, 0) + c
        steps.add(r["step"])
    return {k: v for k, v in out.items() if v}, len(steps)


def _spread(counts: dict[int, int], n: int, lo: int, hi: int) -> None:
    """Add ``n`` values spread evenly over binades ``lo..hi`` (remainder to the lowest)."""
    hi = max(hi, lo)
    width = hi - lo + 1
    for i, e in enumerate(range(lo, hi + 1)):
        c = n // width + (1 if i < n % width else 0)
        if c:
            counts[e] = counts.get(e, 0) + c


def _row_exponents(r: dict, fmt: Format) -> dict[int, int]:
    """binade -> count of one stats row. The under/over bins only say "below/above the format's
    range"; the row's nzmin/abs-max bound them, and their counts are spread evenly in between
    (an FP32 run measured against fp16 puts its tiny gradients there)."""
    hist = r["hist"]
    out: dict[int, int] = {}
    for e, c in zip(range(fmt.min_exp, fmt.max_exp + 1), hist[1:-1]):
        if c:
            out[e] = int(c)
    under, over = int(hist[0]), int(hist[-1])
    nzmin, absmax = r.get("nzmin"), r.get("absmax")
    if under:
        lo = math.floor(math.log2(nzmin)) if nzmin and 0 < nzmin < math.inf else fmt.min_exp - 1
        hi = math.floor(math.log2(absmax)) if absmax and absmax > 0 else fmt.min_exp - 1
        _spread(out, under, min(lo, fmt.min_exp - 1), min(hi, fmt.min_exp - 1))
    if over:
        hi = math.floor(math.log2(absmax)) if absmax and 0 < absmax < math.inf else fmt.max_exp + 1
        _spread(out, over, fmt.max_exp + 1, max(hi, fmt.max_exp + 1))
    return out
