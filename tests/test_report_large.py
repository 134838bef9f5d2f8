"""The report's aggregates (totalled in SQL, histograms streamed with numpy) against references computed
here, row by row, from a direct sqlite3 read of the trace: per-layer totals, the exponent histograms,
the unscaled gradient histograms of the loss-scale advisor and the heatmap's grid. The trace mixes
what the fast paths must not get wrong: NaN/Inf rows (a NaN abs-max is stored as NULL), several calls
a step, two dtypes in one layer, layers that share an execution order or are missing from the layers
table, histograms of another length or none, under/over bins, changing loss scales and skipped steps,
and rows written out of step order."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from ampdoctor.formats import get_format
from ampdoctor.report import build_report
from ampdoctor.report.step_grid import step_grid
from ampdoctor.report.unscaled import GRAD_KINDS, grad_layers, unscaled_hists
from ampdoctor.trace import TraceReader, TraceWriter, hist_blob

FMT = get_format("fp16")
STEPS = 30
BROKE = 20  # from this step on: layer 4 makes Inf in forward, NaN after it and in every gradient
SKIPPED = (7, 14)
# id, name, type, ord: 7 and 8 share an order; 6 has none; 9 is not in the layers table
LAYERS = [(0, "", "Net", 0), (1, "inp", "Linear", 1), (2, "blk.attn", "Attention", 2), (3, "blk.mlp", "Linear", 3),
          (4, "blk.norm", "LayerNorm", 4), (5, "mid", "Linear", 5), (6, "head", "Linear", None),
          (7, "aux.a", "Linear", 6), (8, "aux.b", "Linear", 6)]
WITH_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def _hist(rng: np.random.Generator, numel: int, top: int, *, under: int = 0, over: int = 0) -> np.ndarray:
    h = np.zeros(FMT.n_bins, dtype=np.int64)
    lo = max(top - 6, FMT.min_exp)
    for e in range(lo, top + 1):
        h[e - FMT.min_exp + 1] = rng.integers(0, numel // 8 + 1)
    h[0], h[-1] = under, over
    return h


def _row(rng, step, layer, kind, slot, call, dtype, numel, *, top=0, nan=0, posinf=0, neginf=0, overflow=0,
         under=0, over=0, hist="ok"):
    if nan >= numel:  # every value NaN: no finite value, abs-max NaN (stored as NULL)
        return (step, layer, kind, slot, call, dtype, numel, 2 * numel, nan, 0, 0, 0, math.inf, -math.inf, math.nan,
                math.inf, 0, 0, 0, hist_blob(np.zeros(FMT.n_bins)))
    h = _hist(rng, numel, top, under=under, over=over)
    absmax = (2.0 ** top) * (1 + rng.random()) if not over else 70000.0 * (1 + rng.random()) * 2.0 ** rng.integers(0, 5)
    nzmin = 2.0 ** float(rng.integers(-40, -30)) if under else 2.0 ** (top - 6)
    blob = {"ok": hist_blob(h), "short": hist_blob(h[:10]), "none": None}[hist]
    sub = int(h[1:1 + FMT.normal_exp - FMT.min_exp].sum())
    return (step, layer, kind, slot, call, dtype, numel, 2 * numel, nan, posinf, neginf, int(rng.integers(0, 3)),
            -absmax, absmax * 0.9, absmax, nzmin, overflow, sub, under, blob)


def build_trace(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    w = TraceWriter(path)
    w.set_meta(format=FMT.name, every=1, status="finished", rank=0, argv=["train.py"])
    w.add_layers([(i, name, typ, order, int(i > 0), None if i == 0 else 0) for i, name, typ, order in LAYERS])
    scale, deferred, stepped = 2.0 ** 16, [], 0
    for step in range(STEPS):
        broke = step >= BROKE
        rows = []
        for lid in WITH_ROWS:
            calls = (0, 1) if lid == 2 else (0, 1, 2) if lid == 6 and step == 5 else (0,)
            for call in calls:
                dtype = ("bfloat16", "float16")[step % 2] if lid == 3 else "float16"  # a tie: the first seen
                nan = 64 if broke and lid > 4 else 0
                rows.append(_row(rng, step, lid, "activation", "out", call, dtype, 64, top=int(rng.integers(-2, 6)),
                                 nan=nan, posinf=3 if broke and lid == 4 else 0,
                                 neginf=1 if (broke and lid == 4) or (lid, step) == (1, 11) else 0,
                                 overflow=2 if lid == 5 and step % 9 == 4 else 0,
                                 hist="short" if (lid, step) == (5, 3) else "none" if (lid, step) == (6, 8) else "ok"))
        for lid in reversed(WITH_ROWS):
            rows.append(_row(rng, step, lid, "gradient", "out", 1 if lid == 2 else 0, "float16", 64,
                             top=int(rng.integers(-8, 2)) + int(math.log2(scale)) - 16, nan=64 if broke else 0,
                             posinf=1 if step in SKIPPED and lid == 9 else 0, under=int(rng.integers(0, 2)) * 5))
        weights = []
        for lid in WITH_ROWS:
            for slot, numel in (("weight", 256), ("bias", 16)):
                weights.append(_row(rng, step, lid, "weight_grad", slot, 0, "float32", numel, top=int(rng.integers(-20, 4)),
                                    nan=numel if broke else 0, under=int(rng.integers(0, 3)) * 7,
                                    over=int(rng.integers(0, 2)) * 3 if lid == 1 else 0))
                # layer 3: an fp16 weight and an fp32 bias (a tie of dtypes within steps: the first row's);
                # layer 7: weights NaN at every step (no finite abs-max at all)
                weights.append(_row(rng, step, lid, "weight", slot, 0,
                                    "float16" if (lid, slot) == (3, "weight") else "float32", numel,
                                    top=int(rng.integers(-4, 0)), nan=numel if lid == 7 else 0))
        # a step's weight rows go in after the next step's activations: rowid order is not step order
        w.add_stats(rows[:len(WITH_ROWS) + 1] + deferred + rows[len(WITH_ROWS) + 1:])
        deferred = weights
        skipped = broke or step in SKIPPED
        if skipped:
            scale /= 2
        elif step == 25:
            scale *= 4
        stepped += not skipped
        w.add_step((step, math.nan if broke else 1.0 / (step + 1), scale, int(skipped), stepped, 1, float(step)))
        w.commit()
    w.add_stats(deferred)
    w.add_event(BROKE, "first_nonfinite", "blk.norm", kind="activation", call=0, producers=1)
    w.close()
    return path


def _raw(path: Path) -> list[dict]:
    con = sqlite3.connect(str(path))
    con.row_factory = sqlite3.Row
    rows = [dict(r) for r in con.execute("SELECT rowid, * FROM stats ORDER BY step, rowid")]
    con.close()
    return rows


def _hist_of(r: dict) -> np.ndarray | None:
    b = r["hist"]
    return np.frombuffer(b, dtype="<i8") if b is not None and len(b) == 8 * FMT.n_bins else None


def reference_layers(path: Path) -> dict[tuple[int, str], dict]:
    """Per (layer id, kind), from every raw row in step order: the totals the report shows."""
    ref: dict[tuple[int, str], dict] = {}
    for r in _raw(path):
        a = ref.setdefault((r["layer"], r["kind"]), {
            "numel": 0, "nan": 0, "inf": 0, "overflow": 0, "subnormal": 0, "flush_to_zero": 0, "absmax": 0.0,
            "first_bad": None, "dtypes": {}, "calls": {}, "bytes": 0, "steps": set(),
            "hist": np.zeros(FMT.n_bins, dtype=np.int64)})
        for k in ("numel", "nan", "overflow", "subnormal", "flush_to_zero", "bytes"):
            a[k] += r[k]
        a["inf"] += r["posinf"] + r["neginf"]
        if r["absmax"] is not None:
            a["absmax"] = max(a["absmax"], r["absmax"])
        if a["first_bad"] is None and (r["nan"] or r["posinf"] or r["neginf"] or r["overflow"]):
            a["first_bad"] = r["step"]
        a["dtypes"][r["dtype"]] = a["dtypes"].get(r["dtype"], 0) + 1
        a["calls"].setdefault(r["step"], set()).add(r["call"])
        a["steps"].add(r["step"])
        h = _hist_of(r)
        if h is not None:
            a["hist"] += h
    return ref


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return build_trace(tmp_path_factory.mktemp("large") / "trace.sqlite")


@pytest.fixture(params=["default", "small chunks"])
def chunks(request, monkeypatch):
    """The streamed reads in their default chunks, and in chunks of a few rows (sums across chunks)."""
    if request.param == "small chunks":
        stream, sums = TraceReader.stat_chunks, TraceReader.hist_sums
        monkeypatch.setattr(TraceReader, "stat_chunks", lambda self, *a, **kw: stream(self, *a, **{**kw, "chunk_rows": 7}))
        monkeypatch.setattr(TraceReader, "hist_sums", lambda self, *a, **kw: sums(self, *a, **{**kw, "chunk_rows": 5}))
    return request.param


def test_the_trace_has_what_the_test_is_about(trace):
    raw = _raw(trace)
    # a step: an activation, a gradient and two weights and weight gradients a layer, layer 2's second call;
    # layer 6's two more calls at step 5
    assert len(raw) == STEPS * (6 * len(WITH_ROWS) + 1) + 2
    assert any(r["absmax"] is None for r in raw) and any(r["posinf"] for r in raw) and any(r["overflow"] for r in raw)
    assert [r["rowid"] for r in raw] != sorted(r["rowid"] for r in raw)  # written out of step order
    assert any(_hist_of(r) is None for r in raw) and any(r["hist"] is None for r in raw)
    assert len({r["dtype"] for r in raw if (r["layer"], r["kind"]) == (3, "activation")}) == 2
    assert all(r["absmax"] is None for r in raw if (r["layer"], r["kind"]) == (7, "weight"))


def test_layer_totals_equal_the_raw_rows(trace, chunks):
    ref = reference_layers(trace)
    names = {i: name or "(root)" for i, name, _, _ in LAYERS}
    report = build_report(trace)
    got = {(r.layer, r.kind): r for r in report.layers}
    assert len(got) == len(report.layers) == len(ref)
    for (lid, kind), a in ref.items():
        r = got[(names.get(lid, f"#{lid}"), kind)]
        assert (r.numel, r.nan, r.inf, r.overflow, r.subnormal, r.flush_to_zero) == (
            a["numel"], a["nan"], a["inf"], a["overflow"], a["subnormal"], a["flush_to_zero"]), (lid, kind)
        assert r.absmax == a["absmax"] and r.first_bad_step == a["first_bad"], (lid, kind)
        assert r.steps == len(a["steps"]) and r.calls == max(len(c) for c in a["calls"].values()), (lid, kind)
        assert r.bytes == int(round(a["bytes"] / len(a["steps"])))
        assert r.dtype == max(a["dtypes"].items(), key=lambda kv: kv[1])[0]  # most rows; at a tie the first seen
        assert r.hist == a["hist"].tolist(), (lid, kind)
        if a["inf"]:
            assert r.headroom_bits == -math.inf
        elif a["nan"] >= a["numel"]:
            assert math.isnan(r.headroom_bits)
        else:
            assert r.headroom_bits == FMT.headroom_bits(a["absmax"])
    assert got[("blk.attn", "activation")].calls == 2 and got[("head", "activation")].calls == 3
    assert got[("blk.norm", "activation")].inf == 4 * (STEPS - BROKE) and got[("inp", "activation")].first_bad_step == 11
    assert got[("blk.mlp", "activation")].dtype == "bfloat16" and got[("blk.mlp", "weight")].dtype == "float16"
    assert got[("aux.a", "weight")].absmax == 0.0 and math.isnan(got[("aux.a", "weight")].headroom_bits)
    assert got[("mid", "gradient")].first_bad_step == BROKE and got[("#9", "gradient")].first_bad_step == SKIPPED[0]
    # execution order, and at an equal order (aux.a, aux.b) the order they first came in
    order = [(r.order, r.kind) for r in report.layers]
    assert order == sorted(order)
    assert [r.layer for r in report.layers if r.kind == "activation"][-4:] == ["aux.a", "aux.b", "head", "#9"]


def _spread(out: dict[int, int], n: int, lo: int, hi: int) -> None:
    hi = max(hi, lo)
    for i, e in enumerate(range(lo, hi + 1)):
        c = n // (hi - lo + 1) + (1 if i < n % (hi - lo + 1) else 0)
        if c:
            out[e] = out.get(e, 0) + c


def test_unscaled_gradient_histograms_equal_the_raw_rows(trace, chunks):
    report = build_report(trace)
    tl = {t["step"]: t for t in report.timeline}
    used = {s: (tl[s - 1]["scale"] if s - 1 in tl else tl[s]["scale"] * (2.0 if tl[s]["skipped"] else 1.0)) for s in tl}
    raw = [r for kind in GRAD_KINDS for r in _raw(trace) if r["kind"] == kind]
    bad = {s for s, t in tl.items() if t["skipped"] or not math.isfinite(t["loss"])}
    bad |= {r["step"] for r in raw if r["nan"] or r["posinf"] or r["neginf"]}
    keep = grad_layers(report)
    names = {i: name or "(root)" for i, name, _, _ in LAYERS}
    ref: dict[str, dict[int, int]] = {}
    ref_amax: dict[str, float] = {}
    steps = set()
    seen_wgrad: set[tuple] = set()
    for r in raw:  # (each kind by step, then rowid)
        name, h = names.get(r["layer"], f"#{r['layer']}"), _hist_of(r)
        if r["kind"] == "weight_grad":  # an fp32 .grad read again in the same step (accumulation): a sum, left out
            key = (r["step"], r["layer"], r["slot"])
            again = key in seen_wgrad
            seen_wgrad.add(key)
            if again and r["dtype"] in ("float32", "float64"):
                continue
        if r["step"] in bad or (keep is not None and name not in keep) or h is None:
            continue
        shift = int(round(math.log2(used[r["step"]])))
        counts: dict[int, int] = {}
        for j, c in enumerate(h[1:-1].tolist()):
            if c:
                counts[FMT.min_exp + j] = c
        if h[0]:
            lo = math.floor(math.log2(r["nzmin"])) if r["nzmin"] and 0 < r["nzmin"] < math.inf else FMT.min_exp - 1
            hi = math.floor(math.log2(r["absmax"])) if r["absmax"] and r["absmax"] > 0 else FMT.min_exp - 1
            _spread(counts, int(h[0]), min(lo, FMT.min_exp - 1), min(hi, FMT.min_exp - 1))
        if h[-1]:
            hi = math.floor(math.log2(r["absmax"])) if r["absmax"] and 0 < r["absmax"] < math.inf else FMT.max_exp + 1
            _spread(counts, int(h[-1]), FMT.max_exp + 1, max(hi, FMT.max_exp + 1))
        acc = ref.setdefault(name, {})
        for e, c in counts.items():
            acc[e - shift] = acc.get(e - shift, 0) + c
        if r["absmax"] is not None and not math.isnan(r["absmax"]):
            ref_amax[name] = max(ref_amax.get(name, 0.0), r["absmax"] / used[r["step"]])
        steps.add(r["step"])
    ref = {k: dict(sorted(v.items())) for k, v in ref.items() if v}
    got, used_steps, amax = unscaled_hists(report)
    assert amax == {k: ref_amax.get(k, 0.0) for k in ref}
    assert used_steps == len(steps) == BROKE - len(SKIPPED)
    assert list(got) == list(ref)  # the same layers, in the order their first row came
    assert got == ref
    assert any(e < FMT.min_exp - 1 for h in got.values() for e in h)  # spread under bins are in there
    assert any(e > FMT.max_exp + 1 - 16 for e in got["inp"])          # and over bins (unscaled by 2**16 or so)


@pytest.mark.parametrize("kind", ["activation", "gradient", "weight_grad"])
def test_heatmap_grid_equals_the_raw_rows(trace, kind):
    report = build_report(trace)
    g = step_grid(report, kind)
    names = {i: name or "(root)" for i, name, _, _ in LAYERS}
    raw = [r for r in _raw(trace) if r["kind"] == kind]
    assert g.layers == [r.layer for r in report.rows(kind)] and g.steps == sorted({r["step"] for r in raw})
    absmax = np.zeros((len(g.layers), len(g.steps)))
    bad = np.zeros(absmax.shape, dtype=bool)
    numel, under = np.zeros(absmax.shape), np.zeros(absmax.shape)
    present = np.zeros(absmax.shape, dtype=bool)
    for r in raw:
        if r["layer"] not in names:  # (a layer missing from the layers table has a row, "#9", but no cells)
            continue
        i, j = g.layers.index(names[r["layer"]]), g.steps.index(r["step"])
        present[i, j] = True
        absmax[i, j] = max(absmax[i, j], r["absmax"] or 0.0)
        bad[i, j] |= bool(r["nan"] or r["posinf"] or r["neginf"])
        numel[i, j] += r["numel"]
        under[i, j] += r["subnormal"] + r["flush_to_zero"]
    assert np.array_equal(g.present, present) and present[:-1].all() and g.layers[-1] == "#9"
    with np.errstate(divide="ignore"):
        head = np.where(absmax > 0, np.log2(FMT.max / np.where(absmax > 0, absmax, 1.0)), np.inf)
    head[bad] = -np.inf
    assert np.array_equal(g.headroom, head) and np.array_equal(g.underflow, 100.0 * under / np.maximum(numel, 1))
    assert bad.any() and (~bad).any()


def test_reader_sums_equal_the_raw_rows(trace):
    """The reader's aggregated reads on their own: totals per (layer, kind, dtype) and histogram sums."""
    raw = _raw(trace)
    with TraceReader(trace) as r, r.snapshot():
        groups = r.stat_groups()
        sums = r.hist_sums(FMT.n_bins, chunk_rows=3)
        assert r.nonfinite_steps(GRAD_KINDS) == {x["step"] for x in raw if x["kind"] in GRAD_KINDS
                                                 and (x["nan"] or x["posinf"] or x["neginf"])}
        assert r.calls_per_step(2, "activation") == 2 and r.step_count(3, "activation") == STEPS
    assert sum(g["rows"] for g in groups) == len(raw)
    for g in groups:
        mine = [x for x in raw if (x["layer"], x["kind"], x["dtype"]) == (g["layer"], g["kind"], g["dtype"])]
        assert g["rows"] == len(mine) and g["numel"] == sum(x["numel"] for x in mine)
        assert g["absmax"] == max(x["absmax"] or 0.0 for x in mine)
        assert g["first_step"] == min(x["step"] for x in mine) and g["steps"] == len({x["step"] for x in mine})
    ref = reference_layers(trace)
    assert {k: v.tolist() for k, v in sums.items()} == {k: a["hist"].tolist() for k, a in ref.items()
                                                       if any(_hist_of(x) is not None for x in raw
                                                              if (x["layer"], x["kind"]) == k)}
