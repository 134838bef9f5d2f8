"""Gradient exponent histograms from the trace, unscaled, for the loss-scale advisor.

Gradients are recorded *as scaled* by the GradScaler; :func:`unscaled_hists` unscales each step's
histograms with the scale that step's backward used: the previous step's scale after
``update()`` (the first step's is inferred: twice its post-update scale when it was skipped).
Only clean steps count (finite loss, not skipped, no NaN/Inf gradient).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..formats import Format
from ..trace import TraceReader
from .model import Report

__all__ = ["HIGH_PRECISION", "GRAD_KINDS", "grad_layers", "unscaled_hists"]

HIGH_PRECISION = ("float32", "float64")
GRAD_KINDS = ("gradient", "weight_grad")


def _used_scales(report: Report) -> dict[int, float]:
    """Scale each step's backward ran with (see the module doc). The first step's is the GradScaler's
    init_scale where the trace holds it (``first_scale``: the watch saw the scaler's first ``scale()``)."""
    tl = {t["step"]: t for t in report.timeline}
    out: dict[int, float] = {}
    first = report.meta.get("first_scale")
    for s in sorted(tl):
        prev = tl.get(s - 1)
        if isinstance(first, dict) and first.get("step") == s and isinstance(first.get("scale"), (int, float)) \
                and first["scale"] > 0:
            out[s] = float(first["scale"])
        elif prev is not None and prev.get("scale"):
            out[s] = float(prev["scale"])
        elif tl[s].get("scale"):
            out[s] = float(tl[s]["scale"]) * (2.0 if tl[s].get("skipped") else 1.0)
        else:
            out[s] = 1.0
    return out


def grad_layers(report: Report) -> set[str] | None:
    """Layers whose gradients live in the low-precision format (None: all of them, a readiness run)."""
    acts = report.rows("activation")
    if not acts or all(r.dtype in HIGH_PRECISION for r in acts):
        return None
    return {r.layer for r in acts if r.dtype not in HIGH_PRECISION}


def unscaled_hists(report: Report) -> tuple[dict[str, dict[int, int]], int, dict[str, float]] | None:
    """Per layer: unscaled exponent -> count, from clean steps (finite loss, no NaN/Inf gradient),
    the number of steps used, and per layer the largest unscaled abs-max. None when the trace file is gone. Layers come in the order their
    first row used came in (the gradients' rows, by step, then the weight gradients'); each layer's
    exponents in increasing order.

    Streamed with numpy (:meth:`TraceReader.stat_chunks`): the histograms of one chunk of rows at a
    time. Each row counts as :class:`_Unscaled` says, shifted by its step's scale."""
    path = Path(report.trace)
    if not path.exists():
        return None
    fmt = report.fmt
    scales = _used_scales(report)
    bad_steps = {t["step"] for t in report.timeline if t["loss"] is not None and not math.isfinite(t["loss"])}
    bad_steps |= {t["step"] for t in report.timeline if t.get("skipped")}
    keep = grad_layers(report)
    acc = _Unscaled(fmt)
    with TraceReader(path) as reader, reader.snapshot():
        names = {row["id"]: (row["name"] or "(root)") for row in reader.layers()}
        bad_steps |= reader.nonfinite_steps(GRAD_KINDS)
        bad = np.array(sorted(bad_steps), dtype=np.int64)
        # an accumulating step's fp32 .grad read after its later backwards is a sum never cast to the format:
        # only its first reading (one micro-batch's gradient, upcast) counts (fp16 .grad sums do overflow)
        sums = reader.repeated_rows("weight_grad", HIGH_PRECISION)
        shifts: dict[int, int] = {}
        layer_at: dict[int, int] = {}  # layer id -> its name's number in acc, or -1: not a layer kept
        for c in reader.stat_chunks(("layer", "step", "rowid", "nzmin", "absmax"), kinds=GRAD_KINDS,
                                    hist_bins=fmt.n_bins):
            lids, at = np.unique(c["layer"], return_inverse=True)
            for lid in lids.tolist():
                if lid not in layer_at:
                    name = names.get(lid, f"#{lid}")
                    layer_at[lid] = acc.layer(name) if keep is None or name in keep else -1
            nid = np.array([layer_at[lid] for lid in lids.tolist()], dtype=np.int64)[at.reshape(-1)]
            use = (nid >= 0) & ~np.isin(c["step"], bad) & ~np.isin(c["rowid"], sums)
            if not use.any():
                continue
            rows = np.flatnonzero(use)
            steps = c["step"][rows]
            for s in np.unique(steps).tolist():
                if s not in shifts:
                    shifts[s] = int(round(math.log2(scales.get(s, 1.0))))
            acc.add(nid[rows], c["kind"][rows], steps, c["rowid"][rows],
                    np.array([shifts[s] for s in steps.tolist()], dtype=np.int64), c["nzmin"][rows],
                    c["absmax"][rows], c["hist"][rows])
    return acc.result()


class _Unscaled:
    """The sums behind :func:`unscaled_hists`, chunk by chunk: the exponent bins per (layer, shift)
    as int64 arrays, and the under/over bins spread per row with difference arrays. The under/over bins
    only say "below/above the format's range"; the row's nzmin/abs-max bound them, and their counts are
    spread evenly over the binades in between, the remainder to the lowest (an FP32 run measured against
    fp16 puts its tiny gradients there)."""

    def __init__(self, fmt: Format):
        self.fmt = fmt
        self.index: dict[str, int] = {}            # layer -> its number here
        self.first: list[tuple[int, int, int]] = []  # per layer: (kind, step, rowid) of its first row used
        self.bins: dict[tuple[int, int], np.ndarray] = {}  # (layer, shift) -> exponent bins summed
        self.spread: list[dict[int, int]] = []     # per layer: unscaled exponent -> count from under/over bins
        self.amax: list[float] = []                # per layer: the largest unscaled abs-max
        self.steps: set[int] = set()

    def layer(self, name: str) -> int:
        """The number of layer ``name`` here (a new one for a name not seen yet)."""
        if name not in self.index:
            self.index[name] = len(self.index)
            self.first.append((1 << 62, 1 << 62, 1 << 62))
            self.spread.append({})
            self.amax.append(0.0)
        return self.index[name]

    def add(self, nid: np.ndarray, kinds: np.ndarray, steps: np.ndarray, rowids: np.ndarray, shifts: np.ndarray,
            nzmin: np.ndarray, absmax: np.ndarray, hist: np.ndarray) -> None:
        """Rows of layers ``nid`` (:meth:`layer`), with the index of their kind in ``GRAD_KINDS``, their
        steps and rowids, the shift (log2 of the scale) of their step, nzmin, abs-max and histograms."""
        fmt = self.fmt
        self.steps.update(np.unique(steps).tolist())
        order = np.lexsort((rowids, steps, kinds, nid))  # each layer's first row: kind, then step, then row
        lead = order[np.flatnonzero(np.r_[True, nid[order][1:] != nid[order][:-1]])]
        for i in lead.tolist():
            key = (int(kinds[i]), int(steps[i]), int(rowids[i]))
            if key < self.first[nid[i]]:
                self.first[nid[i]] = key
        top = np.zeros(len(self.amax))  # the largest unscaled abs-max of each layer in these rows
        np.maximum.at(top, nid, np.nan_to_num(absmax * np.exp2(-shifts.astype(np.float64)), nan=0.0))  # (exact)
        for n in np.flatnonzero(top > np.asarray(self.amax)).tolist():
            self.amax[n] = float(top[n])
        # exponent bins: summed per (layer, shift) (one row of the same layer and shift is like another)
        pair, inverse = np.unique(np.stack([nid, shifts], axis=1), axis=0, return_inverse=True)
        sums = np.zeros((len(pair), fmt.n_bins - 2), dtype=np.int64)
        np.add.at(sums, inverse.reshape(-1), hist[:, 1:-1])
        for (n, sh), row in zip(pair.tolist(), sums):
            got = self.bins.get((n, sh))
            self.bins[(n, sh)] = row if got is None else got + row
        # under and over bins: spread between the row's nzmin and abs-max
        lo_exp, hi_exp = fmt.min_exp - 1, fmt.max_exp + 1
        pieces = []  # (rows, counts, lowest binade, highest binade), recorded (scaled) binades
        under = np.flatnonzero(hist[:, 0])
        if len(under):
            lo = [math.floor(math.log2(z)) if z and 0 < z < math.inf else lo_exp for z in nzmin[under].tolist()]
            hi = [math.floor(math.log2(a)) if a and a > 0 else lo_exp for a in absmax[under].tolist()]
            lo = np.minimum(np.array(lo, dtype=np.int64), lo_exp)
            hi = np.maximum(np.minimum(np.array(hi, dtype=np.int64), lo_exp), lo)
            pieces.append((under, hist[under, 0], lo, hi))
        over = np.flatnonzero(hist[:, -1])
        if len(over):
            hi = [math.floor(math.log2(a)) if a and 0 < a < math.inf else hi_exp for a in absmax[over].tolist()]
            hi = np.maximum(np.array(hi, dtype=np.int64), hi_exp)
            pieces.append((over, hist[over, -1], np.full(len(over), hi_exp, dtype=np.int64), hi))
        for rows, n, lo, hi in pieces:
            self._spread(nid[rows], n, lo - shifts[rows], hi - shifts[rows])

    def _spread(self, nid: np.ndarray, n: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Add, per row, ``n`` values spread evenly over binades ``lo..hi`` (remainder to the lowest),
        for all the rows at once: a difference array per layer."""
        width = hi - lo + 1
        base, rem = n // width, n % width
        off = int(lo.min())
        layers, at = np.unique(nid, return_inverse=True)
        diff = np.zeros((len(layers), int(hi.max()) - off + 2), dtype=np.int64)
        at = at.reshape(-1)
        np.add.at(diff, (at, lo - off), base + (rem > 0))
        np.add.at(diff, (at, lo - off + rem), -(rem > 0).astype(np.int64))
        np.add.at(diff, (at, hi + 1 - off), -base)
        counts = np.cumsum(diff, axis=1)
        for k, lid in enumerate(layers.tolist()):
            acc = self.spread[lid]
            for j in np.flatnonzero(counts[k]).tolist():
                acc[j + off] = acc.get(j + off, 0) + int(counts[k, j])

    def result(self) -> tuple[dict[str, dict[int, int]], int, dict[str, float]]:
        per: list[dict[int, int]] = [dict(s) for s in self.spread]
        for (n, sh), row in self.bins.items():
            acc = per[n]
            for j in np.flatnonzero(row).tolist():
                e = self.fmt.min_exp + j - sh
                acc[e] = acc.get(e, 0) + int(row[j])
        names = sorted(self.index, key=lambda name: self.first[self.index[name]])
        out, amax = {}, {}
        for name in names:
            h = {e: c for e, c in sorted(per[self.index[name]].items()) if c}
            if h:
                out[name] = h
                amax[name] = self.amax[self.index[name]]
        return out, len(self.steps), amax

