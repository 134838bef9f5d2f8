"""The fixed look shared by every plot: rc style, sizes, palette, new axes, and PNG rendering.

Figures are ``matplotlib.figure.Figure`` objects *not* registered with pyplot, so nothing leaks
into a notebook's or a script's figure list. :func:`to_png` renders a figure with a fixed style,
dpi and no PNG metadata (same report -> same bytes) and closes figures it created. No pyplot
import here: ``Figure`` + Agg need no global state.
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Iterator

import matplotlib
import matplotlib.style
from matplotlib.axes import Axes
from matplotlib.figure import Figure

__all__ = ["DPI", "MAX_ROWS", "UNDERFLOW_MARK", "KIND_LABEL", "style", "new_axes", "short_name", "to_png"]

DPI = 100
MAX_ROWS = 60        # rows (layers) of a per-layer figure; the heatmap keeps the worst, in execution order
UNDERFLOW_MARK = 1.0  # percent of values subnormal or flushed that makes a layer (or heatmap cell) at risk

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
KIND_LABEL = {"activation": "activations", "gradient": "activation gradients (as scaled)",
              "weight": "weights", "weight_grad": "weight gradients (as scaled)"}


@contextlib.contextmanager
def style() -> Iterator[None]:
    """Matplotlib defaults plus our rc, whatever the caller's rcParams are."""
    with matplotlib.style.context("default"), matplotlib.rc_context(_STYLE):
        yield


def new_axes(ax: Axes | None, size: tuple[float, float]) -> Axes:
    """``ax`` itself, or the axes of a new un-registered figure of ``size`` inches."""
    if ax is not None:
        return ax
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    return fig.add_subplot()


def short_name(name: str, width: int = 38) -> str:
    """A layer name cut from the left to ``width`` characters (the leaf matters most)."""
    return name if len(name) <= width else "\u2026" + name[-(width - 1):]


def to_png(fig: Figure, *, close: bool = True) -> bytes:
    """PNG bytes of ``fig`` (fixed dpi, no metadata, so identical input gives identical bytes).
    Closes ``fig`` when it is a pyplot figure and ``close`` is true; our own figures need no closing."""
    buf = io.BytesIO()
    with style():
        fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None}, facecolor="white")
    if close and "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close(fig)  # a no-op for figures pyplot does not manage
    return buf.getvalue()
