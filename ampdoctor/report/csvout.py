"""The per-layer table as CSV (stdlib ``csv``): one row per layer and kind, every kind, execution order.

Numbers are written unrounded (``repr`` of floats; ``inf``/``-inf`` for infinite headroom) so a
spreadsheet or pandas can sort and filter them; ``first_bad_step`` is empty when the layer never
went bad, ``min``/``max`` (the smallest and largest finite value), ``absmax`` and ``headroom_bits``
when no value was finite.
"""

from __future__ import annotations

import csv
import io
import math
import os
from typing import Any

from .model import Report, write_whole

__all__ = ["CSV_COLUMNS", "render_csv", "write_csv"]

CSV_COLUMNS = (
    "kind", "layer", "type", "order", "dtype", "min", "max", "absmax", "headroom_bits", "overflow_pct", "subnormal_pct", "flush_pct",
    "nan", "inf", "first_bad_step", "numel", "overflow", "subnormal", "flush_to_zero", "calls", "bytes", "steps",
)
KIND_ORDER = ("activation", "gradient", "weight", "weight_grad")


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    return v


def _value(r: Any, column: str) -> Any:
    """A row's cell: none (empty) for the abs-max and the headroom of a layer with no finite value."""
    if column == "absmax" and not r.finite:
        return None
    v = getattr(r, column)
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def render_csv(report: Report) -> str:
    """The CSV text: a header row, then every layer row grouped by kind."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    kinds = [k for k in KIND_ORDER if report.rows(k)] + sorted({r.kind for r in report.layers} - set(KIND_ORDER))
    for kind in kinds:
        for r in report.rows(kind):
            w.writerow([_cell(_value(r, c)) for c in CSV_COLUMNS])
    return buf.getvalue()


def write_csv(report: Report, path: str | os.PathLike) -> None:
    """Write :func:`render_csv` to ``path`` (UTF-8)."""
    write_whole(path, render_csv(report))
