"""Concrete advice from a :class:`~ampdoctor.report.model.Report`, each item citing recorded numbers.
Code in an item is set in backticks (the HTML report shows it as code).

:func:`advise` is what ``build_report`` calls; the structured pieces behind it are public so that
tests and tools can apply them: :func:`loss_scale_range` (a static loss scale with no overflow and
at most 1% of gradient values subnormal or flushed), :func:`loss_scale_analysis` (the same with the
per-layer binade spans), :func:`scaler_health` and :func:`readiness` (a run without autocast,
measured against a low-precision format).

Gradients are recorded *as scaled* by the GradScaler; the analysis unscales each step's
histograms with the scale that step's backward used: the previous step's scale after
``update()`` (the first step's is inferred: twice its post-update scale when it was skipped).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..formats import Format
from ..trace import TraceReader
from .model import LayerRow, Report

__all__ = ["advise", "LossScaleRange", "LossScaleAnalysis", "loss_scale_range", "loss_scale_analysis",
           "ScalerHealth", "scaler_health", "readiness", "module_expr", "culprits"]

MAX_UNDERFLOW_PCT = 1.0
HIGH_PRECISION = ("float32", "float64")
GRAD_KINDS = ("gradient", "weight_grad")
HUGE_SCALE = 2.0 ** 32    # a scale this large means the gradients are tiny, or overflow checks never fire
MATMUL_OPS = ("matmul", "bmm", "baddbmm", "mm", "addmm", "linear", "einsum", "scaled_dot_product_attention")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


# -- names and snippets ---------------------------------------------------------------------------
def module_expr(name: str, root: str = "model") -> str:
    """Python expression for a qualified module name: ``blocks.1.attn`` -> ``model.blocks[1].attn``."""
    if not name or name == "(root)":
        return root
    parts = name.split(".")
    if not all(p.isdigit() or _IDENT.match(p) for p in parts):
        return f"{root}.get_submodule({name!r})"
    out = root
    for p in parts:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def culprits(report: Report) -> tuple[list[str], str]:
    """The layers to keep in FP32 and where that came from: bisect's verified culprits, else the
    first producer of a non-finite value (when it produced it from finite inputs)."""
    b = report.bisect or {}
    if b.get("verdict") == "culprit" and b.get("culprits"):
        return list(b["culprits"]), "bisect"
    if b.get("verdict") in ("not_precision", "healthy"):
        return [], ""  # bisect showed that forcing FP32 is not the fix
    fn = report.diagnosis.first_nonfinite
    if fn and not fn.get("input_nonfinite") and not fn.get("from_loss") and fn.get("layer") is not None:
        return [fn["layer"] or "(root)"], "first_nonfinite"
    return [], ""


def _fmt_num(v: float) -> str:
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.2e}"


def _pow2(k: int) -> str:
    return f"2**{k} = {_fmt_num(2.0 ** k)}"


def _scale_literal(k: int) -> str:
    """A power-of-two scale as Python: ``65536`` up to 2**24, ``2.0**33`` beyond (or below 1)."""
    return str(2 ** k) if 0 <= k <= 24 else f"2.0**{k}"


def _row(report: Report, layer: str, kind: str) -> LayerRow | None:
    return next((r for r in report.layers if r.layer == layer and r.kind == kind), None)


def _evidence(report: Report, layer: str) -> str:
    """The recorded numbers that make ``layer`` the culprit."""
    fmt = report.fmt
    bits = []
    fn = report.diagnosis.first_nonfinite or {}
    kinds = [fn["kind"]] if fn.get("layer") == layer and fn.get("kind") else []
    kinds += [k for k in ("activation", "gradient", "weight_grad") if k not in kinds]
    for kind in kinds:  # the producing kind only: a NaN gradient after an Inf output is an echo
        r = _row(report, layer, kind)
        if r is None or not (r.bad or r.headroom_bits < 1):
            continue
        what = {"activation": "output", "gradient": "gradient", "weight_grad": "weight gradient"}.get(kind, kind)
        s = f"its {what} reached abs-max {_fmt_num(r.absmax)} ({fmt.name} max {fmt.max:.6g}, headroom " \
            f"{r.headroom_bits:+.1f} bits"
        counts = [f"{n} {lbl}" for n, lbl in ((r.inf, "Inf"), (r.nan, "NaN"), (r.overflow, "overflowing")) if n]
        if counts:
            s += ", " + ", ".join(counts) + " values"
        if r.first_bad_step is not None:
            s += f", first at step {r.first_bad_step}"
        bits.append(s + ")")
        break
    return "; ".join(bits)


# -- the loss-scale advisor ----------------------------------------------------------------------
class LossScaleRange(NamedTuple):
    """Static loss scales (powers of two) with no gradient overflow and at most
    ``MAX_UNDERFLOW_PCT`` % of gradient values subnormal or flushed; ``recommended`` lies inside."""
    lo: float
    hi: float
    recommended: float


@dataclass
class LossScaleAnalysis:
    format: str
    k_lo: int                 # smallest log2(scale) with underflow <= max_underflow_pct
    k_hi: int                 # largest log2(scale) with no overflow
    k_rec: int | None         # recommended log2(scale); None when no single scale works
    max_underflow_pct: float
    underflow_at_rec: float | None   # percent of gradient values subnormal/flushed at the recommended scale
    top_exp: int              # highest binade of the unscaled gradients
    steps_used: int
    values: int               # non-zero finite gradient values analysed
    spans: dict[str, int] = field(default_factory=dict)   # layer -> binades its gradients span (1%..max)
    too_wide: list[str] = field(default_factory=list)     # layers spanning more binades than the format's normal range

    @property
    def feasible(self) -> bool:
        return self.k_rec is not None


def _used_scales(report: Report) -> dict[int, float]:
    """Scale each step's backward ran with (see the module doc)."""
    tl = {t["step"]: t for t in report.timeline}
    out: dict[int, float] = {}
    for s in sorted(tl):
        prev = tl.get(s - 1)
        if prev is not None and prev.get("scale"):
            out[s] = float(prev["scale"])
        elif tl[s].get("scale"):
            out[s] = float(tl[s]["scale"]) * (2.0 if tl[s].get("skipped") else 1.0)
        else:
            out[s] = 1.0
    return out


def _grad_layers(report: Report) -> set[str] | None:
    """Layers whose gradients live in the low-precision format (None: all of them, a readiness run)."""
    acts = report.rows("activation")
    if not acts or all(r.dtype in HIGH_PRECISION for r in acts):
        return None
    return {r.layer for r in acts if r.dtype not in HIGH_PRECISION}


def _unscaled_hists(report: Report) -> tuple[dict[str, dict[int, int]], int] | None:
    """Per layer: unscaled exponent -> count, from clean steps (finite loss, no NaN/Inf gradient)."""
    path = Path(report.trace)
    if not path.exists():
        return None
    fmt = report.fmt
    scales = _used_scales(report)
    bad_steps = {t["step"] for t in report.timeline if t["loss"] is not None and not math.isfinite(t["loss"])}
    bad_steps |= {t["step"] for t in report.timeline if t.get("skipped")}
    keep = _grad_layers(report)
    rows = []
    with TraceReader(path) as reader:
        names = {row["id"]: (row["name"] or "(root)") for row in reader.layers()}
        for kind in GRAD_KINDS:
            rows += reader.stats(kind=kind, with_hist=True)
    for r in rows:
        if r["nan"] or r["posinf"] or r["neginf"]:
            bad_steps.add(r["step"])
    out: dict[str, dict[int, int]] = {}
    steps = set()
    for r in rows:
        name = names.get(r["layer"], f"#{r['layer']}")
        if r["step"] in bad_steps or (keep is not None and name not in keep) or len(r["hist"]) != fmt.n_bins:
            continue
        shift = int(round(math.log2(scales.get(r["step"], 1.0))))
        acc = out.setdefault(name, {})
        for e, c in _row_exponents(r, fmt).items():
            acc[e - shift] = acc.get(e - shift, 0) + c
        steps.add(r["step"])
    return {k: v for k, v in out.items() if v}, len(steps)


def _spread(counts: dict[int, int], n: int, lo: int, hi: int) -> None:
    """Add ``n`` values spread evenly over binades ``lo..hi`` (remainder to the lowest)."""
    hi = max(hi, lo)
    width = hi - lo + 1
    for i, e in enumerate(range(lo, hi + 1)):
        c = n // width + (1 if i < n % width else 0)
        if c:
            counts[e] = counts.get(e, 0) + c


def _row_exponents(r: dict, fmt: Format) -> dict[int, int]:
    """binade -> count of one stats row. The under/over bins only say "below/above the format's
    range"; the row's nzmin/abs-max bound them, and their counts are spread evenly in between
    (an FP32 run measured against fp16 puts its tiny gradients there)."""
    hist = r["hist"]
    out: dict[int, int] = {}
    for e, c in zip(range(fmt.min_exp, fmt.max_exp + 1), hist[1:-1]):
        if c:
            out[e] = int(c)
    under, over = int(hist[0]), int(hist[-1])
    nzmin, absmax = r.get("nzmin"), r.get("absmax")
    if under:
        lo = math.floor(math.log2(nzmin)) if nzmin and 0 < nzmin < math.inf else fmt.min_exp - 1
        hi = math.floor(math.log2(absmax)) if absmax and absmax > 0 else fmt.min_exp - 1
        _spread(out, under, min(lo, fmt.min_exp - 1), min(hi, fmt.min_exp - 1))
    if over:
        hi = math.floor(math.log2(absmax)) if absmax and 0 < absmax < math.inf else fmt.max_exp + 1
        _spread(out, over, fmt.max_exp + 1, max(hi, fmt.max_exp + 1))
    return out


def _k_range(hist: dict[int, int], fmt: Format, max_underflow_pct: float) -> tuple[int, int, int]:
    """(k_lo, k_hi, top exponent) of one exponent histogram."""
    es = sorted(hist)
    total = sum(hist.values())
    top = es[-1]
    # values in binade e are < 2**(e+1): scaled by 2**k they stay <= max while e+1+k <= log2(max)
    k_hi = fmt.max_exp - top - 1
    # values in binade e stay normal when e+k >= normal_exp; find the least k with few below
    allowed = total * max_underflow_pct / 100.0
    below = 0
    k_lo = fmt.normal_exp - es[0]
    for e in es:
        if below + hist[e] > allowed:
            k_lo = fmt.normal_exp - e
            break
        below += hist[e]
    return k_lo, k_hi, top


def loss_scale_analysis(report: Report, *, max_underflow_pct: float = MAX_UNDERFLOW_PCT) -> LossScaleAnalysis | None:
    """The loss-scale advisor's numbers, or None when no clean gradient histogram was recorded."""
    got = _unscaled_hists(report)
    if not got or not got[0]:
        return None
    per_layer, steps_used = got
    fmt = report.fmt
    merged: dict[int, int] = {}
    for h in per_layer.values():
        for e, c in h.items():
            merged[e] = merged.get(e, 0) + c
    k_lo, k_hi, top = _k_range(merged, fmt, max_underflow_pct)
    normal_binades = fmt.max_exp - fmt.normal_exp  # binades between the smallest normal and max/2
    spans, wide = {}, []
    for name, h in per_layer.items():
        lo, hi, _ = _k_range(h, fmt, max_underflow_pct)
        spans[name] = normal_binades - (hi - lo)  # binades the layer needs (1st percentile .. max)
        if hi < lo:
            wide.append(name)
    k_rec = None
    under = None
    if k_lo <= k_hi:
        # the middle, in binades: the most room both for gradients that grow and for those that shrink
        k_rec = (k_lo + k_hi + 1) // 2
        below = sum(c for e, c in merged.items() if e + k_rec < fmt.normal_exp)
        under = 100.0 * below / max(sum(merged.values()), 1)
    return LossScaleAnalysis(fmt.name, k_lo, k_hi, k_rec, max_underflow_pct, under, top, steps_used,
                             sum(merged.values()), spans, sorted(wide, key=lambda n: -spans[n]))


def loss_scale_range(report: Report, *, max_underflow_pct: float = MAX_UNDERFLOW_PCT) -> LossScaleRange | None:
    """``(lo, hi, recommended)`` static loss scales, or None when no single scale works or no
    clean gradients were recorded."""
    a = loss_scale_analysis(report, max_underflow_pct=max_underflow_pct)
    if a is None or not a.feasible:
        return None
    return LossScaleRange(2.0 ** a.k_lo, 2.0 ** a.k_hi, 2.0 ** a.k_rec)


# -- GradScaler health -------------------------------------------------------------------------------
@dataclass
class ScalerHealth:
    state: str            # none | healthy | startup | occasional | frequent | persistent | collapse | huge
    steps: int
    skipped: int
    startup_backoffs: int
    skipped_after_startup: int
    first_scale: float | None
    last_scale: float | None
    min_scale: float | None
    max_scale: float | None


def scaler_health(report: Report) -> ScalerHealth:
    tl = [t for t in report.timeline]
    scales = [float(t["scale"]) for t in tl if t.get("scale")]
    if not scales:
        return ScalerHealth("none", len(tl), 0, 0, 0, None, None, None, None)
    skipped = [bool(t.get("skipped")) for t in tl]
    startup = 0
    while startup < len(skipped) and skipped[startup]:
        startup += 1
    after = skipped[startup:]
    n_after = sum(after)
    tail = after[-10:]
    if min(scales) < 1.0:
        state = "collapse"
    elif len(tail) >= 5 and sum(tail) > len(tail) / 2:
        state = "persistent"
    elif max(scales) >= HUGE_SCALE:
        state = "huge"
    elif n_after > max(2, 0.05 * len(after)):
        state = "frequent"
    elif n_after:
        state = "occasional"
    elif startup:
        state = "startup"
    else:
        state = "healthy"
    first = scales[0] * (2.0 if skipped and skipped[0] else 1.0)
    return ScalerHealth(state, len(tl), sum(skipped), startup, n_after, first, scales[-1], min(scales), max(scales))


def _scaler_advice(report: Report, h: ScalerHealth, ls: LossScaleAnalysis | None) -> list[str]:
    if h.state == "none":
        return []
    def lg(v: float | None) -> str:
        return f"2**{math.log2(v):.0f}" if v and v > 0 else "0"

    base = f"GradScaler: {h.skipped} of {h.steps} steps skipped"
    if h.state == "collapse":
        return [f"{base}; its scale collapsed from {lg(h.first_scale)} to {lg(h.min_scale)} (below 1): gradients "
                "overflow at every scale, so the Inf/NaN comes from a layer that produces it, not from the loss scale. "
                "Fix that layer (above); changing init_scale will not help."]
    if h.state == "persistent":
        return [f"{base}, {h.skipped_after_startup} after start-up and most of the last 10: persistent overflow. The scale "
                f"fell to {lg(h.last_scale)} without the overflow stopping: a layer produces Inf/NaN (see the culprit), "
                "or the gradients span more binades than the format holds."]
    out = []
    if h.startup_backoffs:
        out.append(f"{base}: {h.startup_backoffs} start-up backoffs ({lg(h.first_scale)} -> "
                   f"{lg(h.first_scale / 2 ** h.startup_backoffs)}) are normal; "
                   + (f"`GradScaler(init_scale={_scale_literal(ls.k_rec)})` avoids them." if ls and ls.feasible
                      else "a lower init_scale avoids them."))
    if h.state == "occasional":
        out.append(f"{base}, {h.skipped_after_startup} after start-up: occasional overflow that the scaler backs off "
                   f"from (scale {lg(h.first_scale)} -> {lg(h.last_scale)}); normal for a dynamic loss scale.")
    if h.state == "frequent":
        out.append(f"GradScaler skipped {h.skipped_after_startup} steps after start-up: the scale keeps growing into "
                   "overflow. A longer growth_interval (e.g. `GradScaler(growth_interval=4000)`) skips fewer steps"
                   + (f"; the recorded gradients tolerate at most {_pow2(ls.k_hi)}." if ls else "."))
    if h.state == "huge":
        out.append(f"GradScaler's scale grew to {lg(h.max_scale)}: the gradients are tiny (or a skipped-step check never "
                   "fires). Harmless while the scaled loss stays finite; a larger `GradScaler(growth_interval=...)`, or "
                   "a smaller init_scale, keeps it in range.")
    if h.state == "healthy" and not out:
        out.append(f"{base}; scale {lg(h.first_scale)} -> {lg(h.last_scale)}: healthy.")
    return out


def _loss_scale_advice(report: Report, ls: LossScaleAnalysis | None, ready: bool) -> list[str]:
    if ls is None:
        return []
    fmt = report.fmt
    out = []
    if fmt.max_exp >= 100 and ls.feasible:
        return [f"Gradients fit {fmt.name} at scale 1 ({fmt.name} has FP32's exponent range): no loss scaling needed "
                f"(largest gradient binade 2**{ls.top_exp}, {ls.values} values over {ls.steps_used} steps)."]
    if ls.feasible:
        under = f"{ls.underflow_at_rec:.2g}%" if ls.underflow_at_rec is not None else "?"
        lead = (f"To train in {fmt.name}, use a GradScaler: " if ready else "Loss scale: ")
        out.append(f"{lead}static loss scales from {_pow2(ls.k_lo)} to {_pow2(ls.k_hi)} keep every recorded gradient "
                   f"below the {fmt.name} max and at most {ls.max_underflow_pct:g}% of them subnormal or flushed "
                   f"({ls.values} values over {ls.steps_used} steps, unscaled). Recommended "
                   f"`torch.amp.GradScaler(init_scale={_scale_literal(ls.k_rec)}, growth_interval=2000)`; at that scale "
                   f"{under} of the gradient values underflow.")
    else:
        out.append(f"No single static loss scale fits the gradients in {fmt.name}: avoiding overflow needs a scale "
                   f"<= {_pow2(ls.k_hi)}, keeping underflow at most {ls.max_underflow_pct:g}% needs >= {_pow2(ls.k_lo)}.")
    if ls.too_wide:
        names = ", ".join(f"{n} ({ls.spans[n]} binades)" for n in ls.too_wide[:5])
        out.append(f"Gradients of {names} span more binades than {fmt.name}'s normal range holds "
                   f"({fmt.max_exp - fmt.normal_exp}): run these layers in bf16 or FP32, e.g. "
                   f"`ampdoctor.keep_fp32({module_expr(ls.too_wide[0])})`.")
    return out


def _zero_gradient_advice(report: Report, ls: LossScaleAnalysis | None) -> list[str]:
    """Low-precision gradients that were exactly zero at every recorded step: flushed before any
    layer saw them (no histogram to measure, so say what the zeros imply)."""
    low = _grad_layers(report)
    rows = [r for r in report.rows("gradient") if (low is None or r.layer in low) and r.numel]
    zero = [r for r in rows if r.absmax == 0 and not r.bad]
    losses = [t["loss"] for t in report.timeline if t["loss"] is not None and math.isfinite(t["loss"])]
    if not rows or len(zero) < len(rows) or not losses or not any(losses) or (ls is not None and ls.values):
        return []
    fmt = report.fmt
    names = ", ".join(r.layer for r in sorted(zero, key=lambda r: -r.order)[:4]) + (
        f" and {len(zero) - 4} more" if len(zero) > 4 else "")
    k = fmt.normal_exp - (fmt.min_exp - 1)
    return [f"Every {fmt.name} activation gradient ({names}) was exactly 0 in all {max(r.steps for r in zero)} recorded "
            f"steps while the loss was finite (last {_fmt_num(losses[-1])}): the gradients underflow to zero in "
            f"{fmt.name} before any layer sees them, so nothing trains. Values below 2**{fmt.min_exp - 1} round to 0, "
            f"so a loss scale of at least {_pow2(k)} is needed to lift them into the normal range: use "
            "`torch.amp.GradScaler()` or a static loss scale. To measure the range, run the script once without autocast "
            f"under `ampdoctor run --format {fmt.name}`: that report gives the static loss scales that fit."]


# -- readiness (a run without autocast, measured against a low-precision format) ---------------
def readiness(report: Report) -> dict | None:
    """For a run whose activations were all float32/float64: which layers would overflow or
    underflow in the report's format. None when the run already used low precision."""
    acts = report.rows("activation")
    if not acts or any(r.dtype not in HIGH_PRECISION for r in acts) or report.format == "fp32":
        return None
    over, under = {}, {}
    for kind in ("activation", "gradient", "weight", "weight_grad"):
        for r in report.rows(kind):
            if r.overflow or r.inf or r.headroom_bits < 0:
                over.setdefault(kind, []).append(r)
            if r.subnormal_pct + r.flush_pct >= MAX_UNDERFLOW_PCT:
                under.setdefault(kind, []).append(r)
    return {"format": report.format, "layers": len(acts), "overflow": over, "underflow": under}


def _readiness_advice(report: Report, ready: dict) -> list[str]:
    fmt = report.fmt
    what = {"activation": "outputs", "gradient": "gradients", "weight": "weights", "weight_grad": "weight gradients"}
    n_over = len({r.layer for rows in ready["overflow"].values() for r in rows})
    n_under = len({r.layer for rows in ready["underflow"].values() for r in rows})
    out = [f"{fmt.name} readiness: this run had no autocast (every activation was float32), so its values were "
           f"measured against {fmt.name}: {n_over} of {ready['layers']} layers would overflow, {n_under} would "
           f"underflow."]

    def listing(groups: dict, describe, key) -> str:
        parts = []
        for kind, rows in groups.items():
            rows = sorted(rows, key=key)
            more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
            parts.append(f"{what[kind]} of " + ", ".join(describe(r) for r in rows[:5]) + more)
        return "; ".join(parts)

    if ready["overflow"]:
        out.append(f"Would overflow in {fmt.name} (max {fmt.max:.6g}): " + listing(
            ready["overflow"], lambda r: f"{r.layer} (abs-max {_fmt_num(r.absmax)}, {r.overflow_pct:.3g}% over)",
            lambda r: r.headroom_bits) + ".")
        worst = min((r for rows in ready["overflow"].values() for r in rows if r.kind == "activation"),
                    key=lambda r: r.order, default=None)
        if worst is not None:
            out.append(f"Keep {worst.layer} in FP32 when you switch on autocast: `ampdoctor.keep_fp32("
                       f"{module_expr(worst.layer)})`.")
    if ready["underflow"]:
        out.append(f"Would underflow in {fmt.name} (>= {MAX_UNDERFLOW_PCT:g}% of values subnormal or flushed to "
                   "zero): " + listing(ready["underflow"], lambda r: f"{r.layer} ({r.subnormal_pct + r.flush_pct:.3g}%)",
                                       lambda r: -(r.subnormal_pct + r.flush_pct)) + ".")
    if not n_over and not n_under:
        least = min(report.rows("activation"), key=lambda r: r.headroom_bits)
        out.append(f"Every recorded value fits {fmt.name}; the least headroom is {least.headroom_bits:+.1f} bits "
                   f"({least.layer}, abs-max {_fmt_num(least.absmax)}).")
    return out


# -- the other rules -------------------------------------------------------------------------------
def _culprit_advice(report: Report) -> list[str]:
    names, source = culprits(report)
    if not names:
        fn = report.diagnosis.first_nonfinite or {}
        if fn.get("input_nonfinite"):
            return [f"The input of {fn.get('layer') or '(root)'} was already non-finite at step {fn.get('step')}: "
                    "check the data and the code outside the watched model; forcing FP32 will not help."]
        if fn.get("from_loss"):
            return [f"The gradient entering the model from the loss was non-finite at step {fn.get('step')}: the loss "
                    "(times the loss scale) overflowed; compute the loss in FP32 (`loss_fn(out.float(), y)`) and check it."]
        return []
    why = "bisect verified that forcing it to FP32 makes training pass" if source == "bisect" else \
        "it was the first layer to produce a non-finite value from finite inputs"
    ev = "; ".join(f"{n}: {e}" for n in names if (e := _evidence(report, n)))
    lines = [f"Keep {', '.join(names)} in FP32 ({why}{'; ' + ev if ev else ''}): "
             + "; ".join(f"`ampdoctor.keep_fp32({module_expr(n)})`" for n in names)
             + " — or in plain PyTorch, around that call in forward: "
             "`with torch.autocast(x.device.type, enabled=False): out = layer(x.float())`"]
    if source == "first_nonfinite":
        lines += _nan_not_overflow(report, names[0])
    return lines


def _nan_not_overflow(report: Report, layer: str) -> list[str]:
    """A producer whose output held NaN but no Inf and no overflow, its finite values far below the
    format's max: an invalid operation is as likely as a hidden overflow; say how to tell them apart."""
    fn = report.diagnosis.first_nonfinite or {}
    r = _row(report, layer, fn.get("kind") or "activation")
    if r is None or not r.nan or r.inf or r.overflow or not (4.0 < r.headroom_bits < math.inf):
        return []
    fmt = report.fmt
    return [f"{layer} produced NaN without any Inf or overflow in its output (finite values up to "
            f"{_fmt_num(r.absmax)}, {r.headroom_bits:.1f} bits below the {fmt.name} max): either an invalid operation "
            "(log or sqrt of a negative number, 0/0), which FP32 will not fix, or an overflow inside its forward "
            "(x*x, exp) that turned into NaN. `ampdoctor bisect` tells them apart (verdict not_precision for the first)."]


def _attention_advice(report: Report) -> list[str]:
    b = report.bisect or {}
    ops = [o for o in (b.get("ops") or []) if isinstance(o, dict)]
    names = [str(o.get("op", "")).lower().rsplit(".", 1)[-1] for o in ops]
    matmuls = [o for o, n in zip(ops, names) if any(n.startswith(m) for m in MATMUL_OPS)
               and o.get("phase", "forward") == "forward"]
    mm = next((o for o in matmuls if o.get("pick") == "first"), matmuls[0] if matmuls else None)
    if mm is None:
        return []
    attn = any("softmax" in n for n in names) or any(
        w in str(mm.get("layer", "")).lower() or w in (next((r.type for r in report.layers
                                                             if r.layer == mm.get("layer")), "") or "").lower()
        for w in ("attn", "attention"))
    if not attn:
        return []
    where = f" at {mm['where']}" if mm.get("where") else ""
    if mm.get("absmax") is not None:
        amax = f" (abs-max {_fmt_num(float(mm['absmax']))} vs {report.fmt.name} max {report.fmt.max:.6g})"
    else:
        amax = " (non-finite output)" if mm.get("nonfinite") else ""
    return [f"The first overflowing op is {mm.get('op')}{where} in {mm.get('layer')}{amax}, a matmul feeding a softmax: "
            "scale q by 1/sqrt(head_dim) before the matmul instead of the scores after it "
            "(`q = q * head_dim ** -0.5; scores = q @ k.transpose(-2, -1)`), compute the scores in FP32, or clamp them "
            "before softmax (`scores.clamp(-3e4, 3e4)`); `F.scaled_dot_product_attention` does the pre-scaling for you."]


def _divergence_advice(report: Report) -> list[str]:
    d = report.diagnosis
    b = report.bisect or {}
    out = []
    if b.get("verdict") == "not_precision":
        out.append("bisect: training breaks with every layer in FP32 too, so this is not a precision problem: "
                   "look at the learning rate, warmup, gradient clipping and the data.")
    finite = [(t["step"], t["loss"]) for t in report.timeline if t["loss"] is not None and math.isfinite(t["loss"])]
    if d.reason == "divergence" or (finite and d.broke and len(finite) >= 3):
        lo_step, lo = min(finite, key=lambda p: p[1]) if finite else (None, None)
        last_step, last = finite[-1] if finite else (None, None)
        grew = lo is not None and lo > 0 and last > 10 * lo and last_step > lo_step
        if d.reason == "divergence" or grew:
            out.append(f"The loss grew from {_fmt_num(lo)} (step {lo_step}) to {_fmt_num(last)} (step {last_step}) "
                       "before training broke: an optimisation divergence. Lower the learning rate, add warmup, "
                       "and clip gradients (`scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(model.parameters(), "
                       "1.0)` before `scaler.step(opt)`).")
    return out


def _pure_half_advice(report: Report, scaler: ScalerHealth) -> list[str]:
    weights = report.rows("weight")
    half = [r for r in weights if r.dtype in ("float16", "bfloat16")]
    if not half:
        return []
    dts = sorted({r.dtype for r in half})
    out = [f"{len(half)} of {len(weights)} weight tensors are stored in {'/'.join(dts)} (a pure .half()/.bfloat16() "
           "model): keep FP32 master weights and use torch.autocast instead."]
    if "float16" in dts:
        out.append("In fp16, Adam's eps=1e-8 underflows to 0 (fp16's smallest subnormal is 5.96e-08) and a norm's "
                   "eps=1e-5 is subnormal (smallest normal 6.1e-05): divisions by ~0 blow up. With fp16 parameters "
                   "use eps >= 1e-4, or FP32 parameters.")
        if scaler.state != "none":
            out.append("A GradScaler with fp16 parameters: unscale_() refuses fp16 gradients ('Attempting to unscale "
                       "FP16 gradients'); GradScaler expects FP32 parameters under autocast.")
    if "bfloat16" in dts:
        small = [r for r in half if r.dtype == "bfloat16"]
        out.append(f"bf16 weights keep 8 significant bits: updates smaller than 2**-8 of a weight are rounded away "
                   f"({len(small)} tensors); use FP32 master weights or a stochastic-rounding/Kahan optimizer.")
    return out


def advise(report: Report) -> list[str]:
    """Advice items, most important first; every item says the numbers it rests on."""
    out: list[str] = []
    ready = readiness(report)
    scaler = scaler_health(report)
    try:
        ls = loss_scale_analysis(report)
    except Exception as e:  # advice must never lose the report
        ls = None
        out_note = f"loss-scale analysis failed: {type(e).__name__}: {e}"
        report.notes.append(out_note)
    if ready is not None:
        out += _readiness_advice(report, ready)
    else:
        out += _culprit_advice(report)
        out += _attention_advice(report)
    out += _divergence_advice(report)
    out += _scaler_advice(report, scaler, ls)
    if report.fmt.name not in ("fp32",):
        out += _zero_gradient_advice(report, ls)
        out += _loss_scale_advice(report, ls, ready is not None)
    out += _pure_half_advice(report, scaler)
    return out
