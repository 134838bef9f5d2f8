"""The loss-scale advisor: which static loss scales keep the recorded gradients in the format.

:func:`loss_scale_range` gives the powers of two with no gradient overflow and at most
``MAX_UNDERFLOW_PCT`` % of gradient values subnormal or flushed; :func:`loss_scale_analysis`
gives the same with the per-layer binade spans. Both read the unscaled gradient histograms
(:mod:`ampdoctor.report.unscaled`). :func:`loss_scale_advice` and :func:`zero_gradient_advice`
phrase the result as advice items.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from ..formats import Format
from ..naming import root_hint, wrapper_of
from .model import Report
from .phrasing import fmt_num, module_expr, plural, pow2, scale_literal
from .unscaled import HIGH_PRECISION, grad_layers, unscaled_hists

__all__ = ["MAX_UNDERFLOW_PCT", "LossScaleRange", "LossScaleAnalysis", "loss_scale_range", "loss_scale_analysis",
           "loss_scale_advice", "zero_gradient_advice"]

MAX_UNDERFLOW_PCT = 1.0


class LossScaleRange(NamedTuple):
    """Static loss scales (powers of two) with no gradient overflow and at most
    ``MAX_UNDERFLOW_PCT`` % of gradient values subnormal or flushed; ``recommended`` lies inside."""
    lo: float
    hi: float
    recommended: float


@dataclass
class LossScaleAnalysis:
    """The advisor's numbers, as log2 of the scale; ``feasible`` when one static scale fits."""
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


def _k_hi(fmt: Format, top: int, amax: float = 0.0) -> int:
    """The largest log2(scale) with no overflow, for values whose highest binade is ``top`` and largest
    value ``amax`` (0: not known)."""
    if 0 < amax < math.inf:
        # scaled by 2**k (exact) the largest value stays <= max, so no value overflows
        k = math.floor(math.log2(fmt.max / amax))
        while amax * 2.0 ** k > fmt.max:  # (log2's rounding)
            k -= 1
        while amax * 2.0 ** (k + 1) <= fmt.max:
            k += 1
        return k
    # values in binade e are < 2**(e+1): scaled by 2**k they stay <= max while e+1+k <= log2(max)
    return fmt.max_exp - top - 1


def _k_range(hist: dict[int, int], fmt: Format, max_underflow_pct: float, amax: float = 0.0) -> tuple[int, int, int]:
    """(k_lo, k_hi, top exponent) of one exponent histogram whose largest value is ``amax`` (0: not known)."""
    es = sorted(hist)
    total = sum(hist.values())
    top = es[-1]
    k_hi = _k_hi(fmt, top, amax)
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
    got = unscaled_hists(report)
    if not got or not got[0]:
        return None
    per_layer, steps_used, amax = got
    fmt = report.fmt
    merged: dict[int, int] = {}
    for h in per_layer.values():
        for e, c in h.items():
            merged[e] = merged.get(e, 0) + c
    k_lo, k_hi, top = _k_range(merged, fmt, max_underflow_pct, max(amax.values(), default=0.0))
    normal_binades = fmt.max_exp - fmt.normal_exp  # binades between the smallest normal and max/2
    spans, wide = {}, []
    for name, h in per_layer.items():
        lo, hi, top_h = _k_range(h, fmt, max_underflow_pct)  # (by binades: the span counts whole binades)
        spans[name] = normal_binades - (hi - lo)  # binades the layer needs (1st percentile .. max)
        if _k_hi(fmt, top_h, amax.get(name, 0.0)) < lo:
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


def _over(ls: LossScaleAnalysis) -> str:
    """What the advisor read: ``1000 values over 4 steps``."""
    return f"{plural(ls.values, 'value')} over {plural(ls.steps_used, 'step')}"


def loss_scale_advice(report: Report, ls: LossScaleAnalysis | None, ready: bool, after_fix: bool = False) -> list[str]:
    """The static loss scales that fit (or why none does), and layers too wide for the format;
    ``ready``: the run had no autocast, so the advice is how to start using a GradScaler; ``after_fix``:
    the GradScaler's advice said the Inf/NaN is not the scale's (it collapsed, or overflow persisted as it
    fell), so the range is what to use once that is fixed, not a fix of its own."""
    if ls is None:
        return []
    fmt = report.fmt
    out = []
    if fmt.max_exp >= 100 and ls.feasible and ls.k_lo <= 0 <= ls.k_hi:
        return [f"Gradients fit {fmt.name} at scale 1 ({fmt.name} has FP32's exponent range): no loss scaling needed "
                f"(largest gradient binade 2**{ls.top_exp}, {_over(ls)})."]
    if fmt.max_exp >= 100 and ls.feasible and ls.k_lo > 0:
        # bf16 too: its range is FP32's, but gradients that small still fall below it (a loss scaled down
        # by far), so scale 1 leaves them subnormal or zero
        return [f"Gradients underflow {fmt.name} at scale 1: more than {ls.max_underflow_pct:g}% of the recorded "
                f"gradient values are subnormal or flushed to zero ({_over(ls)}, "
                f"largest binade 2**{ls.top_exp}). Static loss scales from {pow2(ls.k_lo)} to {pow2(ls.k_hi)} keep "
                f"them in range: multiply the loss by {scale_literal(ls.k_rec)} before backward and divide the "
                "gradients by it before the optimizer step, or make the loss larger where it is computed."]
    if ls.feasible:
        under = f"{ls.underflow_at_rec:.2g}%" if ls.underflow_at_rec is not None else "?"
        lead = (f"To train in {fmt.name}, use a GradScaler: " if ready else
                "Loss scale, once the Inf/NaN above is fixed (no loss scale fixes it): " if after_fix else "Loss scale: ")
        half_params = any(r.dtype in ("float16", "bfloat16") for r in report.rows("weight"))
        how = (f"a static loss scale of {scale_literal(ls.k_rec)} (multiply the loss before backward, divide the "
               "gradients before the step: GradScaler refuses fp16 parameters)" if half_params else
               f"`torch.amp.GradScaler(init_scale={scale_literal(ls.k_rec)}, growth_interval=2000)`")
        out.append(f"{lead}static loss scales from {pow2(ls.k_lo)} to {pow2(ls.k_hi)} keep every recorded gradient "
                   f"below the {fmt.name} max and at most {ls.max_underflow_pct:g}% of them subnormal or flushed "
                   f"({_over(ls)}, unscaled). Recommended {how}; at that scale "
                   f"{under} of the gradient values underflow.")
    else:
        out.append(f"No single static loss scale fits the gradients in {fmt.name}: avoiding overflow needs a scale "
                   f"<= {pow2(ls.k_hi)}, keeping underflow at most {ls.max_underflow_pct:g}% needs >= {pow2(ls.k_lo)}.")
    if ls.too_wide:
        names = ", ".join(f"{n} ({plural(ls.spans[n], 'binade')})" for n in ls.too_wide[:5])
        out.append(f"Gradients of {names} span more binades than {fmt.name}'s normal range holds "
                   f"({fmt.max_exp - fmt.normal_exp}): run these layers in bf16 or FP32, e.g. "
                   f"`ampdoctor.keep_fp32({module_expr(ls.too_wide[0], types=report.module_types)})`"
                   f"{root_hint(ls.too_wide[:1], report.module_types, wrapper_of(report.notes))}.")
    return out


def zero_gradient_advice(report: Report, ls: LossScaleAnalysis | None) -> list[str]:
    """Low-precision gradients that were exactly zero at every recorded step: flushed before any
    layer saw them (no histogram to measure, so say what the zeros imply)."""
    low = grad_layers(report)
    rows = [r for r in report.rows("gradient") if (low is None or r.layer in low) and r.numel]
    zero = [r for r in rows if r.absmax == 0 and not r.bad]
    losses = [t["loss"] for t in report.timeline if t["loss"] is not None and math.isfinite(t["loss"])]
    if not rows or len(zero) < len(rows) or not losses or not any(losses) or (ls is not None and ls.values):
        return []
    fmt = report.fmt
    names = ", ".join(r.layer for r in sorted(zero, key=lambda r: -r.order)[:4]) + (
        f" and {len(zero) - 4} more" if len(zero) > 4 else "")
    k = fmt.normal_exp - (fmt.min_exp - 1)
    n = max(r.steps for r in zero)
    steps = 'the one recorded step' if n == 1 else f'all {n} recorded steps'
    if all(r.dtype in HIGH_PRECISION for r in zero):  # zeros in FP32: nothing underflowed, no scale lifts them
        dtypes = "/".join(sorted({r.dtype for r in zero}))
        return [f"Every activation gradient ({names}) was exactly 0 in {dtypes} in {steps} while the loss was "
                f"finite (last {fmt_num(losses[-1])}): nothing underflowed, the loss does not depend on the model's "
                "output (a loss multiplied by 0, an output detached or replaced by a constant?), so nothing trains. "
                "No loss scale changes that."]
    return [f"Every {fmt.name} activation gradient ({names}) was exactly 0 in "
            f"{steps} while the loss was finite "
            f"(last {fmt_num(losses[-1])}): the gradients underflow to zero in "
            f"{fmt.name} before any layer sees them, so nothing trains. Values below 2**{fmt.min_exp - 1} round to 0, "
            f"so a loss scale of at least {pow2(k)} is needed to lift them into the normal range: use "
            "`torch.amp.GradScaler()` or a static loss scale. To measure the range, run the script once without autocast "
            f"under `ampdoctor run --format {fmt.name}`: that report gives the static loss scales that fit."]
