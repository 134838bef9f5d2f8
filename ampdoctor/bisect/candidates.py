"""What the baseline trace says: the candidate modules, their tree, and where to look first."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..naming import model_half, split_owner, wrapper_of
from ..report.model import loss_made_first, startup_backoffs
from ..trace import TraceReader


@dataclass
class Baseline:
    candidates: list[str]                 # executed modules in execution order (root "" first)
    parent: dict[str, str | None]
    hints: list[str]                      # most likely culprits first
    first_nonfinite: dict | None
    types: dict[str, str] = field(default_factory=dict)
    half_weights: dict[str, str] = field(default_factory=dict)  # layer -> dtype of its float16/bfloat16 weights
    wrapper: str | None = None  # the DDP/FSDP/DataParallel class the model ran in (names are inside it)
    model_dtype: str | None = None  # a pure .half()/.bfloat16() model's dtype (naming.model_half)


def _parent_of(name: str, names: set[str]) -> str | None:
    """The nearest executed ancestor; ``Class:`` prefixes (second models) are roots of their own."""
    own, local = split_owner(name, names)
    owner = "" if own is None else own + ":"
    if local == "":
        return None
    p = local.rpartition(".")[0]
    while p and owner + p not in names:
        p = p.rpartition(".")[0]
    if p and owner + p in names:
        return owner + p
    return owner if owner in names else None


def _ancestors(name: str, parent: dict[str, str | None]) -> set[str]:
    out, p = set(), parent.get(name)
    while p is not None and p not in out:
        out.add(p)
        p = parent.get(p)
    return out


_UNKNOWN = object()


def _recorded_producer(event: dict, at: dict[str, set], parent: dict[str, str | None]) -> object:
    """The module that made the NaN/Inf at the forward ``first_nonfinite`` event's step, where the
    event says that no other module did (None: the data did), else ``_UNKNOWN``. The event counts the
    calls whose output went non-finite while their inputs were finite (``producers``): the layer it
    names and those of its ancestors non-finite then (whose output holds its NaN) must be all of them."""
    d = event["detail"]
    if d.get("input_nonfinite"):
        return None if d.get("producers") == 0 else _UNKNOWN
    name = event["layer"]
    if name not in at:
        return _UNKNOWN
    explained = {name} | (_ancestors(name, parent) & set(at))
    return name if d.get("producers") == sum(len(at[n]) for n in explained) else _UNKNOWN


def _passed_along(acts: list[dict], by_id: dict, order: list[str], parent: dict[str, str | None],
                  event: dict | None) -> dict[str, int]:
    """The layers whose output went NaN/Inf, at the first step where it did, only because a module
    run before them, or inside them, or the data had made it, with that step: from there on their
    NaN/Inf is not theirs, and by its counts they outrank the layer that made it.

    At the step of the forward ``first_nonfinite`` event (``event``) the trace says who made it (see
    :func:`_recorded_producer`); where it cannot tell, no layer non-finite from that step on is
    counted as passing it along. At any later step no producer is recorded (one forward event per
    run): the innermost of the first modules run whose output went non-finite stands for it, as the
    attribution picks, and a layer run after it may be passing its NaN along (or be an independent
    producer, which the search still finds: a hint is only a first guess)."""
    bad: dict[int, dict[str, set]] = {}  # step -> layer -> the calls whose output held NaN/Inf
    for s in acts:
        lay = by_id.get(s["layer"])
        if lay is not None and lay["name"] in parent and (s["nan"] or s["posinf"] or s["neginf"]):
            bad.setdefault(s["step"], {}).setdefault(lay["name"], set()).add(s["call"] or 0)
    rank = {n: i for i, n in enumerate(order)}
    anc = {n: _ancestors(n, parent) for n in {n for at in bad.values() for n in at}}
    along: dict[str, int] = {}
    seen: set[str] = set()  # non-finite at an earlier step: judged there
    for step in sorted(bad):
        at = bad[step]
        names = sorted(at, key=rank.get)
        if event is not None and step == event["step"]:
            producer = _recorded_producer(event, at, parent)
        else:  # the first one run that has no non-finite module inside it
            holders = set().union(*(anc[n] for n in names))
            producer = next(n for n in names if n not in holders)
        if producer is not _UNKNOWN:  # the others (its ancestors too) hold its NaN, or the data's
            along.update((n, step) for n in names if n not in seen and n != producer)
        seen.update(at)
    return along


def read_baseline(trace: str | Path, failure_step: int | None = None, reason: str | None = None) -> Baseline:
    """What the baseline trace says; ``failure_step``/``reason``: the baseline's failure, which picks
    the first non-finite event of a run whose only events are GradScaler-scaled gradients (as the
    report does: one at or after the failure, not a start-up backoff at step 0)."""
    with TraceReader(trace) as r:
        all_layers = r.layers()
        layers = [lay for lay in all_layers if lay["ord"] is not None]
        by_id = {lay["id"]: lay for lay in layers}
        acts = r.stats(kind="activation")
        weights = r.stats(kind="weight")
        events = r.events("first_nonfinite")
        grad_events = r.events("grad_nonfinite")
        wrapper = wrapper_of(e["detail"].get("message", "") for e in r.events("note") if e["layer"] is None)
        steps = r.steps()
        losses = {st["step"]: st["loss"] for st in steps}
    layers.sort(key=lambda lay: lay["ord"])
    names = [lay["name"] for lay in layers]
    # Every module that ran is a candidate: one with half-precision inputs may compute in fp16 and
    # still return fp32 (an fp32 parameter promotes the result), so output dtypes cannot rule it out.
    cands = list(names)
    cset = set(cands)
    parent = {n: _parent_of(n, cset) for n in cands}
    fwd_all = [e for e in events if e["detail"].get("kind") == "activation"]
    fwd = [e for e in fwd_all if not e["detail"].get("input_nonfinite")]
    # the worst layers: by their NaN/Inf counts those that pass a NaN along (a LayerNorm after an
    # overflowing Linear, everything after it) outrank the one that made it, so what they hold from
    # the step they began to pass it along does not count
    along = _passed_along(acts, by_id, cands, parent, fwd_all[0] if fwd_all else None)
    overflow: dict[str, float] = {}
    for s in acts:
        lay = by_id.get(s["layer"])
        if lay is None or s["step"] >= along.get(lay["name"], s["step"] + 1):
            continue
        n = lay["name"]
        overflow[n] = overflow.get(n, 0) + s["overflow"] + s["posinf"] + s["neginf"] + s["nan"]
    first = None
    if events:
        # without a producer (the data was non-finite) the earliest forward event or unscaled gradient:
        # a gradient the GradScaler scaled into Inf at a start-up backoff (step 0) is not the failure
        later = [e for e in events if e["detail"].get("kind") == "activation" or not e["detail"].get("scaled")]
        at_start = [e for e in events if e["detail"].get("at_start")]  # weights NaN/Inf before any step
        e = (at_start or fwd or later or events)[0]
        if not at_start and not fwd and not later and grad_events and reason in ("skipped_steps", "scale_collapse"):
            at = [g for g in grad_events if failure_step is None or g["step"] >= failure_step]
            e = at[0] if at else grad_events[-1]
        first = {"layer": e["layer"], "kind": e["detail"].get("kind"), "step": e["step"]}
        if e["detail"].get("input_nonfinite"):  # the layer's input already held it: the data, not the layer
            first["input_nonfinite"] = True
        if e["detail"].get("at_start"):
            first["at_start"] = True
        if e["detail"].get("from_loss"):  # the gradient entering the model from the loss: the loss overflowed
            first["from_loss"] = True
            loss = losses.get(e["step"])
            if loss is not None and not math.isfinite(loss):
                first["loss_nonfinite"] = True  # the loss itself, in forward: its computation, not its gradient
    made = loss_made_first(steps, events, first)  # (the report's rule: the loss, non-finite before any gradient)
    if made is not None:
        first = {k: v for k, v in made.items() if k != "scaled"}
        if first["layer"] is None:
            del first["layer"]
    hints: list[str] = []
    for e in fwd[:1]:
        if e["layer"] in cset:
            hints.append(e["layer"])
    # the layer whose gradient first went non-finite: the one the diagnosis names (a GradScaler's scaled
    # overflow at a start-up backoff is not it, nor the loss's own gradient), else the earliest such event
    # after the start-up backoffs
    n_start = startup_backoffs(steps)
    grads = [first["layer"]] if first and first.get("kind") in ("gradient", "weight_grad") and not \
        (first.get("from_loss") or first.get("input_nonfinite") or first.get("at_start")) else []
    grads += [e["layer"] for e in events if e["detail"].get("kind") in ("gradient", "weight_grad")
              and not e["detail"].get("from_loss") and not (e["detail"].get("scaled") and e["step"] < n_start)]
    hints += next(([n] for n in grads if n in cset and n not in hints), [])
    worst = sorted((n for n in overflow if n in cset and overflow[n] > 0), key=lambda n: -overflow[n])
    for n in worst[:2]:
        if n not in hints:
            hints.append(n)
    types = {lay["name"]: lay["type"] for lay in all_layers}  # containers never called too (a ModuleDict)
    # weights stored in half precision: a pure .half()/.bfloat16() model, where autocast is not the fix
    half = {by_id[s["layer"]]["name"]: s["dtype"] for s in weights
            if s["dtype"] in ("float16", "bfloat16") and s["layer"] in by_id}
    return Baseline(candidates=cands, parent=parent, hints=hints, first_nonfinite=first, types=types,
                    half_weights=half, wrapper=wrapper, model_dtype=model_half(s["dtype"] for s in weights))
