"""Which layers ran in which dtype, and the activation bytes each dtype took per step."""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .model import Report
from .plot_style import DPI, MAX_ROWS, new_axes, short_name, style

__all__ = ["DTYPE_COLORS", "dtype_map", "dtype_bytes", "dtype_figure"]

DTYPE_COLORS = {"float16": "#1f77b4", "bfloat16": "#2ca02c", "float32": "#7f7f7f", "float64": "#404040",
                "float8_e4m3fn": "#9467bd", "float8_e5m2": "#8c564b"}


def _dtype_color(dtype: str) -> str:
    return DTYPE_COLORS.get(dtype, "#bcbd22")


def dtype_map(report: Report, *, ax: Axes | None = None, max_rows: int = MAX_ROWS) -> Figure:
    """Which layers ran in which dtype (activations, execution order): one bar per layer, its length
    the activation bytes per step, its colour the dtype."""
    rows = report.rows("activation")
    shown = rows[:max_rows]
    with style():
        ax = new_axes(ax, (6.0, min(2.0 + 0.2 * max(len(shown), 1), 15.0)))
        fig = ax.get_figure()
        if not rows:
            ax.text(0.5, 0.5, "no activations recorded", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            return fig
        y = np.arange(len(shown))
        ax.barh(y, [max(r.bytes, 1) for r in shown], color=[_dtype_color(r.dtype) for r in shown], height=0.8)
        ax.set_yticks(y, [short_name(r.layer, 32) for r in shown])
        ax.invert_yaxis()
        ax.set_xlabel("activation bytes per step")
        more = f" (first {len(shown)} of {len(rows)})" if len(rows) > len(shown) else ""
        ax.set_title("Layer output dtypes, execution order" + more, loc="left")
        seen = sorted({r.dtype for r in shown})
        ax.legend(handles=[Patch(color=_dtype_color(d), label=d) for d in seen], loc="lower right", frameon=True)
        return fig


def dtype_bytes(report: Report, *, ax: Axes | None = None) -> Figure:
    """Activation bytes per step, summed by dtype."""
    totals: dict[str, int] = {}
    for r in report.rows("activation"):
        totals[r.dtype] = totals.get(r.dtype, 0) + r.bytes
    with style():
        ax = new_axes(ax, (4.0, 2.6))
        fig = ax.get_figure()
        names = sorted(totals)
        vals = [totals[n] for n in names]
        ax.bar(names, vals, color=[_dtype_color(n) for n in names])
        for i, v in enumerate(vals):
            ax.text(i, v, _fmt_bytes(v), ha="center", va="bottom")
        ax.set_ylabel("bytes per step")
        ax.set_title("Activation bytes by dtype", loc="left")
        if vals:
            ax.set_ylim(0, max(vals) * 1.2)
        return fig


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def dtype_figure(report: Report) -> Figure:
    """:func:`dtype_map` and :func:`dtype_bytes` side by side."""
    n = min(len(report.rows("activation")), MAX_ROWS)
    with style():
        fig = Figure(figsize=(11.0, min(2.2 + 0.2 * max(n, 1), 15.0)), dpi=DPI, layout="constrained")
        left, right = fig.subplots(1, 2, width_ratios=[2.2, 1])
        dtype_map(report, ax=left)
        dtype_bytes(report, ax=right)
        return fig
