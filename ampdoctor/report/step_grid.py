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
    """Read the per-step statistics of ``kind`` from the report's trace (None when it is gone), totalled
    per layer and step in SQL (:meth:`TraceReader.step_cells`): layers x steps cells, not rows, in memory."""
    path = Path(report.trace)
    if not path.exists():
        return None
    fmt = report.fmt
    with TraceReader(path) as reader, reader.snapshot():
        names = {row["id"]: (row["name"] or "(root)") for row in reader.layers()}
        cells = reader.step_cells(kind)
    order = [r.layer for r in report.rows(kind)]
    if not len(cells["step"]) or not order:
        return None
    steps = np.unique(cells["step"])
    row = {n: i for i, n in enumerate(order)}
    # layer ids -> grid rows (ids of one name share a row; an id missing from the layers table gets no cells)
    at = np.array([row.get(names.get(lid, ""), -1) for lid in cells["layer"].tolist()], dtype=np.int64)
    use = at >= 0
    i, j = at[use], np.searchsorted(steps, cells["step"][use])
    shape = (len(order), len(steps))
    absmax = np.zeros(shape)
    bad = np.zeros(shape, dtype=bool)
    numel = np.zeros(shape)
    under = np.zeros(shape)
    present = np.zeros(shape, dtype=bool)
    present[i, j] = True
    np.maximum.at(absmax, (i, j), cells["absmax"][use])
    np.logical_or.at(bad, (i, j), cells["bad"][use])
    np.add.at(numel, (i, j), cells["numel"][use])
    np.add.at(under, (i, j), cells["under"][use])
    with np.errstate(divide="ignore"):
        head = np.where(absmax > 0, np.log2(fmt.max / np.where(absmax > 0, absmax, 1.0)), np.inf)
    head[bad] = -np.inf
    pct = 100.0 * under / np.maximum(numel, 1)
    return StepGrid(kind, order, steps.tolist(), head, pct, present)
