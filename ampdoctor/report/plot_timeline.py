"""Per-step timelines: the loss (with the FP32 control's, when bisect recorded one) and the
GradScaler's scale, skipped steps shaded."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .model import Report
from .plot_style import C_OVERFLOW, C_SKIP, DPI, new_axes, style

__all__ = ["loss_timeline", "scale_timeline", "timeline"]


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
    with style():
        ax = new_axes(ax, (11.0, 2.6))
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
    with style():
        ax = new_axes(ax, (11.0, 2.2))
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
    with style():
        fig = Figure(figsize=(11.0, 4.4), dpi=DPI, layout="constrained")
        top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
        loss_timeline(report, ax=top)
        scale_timeline(report, ax=bottom)
        return fig
