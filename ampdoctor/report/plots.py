"""Deterministic matplotlib plots of a :class:`~ampdoctor.report.model.Report`.

Every function draws on ``ax`` when given (and returns that axes' figure), otherwise on a new
``matplotlib.figure.Figure`` of a fixed size that is *not* registered with pyplot, so nothing
leaks into a notebook's or a script's figure list. :func:`to_png` renders a figure with a fixed
style, dpi and no PNG metadata (same report -> same bytes) and closes figures it created.

Per-step views (the headroom heatmaps) read the report's trace file; everything else uses the
report's aggregates. This module gathers the plots (one module per view: :mod:`.plot_heatmap`,
:mod:`.plot_hist`, :mod:`.plot_timeline`, :mod:`.plot_dtype`; the shared look in
:mod:`.plot_style`) and lists those of the HTML report (:func:`figure_makers`).
"""

from __future__ import annotations

from typing import Callable, Sequence

from matplotlib.figure import Figure

from .model import Report
from .plot_dtype import dtype_bytes, dtype_figure, dtype_map
from .plot_heatmap import MAX_COLS, headroom_heatmap
from .plot_hist import layer_histogram, worst_histograms, worst_rows
from .plot_style import DPI, KIND_LABEL, MAX_ROWS, UNDERFLOW_MARK, to_png
from .plot_timeline import _control_loss as _control_loss  # tests check the FP32 control's parsing
from .plot_timeline import loss_timeline, scale_timeline, timeline
from .step_grid import StepGrid, step_grid

__all__ = [
    "StepGrid", "step_grid", "headroom_heatmap", "layer_histogram", "worst_histograms", "worst_rows",
    "loss_timeline", "scale_timeline", "timeline", "dtype_map", "dtype_bytes", "dtype_figure", "to_png",
    "figure_makers", "DPI", "MAX_ROWS", "MAX_COLS", "UNDERFLOW_MARK",
]


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
