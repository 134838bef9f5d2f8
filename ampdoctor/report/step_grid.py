"""Per-step statistics of one kind from the report's trace, as a layers x steps grid of headroom
and underflow: the data behind the headroom heatmap (numpy only, nothing drawn here)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..trace import TraceReader
from .model import Report

__all__ = ["StepGrid", "step_grid"]


@dataclass
class StepGrid:
    """Layers (rows, execution order) x recorded steps (columns) of one kind."""
    kind: str
    layers: list[str]
    steps: list[int]
    headroom: np.ndarray    # bits; -inf where the layer held NaN/Inf, +inf where all values were zero
    underflow: np.ndarray   # percent of values subnormal or flushed to zero
    present: np.ndarray     # bool: the layer produced this kind at this step


def step_grid(report: Report, kind: str) -> StepGrid | None:
    """Read the per-step statistics of ``kind`` from the report's trace (None when it is gone)."""
    path = Path(report.trace)
    if not path.exists():
        return None
    fmt = report.fmt
    with TraceReader(path) as reader:
        names = {row["id"]: (row["name"] or "(root)") for row in reader.layers()}
        stats = reader.stats(kind=kind)
    order = [r.layer for r in report.rows(kind)]
    if not stats or not order:
        return None
    steps = sorted({s["step"] for s in stats})
    col = {s: i for i, s in enumerate(steps)}
    row = {n: i for i, n in enumerate(order)}
    shape = (len(order), len(steps))
    absmax = np.zeros(shape)
    bad = np.zeros(shape, dtype=bool)
    numel = np.zeros(shape)
    under = np.zeros(shape)
    present = np.zeros(shape, dtype=bool)
    for s in stats:
        i = row.get(names.get(s["layer"], ""))
        if i is None:
            continue
        j = col[s["step"]]
        present[i, j] = True
        absmax[i, j] = max(absmax[i, j], s["absmax"] or 0.0)
        bad[i, j] |= bool(s["nan"] or s["posinf"] or s["neginf"])
        numel[i, j] += s["numel"]
        under[i, j] += s["subnormal"] + s["flush_to_zero"]
    with np.errstate(divide="ignore"):
        head = np.where(absmax > 0, np.log2(fmt.max / np.where(absmax > 0, absmax, 1.0)), np.inf)
    head[bad] = -np.inf
    pct = 100.0 * under / np.maximum(numel, 1)
    return StepGrid(kind, order, steps, head, pct, present)
