"""The headroom heatmap: bits below the format's max per layer (rows) and step (columns), read
from the trace (:mod:`.step_grid`); big grids keep the worst layers and bin the steps."""

from __future__ import annotations

import math

import matplotlib.cm
import matplotlib.lines
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import LinearSegmentedColormap, Normalize, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..formats import Format
from .model import Report
from .plot_style import (
    C_FLUSH,
    C_MISSING,
    C_NONFINITE,
    C_OVERFLOW,
    C_SUBNORMAL,
    KIND_LABEL,
    MAX_ROWS,
    UNDERFLOW_MARK,
    new_axes,
    short_name,
    style,
)
from .step_grid import StepGrid, step_grid

__all__ = ["MAX_COLS", "HEADROOM_CMAP", "headroom_heatmap"]

MAX_COLS = 150       # heatmap columns (steps); longer runs are binned, keeping the worst of each bin
LEGEND_PAD = 17.0    # points between the top of the heatmap and its title: the legend's row goes in between

# headroom colours: warm near overflow, cool with room to spare (red/dark are kept for overflow/NaN)
HEADROOM_CMAP = LinearSegmentedColormap.from_list(
    "ampdoctor_headroom", [(0.0, "#f08a24"), (0.18, "#fde9a9"), (0.45, "#b9dcea"), (1.0, "#1d4e89")])


def _select_rows(grid: StepGrid, max_rows: int) -> tuple[StepGrid, int]:
    """At most ``max_rows`` layers, in execution order: NaN/Inf first, then >= 1% underflow, then least
    headroom; and the number of layers there were."""
    n = len(grid.layers)
    if n <= max_rows:
        return grid, n
    worst = np.where(grid.present, grid.headroom, np.inf).min(axis=1)
    under = grid.underflow.max(axis=1)
    score = np.where(np.isneginf(worst), -1e9, np.where(np.isfinite(worst), worst, 1e9)) - (under >= UNDERFLOW_MARK) * 1e6
    keep = np.sort(np.argsort(score, kind="stable")[:max_rows])
    return StepGrid(grid.kind, [grid.layers[i] for i in keep], grid.steps, grid.headroom[keep], grid.underflow[keep],
                    grid.present[keep]), n


def _bin_cols(grid: StepGrid, max_cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Columns binned to at most ``max_cols``, each bin keeping its worst value."""
    n = len(grid.steps)
    if n <= max_cols:
        return grid.headroom, grid.underflow, grid.present, grid.steps
    edges = np.linspace(0, n, max_cols + 1).astype(int)
    h = np.stack([np.where(grid.present[:, a:b], grid.headroom[:, a:b], np.inf).min(axis=1)
                  for a, b in zip(edges[:-1], edges[1:])], axis=1)
    u = np.stack([grid.underflow[:, a:b].max(axis=1) for a, b in zip(edges[:-1], edges[1:])], axis=1)
    p = np.stack([grid.present[:, a:b].any(axis=1) for a, b in zip(edges[:-1], edges[1:])], axis=1)
    return h, u, p, [grid.steps[a] for a in edges[:-1]]


def _step_ticks(col_steps: list[int], n: int = 12) -> tuple[list[int], list[str]]:
    """Column positions of round step numbers (columns may be binned or sampled every N steps)."""
    from matplotlib.ticker import MaxNLocator
    if len(col_steps) == 1:
        return [0], [str(col_steps[0])]
    values = [v for v in MaxNLocator(nbins=n, integer=True).tick_values(col_steps[0], col_steps[-1])
              if col_steps[0] <= v <= col_steps[-1]]
    cols = np.searchsorted(np.asarray(col_steps), values, side="right") - 1
    ticks, labels = [], []
    for c in cols:
        if c not in ticks:
            ticks.append(int(c))
            labels.append(str(col_steps[int(c)]))
    return ticks, labels


def _headroom_rgba(head: np.ndarray, present: np.ndarray, fmt: Format) -> np.ndarray:
    normal_bits = math.log2(fmt.max / fmt.smallest_normal)
    flush_bits = math.log2(fmt.max / fmt.smallest_subnormal)
    cmap = HEADROOM_CMAP
    rgba = cmap(Normalize(0.0, normal_bits)(np.clip(np.nan_to_num(head, posinf=0, neginf=0), 0, normal_bits)))
    for mask, color in ((head > normal_bits, C_SUBNORMAL), (head > flush_bits, C_FLUSH),
                        ((head < 0) & np.isfinite(head), C_OVERFLOW), (np.isneginf(head), C_NONFINITE),
                        (np.isposinf(head), C_FLUSH), (~present, C_MISSING)):
        rgba[mask] = to_rgba(color)
    return rgba


def headroom_heatmap(report: Report, kind: str = "activation", *, ax: Axes | None = None,
                     grid: StepGrid | None = None) -> Figure:
    """Headroom in bits (``log2(format max / abs-max)``) per layer and step. Red: overflow (< 0
    bits); dark: NaN/Inf; lavender: even the largest value is subnormal; grey: everything flushes
    to zero; a dot: at least 1% of the values are subnormal or flushed."""
    fmt = report.fmt
    grid = grid if grid is not None else step_grid(report, kind)
    with style():
        n_rows = min(len(grid.layers), MAX_ROWS) if grid else 1
        ax = new_axes(ax, (11.0, min(max(1.9 + 0.2 * n_rows, 2.8), 15.0)))
        fig = ax.get_figure()
        title = f"Headroom of {KIND_LABEL.get(kind, kind)} in {fmt.name}"
        if grid is None:
            ax.set_title(title, loc="left")
            ax.text(0.5, 0.5, "no per-step statistics in the trace", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            return fig
        grid, total = _select_rows(grid, MAX_ROWS)
        head, under, present, col_steps = _bin_cols(grid, MAX_COLS)
        rgba = _headroom_rgba(head, present, fmt)
        ax.imshow(rgba, aspect="auto", interpolation="nearest")
        ys, xs = np.nonzero((under >= UNDERFLOW_MARK) & present)
        if len(xs):
            ax.scatter(xs, ys, s=9, c="#b000d0", marker="o", edgecolors="white", linewidths=0.4)
        ax.set_yticks(range(len(grid.layers)), [short_name(n) for n in grid.layers])
        ticks, labels = _step_ticks(col_steps)
        ax.set_xticks(ticks, labels)
        ax.set_xlabel("step" + (" (binned: worst of each bin)" if len(col_steps) < len(grid.steps) else ""))
        if total > len(grid.layers):
            title += f" - {len(grid.layers)} of {total} layers with the least headroom"
        # the title goes on a line of its own above the legend's, which it would run into once long
        ax.set_title(title, loc="left", pad=LEGEND_PAD)
        normal_bits = math.log2(fmt.max / fmt.smallest_normal)
        cmap = HEADROOM_CMAP.with_extremes(under=C_OVERFLOW, over=C_SUBNORMAL)
        sm = matplotlib.cm.ScalarMappable(Normalize(0, normal_bits), cmap)
        fig.colorbar(sm, ax=ax, label="headroom (bits)", fraction=0.03, pad=0.01, extend="both")
        handles = [Patch(color=C_OVERFLOW, label="overflow (< 0 bits)"), Patch(color=C_NONFINITE, label="NaN/Inf"),
                   Patch(color=C_SUBNORMAL, label="all values subnormal"), Patch(color=C_FLUSH, label="all flush to zero"),
                   matplotlib.lines.Line2D([], [], marker="o", color="#b000d0", linestyle="", markersize=4,
                                           label=f">= {UNDERFLOW_MARK:g}% subnormal/flushed")]
        ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=5, frameon=False,
                  borderaxespad=0.2, handlelength=1.2, columnspacing=1.0)
        return fig
