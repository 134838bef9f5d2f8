"""GradScaler health from the recorded scale and skipped steps: :func:`scaler_health` classifies
the run (healthy, start-up backoffs, occasional/frequent/persistent overflow, skips that stopped once the
scale settled, collapse, huge, every
step skipped, skips only where the forward broke),
:func:`scaler_advice` says what that means and what to change."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..oracle import NAN_SKIPS
from .lossscale import LossScaleAnalysis
from .model import Report, nan_without_inf, never_stepped, startup_backoffs
from .phrasing import plural, pow2, scale_literal, shown_layer

__all__ = ["HUGE_SCALE", "ScalerHealth", "scaler_health", "scaler_advice"]

HUGE_SCALE = 2.0 ** 32    # a scale this large means the gradients are tiny, or overflow checks never fire
DEFAULT_INIT_SCALE = 2.0 ** 16  # torch.amp.GradScaler's init_scale


@dataclass
class ScalerHealth:
    """The GradScaler's record: ``state`` is one of the classes above ("none": no GradScaler ran)."""
    # none | healthy | startup | occasional | frequent | persistent | settled (skips after start-up while the scale
    # only fell, then none for 10 steps or more) | collapse | below_one (the scale fell
    # below 1, and steps were taken from then on: gradients too large for scale 1) | huge | unsettled (every step
    # skipped, the scale still >= 1: start-up backoffs that had not ended, or a failure) | nan (every step
    # skipped, the gradients NaN without Inf: not the scale) | forward (the only skips after start-up had a
    # NaN/Inf loss: the forward broke, the scale did not overflow)
    state: str
    steps: int
    skipped: int
    startup_backoffs: int
    skipped_after_startup: int
    first_scale: float | None
    last_scale: float | None
    min_scale: float | None
    max_scale: float | None
    nonfinite_loss_skips: int = 0  # skipped steps whose loss itself was NaN/Inf (the forward broke, not the scale)
    overflow_after_startup: int = 0  # skipped steps after start-up with a finite loss: the scaled gradients overflowed
    tail_skips: int = 0  # skipped steps among the last 10 after start-up (``tail_len`` of them)
    tail_len: int = 0
    last_skip_step: int | None = None  # the step of the last skip (None: no skip)
    steps_after_last_skip: int = 0  # steps recorded after it (all taken)


def scaler_health(report: Report) -> ScalerHealth:
    """Classify the run's GradScaler from its scale after each step and the steps it skipped."""
    tl = [t for t in report.timeline]
    scales = [float(t["scale"]) for t in tl if t.get("scale")]
    if not scales:
        return ScalerHealth("none", len(tl), 0, 0, 0, None, None, None, None)
    skipped = [bool(t.get("skipped")) for t in tl]
    # a skip whose loss was NaN/Inf is not a start-up backoff: the forward broke, no scale fixes that
    loss_ok = [t.get("loss") is None or math.isfinite(t["loss"]) for t in tl]
    bad_loss = sum(1 for s, ok in zip(skipped, loss_ok) if s and not ok)
    startup = startup_backoffs(tl)
    after = skipped[startup:]
    n_after = sum(after)
    # only a skip with a finite loss is the scale's own overflow; "keeps growing into overflow" also needs
    # the scale to have grown at all (a run whose scale only fell was never told to grow more slowly)
    n_overflow = sum(1 for s, ok in zip(after, loss_ok[startup:]) if s and ok)
    grew = any(b > a for a, b in zip(scales, scales[1:]))
    tail = after[-10:]
    below = next((i for i, t in enumerate(tl) if t.get("scale") and float(t["scale"]) < 1.0), None)
    if below is not None and any(not sk and ok for sk, ok in zip(skipped[below:], loss_ok[below:])):
        state = "below_one"  # the scale fell below 1 and then steps were taken: gradients too large for scale 1
    elif min(scales) < 1.0:
        state = "collapse"
    elif never_stepped(tl) and len(tl) >= NAN_SKIPS and nan_without_inf(report.layers):
        state = "nan"
    elif never_stepped(tl):
        state = "unsettled"
    elif len(tail) >= 5 and sum(tail) > len(tail) / 2:
        state = "persistent"
    elif grew and max(scales[1:]) >= HUGE_SCALE and max(scales[1:]) > scales[0]:
        state = "huge"  # (it grew there: a huge init_scale that only fell is start-up backoffs, not tiny gradients)
    elif n_overflow > max(2, 0.05 * len(after)):
        # skipped again and again: into a scale that grew back, or (too few steps for the tail's rule) while it
        # only fell; one that only fell and then stopped skipping for 10 steps or more settled where the
        # gradients fit (they grew during training): the overflow did not persist
        state = "frequent" if grew else "settled" if len(tail) >= 10 and not any(tail) else "persistent"
    elif n_overflow:
        state = "occasional"
    elif bad_loss:
        state = "forward"
    elif startup:
        state = "startup"
    else:
        state = "healthy"
    first = scales[0] * (2.0 if skipped and skipped[0] else 1.0)
    last = max((i for i, sk in enumerate(skipped) if sk), default=None)
    return ScalerHealth(state, len(tl), sum(skipped), startup, n_after, first, scales[-1], min(scales), max(scales),
                        bad_loss, n_overflow, sum(tail), len(tail), tl[last]["step"] if last is not None else None,
                        len(tl) - 1 - last if last is not None else 0)


def scaler_advice(report: Report, h: ScalerHealth, ls: LossScaleAnalysis | None) -> list[str]:
    """What ``h``'s state means and what to change, citing the loss-scale advisor's range when known."""
    if h.state == "none":
        return []
    def lg(v: float | None) -> str:
        return f"2**{math.log2(v):.0f}" if v and v > 0 else "0"

    base = f"GradScaler: {h.skipped} of {plural(h.steps, 'step')} skipped"
    fn = report.diagnosis.first_nonfinite or {}
    from_loss = bool(fn.get("from_loss"))
    see = ("its computation, outside the watched layers, overflowed: compute the loss in FP32" if from_loss else
           f"the input of {shown_layer(fn.get('layer'))} was already non-finite: the code that feeds it, or the data"
           if fn.get("input_nonfinite") else
           "see the first non-finite producer" if fn else
           "its producer was not recorded: rerun with --every 1 to see which layer makes it"
           if int(report.meta.get("every") or 1) > 1 else "no watched layer's output was non-finite: the loss "
           "computation outside the model, or the data")
    # what makes the Inf/NaN, for the states where the scale did not fix it
    fed = shown_layer(fn.get("layer"))
    maker = ("the loss computation, outside the watched layers" if from_loss else
             f"the code that feeds {fed}, outside the watched layers (above)" if fn.get("input_nonfinite") else
             "a layer that produces it (above)" if fn else
             f"something that produces it ({see})")
    fix = ("Compute the loss in FP32 (above)" if from_loss else "Fix that code (above)" if fn.get("input_nonfinite") else
           "Fix that layer (above)" if fn else "Find where it is made")
    forward = ("" if not h.nonfinite_loss_skips else
               f" The loss itself was NaN/Inf in {h.nonfinite_loss_skips} of the skipped steps ({see}), which no loss "
               "scale fixes." if from_loss else
               f" The loss itself was NaN/Inf in {h.nonfinite_loss_skips} of the skipped steps: the forward pass "
               f"produces it ({see}), which no loss scale fixes.")
    if h.state == "below_one":
        # (with a NaN/Inf loss among the skips the forward did produce one: the steps after prove only the scale)
        went = ("steps went through at that scale" if h.nonfinite_loss_skips else
                "nothing produced Inf/NaN: the steps after went through")
        return [f"{base}; its scale fell from {lg(h.first_scale)} to {lg(h.min_scale)} before steps were taken again: "
                f"the unscaled gradients are larger than {report.fmt.name} holds at scale 1, and only a scale below 1 "
                f"fits them ({went}). Make the loss smaller where it "
                "is computed (a sum over many elements, a large weight on a loss term), or start the GradScaler "
                "below 1 (see the loss-scale range) so the first steps are not skipped." + forward]
    if h.state == "collapse":
        return [f"{base}; its scale collapsed from {lg(h.first_scale)} to {lg(h.min_scale)} (below 1): gradients "
                f"overflow at every scale, so the Inf/NaN comes from {maker}, not from the loss scale. "
                f"{fix}; changing init_scale will not help." + forward]
    if h.state == "persistent":
        where = ("most of the last 10" if h.tail_skips * 2 > h.tail_len >= 5 else
                 "again and again while the scale only fell")
        return [f"{base}, {h.skipped_after_startup} after start-up, {where}: persistent overflow. The scale "
                f"fell to {lg(h.last_scale)} without the overflow stopping: the Inf/NaN comes from {maker}, "
                "or the gradients span more binades than the format holds." + forward]
    if h.state == "settled":
        return [f"{base}, {h.overflow_after_startup} after start-up with a finite loss while the scale fell from "
                f"{lg(h.first_scale)} to {lg(h.last_scale)}, the last at step {h.last_skip_step}; none in the "
                f"{h.steps_after_last_skip} steps after it: the gradients grew during training and the scale settled "
                f"where they fit. Not a failure while steps go through; `GradScaler(init_scale="
                f"{scale_literal(round(math.log2(h.last_scale))) if h.last_scale else 1})` starts there." + forward]
    if h.state == "nan":
        return [f"{base} and none taken; the scale fell from {lg(h.first_scale)} to {lg(h.min_scale)} without the skips "
                "stopping. These are not start-up backoffs: the gradients held NaN but no Inf, "
                "and a scale too high for the gradients makes them overflow to Inf, not NaN. NaN comes from an invalid "
                "operation in a layer's backward (inf*0, inf-inf, 0/0; often a value that overflowed inside its forward, "
                "such as `x ** 3`), at any scale: fix that layer (above); a lower init_scale will not help."]
    high = h.first_scale is not None and h.first_scale > DEFAULT_INIT_SCALE
    if h.state == "unsettled":
        return [f"{base} and none taken yet; the scale fell from {lg(h.first_scale)} to {lg(h.min_scale)}. Start-up "
                "backoffs end once the scale fits the gradients, usually within a few steps; these had not ended "
                "when the run did. Run more steps to tell them from a failure (more than 20 in a row count as one)"
                + (f"; `GradScaler(init_scale={scale_literal(ls.k_rec)})` would start where the recorded gradients "
                   "fit." if ls and ls.feasible else
                   f"; an init_scale of {lg(h.first_scale)} is above the default {lg(DEFAULT_INIT_SCALE)}: a smaller one "
                   "ends them sooner." if high else ".")]
    out = []
    settled = h.first_scale / 2 ** h.startup_backoffs if h.first_scale else None  # the scale start-up ended at
    if h.startup_backoffs and high and settled:
        # a huge init_scale (2**40): many backoffs, then training went on; not a failure, and not "normal" either
        default = max(0, math.ceil(math.log2(DEFAULT_INIT_SCALE / settled)))
        out.append(f"{base}: {plural(h.startup_backoffs, 'start-up backoff')}, the scale falling from "
                   f"{lg(h.first_scale)} to {lg(settled)} before the first optimizer step, then training went on: not a failure, but an "
                   f"init_scale of {lg(h.first_scale)} is far above what these gradients fit. A smaller init_scale "
                   "avoids them: " + (f"`GradScaler(init_scale={scale_literal(ls.k_rec)})`, or " if ls and ls.feasible
                                      else "")
                   + f"the default {lg(DEFAULT_INIT_SCALE)} (`torch.amp.GradScaler()`)"
                   + (f", which would take {'one' if default == 1 else default} of them." if default
                      else ", which these gradients fit."))
    elif h.startup_backoffs:
        out.append(f"{base}: {plural(h.startup_backoffs, 'start-up backoff')} ({lg(h.first_scale)} -> "
                   f"{lg(settled)}) {'is' if h.startup_backoffs == 1 else 'are'} normal; "
                   + (f"`GradScaler(init_scale={scale_literal(ls.k_rec)})` avoids "
                      f"{'it' if h.startup_backoffs == 1 else 'them'}." if ls and ls.feasible
                      else f"a lower init_scale avoids {'it' if h.startup_backoffs == 1 else 'them'}."))
    if h.state == "occasional":
        finite = " with a finite loss" if h.nonfinite_loss_skips else ""
        since = settled if h.startup_backoffs and settled else h.first_scale  # (the backoffs are said apart)
        lead = f"{base}, {h.overflow_after_startup}" if not out else f"Of those skips, {h.overflow_after_startup}"  # (said once)
        out.append(f"{lead}{finite} after start-up: occasional overflow that the scaler backs off "
                   f"from (scale {lg(since)} -> {lg(h.last_scale)}{' after start-up' if since != h.first_scale else ''})"
                   + ("." if h.nonfinite_loss_skips else "; normal for a dynamic loss scale."))
    if h.state == "frequent":
        out.append(f"GradScaler skipped {plural(h.overflow_after_startup, 'step')} after start-up: the scale keeps "
                   "growing into overflow. A longer growth_interval (e.g. `GradScaler(growth_interval=4000)`) skips fewer steps"
                   + (f"; the recorded gradients tolerate at most {pow2(ls.k_hi)}." if ls else "."))
    if h.state == "huge":
        out.append(f"GradScaler's scale grew to {lg(h.max_scale)}: the gradients are tiny (or a skipped-step check never "
                   "fires). Harmless while the scaled loss stays finite; a larger `GradScaler(growth_interval=...)`, or "
                   "a smaller init_scale, keeps it in range.")
    if h.state == "forward":
        out.append(f"{base}." + forward)
    elif forward and h.state in ("occasional", "frequent", "huge"):
        out.append(forward.strip())
    if h.state == "healthy" and not out:
        out.append(f"{base}; scale {lg(h.first_scale)} -> {lg(h.last_scale)}: healthy.")
    return out

