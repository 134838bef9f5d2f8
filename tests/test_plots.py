"""Plots: deterministic PNG bytes, a Figure back, ax= honoured, no figure left open."""

from __future__ import annotations

import json

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
from report_helpers import overflow_trace

from ampdoctor.report import build_report, plots

ALL = {
    "timeline": lambda r: plots.timeline(r),
    "loss": lambda r: plots.loss_timeline(r),
    "scale": lambda r: plots.scale_timeline(r),
    "heatmap-activation": lambda r: plots.headroom_heatmap(r, "activation"),
    "heatmap-gradient": lambda r: plots.headroom_heatmap(r, "gradient"),
    "hist-activation": lambda r: plots.worst_histograms(r, "activation"),
    "hist-gradient": lambda r: plots.worst_histograms(r, "gradient"),
    "layer-hist": lambda r: plots.layer_histogram(r.rows("activation")[0], r.fmt),
    "dtype-map": lambda r: plots.dtype_map(r),
    "dtype-bytes": lambda r: plots.dtype_bytes(r),
    "dtypes": lambda r: plots.dtype_figure(r),
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    overflow_trace(d / "trace.sqlite")
    (d / "bisect.json").write_text(json.dumps({"verdict": "culprit", "culprits": ["mid"],
                                               "fp32_control_losses": {"0": 5.0, "3": 4.0, "6": 3.0}}))
    return build_report(d)


@pytest.mark.parametrize("name", sorted(ALL))
def test_same_png_twice_and_nothing_left_open(report, name):
    before = plt.get_fignums()
    fig1 = ALL[name](report)
    assert isinstance(fig1, matplotlib.figure.Figure)
    a = plots.to_png(fig1)
    b = plots.to_png(ALL[name](report))
    assert a[:8] == b"\x89PNG\r\n\x1a\n"
    assert a == b
    assert plt.get_fignums() == before


def test_deterministic_whatever_the_callers_style(report):
    a = plots.to_png(plots.timeline(report))
    with matplotlib.rc_context({"font.size": 20, "lines.linewidth": 5, "axes.facecolor": "black"}):
        b = plots.to_png(plots.timeline(report))
    assert a == b


def test_ax_is_honoured_and_pyplot_figures_closed_by_to_png(report):
    before = plt.get_fignums()
    fig, axes = plt.subplots(1, 3)
    assert plots.headroom_heatmap(report, "activation", ax=axes[0]) is fig
    assert plots.loss_timeline(report, ax=axes[1]) is fig
    assert plots.layer_histogram(report.rows("gradient")[0], report.fmt, ax=axes[2]) is fig
    assert axes[0].get_title(loc="left").startswith("Headroom of activations")
    plots.to_png(fig)
    assert plt.get_fignums() == before


def test_step_grid_matches_the_trace(report):
    g = plots.step_grid(report, "activation")
    assert g.layers == [r.layer for r in report.rows("activation")]
    mid = g.layers.index("mid")
    bad = report.rows("activation")[mid].first_bad_step
    assert np.isneginf(g.headroom[mid, g.steps.index(bad)])
    assert np.isfinite(g.headroom[mid, 0]) and g.headroom[mid, 0] < 16
    assert g.present.all()


def test_control_loss_from_bisect(report):
    assert plots._control_loss(report) == [(0, 5.0), (3, 4.0), (6, 3.0)]
    line_labels = [ln.get_label() for ln in plots.loss_timeline(report).axes[0].get_lines()]
    assert "FP32 control" in line_labels


def test_worst_histogram_puts_the_producer_first(report):
    assert plots.worst_rows(report, "activation", 2)[0].layer == "mid"


def test_heatmap_without_trace_file(report, tmp_path):
    import copy
    r = copy.copy(report)
    r.trace = str(tmp_path / "gone.sqlite")
    fig = plots.headroom_heatmap(r, "activation")
    assert "no per-step statistics" in " ".join(t.get_text() for t in fig.axes[0].texts)
    plots.to_png(fig)


def test_many_layers_and_steps_are_bounded(report):
    g = plots.step_grid(report, "activation")
    n, m = 130, 400
    rng = np.random.default_rng(0)
    big = plots.StepGrid("activation", [f"l{i}" for i in range(n)], list(range(m)), rng.uniform(-1, 30, (n, m)),
                         rng.uniform(0, 2, (n, m)), np.ones((n, m), dtype=bool))
    fig = plots.headroom_heatmap(report, "activation", grid=big)
    img = fig.axes[0].images[0].get_array()
    assert img.shape[:2] == (plots.MAX_ROWS, plots.MAX_COLS)
    assert g is not None
    plots.to_png(fig)


def test_histogram_of_a_tensor_holding_inf_counts_it(report):
    """A row with Inf values has no finite headroom: its histogram says how many Inf it held
    beside the finite abs-max, never "-inf bits"."""
    import dataclasses
    import math
    row = report.rows("activation")[0]
    texts = lambda fig: " ".join(t.get_text() for ax in fig.axes for t in ax.texts)  # noqa: E731
    inf_row = dataclasses.replace(row, inf=7, headroom_bits=-math.inf)
    got = texts(plots.layer_histogram(inf_row, report.fmt))
    assert "7 Inf (abs-max of the finite values)" in got and "-inf bits" not in got
    fine = dataclasses.replace(row, inf=0, headroom_bits=2.5)
    assert "headroom +2.5 bits" in texts(plots.layer_histogram(fine, report.fmt))
