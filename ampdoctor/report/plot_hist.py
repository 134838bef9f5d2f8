"""Histograms of recorded values (log2 binades) against the format's range: one layer
(:func:`layer_histogram`), or the layers most at risk side by side (:func:`worst_histograms`)."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..formats import Format
from .model import LayerRow, Report
from .plot_style import (
    C_FLUSH,
    C_NORMAL,
    C_OVERFLOW,
    C_SUBNORMAL,
    DPI,
    KIND_LABEL,
    UNDERFLOW_MARK,
    new_axes,
    short_name,
    style,
)

__all__ = ["worst_rows", "layer_histogram", "worst_histograms"]


def _underflow_pct(r: LayerRow) -> float:
    return r.subnormal_pct + r.flush_pct


def worst_rows(report: Report, kind: str, n: int = 4) -> list[LayerRow]:
    """The ``n`` layers of ``kind`` most at risk: the first non-finite producer, then layers by the
    step they first went bad (propagators tie with their producer, so least headroom breaks the
    tie), then overflow, >= 1% underflow and least headroom."""
    first = report.diagnosis.first_nonfinite or {}

    def key(r: LayerRow) -> tuple:
        head = r.headroom_bits if math.isfinite(r.headroom_bits) else (-1e9 if r.headroom_bits < 0 else 1e9)
        under = _underflow_pct(r)
        producer = r.layer == (first.get("layer") or "(root)") and first.get("kind") == kind
        bad_at = r.first_bad_step if r.first_bad_step is not None else 1 << 62
        return (not producer, bad_at, -r.overflow, -(under if under >= UNDERFLOW_MARK else 0.0), head, r.order)
    rows = [r for r in report.rows(kind) if r.hist and sum(r.hist)]
    return sorted(rows, key=key)[:n]


def layer_histogram(row: LayerRow, fmt: Format, *, ax: Axes | None = None, title: str | None = None) -> Figure:
    """log2 histogram of one layer's values (all recorded steps) against ``fmt``'s range, in the
    spirit of unit-scaling's scale plot: the normal range, the subnormal band, flush-to-zero and
    overflow are shaded; the end bars are the under/over bins."""
    with style():
        ax = new_axes(ax, (4.0, 2.6))
        fig = ax.get_figure()
        hist = np.asarray(row.hist, dtype=float)
        total = hist.sum()
        exps = np.arange(fmt.min_exp - 1, fmt.max_exp + 2)  # under bin, exponents, over bin
        frac = hist / total if total else hist
        log_max = math.log2(fmt.max)
        lo, hi = fmt.min_exp - 1.5, fmt.max_exp + 2.5
        ax.axvspan(lo, fmt.min_exp, color=C_FLUSH, alpha=0.35, linewidth=0)
        ax.axvspan(fmt.min_exp, fmt.normal_exp, color=C_SUBNORMAL, alpha=0.6, linewidth=0)
        ax.axvspan(fmt.normal_exp, log_max, color=C_NORMAL, alpha=1.0, linewidth=0)
        ax.axvspan(log_max, hi, color=C_OVERFLOW, alpha=0.25, linewidth=0)
        colors = ["#444444"] * len(exps)
        if len(colors) >= 2:
            colors[0], colors[-1] = C_FLUSH, C_OVERFLOW
        if len(frac) == len(exps):
            ax.bar(exps + 0.5, frac, width=0.9, color=colors, linewidth=0)
        ax.set_xlim(lo, hi)
        ax.set_ylim(0, max(float(frac.max()) * 1.15 if total else 1.0, 1e-3))
        ax.set_xlabel("log2 |x|")
        ax.set_ylabel("fraction of values")
        dtype = "" if row.dtype in ("", None) else f" [{row.dtype}]"
        ax.set_title(title or f"{short_name(row.layer, 30)}{dtype}", loc="left")
        head = (f"headroom {row.headroom_bits:+.1f} bits" if math.isfinite(row.headroom_bits) else
                f"{row.inf} Inf, no finite value" if row.inf and not row.finite else
                f"{row.inf} Inf (abs-max of the finite values)" if row.inf else
                "no finite value (all NaN)" if math.isnan(row.headroom_bits) else "no non-zero finite value")
        stats = (f"abs-max {row.absmax:.3g}  " if row.finite else "") + f"{head}\n" \
                f"overflow {row.overflow_pct:.3g}%  subnormal {row.subnormal_pct:.3g}%  flush {row.flush_pct:.3g}%"
        ax.text(0.01, 0.97, stats, transform=ax.transAxes, va="top", ha="left", fontsize=6.5,
                bbox={"facecolor": "white", "alpha": 0.8, "linewidth": 0, "pad": 1.5})
        return fig


def worst_histograms(report: Report, kind: str = "activation", n: int = 4) -> Figure:
    """One figure: :func:`layer_histogram` of the ``n`` worst layers of ``kind`` side by side."""
    rows = worst_rows(report, kind, n)
    fmt = report.fmt
    with style():
        fig = Figure(figsize=(3.4 * max(len(rows), 1) + 0.4, 3.0), dpi=DPI, layout="constrained")
        if not rows:
            ax = fig.add_subplot()
            ax.text(0.5, 0.5, f"no {KIND_LABEL.get(kind, kind)} recorded", ha="center", va="center")
            ax.set_axis_off()
            return fig
        axes = fig.subplots(1, len(rows), squeeze=False)[0]
        for ax, r in zip(axes, rows):
            layer_histogram(r, fmt, ax=ax)
        fig.suptitle(f"{KIND_LABEL.get(kind, kind).capitalize()} against the {fmt.name} range "
                     f"(grey: flushed to zero, lavender: subnormal, green: normal, red: overflow)", x=0.01, ha="left",
                     fontsize=9)
        return fig
