"""What the baseline trace says: the candidate modules, their tree, and where to look first."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..naming import split_owner, wrapper_of
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
    layers.sort(key=lambda lay: lay["ord"])
    names = [lay["name"] for lay in layers]
    overflow: dict[str, float] = {}
    for s in acts:
        lay = by_id.get(s["layer"])
        if lay is None:
            continue
        n = lay["name"]
        overflow[n] = overflow.get(n, 0) + s["overflow"] + s["posinf"] + s["neginf"] + s["nan"]
    # Every module that ran is a candidate: one with half-precision inputs may compute in fp16 and
    # still return fp32 (an fp32 parameter promotes the result), so output dtypes cannot rule it out.
    cands = list(names)
    cset = set(cands)
    parent = {n: _parent_of(n, cset) for n in cands}
    hints: list[str] = []
    fwd = [e for e in events if e["detail"].get("kind") == "activation" and not e["detail"].get("input_nonfinite")]
    for e in fwd[:1]:
        if e["layer"] in cset:
            hints.append(e["layer"])
    for e in events:
        if e["layer"] in cset and e["layer"] not in hints and not e["detail"].get("from_loss") and \
                e["detail"].get("kind") in ("gradient", "weight_grad"):
            hints.append(e["layer"])
            break
    worst = sorted((n for n in overflow if n in cset and overflow[n] > 0), key=lambda n: -overflow[n])
    for n in worst[:2]:
        if n not in hints:
            hints.append(n)
    first = None
    if events:
        # without a producer (the data was non-finite) the earliest forward event or unscaled gradient:
        # a gradient the GradScaler scaled into Inf at a start-up backoff (step 0) is not the failure
        later = [e for e in events if e["detail"].get("kind") == "activation" or not e["detail"].get("scaled")]
        e = (fwd or later or events)[0]
        if not fwd and not later and grad_events and reason in ("skipped_steps", "scale_collapse"):
            at = [g for g in grad_events if failure_step is None or g["step"] >= failure_step]
            e = at[0] if at else grad_events[-1]
        first = {"layer": e["layer"], "kind": e["detail"].get("kind"), "step": e["step"]}
        if e["detail"].get("input_nonfinite"):  # the layer's input already held it: the data, not the layer
            first["input_nonfinite"] = True
    types = {lay["name"]: lay["type"] for lay in all_layers}  # containers never called too (a ModuleDict)
    # weights stored in half precision: a pure .half()/.bfloat16() model, where autocast is not the fix
    half = {by_id[s["layer"]]["name"]: s["dtype"] for s in weights
            if s["dtype"] in ("float16", "bfloat16") and s["layer"] in by_id}
    return Baseline(candidates=cands, parent=parent, hints=hints, first_nonfinite=first, types=types,
                    half_weights=half, wrapper=wrapper)
