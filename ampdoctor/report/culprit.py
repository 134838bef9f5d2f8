"""The culprit: which layers to keep in FP32 (bisect's verdict, else the first producer of a
non-finite value), the recorded numbers that make them culprits, and the fix; plus the attention
matmul that bisect found overflowing first."""

from __future__ import annotations

import math

from ..naming import (
    half_weights_under,
    is_torch_module,
    model_half,
    plain_fix,
    root_hint,
    wrapped_hint,
    wrapper_of,
)
from ..trace import TraceReader
from .model import LayerRow, Report, grew_tenfold, startup_backoffs
from .phrasing import fmt_num, module_expr, shown_layer

__all__ = ["MATMUL_OPS", "culprits", "culprit_advice", "attention_advice", "recomputed_note"]

# how bisect's advice line starts when a culprit's input was already beyond the format's max as it was called
CAME_IN = "The input of "
LOSS_OVERFLOW = "The loss overflowed"  # bisect's advice for a first non-finite value made by the loss
OWN_CODE = "The first NaN/Inf was made in "  # bisect's advice for one made by a root's own code, not a layer
OUTSIDE_MODEL = "Every layer in FP32 still breaks, but with autocast off"  # bisect's advice: the script's own code


def trains_without_autocast(bisect: dict | None) -> bool:
    """Bisect found every layer in FP32 still breaking, and the script with every autocast region off training:
    the NaN/Inf is made by the script's own code under autocast (a loss), outside the model's modules."""
    return (bisect or {}).get("verdict") == "not_precision" and (bisect or {}).get("autocast_off_control") == "pass"
MATMUL_OPS = ("matmul", "bmm", "baddbmm", "mm", "addmm", "linear", "einsum", "scaled_dot_product_attention")


def recomputed_note(op: dict) -> str:
    """What a bisect op entry's abs-max is of, where it is not of the op's own output (``absmax_of``
    "fp32_recompute"): its low-precision output held Inf/NaN, so the drill-down ran the op again in
    FP32 to measure how large the values really got."""
    if op.get("absmax_of") != "fp32_recompute":
        return ""
    return f" when recomputed in FP32; its {op.get('dtype') or 'low-precision'} output held Inf/NaN"


def culprits(report: Report) -> tuple[list[str], str]:
    """The layers to keep in FP32 and where that came from: bisect's verified culprits, else the
    first producer of a non-finite value (when it produced it from finite inputs)."""
    b = (report.bisect or {})
    if b.get("verdict") == "culprit" and b.get("culprits"):
        return list(b["culprits"]), "bisect"
    if b.get("verdict") in ("not_precision", "healthy"):
        return [], ""  # bisect showed that forcing FP32 is not the fix
    fn = report.diagnosis.first_nonfinite
    if fn and not fn.get("input_nonfinite") and not fn.get("from_loss") and fn.get("kind") != "weight" \
            and fn.get("layer") is not None and not _all_fp32(report):
        return [fn["layer"] or "(root)"], "first_nonfinite"
    return [], ""


def _all_fp32(report: Report) -> bool:
    """No activation was in a low-precision dtype: the run had no autocast and no half model, so a
    non-finite value was produced in FP32 and keeping a layer in FP32 cannot be the fix."""
    acts = report.rows("activation")
    return bool(acts) and not any(r.dtype in ("float16", "bfloat16") or r.dtype.startswith("float8") for r in acts)


def half_weights(report: Report) -> dict[str, str]:
    """Layer -> dtype of its weights, for the layers whose weights are stored in float16/bfloat16 (a pure
    ``.half()``/``.bfloat16()`` model: no autocast to turn off around them)."""
    return {r.layer: r.dtype for r in report.rows("weight") if r.dtype in ("float16", "bfloat16")}


def model_dtype(report: Report) -> str | None:
    """A pure ``.half()``/``.bfloat16()`` model's dtype (every weight row in it), else None."""
    return model_half(r.dtype for r in report.rows("weight"))


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
        if r.inf and r.numel and r.nan + r.inf >= r.numel:  # every value recorded was NaN or Inf
            s = f"its {what} overflowed to Inf ({fmt.name} max {fmt.max:.6g}; no finite value"
        elif r.inf:  # the recorded abs-max is of its finite values
            s = f"its {what} overflowed to Inf ({fmt.name} max {fmt.max:.6g}; largest finite abs-max {fmt_num(r.absmax)}"
        elif math.isnan(r.headroom_bits):
            s = f"its {what} held no finite value (every value NaN"
        elif math.isinf(r.headroom_bits):
            s = f"its {what} held no non-zero finite value"
        else:
            s = f"its {what} reached abs-max {fmt_num(r.absmax)} ({fmt.name} max {fmt.max:.6g}, headroom " \
                f"{r.headroom_bits:+.1f} bits"
        counts = [f"{n} {lbl}" for n, lbl in ((r.inf, "Inf"), (r.nan, "NaN"), (r.overflow, "overflowing")) if n]
        if counts:
            s += ", " + ", ".join(counts) + " values"
        if r.first_bad_step is not None:
            s += f", first at step {r.first_bad_step}"
        bits.append(s + ")")
        break
    return "; ".join(bits)


def _grew_first(report: Report) -> list[str]:
    """The loss grew tenfold or more before the first non-finite value (over the finite losses of the steps
    before it, taken or skipped): a divergence ends in an overflow too, and FP32 does not fix it (an audit's
    learning rate of 0.5 got "keep model[2] in FP32"; bisect's all-FP32 control broke too)."""
    fn = report.diagnosis.first_nonfinite or {}
    grew = grew_tenfold(report.timeline, fn["step"], peak=True) if fn.get("step") is not None else None
    if grew is None:
        return []
    low, high = grew
    return [f"Before that, the loss grew from {fmt_num(low[1])} (step {low[0]}) to {fmt_num(high[1])} (step {high[0]}): "
            "a training that diverges (a learning rate too high, bad data) ends in an overflow like this one too, and "
            "FP32 does not fix it. `ampdoctor bisect` tells the two apart (if its all-FP32 control breaks as well, the "
            "verdict is not_precision)."]


def _cast_back(report: Report, name: str) -> list[str]:
    """A suspect of a pure fp16/bf16 model whose output went Inf: keep_fp32 casts its output back to the
    model's dtype, where an output that is itself too large overflows again (an audit's ``x * x * alpha``
    gate: its keep_fp32 alone left the loss NaN; bisect's answer was the block around it)."""
    half = half_weights_under(name, half_weights(report))
    act = next((r for r in report.layers if r.layer == name and r.kind == "activation"), None)
    if not half or act is None or not (act.inf or act.overflow):
        return []
    parent = name.rpartition(".")[0]
    who = (f"its parent instead: `ampdoctor.keep_fp32({module_expr(parent, types=report.module_types)})`" if parent else
           "the layers that consume it too")
    return [f"The model's weights are {half} (no autocast): keep_fp32({name}) casts its output back to {half}, so if "
            f"that output is itself above the {report.fmt.name} max (its Inf may be the output's own, not a value "
            f"inside its forward's), it overflows there again and the loss stays non-finite. Then keep {who}, or "
            "bound the output; `ampdoctor bisect` finds the smallest set that fixes training."]


def culprit_advice(report: Report, growth_said: bool = False) -> list[str]:
    """How to keep the culprits in FP32 and why; when there is none, where the non-finite value came from.
    ``growth_said``: the divergence advice says already how the loss grew (not said twice)."""
    names, source = culprits(report)
    if not names:
        fn = report.diagnosis.first_nonfinite or {}
        if trains_without_autocast(report.bisect):
            return [a for a in report.bisect.get("advice") or [] if isinstance(a, str) and a.startswith(OUTSIDE_MODEL)]
        if fn.get("input_nonfinite"):
            return [f"The input of {shown_layer(fn.get('layer'))} was already non-finite at step {fn.get('step')}: "
                    "check the data and the code outside the watched model; forcing FP32 will not help."]
        if fn.get("layer") is not None and not fn.get("input_nonfinite") and _all_fp32(report) \
                and (report.bisect or {}).get("verdict") not in ("not_precision", "healthy"):
            what = {"activation": "output", "gradient": "gradient", "weight_grad": "weight gradient"}.get(
                fn.get("kind"), fn.get("kind"))
            return [f"The first non-finite value ({shown_layer(fn.get('layer'))}'s {what} at step {fn.get('step')}) was "
                    "produced in FP32 (every activation of this run was float32): keeping a layer in FP32 will not "
                    "help; look at the learning rate, the data and the loss."]
        n_start = startup_backoffs(report.timeline)
        if fn.get("from_loss") and fn.get("scaled") and n_start and fn.get("step") is not None \
                and fn["step"] <= report.timeline[n_start - 1]["step"]:
            return []  # the loss scale's overflow at a start-up backoff (the scaler's advice says what to change)
        if fn.get("from_loss"):
            loss = next((t.get("loss") for t in report.timeline if t.get("step") == fn.get("step")), None)
            if loss is not None and not math.isfinite(loss):  # the loss itself, in forward: not its gradient
                return [f"The loss itself was non-finite at step {fn.get('step')} while every watched layer's output "
                        "was finite: its computation, outside the model, overflowed; compute the loss in FP32 "
                        "(`loss_fn(out.float(), y)`, or after the `with torch.autocast(...)` block: under autocast a matmul runs in "
                        "fp16 whatever its inputs) and check it."]
            scaled = " (times the loss scale)" if fn.get("scaled") else ""  # (no GradScaler: no scale to blame)
            return [f"The gradient entering the model from the loss was non-finite at step {fn.get('step')}: the loss"
                    f"{scaled} overflowed; compute the loss in FP32 (`loss_fn(out.float(), y)`, or after the `with "
                    "torch.autocast(...)` block: under autocast a matmul runs in fp16 whatever its inputs) and check it."]
        return []
    why = "bisect verified that forcing it to FP32 makes training pass" if source == "bisect" else \
        "it was the first layer to produce a non-finite value from finite inputs"
    ev = "; ".join(f"{n}: {e}" for n in names if (e := _evidence(report, n)))
    pure = model_dtype(report)
    lines = [f"Keep {', '.join(names)} in FP32 ({why}{'; ' + ev if ev else ''}): "
             + "; ".join(f"`ampdoctor.keep_fp32({module_expr(n, types=report.module_types)})`" for n in names)
             + root_hint(names, report.module_types, wrapper_of(report.notes))
             + wrapped_hint(wrapper_of(report.notes))
             + " — or in plain PyTorch: " + "; ".join(
                 plain_fix(module_expr(n, types=report.module_types), half_weights_under(n, half_weights(report)),
                           report.module_types.get(n), is_torch_module(report.module_types.get(n)),
                           pure)
                 for n in names)]
    weights = [w for n in names for w in _weights_beyond(report, n)]
    if source == "first_nonfinite":
        lines[0] += (" (a suspect from this run's numbers: `ampdoctor bisect` re-runs the script to check that it "
                     "really fixes training, or finds that FP32 breaks too)")
        lines += weights or _nan_not_overflow(report, names[0])
        lines += _cast_back(report, names[0])
        if not growth_said:
            lines += _grew_first(report)
    else:  # what bisect's drill-down saw of the culprits' inputs (bisect.json's advice)
        lines += weights
        lines += [a for a in (report.bisect or {}).get("advice") or [] if isinstance(a, str) and a.startswith(CAME_IN)]
        # the loss made the first NaN/Inf: computing it in FP32 is the fix to try first
        lines[:0] = [a for a in (report.bisect or {}).get("advice") or [] if isinstance(a, str)
                     and (a.startswith(LOSS_OVERFLOW) or a.startswith(OWN_CODE))]
    return lines


def _weights_beyond(report: Report, layer: str) -> list[str]:
    """The weights of ``layer`` (or of a layer inside it) that are stored in a wider dtype than the format and
    hold values beyond its max: autocast casts them to the format when the layer runs, where they become Inf
    (and Inf - Inf NaN), although the layer's input and recorded output show nothing too large."""
    fmt = report.fmt
    fn = report.diagnosis.first_nonfinite or {}
    broke = fn.get("step") if fn.get("layer") == layer else None
    out = []
    for r in report.rows("weight"):
        if not (r.layer == layer or layer in ("", "(root)") or r.layer.startswith(layer + ".")):
            continue
        if not r.overflow or not _wider(r.dtype, fmt.max):
            continue
        if broke is not None and r.first_bad_step is not None and r.first_bad_step > broke:
            continue  # grew beyond the max after the layer broke: an echo, not the cause
        beyond = f"above the {fmt.name} max {fmt.max:.6g}"
        params = _params_beyond(report, r.layer, fmt.max)
        if params:
            held = "; ".join(f"{n} ({r.dtype}) holds {c} value{'s' if c != 1 else ''} {beyond} (abs-max "
                             f"{fmt_num(a)}, from step {st})" for n, a, c, st in params)
        else:
            since = f", from step {r.first_bad_step}" if r.first_bad_step is not None else ""
            held = f"the {r.dtype} weights of {r.layer} hold values {beyond} (abs-max {fmt_num(r.absmax)}{since})"
        held = f"{held[0].upper()}{held[1:]}" if held.startswith("the ") else held  # (a module's name keeps its case)
        out.append(f"{held}: autocast casts the weights to {fmt.name} when {r.layer} runs, and "
                   f"those values become Inf, so its output turns Inf or NaN (Inf - Inf) although its input is finite. "
                   f"Keeping {r.layer} in FP32 works around it; find out why the weights grew so large (learning "
                   "rate, weight decay, the initialisation or a loaded checkpoint) and scale them down.")
    return out


def _wider(dtype: str, fmax: float) -> bool:
    """Whether a weight's ``dtype`` holds values beyond the format's max (float32 does, float16 does not)."""
    import torch

    dt = getattr(torch, dtype, None)
    return isinstance(dt, torch.dtype) and dt.is_floating_point and float(torch.finfo(dt).max) > fmax


def _params_beyond(report: Report, layer: str, fmax: float) -> list[tuple[str, float, int, int]]:
    """The parameters of ``layer`` (``weight``, ``bias``, ...) that held values beyond ``fmax``, from the trace's
    weight rows: (qualified name, abs-max, most values beyond in one step, first step); none where the trace
    cannot be read (a report rendered without it)."""
    try:
        with TraceReader(report.trace) as r:
            lid = next((row["id"] for row in r.layers() if (row["name"] or "(root)") == layer), None)
            rows = r.stats(kind="weight", layer=lid) if lid is not None else []
    except Exception:  # noqa: BLE001 - a detail: the layer's numbers say it already
        return []
    seen: dict[str, list] = {}  # slot -> [abs-max, most values beyond in a step, first step]
    for row in sorted(rows, key=lambda row: row["step"]):
        a, n = row.get("absmax"), row.get("overflow") or 0
        if not row.get("slot") or a is None or not a > fmax or not n:
            continue
        got = seen.setdefault(row["slot"], [0.0, 0, row["step"]])
        got[0], got[1] = max(got[0], float(a)), max(got[1], int(n))
    prefix = "" if layer in ("", "(root)") else layer + "."
    return [(prefix + slot, a, n, st) for slot, (a, n, st) in seen.items()]


def _nan_not_overflow(report: Report, layer: str) -> list[str]:
    """A producer whose output held NaN but no Inf and no overflow, its finite values far below the
    format's max: an invalid operation is as likely as a hidden overflow; say how to tell them apart."""
    fn = report.diagnosis.first_nonfinite or {}
    r = _row(report, layer, fn.get("kind") or "activation")
    if r is None or not r.nan or r.inf or r.overflow or not (4.0 < r.headroom_bits < math.inf):
        return []
    fmt = report.fmt
    return [f"{layer} produced NaN without any Inf or overflow in its output (finite values up to "
            f"{fmt_num(r.absmax)}, {r.headroom_bits:.1f} bits below the {fmt.name} max): either an invalid operation "
            "(log or sqrt of a negative number, 0/0), which FP32 will not fix, or an overflow inside its forward "
            "(x*x, exp) that turned into NaN. `ampdoctor bisect` tells them apart (verdict not_precision for the first)."]


def attention_advice(report: Report) -> list[str]:
    """Bisect's first overflowing forward matmul, when it feeds a softmax: how to scale attention scores."""
    b = (report.bisect or {})
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
        amax = f" (abs-max {fmt_num(float(mm['absmax']))} vs {report.fmt.name} max {report.fmt.max:.6g})"
        if recomputed_note(mm):
            amax = f" (abs-max {fmt_num(float(mm['absmax']))} when recomputed in FP32 vs {report.fmt.name} max " \
                   f"{report.fmt.max:.6g}; its {mm.get('dtype') or 'low-precision'} output held Inf/NaN)"
    else:
        amax = " (non-finite output)" if mm.get("nonfinite") else ""
    # a product that is itself Inf/NaN in the format is past saving by a clamp after it (bisect's advice says so too)
    clamp = ("; clamping the scores after the product is too late: it is Inf/NaN already" if mm.get("nonfinite") else
             ", or clamp them before softmax (`scores.clamp(-3e4, 3e4)`)")
    return [f"The first overflowing op is {mm.get('op')}{where} in {mm.get('layer')}{amax}, a matmul feeding a softmax: "
            "scale q by 1/sqrt(head_dim) before the matmul instead of the scores after it "
            "(`q = q * head_dim ** -0.5; scores = q @ k.transpose(-2, -1)`) or compute the scores in FP32"
            f"{clamp}; `F.scaled_dot_product_attention` does the pre-scaling for you."]
