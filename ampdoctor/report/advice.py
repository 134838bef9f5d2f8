"""Concrete advice from a :class:`~ampdoctor.report.model.Report`, each item citing recorded numbers.
Code in an item is set in backticks (the HTML report shows it as code).

:func:`advise` is what ``build_report`` calls: it runs the rules and orders their items. The rules
live beside it, one module each, and their structured pieces are public (re-exported here) so
that tests and tools can apply them:

- :mod:`.lossscale`: :func:`loss_scale_range` (a static loss scale with no overflow and at most
  1% of gradient values subnormal or flushed) and :func:`loss_scale_analysis` (the same with the
  per-layer binade spans), read from the unscaled gradient histograms (:mod:`.unscaled`);
- :mod:`.scaler_health`: :func:`scaler_health`, the GradScaler's record;
- :mod:`.readiness`: :func:`readiness`, a run without autocast measured against a low-precision format;
- :mod:`.culprit`: :func:`culprits`, the layers to keep in FP32, and the attention-matmul fix;
- :mod:`.training`: optimisation divergence and half-precision weights;
- :mod:`.phrasing`: :func:`module_expr` and the number formats the items share.
"""

from __future__ import annotations

from .culprit import attention_advice, culprit_advice, culprits
from .lossscale import (
    LossScaleAnalysis,
    LossScaleRange,
    loss_scale_advice,
    loss_scale_analysis,
    loss_scale_range,
    zero_gradient_advice,
)
from .model import Report
from .phrasing import module_expr
from .readiness import readiness, readiness_advice
from .scaler_health import ScalerHealth, scaler_advice, scaler_health
from .training import divergence_advice, pure_half_advice

__all__ = ["advise", "backward_error_advice", "stopped_in_backward", "LossScaleRange", "LossScaleAnalysis",
           "loss_scale_range", "loss_scale_analysis", "ScalerHealth", "scaler_health", "readiness", "module_expr", "culprits"]


def backward_error_advice(report: Report) -> list[str]:
    """A backward pass that raised (the session's ``backward_error`` metadata): the first thing to fix."""
    err = report.meta.get("backward_error")
    if not err:
        return []
    step = report.meta.get("backward_error_step")
    at = f" at step {step}" if step is not None else ""
    return [f"Fix the error that backward() raised{at} first ({err}): the gradients of that step stop where it "
            "raised, so the numbers recorded for them are partial."]


def stopped_in_backward(report: Report) -> bool:
    """backward() raised and no optimizer step ran (none taken, none skipped by a GradScaler): the only
    gradients recorded are the partial ones of the pass that raised, a loss scale for them means nothing.
    (A loop that updates its weights by hand also counts no optimizer step: its full gradients do.)"""
    return (bool(report.meta.get("backward_error")) and report.diagnosis.optimizer_steps == 0
            and not any(t.get("skipped") for t in report.timeline))


def advise(report: Report) -> list[str]:
    """Advice items, most important first; every item says the numbers it rests on."""
    out: list[str] = backward_error_advice(report)
    ready = readiness(report)
    scaler = scaler_health(report)
    try:
        ls = loss_scale_analysis(report)
    except Exception as e:  # advice must never lose the report
        ls = None
        out_note = f"loss-scale analysis failed: {type(e).__name__}: {e}"
        report.notes.append(out_note)
    diverged = divergence_advice(report, scaler)
    growth_said = any(a.startswith("The loss grew from") for a in diverged)
    if diverged and culprits(report)[1] != "bisect":
        # the loss grew tenfold before it broke (or bisect saw FP32 break too): the learning rate is the fix,
        # and the layer that first overflowed (a suspect from the numbers, not verified) comes after it
        out += diverged
        diverged = []
    if ready is not None:
        out += readiness_advice(report, ready)
    else:
        out += culprit_advice(report, growth_said=growth_said)
        out += attention_advice(report)
    out += diverged
    out += scaler_advice(report, scaler, ls)
    if report.fmt.name not in ("fp32",) and not stopped_in_backward(report):
        out += zero_gradient_advice(report, ls)
        out += loss_scale_advice(report, ls, ready is not None,
                                 after_fix=scaler.state in ("collapse", "persistent", "nan"))
    out += pure_half_advice(report, scaler)
    return out
