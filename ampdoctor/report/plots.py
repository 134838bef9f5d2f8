"""Deterministic matplotlib plots of a :class:`~ampdoctor.report.model.Report`.

Every function draws on ``ax`` when given (and returns that axes' figure), otherwise on a new
``matplotlib.figure.Figure`` of a fixed size that is *not* registered with pyplot, so nothing
leaks into a notebook's or a script's figure list. :func:`to_png` renders a figure with a fixed
style, dpi and no PNG metadata (same report -> same bytes) and closes figures it created.

Per-step views (the headroom heatmaps) read the report's trace file; everything else uses the
report's aggregates. No pyplot import here: ``Figure`` + Agg need no global state.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import matplotlib
import matplotlib.cm
import matplotlib.lines
import matplotlib.style
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import LinearSegmentedColormap, Normalize, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..formats import Format
from ..trace import TraceReader
from .model import LayerRow, Report

__all__ = [
    "StepGrid", "step_grid", "headroom_heatmap", "layer_histogram", "worst_histograms", "worst_rows",
    "loss_timeline", "scale_timeline", "timeline", "dtype_map", "dtype_bytes", "dtype_figure", "to_png",
    "figure_makers",
]

DPI = 100
MAX_ROWS = 60        # heatmap rows (layers); the worst are kept, in execution order
MAX_COLS = 150       # heatmap columns (steps); longer runs are binned, keeping the worst of each bin
UNDERFLOW_MARK = 1.0  # percent of values subnormal or flushed that earns a heatmap cell a dot

_STYLE = {
    "font.family": "DejaVu Sans", "font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8,
    "xtick.labelsize": 7, "ytick.labelsize": 7, "legend.fontsize": 7, "figure.dpi": DPI,
    "savefig.dpi": DPI, "image.interpolation": "nearest", "svg.hashsalt": "ampdoctor",
    "axes.spines.top": False, "axes.spines.right": False,
}
C_OVERFLOW = "#d62728"
C_NONFINITE = "#3b0000"
C_SUBNORMAL = "#c5b0d5"
C_FLUSH = "#9e9e9e"
C_MISSING = "#ffffff"
C_NORMAL = "#e8f4e8"
C_SKIP = "#ff7f0e"
# headroom colours: warm near overflow, cool with room to spare (red/dark are kept for overflow/NaN)
HEADROOM_CMAP = LinearSegmentedColormap.from_list(
    "ampdoctor_headroom", [(0.0, "#f08a24"), (0.18, "#fde9a9"), (0.45, "#b9dcea"), (1.0, "#1d4e89")])
DTYPE_COLORS = {"float16": "#1f77b4", "bfloat16": "#2ca02c", "float32": "#7f7f7f", "float64": "#404040",
                "float8_e4m3fn": "#9467bd", "float8_e5m2": "#8c564b"}
KIND_LABEL = {"activation": "activations", "gradient": "activation gradients (as scaled)",
              "weight": "weights", "weight_grad": "weight gradients (as scaled)"}


@contextlib.contextmanager
def _style() -> Iterator[None]:
    """Matplotlib defaults plus our rc, whatever the caller's rcParams are."""
    with matplotlib.style.context("default"), matplotlib.rc_context(_STYLE):
        yield


def _new_axes(ax: Axes | None, size: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    return fig.add_subplot()


def _short(name: str, width: int = 38) -> str:
    return name if len(name) <= width else "\u2026" + name[-(width - 1):]


def to_png(fig: Figure, *, close: bool = True) -> bytes:
    """PNG bytes of ``fig`` (fixed dpi, no metadata, so identical input gives identical bytes).
    Closes ``fig`` when it is a pyplot figure and ``close`` is true; our own figures need no closing."""
    buf = io.BytesIO()
    with _style():
        fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None}, facecolor="white")
    if close and "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close(fig)  # a no-op for figures pyplot does not manage
    return buf.getvalue()


# -- per-step grid ------------------------------------------------------------------------------
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


def _select_rows(grid: StepGrid, max_rows: int) -> tuple[StepGrid, int]:
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
    with _style():
        n_rows = min(len(grid.layers), MAX_ROWS) if grid else 1
        ax = _new_axes(ax, (11.0, min(max(1.9 + 0.2 * n_rows, 2.8), 15.0)))
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
        ax.set_yticks(range(len(grid.layers)), [_short(n) for n in grid.layers])
        ticks, labels = _step_ticks(col_steps)
        ax.set_xticks(ticks, labels)
        ax.set_xlabel("step" + (" (binned: worst of each bin)" if len(col_steps) < len(grid.steps) else ""))
        if total > len(grid.layers):
            title += f" - {len(grid.layers)} of {total} layers with the least headroom"
        ax.set_title(title, loc="left")
        normal_bits = math.log2(fmt.max / fmt.smallest_normal)
        cmap = HEADROOM_CMAP.with_extremes(under=C_OVERFLOW, over=C_SUBNORMAL)
        sm = matplotlib.cm.ScalarMappable(Normalize(0, normal_bits), cmap)
        fig.colorbar(sm, ax=ax, label="headroom (bits)", fraction=0.03, pad=0.01, extend="both")
        handles = [Patch(color=C_OVERFLOW, label="overflow (< 0 bits)"), Patch(color=C_NONFINITE, label="NaN/Inf"),
                   Patch(color=C_SUBNORMAL, label="all values subnormal"), Patch(color=C_FLUSH, label="all flush to zero"),
                   matplotlib.lines.Line2D([], [], marker="o", color="#b000d0", linestyle="", markersize=4,
                                           label=f">= {UNDERFLOW_MARK:g}% subnormal/flushed")]
        ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=5, frameon=False,
                  borderaxespad=0.2, handlelength=1.2, columnspacing=1.0)
        return fig


# -- histograms against the format's range -----------------------------------------------------
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
    with _style():
        ax = _new_axes(ax, (4.0, 2.6))
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
        ax.set_title(title or f"{_short(row.layer, 30)}{dtype}", loc="left")
        stats = f"abs-max {row.absmax:.3g}  headroom {row.headroom_bits:+.1f} bits\n" \
                f"overflow {row.overflow_pct:.3g}%  subnormal {row.subnormal_pct:.3g}%  flush {row.flush_pct:.3g}%"
        ax.text(0.01, 0.97, stats, transform=ax.transAxes, va="top", ha="left", fontsize=6.5,
                bbox={"facecolor": "white", "alpha": 0.8, "linewidth": 0, "pad": 1.5})
        return fig


def worst_histograms(report: Report, kind: str = "activation", n: int = 4) -> Figure:
    """One figure: :func:`layer_histogram` of the ``n`` worst layers of ``kind`` side by side."""
    rows = worst_rows(report, kind, n)
    fmt = report.fmt
    with _style():
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


# -- timeline ------------------------------------------------------------------------------------
def _control_loss(report: Report) -> list[tuple[int, float]]:
    """The FP32 control's losses from the bisect JSON, if it recorded them."""
    b = report.bisect or {}
    loss = b.get("fp32_control_losses")  # {"step": loss}, written by bisect's FP32 reference run
    if loss is None:
        ctl = b.get("control") or b.get("fp32_control") or {}
        loss = ctl.get("loss") if isinstance(ctl, dict) else None
    if isinstance(loss, dict):
        return sorted((int(k), float(v)) for k, v in loss.items() if v is not None and str(k).lstrip("-").isdigit())
    if isinstance(loss, list):
        out = []
        for i, v in enumerate(loss):
            if isinstance(v, (list, tuple)) and len(v) == 2:
                out.append((int(v[0]), float(v[1]) if v[1] is not None else math.nan))
            elif isinstance(v, (int, float)):
                out.append((i, float(v)))
        return out
    return []


def _mark_skipped(ax: Axes, report: Report) -> int:
    skipped = [t["step"] for t in report.timeline if t.get("skipped")]
    for s in skipped:
        ax.axvspan(s - 0.5, s + 0.5, color=C_SKIP, alpha=0.18, linewidth=0)
    return len(skipped)


def loss_timeline(report: Report, *, ax: Axes | None = None) -> Figure:
    """Loss per step (non-finite losses as red crosses at the top), the FP32 control's loss if the
    bisect JSON has one, skipped steps shaded."""
    with _style():
        ax = _new_axes(ax, (11.0, 2.6))
        fig = ax.get_figure()
        steps = np.array([t["step"] for t in report.timeline], dtype=float)
        loss = np.array([np.nan if t["loss"] is None else t["loss"] for t in report.timeline], dtype=float)
        finite = np.isfinite(loss)
        n_skip = _mark_skipped(ax, report)
        if finite.any():  # NaN breaks the line where the loss was not finite
            ax.plot(steps, np.where(finite, loss, np.nan), color="#1f77b4", linewidth=1.2, marker="." if
                    finite.sum() < 40 else None, markersize=3, label="loss")
            pos = loss[finite]
            if (pos > 0).all() and pos.max() / pos.min() > 100:
                ax.set_yscale("log")
        bad = np.array([t["loss"] is not None and not math.isfinite(t["loss"]) for t in report.timeline])
        if bad.any():
            ax.plot(steps[bad], np.full(bad.sum(), 0.96), "x", color=C_OVERFLOW, markersize=4,
                    transform=ax.get_xaxis_transform(), label="loss NaN/Inf")
        ctl = _control_loss(report)
        if ctl:
            cs, cl = zip(*ctl)
            ax.plot(cs, cl, color="#555555", linestyle="--", linewidth=1.0, label="FP32 control")
        if not len(steps):
            ax.text(0.5, 0.5, "no steps recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel("loss")
        ax.set_title("Loss", loc="left")
        if len(steps):
            ax.set_xlim(steps.min() - 0.5, steps.max() + 0.5)
            handles, _ = ax.get_legend_handles_labels()
            if n_skip:
                handles.append(Patch(color=C_SKIP, alpha=0.3, label=f"skipped by GradScaler ({n_skip})"))
            ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False, ncol=4,
                      borderaxespad=0.1)
        return fig


def scale_timeline(report: Report, *, ax: Axes | None = None) -> Figure:
    """log2 of the GradScaler's scale after each step, skipped steps shaded."""
    with _style():
        ax = _new_axes(ax, (11.0, 2.2))
        fig = ax.get_figure()
        pts = [(t["step"], t["scale"]) for t in report.timeline if t.get("scale")]
        _mark_skipped(ax, report)
        if pts:
            s, v = zip(*pts)
            ax.step(s, np.log2(np.asarray(v, dtype=float)), where="post", color="#2ca02c", linewidth=1.2)
            ax.set_ylabel("log2(scale)")
        else:
            ax.text(0.5, 0.5, "no GradScaler seen", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
        ax.set_xlabel("step")
        ax.set_title("GradScaler scale (log2; shaded: skipped steps)", loc="left")
        steps = [t["step"] for t in report.timeline]
        if steps:
            ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
        return fig


def timeline(report: Report) -> Figure:
    """Loss over GradScaler scale, sharing the step axis (the loss alone when no GradScaler ran)."""
    if not any(t.get("scale") for t in report.timeline):
        return loss_timeline(report)
    with _style():
        fig = Figure(figsize=(11.0, 4.4), dpi=DPI, layout="constrained")
        top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
        loss_timeline(report, ax=top)
        scale_timeline(report, ax=bottom)
        return fig


# -- dtypes ---------------------------------------------------------------------------------------
def _dtype_color(dtype: str) -> str:
    return DTYPE_COLORS.get(dtype, "#bcbd22")


def dtype_map(report: Report, *, ax: Axes | None = None, max_rows: int = MAX_ROWS) -> Figure:
    """Which layers ran in which dtype (activations, execution order): one bar per layer, its length
    the activation bytes per step, its colour the dtype."""
    rows = report.rows("activation")
    shown = rows[:max_rows]
    with _style():
        ax = _new_axes(ax, (6.0, min(2.0 + 0.2 * max(len(shown), 1), 15.0)))
        fig = ax.get_figure()
        if not rows:
            ax.text(0.5, 0.5, "no activations recorded", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            return fig
        y = np.arange(len(shown))
        ax.barh(y, [max(r.bytes, 1) for r in shown], color=[_dtype_color(r.dtype) for r in shown], height=0.8)
        ax.set_yticks(y, [_short(r.layer, 32) for r in shown])
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
    with _style():
        ax = _new_axes(ax, (4.0, 2.6))
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
    with _style():
        fig = Figure(figsize=(11.0, min(2.2 + 0.2 * max(n, 1), 15.0)), dpi=DPI, layout="constrained")
        left, right = fig.subplots(1, 2, width_ratios=[2.2, 1])
        dtype_map(report, ax=left)
        dtype_bytes(report, ax=right)
        return fig


def figure_makers(report: Report, kinds: Sequence[str] = ("activation", "gradient")
                  ) -> list[tuple[str, str, Callable[[], Figure]]]:
    """Every plot of the HTML report as ``(id, caption, make)``, in display order; ``make()`` draws it
    (lazily, so one failing plot need not cost the others)."""
    out: list[tuple[str, str, Callable[[], Figure]]] = [
        ("timeline", "Loss and GradScaler scale per step", lambda: timeline(report))]
    for kind in kinds:
        if report.rows(kind):
            out.append((f"heatmap-{kind}", f"Headroom of {KIND_LABEL.get(kind, kind)} per layer and step",
                        lambda k=kind: headroom_heatmap(report, k)))
    for kind in kinds:
        if report.rows(kind):
            out.append((f"hist-{kind}", f"Most at-risk {KIND_LABEL.get(kind, kind)} against the {report.format} range",
                        lambda k=kind: worst_histograms(report, k)))
    out.append(("dtypes", "Which layers ran in which dtype, and activation bytes per dtype", lambda: dtype_figure(report)))
    return out
