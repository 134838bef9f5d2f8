"""Advice on the training setup rather than on one layer's precision: an optimisation divergence
(the loss grew before training broke, or bisect found FP32 breaks too) and a model stored in
half precision (pure ``.half()``/``.bfloat16()``: master weights, optimizer eps, GradScaler)."""

from __future__ import annotations

from .culprit import trains_without_autocast
from .model import Report, loss_growth
from .phrasing import fmt_num, plural
from .scaler_health import ScalerHealth, scaler_health

__all__ = ["clip_fix", "diverged", "divergence_advice", "pure_half_advice"]


def diverged(report: Report) -> bool:
    """The loss grew tenfold (from its lowest to its last finite value before the break) and then training
    broke: an optimisation divergence."""
    return bool(_growth(report))


def _growth(report: Report) -> tuple[tuple[int, float], tuple[int, float]] | None:
    """See :func:`~.model.loss_growth`: the run's, when it broke."""
    d = report.diagnosis
    if not d.broke:
        return None
    return loss_growth(report.timeline, d)


def clip_fix(scaler: ScalerHealth | None) -> str:
    """Gradient clipping as the run's loop would write it: with a GradScaler the gradients are unscaled first
    (clipping scaled ones clips at the wrong norm), without one they are clipped as they are."""
    if scaler is not None and scaler.state != "none":
        return ("`scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` before "
                "`scaler.step(opt)`")
    return "`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` before `opt.step()`"


def divergence_advice(report: Report, scaler: ScalerHealth | None = None) -> list[str]:
    """Not a precision problem: bisect's not_precision verdict, or a loss that grew tenfold before it broke.
    ``scaler``: the run's GradScaler record (:func:`~.scaler_health.scaler_health`, computed when not given),
    which decides how the clipping snippet reads."""
    if scaler is None:
        scaler = scaler_health(report)
    d = report.diagnosis
    b = report.bisect or {}
    out = []
    if b.get("verdict") == "not_precision" and not trains_without_autocast(b):
        out.append("bisect: training breaks with every layer in FP32 too, so this is not a precision problem: "
                   "look at the learning rate, warmup, gradient clipping and the data.")
    grew = _growth(report)
    fix = f"Lower the learning rate, add warmup, and clip gradients ({clip_fix(scaler)})."
    if grew:
        (lo_step, lo), (last_step, last) = grew
        until = ("before training broke" if d.step is None or last_step < d.step else
                 "while the GradScaler skipped steps, before the loss turned non-finite")
        out.append(f"The loss grew from {fmt_num(lo)} (step {lo_step}) to {fmt_num(last)} (step {last_step}) "
                   f"{until}: an optimisation divergence. {fix}")
    elif d.reason == "divergence":
        out.append(f"The loss diverged from the FP32 control's{f' at step {d.step}' if d.step is not None else ''}: "
                   f"an optimisation divergence. {fix}")
    return out


def pure_half_advice(report: Report, scaler: ScalerHealth) -> list[str]:
    """Weights stored in fp16/bf16: keep FP32 master weights; the eps and GradScaler traps of each dtype."""
    weights = report.rows("weight")
    half = [r for r in weights if r.dtype in ("float16", "bfloat16")]
    if not half:
        return []
    dts = sorted({r.dtype for r in half})
    out = [f"The weights of {len(half)} of {plural(len(weights), 'layer')} are stored in {'/'.join(dts)} (a pure .half()/.bfloat16() "
           "model): keep FP32 master weights and use torch.autocast instead."]
    if "float16" in dts:
        out.append("In fp16, an Adam/AdamW eps=1e-8 (if you use one) underflows to 0 (fp16's smallest subnormal is 5.96e-08) and a norm's "
                   "eps=1e-5 is subnormal (smallest normal 6.1e-05): divisions by ~0 blow up. With fp16 parameters "
                   "use eps >= 1e-4, or FP32 parameters.")
        if scaler.state != "none":
            out.append("A GradScaler with fp16 parameters: unscale_() refuses fp16 gradients ('Attempting to unscale "
                       "FP16 gradients'); GradScaler expects FP32 parameters under autocast.")
    if "bfloat16" in dts:
        small = [r for r in half if r.dtype == "bfloat16"]
        out.append(f"bf16 weights keep 8 significant bits: updates smaller than 2**-8 of a weight are rounded away "
                   f"({plural(len(small), 'tensor')}); use FP32 master weights or a stochastic-rounding/Kahan optimizer.")
    return out
