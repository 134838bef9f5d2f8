"""Readiness: a run without autocast (every activation float32/float64), measured against a
low-precision format. :func:`readiness` lists the layers whose values would overflow or underflow
there (and, apart, those already NaN/Inf in FP32: a diverged run); :func:`readiness_advice` says so,
and which layer to keep in FP32 once autocast is on."""

from __future__ import annotations

from ..formats import wider_than
from ..naming import root_hint, wrapper_of
from .lossscale import MAX_UNDERFLOW_PCT
from .model import Report
from .phrasing import fmt_num, module_expr, plural
from .unscaled import HIGH_PRECISION

__all__ = ["readiness", "readiness_advice", "ran_in"]


def readiness(report: Report) -> dict | None:
    """For a run whose activations were all float32/float64, or held in a wider-ranged low precision
    than the report's format (bf16 measured against fp16, a run that did not break): which layers would
    overflow or underflow in the report's format, and which were already non-finite (``nonfinite``:
    NaN/Inf there is broken in any format, not an overflow of this one). None when the run used the
    format itself, or broke in a low precision (judged by what it ran in)."""
    acts = report.rows("activation")
    if not acts or report.format == "fp32" or any(not wider_than(r.dtype, report.format) for r in acts):
        return None
    ran = sorted({r.dtype for r in acts} - set(HIGH_PRECISION))
    if ran and report.diagnosis.broke:
        return None
    over, under, nonfinite = {}, {}, {}
    for kind in ("activation", "gradient", "weight", "weight_grad"):
        for r in report.rows(kind):
            if r.overflow:  # finite values beyond the format's max (abs-max and overflow count finite ones)
                over.setdefault(kind, []).append(r)
            if r.nan or r.inf:
                nonfinite.setdefault(kind, []).append(r)
            if r.subnormal_pct + r.flush_pct >= MAX_UNDERFLOW_PCT:
                under.setdefault(kind, []).append(r)
    return {"format": report.format, "layers": len(acts), "overflow": over, "underflow": under,
            "nonfinite": nonfinite, "ran": ran}


def ran_in(ready: dict) -> str:
    """What the activations of a :func:`readiness` run ran in, said for the report."""
    if not ready.get("ran"):
        return "every activation of this run was float32 (no autocast, or none of the layers that ran is one autocast casts)"
    return f"the activations of this run ran in {' and '.join(ready['ran'])} (float32 where autocast keeps it)"


def readiness_advice(report: Report, ready: dict) -> list[str]:
    """Advice items for a :func:`readiness` result: the counts, then the layers, worst first."""
    fmt = report.fmt
    what = {"activation": "outputs", "gradient": "gradients", "weight": "weights", "weight_grad": "weight gradients"}
    n_over = len({r.layer for rows in ready["overflow"].values() for r in rows})
    n_under = len({r.layer for rows in ready["underflow"].values() for r in rows})
    n_bad = len({r.layer for rows in ready["nonfinite"].values() for r in rows})
    held = " and ".join(ready.get("ran") or []) or "FP32"
    already = f"; {n_bad} already had NaN/Inf in {held}" if n_bad else ""
    out = [f"{fmt.name} readiness: {ran_in(ready)}, so its values were measured against {fmt.name}: {n_over} of "
           f"{plural(ready['layers'], 'layer')} would overflow, {n_under} would underflow{already}."]

    def listing(groups: dict, describe, key) -> str:
        parts = []
        for kind, rows in groups.items():
            rows = sorted(rows, key=key)
            more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
            parts.append(f"{what[kind]} of " + ", ".join(describe(r) for r in rows[:5]) + more)
        return "; ".join(parts)

    if ready["overflow"]:
        out.append(f"Would overflow in {fmt.name} (max {fmt.max:.6g}): " + listing(
            ready["overflow"], lambda r: f"{r.layer} (abs-max {fmt_num(r.absmax)}, {r.overflow_pct:.3g}% over)",
            lambda r: fmt.headroom_bits(r.absmax)) + ".")
        worst = min((r for rows in ready["overflow"].values() for r in rows if r.kind == "activation"),
                    key=lambda r: r.order, default=None)
        if worst is not None:
            switch = f"switch autocast to {fmt.name}" if ready.get("ran") else "switch on autocast"
            out.append(f"Keep {worst.layer} in FP32 when you {switch}: `ampdoctor.keep_fp32("
                       f"{module_expr(worst.layer, types=report.module_types)})`"
                       f"{root_hint([worst.layer], report.module_types, wrapper_of(report.notes))}.")
    if ready["underflow"]:
        out.append(f"Would underflow in {fmt.name} (>= {MAX_UNDERFLOW_PCT:g}% of values subnormal or flushed to "
                   "zero): " + listing(ready["underflow"], lambda r: f"{r.layer} ({r.subnormal_pct + r.flush_pct:.3g}%)",
                                       lambda r: -(r.subnormal_pct + r.flush_pct)) + ".")
    if ready["nonfinite"]:
        out.append(f"Already NaN/Inf in {held}, so not counted as overflow (no format fixes a run that diverges in "
                   f"{held} too): " + listing(ready["nonfinite"], lambda r: f"{r.layer} ({r.nan} NaN, {r.inf} Inf)",
                                           lambda r: r.order) + ".")
    if not n_over and not n_under:
        least = min(report.rows("activation"), key=lambda r: fmt.headroom_bits(r.absmax))
        out.append(f"Every {'finite ' if n_bad else ''}recorded value fits {fmt.name}; the least headroom is "
                   f"{fmt.headroom_bits(least.absmax):+.1f} bits ({least.layer}, abs-max {fmt_num(least.absmax)}).")
    return out
