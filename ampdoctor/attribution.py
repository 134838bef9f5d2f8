"""First-non-finite attribution: from a recorded step's statistics rows and NaN/Inf flags (read on
the host), which module first produced NaN/Inf in the forward pass, in the backward pass and in the
weights (the innermost producer whose inputs were finite), written as ``first_nonfinite`` events."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MAX_GRAD_EVENTS = 1000  # per-step producers of non-finite gradients kept while a GradScaler runs


def bad_rows(table: np.ndarray, dropped: set | None = None) -> list[bool]:
    """Per row: whether it counts a NaN or an Inf (``r[1] or r[2] or r[3]``, so a NaN count counts
    too); rows in ``dropped`` (slots that could not be measured) are not."""
    if not len(table):
        return []
    bad = (table[:, 1] != 0) | (table[:, 2] != 0) | (table[:, 3] != 0)
    bad &= ~np.isnan(table[:, 1])  # a slot never filled (a measurement that failed or was cut short) saw nothing
    if dropped:
        bad[list(dropped)] = False
    return bad.tolist()


class Attribution:
    """What a session has found so far. ``layers``: the session's layers (``.name`` by id);
    ``writer``: its trace writer."""

    def __init__(self, layers: list, writer: Any):
        self.layers = layers
        self.writer = writer
        self.found: dict[str, bool] = {"forward": False, "backward": False, "weight": False}
        self.first: dict | None = None  # the first event: {"step", "layer", "kind", ...}
        self._grad_events = 0

    def done(self, scaled: bool) -> bool:
        """Whether no further step can add an event (both passes found, and no GradScaler whose
        skipped steps are worth a grad_nonfinite event each)."""
        return self.found["forward"] and self.found["backward"] and not scaled

    def observe(self, step: int, row_meta: list, host_rows: np.ndarray, flag_meta: list, host_flags: np.ndarray,
                scaled: bool) -> None:
        """One recorded step's rows and flags, read on the host: write the first-non-finite events
        it brings (and, while a GradScaler runs (``scaled``), one grad_nonfinite event per step
        whose backward produced NaN/Inf)."""
        row_bad = bad_rows(host_rows)
        if not host_flags.any() and not any(row_bad):
            return  # nothing non-finite this step: no event can come out of what follows
        by_call: dict[tuple[int, int], dict[str, bool]] = {}
        order: dict[str, list[tuple[int, int]]] = {"out": [], "gout": []}
        in_order: dict[str, set] = {"out": set(), "gout": set()}
        for (lid, call, phase), v in zip(flag_meta, host_flags.tolist()):
            key = (lid, call)
            d = by_call.get(key)
            if d is None:
                d = by_call[key] = {}
            d[phase] = d.get(phase, False) or bool(v)
            seen = in_order.get(phase)
            if seen is not None and key not in seen:
                seen.add(key)
                order[phase].append(key)
        wgrad_bad: dict[int, bool] = {}
        weight_bad: list[int] = []
        for (lid, kind, *_), bad in zip(row_meta, row_bad):
            if kind == "weight_grad":
                wgrad_bad[lid] = wgrad_bad.get(lid, False) or bad
            elif kind == "weight" and bad and lid not in weight_bad:
                weight_bad.append(lid)
        if not self.found["forward"]:
            prod = [k for k in order["out"] if by_call[k].get("out") and not by_call[k].get("in")]
            if prod:
                self._event(step, "activation", self._deepest(prod), len(prod))
                self.found["forward"] = True
            elif any(by_call[k].get("out") for k in order["out"]):
                first_in = next(k for k in order["out"] if by_call[k].get("out"))
                self._event(step, "activation", first_in, 0, input_nonfinite=True)
                self.found["forward"] = True
        if not self.found["backward"] or scaled:
            self._backward(step, by_call, order, wgrad_bad, scaled)
        if weight_bad and not self.found["weight"]:
            self._event(step, "weight", (weight_bad[0], 0), len(weight_bad))
            self.found["weight"] = True

    def _backward(self, step: int, by_call: dict, order: dict, wgrad_bad: dict, scaled: bool) -> None:
        prod = []
        for k in order["gout"]:
            d = by_call[k]
            if d.get("gout"):
                continue
            if d.get("gin"):
                prod.append((k, "gradient"))
            elif wgrad_bad.get(k[0]):
                prod.append((k, "weight_grad"))
        # layers with weight grads but no output-gradient flag (e.g. not reached by a tensor hook)
        for lid, bad in wgrad_bad.items():
            if bad and not any(k[0] == lid for k in by_call if "gout" in by_call[k]) and not any(k[0] == lid for k, _ in prod):
                prod.append(((lid, 0), "weight_grad"))
        extra: dict = {}
        if not prod:
            bad_out = [k for k in order["gout"] if by_call[k].get("gout")]
            if not bad_out:
                return
            # non-finite gradient arrives at the model's output: made by the loss (or its scale)
            prod, extra = [(bad_out[0], "gradient")], {"from_loss": True}
        keys = [k for k, _ in prod]
        best = self._deepest(keys)
        kind = dict(prod)[best]
        if not self.found["backward"]:
            self._event(step, kind, best, len(prod), scaled=scaled, **extra)
            self.found["backward"] = True
        if scaled and self._grad_events < MAX_GRAD_EVENTS:
            self._grad_events += 1
            self.writer.add_event(step, "grad_nonfinite", self.layers[best[0]].name, kind=kind, **extra)

    def _deepest(self, keys: list[tuple[int, int]]) -> tuple[int, int]:
        """The first key whose layer has no descendant among the others (the innermost producer)."""
        names = [self.layers[k[0]].name for k in keys]
        for k, name in zip(keys, names):
            if not any(o != name and (name == "" or o.startswith(name + ".")) for o in names):
                return k
        return keys[0]

    def _event(self, step: int, kind: str, key: tuple[int, int], n_producers: int, **extra: Any) -> None:
        name = self.layers[key[0]].name
        detail = {"kind": kind, "call": key[1], "producers": n_producers, **extra}
        self.writer.add_event(step, "first_nonfinite", name, **detail)
        ev = {"step": step, "layer": name, "kind": kind, **extra}
        if self.first is None:  # attribution runs forward, backward, weights: in time order
            self.first = ev
        log.info("ampdoctor: first non-finite %s at step %d in %s", kind, step, name)
