"""The report's data: per-layer aggregates and the diagnosis, computed from a trace only."""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..formats import Format, get_format, wider_than
from ..oracle import NAN_SKIPS, Decision, Oracle, OracleConfig, trailing_nonfinite_start
from ..trace import TraceReader, _pid_alive, _rank_of, find_traces, rank_siblings
from .phrasing import plural, shown_layer

KIND_TITLES = {
    "activation": "Activations (forward outputs)",
    "gradient": "Activation gradients (as scaled by the GradScaler, if any)",
    "weight": "Weights (after the optimizer step)",
    "weight_grad": "Weight gradients (as accumulated, before unscaling)",
}



def write_whole(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all: into a file beside it, then renamed
    over it, so that a full disk or a failure mid-write leaves no truncated report behind (an
    earlier one at ``path`` stays as it was)."""
    p = Path(path)
    if p.is_symlink():
        p = p.resolve()
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise

@dataclass
class LayerRow:
    layer: str
    type: str
    order: int
    kind: str
    dtype: str
    absmax: float
    headroom_bits: float
    numel: int
    overflow: int
    subnormal: int
    flush_to_zero: int
    nan: int
    inf: int
    overflow_pct: float
    subnormal_pct: float
    flush_pct: float
    first_bad_step: int | None
    calls: int
    bytes: int
    steps: int
    hist: list[int] = field(default_factory=list)
    min: float | None = None  # the smallest and largest finite value over all recorded steps (None: none finite)
    max: float | None = None

    @property
    def finite(self) -> bool:
        """Whether any recorded value was finite (else abs-max, min and max are none)."""
        return self.numel > self.nan + self.inf

    @property
    def bad(self) -> bool:
        return bool(self.nan or self.inf or self.overflow)

    def severity(self) -> tuple:
        """Sort key, worst first: the layers that went bad (NaN/Inf/overflow), the earliest first, and at
        the same step in execution order, so the producer comes before the layers it passed its NaN to
        (however many more values they hold); then the rest by least headroom."""
        if self.bad:
            first = self.first_bad_step if self.first_bad_step is not None else math.inf
            return (0, first, self.order, 0.0)
        head = self.headroom_bits if math.isfinite(self.headroom_bits) else (-1e9 if self.headroom_bits < 0 else 1e9)
        return (1, math.inf, head, self.order)


@dataclass
class Diagnosis:
    broke: bool
    step: int | None
    reason: str | None
    first_nonfinite: dict | None
    lines: list[str]
    steps_seen: int
    optimizer_steps: int
    skipped_steps: int
    first_loss_nonfinite: int | None
    steps_note: str = ""  # after the steps count: the last one was cut short ("" if it ended at its boundary)

    def steps_said(self) -> str:
        """"6 steps", with what the last one was where it ended before its boundary."""
        return plural(self.steps_seen, "step") + self.steps_note


@dataclass
class Report:
    trace: str
    format: str
    meta: dict
    diagnosis: Diagnosis
    layers: list[LayerRow]
    timeline: list[dict]
    events: list[dict]
    notes: list[str]
    bisect: dict | None = None
    advice: list[str] = field(default_factory=list)
    module_types: dict[str, str] = field(default_factory=dict)  # every module's class, containers too (fix snippets)

    @property
    def fmt(self) -> Format:
        return get_format(self.format)

    def rows(self, kind: str) -> list[LayerRow]:
        return [r for r in self.layers if r.kind == kind]

    def to_dict(self, *, hist: bool = False) -> dict:
        layers = []
        for r in self.layers:
            d = asdict(r)
            if not hist:
                d.pop("hist")
            if not r.finite:  # no finite value: no largest finite |x| (0.0 would read as all zeros)
                d["absmax"] = None
            layers.append({k: _jsonable(v) for k, v in d.items()})
        return {
            "schema": "ampdoctor.report/1",
            "trace": self.trace,
            "format": self.format,
            "format_range": {"max": self.fmt.max, "smallest_normal": self.fmt.smallest_normal,
                             "smallest_subnormal": self.fmt.smallest_subnormal},
            "meta": {k: _jsonable(v) for k, v in self.meta.items()},
            "diagnosis": {k: _jsonable(v) for k, v in asdict(self.diagnosis).items()},
            "layers": layers,
            # a loss that was NaN is "nan" there, as Inf is "inf": null is a step with no loss recorded
            "timeline": [{k: _jsonable(v, nan="nan") for k, v in t.items()} for t in self.timeline],
            "events": self.events,
            "notes": self.notes,
            "bisect": self.bisect,
            "advice": self.advice,
        }

    def to_json(self, path: str | Path | None = None, **kw: Any) -> str:
        text = json.dumps(self.to_dict(**kw), indent=2, allow_nan=False)
        if path is not None:
            write_whole(path, text)
        return text

    def to_text(self, **kw: Any) -> str:
        from .text import render_text
        return render_text(self, **kw)

    def __str__(self) -> str:
        return self.to_text()


def _jsonable(v: Any, nan: str | None = None) -> Any:
    """``v`` as JSON holds it (no NaN in JSON): Inf as "inf"/"-inf", NaN as ``nan`` (null unless told)."""
    if isinstance(v, float) and not math.isfinite(v):
        return nan if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return _jsonable(float(v), nan)
    if isinstance(v, dict):
        return {k: _jsonable(x, nan) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x, nan) for x in v]
    return v


def _aggregate(reader: TraceReader, fmt: Format, layers: dict[int, dict]) -> list[LayerRow]:
    """One row per (layer, kind) over every recorded step, totalled in SQL (:meth:`TraceReader.stat_groups`)
    and the histograms summed in a stream (:meth:`TraceReader.hist_sums`): no Python object per stats row.
    The same numbers as going through the rows in ``ORDER BY step, rowid`` order, ties included: the
    dtype shown is the most frequent, and at equal counts the one that came first; rows of layers that
    sort equal stay in the order they first came in."""
    by_key: dict[tuple[int, str], list[dict]] = {}
    for g in reader.stat_groups():
        by_key.setdefault((g["layer"], g["kind"]), []).append(g)
    hists = reader.hist_sums(fmt.n_bins, list(dict.fromkeys(kind for _, kind in by_key)))
    rows, firsts = [], []
    for (lid, kind), parts in by_key.items():
        a = {k: sum(p[k] for p in parts) for k in ("rows", "numel", "overflow", "subnormal", "flush_to_zero", "nan",
                                                   "posinf", "neginf", "bytes")}
        absmax = max(0.0, *(p["absmax"] for p in parts))
        lows = [p["min"] for p in parts if p["min"] is not None]
        highs = [p["max"] for p in parts if p["max"] is not None]
        bads = [p["first_bad"] for p in parts if p["first_bad"] is not None]
        first_step = min(p["first_step"] for p in parts)
        steps = parts[0]["steps"] if len(parts) == 1 else reader.step_count(lid, kind)
        # calls per step with rows of this kind: a call index says how many forwards ran before it, not
        # how many gave this kind (one backward after 20 no-grad validation forwards is call 20)
        nulls = sum(p["null_calls"] for p in parts)
        if nulls:  # (rows without a call index: one more call of their step, as a set of calls counts them)
            one = nulls == a["rows"]
        else:
            one = min(p["min_call"] for p in parts) == max(p["max_call"] for p in parts)
        calls = 1 if one else reader.calls_per_step(lid, kind)
        dtype = _main_dtype(reader, lid, kind, parts)
        info = layers.get(lid, {"name": f"#{lid}", "type": "?", "ord": None})
        inf = a["posinf"] + a["neginf"]
        n = max(a["numel"], 1)
        head = fmt.headroom_bits(absmax) if not inf else -math.inf
        if not inf and a["nan"] >= a["numel"] > 0:
            head = math.nan  # no finite value at all (every value NaN): no headroom to speak of
        nbytes = int(round(a["bytes"] / max(steps, 1)))
        order = info["ord"] if info["ord"] is not None else 10**9 + lid
        hist = hists.get((lid, kind))
        rows.append(LayerRow(
            layer=info["name"] or "(root)", type=info["type"], order=order, kind=kind, dtype=dtype,
            absmax=absmax, headroom_bits=head, numel=a["numel"], overflow=a["overflow"],
            subnormal=a["subnormal"], flush_to_zero=a["flush_to_zero"], nan=a["nan"], inf=inf,
            overflow_pct=100.0 * a["overflow"] / n, subnormal_pct=100.0 * a["subnormal"] / n,
            flush_pct=100.0 * a["flush_to_zero"] / n, first_bad_step=min(bads) if bads else None, calls=calls,
            bytes=nbytes, steps=steps, hist=(hist if hist is not None else np.zeros(fmt.n_bins, np.int64)).tolist(),
            min=min(lows) if lows else None, max=max(highs) if highs else None))
        firsts.append((lid, kind, first_step))
    # rows that sort equal keep the order in which their layer and kind first came (by step, then row)
    where = {(r.order, r.kind): 0 for r in rows}
    for r in rows:
        where[(r.order, r.kind)] += 1
    tie = [0 if where[(r.order, r.kind)] == 1 else reader.first_rowid(lid, kind, step) or 0
           for r, (lid, kind, step) in zip(rows, firsts)]
    keyed = sorted(zip(rows, firsts, tie), key=lambda x: (x[0].order, x[0].kind, x[1][2], x[2]))
    return [r for r, _, _ in keyed]


def _main_dtype(reader: TraceReader, lid: int, kind: str, parts: list[dict]) -> str:
    """The dtype most rows of one layer and kind had; at equal counts the one that came first."""
    most = max(p["rows"] for p in parts)
    tied = [p for p in parts if p["rows"] == most]
    if len(tied) > 1:
        step = min(p["first_step"] for p in tied)
        tied = [p for p in tied if p["first_step"] == step]
    if len(tied) > 1:
        return min(tied, key=lambda p: reader.first_rowid(lid, kind, p["first_step"], p["dtype"]))["dtype"]
    return tied[0]["dtype"]


def never_stepped(timeline: list[dict]) -> bool:
    """A GradScaler skipped every step of the run, each with a finite loss: no optimizer step was taken,
    and the run ended inside what may be its start-up backoffs."""
    return bool(timeline) and all(t.get("skipped") and (t.get("loss") is None or math.isfinite(t["loss"]))
                                  for t in timeline)


def startup_backoffs(timeline: list[dict]) -> int:
    """How many steps the run began with that the GradScaler skipped with a finite loss (or none recorded):
    its start-up backoffs, while the scale falls from ``init_scale`` to one the gradients fit. A skip
    whose loss was NaN/Inf is not one: the forward broke, no scale fixes that."""
    n = 0
    for t in timeline:
        if not (t.get("skipped") and (t.get("loss") is None or math.isfinite(t["loss"]))):
            break
        n += 1
    return n


def backoff_scales(timeline: list[dict], n: int) -> tuple[float, float] | None:
    """``(init_scale, scale after the n-th skip)`` when the scale fell at every one of the first ``n`` steps
    (a GradScaler backing off: the timeline holds the scale after each update, so the one before the first
    skip is taken as twice the first, the default backoff_factor); None when a scale is missing or held."""
    scales = [t.get("scale") for t in timeline[:n]]
    if not n or any(not v for v in scales) or any(b >= a for a, b in zip(scales, scales[1:])):
        return None
    return 2.0 * float(scales[0]), float(scales[-1])


def _lg(v: float) -> str:
    return f"2**{math.log2(v):.0f}"


def nan_without_inf(rows: list[LayerRow]) -> bool:
    """The recorded gradients held NaN but no Inf. A loss scale too high for the gradients makes them
    overflow, to Inf in a half-precision tensor (a value past fp16's max in an FP32 gradient skips no
    step); NaN alone comes from an invalid operation (inf*0, inf-inf, 0/0) in a layer's backward, at
    any scale. (The oracle's ``grads="nan"`` over the whole run: see
    :meth:`ampdoctor.oracle.Oracle.nan_skips`.)"""
    grads = [r for r in rows if r.kind in ("gradient", "weight_grad")]
    return any(r.nan for r in grads) and not any(r.inf for r in grads)


_SCALER_SYMPTOMS = ("skipped_steps", "scale_collapse")  # a GradScaler's break: its skips freeze the weights


def loss_growth(timeline: list[dict], decision: Any) -> tuple[tuple[int, float], tuple[int, float]] | None:
    """``((step, lowest loss), (step, last loss))`` of the finite losses before the break (``decision``),
    when the loss grew tenfold in between; after the break the loss (and the scale) restarting from
    skipped steps says nothing about how training went. A GradScaler's break (skipped steps, a collapsed
    scale) freezes the weights only at its skips, and the steps it took between them trained on: there the
    losses up to the first non-finite one count (a loss that grew 1e5-fold while the scaler backed off is a
    divergence that broke the scaler first)."""
    if decision is None:
        return None
    end = decision.step
    if decision.reason in _SCALER_SYMPTOMS:
        end = next((t["step"] for t in timeline if t["loss"] is not None and not math.isfinite(t["loss"])), None)
    return grew_tenfold(timeline, end)


def grew_tenfold(timeline: list[dict], end: int | None, *, peak: bool = False) -> tuple[tuple[int, float], tuple[int, float]] | None:
    """``((step, lowest loss), (step, a later loss))`` of the finite losses before step ``end`` (None: all),
    when that later loss is ten times the lowest or more: the last one, or with ``peak`` the highest after
    the lowest. None with fewer than three finite losses."""
    finite = [(t["step"], t["loss"]) for t in timeline if t["loss"] is not None and math.isfinite(t["loss"])
              and (end is None or t["step"] < end)]
    if len(finite) < 3:
        return None
    low = min(finite, key=lambda p: p[1])
    high = max((p for p in finite if p[0] > low[0]), key=lambda p: p[1], default=None) if peak else finite[-1]
    return (low, high) if high is not None and low[1] > 0 and high[1] > 10 * low[1] and high[0] > low[0] else None


def _optimizer_steps(timeline: list[dict], meta: dict) -> int:
    """The run's optimizer steps: the session writes them into the meta when it closes; before that (a live
    report, a killed run) the last step's count in the timeline is the number so far."""
    steps = meta.get("optimizer_steps")
    if steps is None:
        steps = max((t.get("optimizer_steps") or 0 for t in timeline), default=0)
    return int(steps or 0)


def _trained_nothing(timeline: list[dict], optimizer_steps: int, rows: list[LayerRow]) -> bool:
    """No optimizer step, no GradScaler step and no gradient recorded: forward passes only."""
    return (not optimizer_steps and not any(t.get("scale") is not None for t in timeline)
            and not any(r.kind in ("gradient", "weight_grad") for r in rows))


def _diagnose(timeline: list[dict], events: list[dict], meta: dict, rows: list[LayerRow] | None = None) -> Diagnosis:
    oracle = Oracle(OracleConfig())
    decision = None
    for t in timeline:
        skipped = None if t["skipped"] is None else bool(t["skipped"])
        decision = oracle.observe(t["step"], t["loss"], t["scale"], skipped, None)
        if decision is not None:
            break
    if decision is None and timeline:
        d = oracle.finish()
        decision = d if d.outcome == "fail" else None
    first_loss_bad = next((t["step"] for t in timeline if t["loss"] is not None and not math.isfinite(t["loss"])), None)
    param_events = [e for e in events if e["kind"] == "first_nonfinite" and e["detail"].get("kind") == "weight"]
    if param_events and (decision is None or (decision.step is not None and param_events[0]["step"] < decision.step)):
        # the weights went non-finite before the loss did (as bisect's oracle sees it: it reads the weights)
        decision = Decision("fail", param_events[0]["step"], "nonfinite_params")
    tail = trailing_nonfinite_start([(t["step"], t["loss"]) for t in timeline])
    if decision is None and tail is not None:
        # the run ended inside a streak of non-finite losses, shorter than the oracle's K: still broken
        decision = Decision("fail", tail, "nonfinite_loss")
    stuck = decision is None and never_stepped(timeline)
    nan_skips = stuck and rows is not None and len(timeline) >= NAN_SKIPS and nan_without_inf(rows)
    if nan_skips:
        # every step skipped for a NaN in the gradients that no scale made (see nan_without_inf): not
        # start-up backoffs, however few the steps are next to the oracle's start-up grace
        decision = Decision("fail", timeline[0]["step"], "skipped_steps")
    fwd_events = [e for e in events if e["kind"] == "first_nonfinite" and e["detail"].get("kind") == "activation"]
    last = timeline[-1] if timeline else None
    ended_there = (last is not None and fwd_events and fwd_events[0]["step"] >= last["step"]
                   and (last["loss"] is None or not math.isfinite(last["loss"])))
    if decision is None and fwd_events and (meta.get("status") == "crashed" or ended_there):
        # the script raised, or stopped (`if loss.isnan(): break`), after its forward went non-finite: the
        # loss of that last step never reached backward, but the outputs say what happened
        decision = Decision("fail", fwd_events[0]["step"], "nonfinite_loss")
    fn = _pick_first_nonfinite(events, decision, timeline)
    every = int(meta.get("every") or 1)
    spread = None  # (sampled steps) the first non-finite value recorded came after the loss had gone non-finite
    if fn is not None and every > 1 and first_loss_bad is not None and fn["step"] > first_loss_bad:
        spread, fn = fn, None  # not known to be the producer: it may have made it again, or passed on an earlier NaN
    skipped = sum(1 for t in timeline if t["skipped"])
    n_start = startup_backoffs(timeline)
    backoff = backoff_scales(timeline, n_start)
    lines = []
    status = meta.get("status", "?")
    cut_short = _partial_note(meta, timeline)  # the last step cut short by a crash, an interrupt, an exit
    if not timeline:
        lines.append("No training step was seen: no optimizer.step() / GradScaler.update() ran while watching. "
                     "Did the script train, and was watch() called before the training loop?")
    elif decision is not None:
        all_skipped = never_stepped(timeline)
        how = {
            "nonfinite_loss": "the loss became non-finite (NaN/Inf)",
            "nonfinite_params": "parameters became non-finite",
            "scale_collapse": "the GradScaler's scale collapsed below 1 (steps skipped all the way down)",
            "skipped_steps": "the GradScaler skipped most steps (persistent gradient overflow)",
            "divergence": "the loss diverged",
        }.get(decision.reason, decision.reason)
        if nan_skips:
            how = (f"the GradScaler skipped all {len(timeline)} steps, and their gradients held NaN without any "
                   "Inf (an invalid operation in the backward, not a loss scale too high)")
        elif decision.reason == "skipped_steps" and all_skipped and backoff is not None:
            # (the oracle fails a backoff longer than its start-up grace only if the run ends inside it)
            how = (f"the GradScaler skipped all {len(timeline)} steps, its scale falling at each from "
                   f"{_lg(backoff[0])} to {_lg(backoff[1])}: start-up backoffs that had not ended after more than "
                   f"{oracle.cfg.startup_grace} steps (an init_scale far above what the gradients fit, or gradients "
                   "that overflow at every scale)")
        grew = loss_growth(timeline, decision)
        if grew is not None and decision.reason in _SCALER_SYMPTOMS:
            (_, lo), (last_step, hi) = grew
            base = ("the GradScaler skipped most steps" if decision.reason == "skipped_steps" else
                    "the GradScaler's scale collapsed below 1")
            how = (f"{base} while the loss grew from {lo:.3g} to {hi:.3g} (step {last_step}) over the steps it "
                   "took: a divergence that broke the GradScaler, not an overflow a loss scale fixes")
        lines.append(f"Training broke at step {decision.step}: {how}.")
    elif stuck:
        lines.append(f"Training did not break in the {plural(len(timeline), 'step')} seen{cut_short}, but took no optimizer step: the "
                     "GradScaler skipped every one. Run more steps to tell start-up backoffs, which end once the "
                     "scale fits the gradients, from a failure.")
    elif rows is not None and timeline and _trained_nothing(timeline, _optimizer_steps(timeline, meta), rows):
        lines.append(f"Nothing trained in the {plural(len(timeline), 'step')} seen{cut_short}: no backward pass, no optimizer.step() "
                     "and no GradScaler.update() ran (evaluation only?), so this shows forward outputs and weights "
                     "only. Watch the training loop to check its gradients and updates.")
    else:
        lines.append(f"Training did not break in the {plural(len(timeline), 'step')} seen{cut_short}.")
    if fn is not None:
        what = {"activation": "forward output", "gradient": "gradient", "weight_grad": "weight gradient",
                "weight": "weights"}.get(fn["kind"], fn["kind"])
        if fn.get("input_nonfinite"):
            lines.append(f"First non-finite value: step {fn['step']}, the input of {shown_layer(fn['layer'])} was already "
                         "non-finite (the data, or code outside the watched model).")
        elif fn["kind"] == "weight" and fn.get("at_start"):
            lines.append(f"First non-finite value: the weights of {shown_layer(fn['layer'])} were already NaN/Inf when "
                         "watch() began, before any step (a checkpoint saved after a run broke, or a bad "
                         "initialisation): fix them first; the NaN they give is not a precision problem.")
        elif fn["kind"] == "weight":
            lines.append(f"First non-finite value: step {fn['step']}, the weights of {shown_layer(fn['layer'])}: the "
                         "optimizer step made them non-finite (an overflowing update or weight gradient; with DDP, "
                         "a non-finite gradient from another rank).")
        elif fn.get("loss_nonfinite"):
            lines.append(f"First non-finite value: step {fn['step']}, the loss itself, while every watched layer's output "
                         "was finite: its computation, outside the model, overflowed.")
        elif fn.get("from_loss"):
            lines.append(f"First non-finite value: step {fn['step']}, the gradient reaching {shown_layer(fn['layer'])} "
                         "from the loss" + (" (scaled by the GradScaler)." if fn.get("scaled") else "."))
        else:
            lines.append(f"First non-finite value: step {fn['step']}, {what} of {shown_layer(fn['layer'])} "
                         "(it produced NaN/Inf from finite inputs; later layers only propagate it).")
    if spread is not None:
        what = {"activation": "a forward output", "gradient": "a gradient", "weight_grad": "a weight gradient",
                "weight": "the weights"}.get(spread["kind"], spread["kind"])
        lines.append(f"The loss was non-finite from step {first_loss_bad} (layer statistics sampled every {every} "
                     f"steps): the first non-finite value recorded (step {spread['step']}, {what} of "
                     f"{shown_layer(spread['layer'])}) came after it: that layer may have made it again there, or passed on a "
                     "NaN the earlier steps left (in the weights, the optimizer state or the data), so it does not "
                     "say which layer made it first. Rerun with --every 1 to pin it.")
    elif fn is None and every > 1 and first_loss_bad is not None and first_loss_bad % every:
        lines.append(f"The loss was non-finite at step {first_loss_bad}, which was not recorded in detail (layer statistics "
                     f"sampled every {every} steps): rerun with --every 1 to see which layer produced it.")
    if fn is not None and every > 1:
        lines.append(f"Layer statistics were sampled every {every} steps (and in full after a non-finite loss): "
                     "the first non-finite value may come a few steps earlier; rerun with --every 1 to pin it.")
    if skipped:
        partial = partial_skips(timeline)
        start = ""
        if backoff is not None and n_start < len(timeline):
            start = (f": {n_start} start-up backoffs (its scale fell from {_lg(backoff[0])} to {_lg(backoff[1])} before "
                     "the first optimizer step)" + (f", {skipped - n_start} after" if skipped > n_start else ""))
        lines.append(f"GradScaler skipped {skipped} of {len(timeline)} steps{start}" + (
            f" (in {partial} of them another optimizer still stepped: with several optimizers on one GradScaler, "
            "a step skips only those whose gradients held Inf/NaN)." if partial else "."))
    ran = meta.get("activation_dtype")
    if ran and ran != meta.get("format_dtype") and decision is None and wider_than(ran, meta.get("format") or ""):
        lines.append(f"Activations ran in {ran} and are measured against {meta.get('format')}: {_a(str(meta.get('format')))} "
                     f"readiness check (what would overflow or underflow there: see the advice); rerun with --format "
                     f"{'bf16' if ran == 'bfloat16' else 'fp16'} to judge them as they ran.")
    elif ran and ran != meta.get("format_dtype"):
        lines.append(f"Activations ran in {ran} but the numbers are measured against {meta.get('format')}: "
                     f"rerun with --format {'bf16' if ran == 'bfloat16' else 'fp16'} to judge them by what they are.")
    if status == "crashed":
        lines.append(f"The script raised: {meta.get('error', '?')}")
    elif status == "interrupted":
        lines.append(f"The run was interrupted ({meta.get('error') or 'KeyboardInterrupt'}): this shows the steps "
                     "recorded before it stopped.")
    elif status == "exited" and meta.get("exit_code") not in (None, 0, "0"):
        lines.append(f"The script exited with status {meta.get('exit_code')}"
                     + (f" ({meta['error']})" if meta.get("error") else "")
                     + ": this shows the steps recorded before it stopped.")
    elif status == "running":
        if _still_written(meta):
            # a live report (``w.report()`` while the watch is still on, or `ampdoctor report` of a run
            # going on on this machine): nothing was killed
            lines.append("The run is still in progress: this shows the steps recorded so far.")
        else:
            lines.append("The run did not finish (killed?): this shows every step committed before it stopped.")
    lost = _lost_steps(meta, timeline)
    if lost:
        lines.append(lost)
    return Diagnosis(
        broke=decision is not None, step=None if decision is None else decision.step,
        reason=None if decision is None else decision.reason, first_nonfinite=fn, lines=lines,
        steps_seen=len(timeline), optimizer_steps=_optimizer_steps(timeline, meta), skipped_steps=skipped,
        first_loss_nonfinite=first_loss_bad, steps_note=cut_short)


def _partial_note(meta: dict, timeline: list) -> str:
    """Where the run's last step counted ended before its step boundary (the session wrote what ran since the
    last one at its close) because a crash, an interrupt or an exit cut it short."""
    if not meta.get("last_step_partial") or not timeline or meta.get("status") not in ("crashed", "interrupted", "exited"):
        return ""  # (a finished run's: what ran after its last step, an evaluation; or all of a run that never trained)
    return f" (the last cut short by the {'crash' if meta['status'] == 'crashed' else 'stop'}: {len(timeline) - 1} completed)"


def _a(word: str) -> str:
    """``word`` after its indefinite article, as said aloud (an fp16, a bf16)."""
    return f"{'an' if word[:1].lower() in 'aefhilmnorsx' else 'a'} {word}"


def _lost_steps(meta: dict, timeline: list[dict]) -> str | None:
    """The trace lacks steps the run took: its writer could not write them (a full disk; ``writer_error``
    in the meta), or the run's step count says more steps ended than the timeline holds."""
    err = meta.get("writer_error")
    took = meta.get("steps")
    took = took if isinstance(took, int) and not isinstance(took, bool) else None
    short = took is not None and took > len(timeline)
    if not isinstance(err, dict) and not short:
        return None
    held = (f"it holds {plural(len(timeline), 'step')} of the {took} the run took" if short else
            f"it holds {plural(len(timeline), 'step')}")
    if isinstance(err, dict):
        at = f" at step {err['step']}" if err.get("step") is not None else ""
        full = "full" in str(err.get("error", "")).lower() or "space" in str(err.get("error", "")).lower()
        return (f"The trace is incomplete: writing it failed{at} ({err.get('error')}), so {held}; what this shows "
                "stops there. " + ("Free space on that disk, or give --out (watch(trace=...)) a folder on "
                                   "another, and run again." if full else "Check that disk (space, quota, a file size limit) or give "
                                   "--out (watch(trace=...)) a folder on another, and run again."))
    return (f"The trace is incomplete: {held} (its writer stopped writing: a full disk?); what this shows stops "
            "there. Free space, or give --out (watch(trace=...)) a folder on another disk, and run again.")


def partial_skips(timeline: list[dict]) -> int:
    """Steps the GradScaler marked skipped (its scale fell) in which an optimizer step was taken all
    the same: several optimizers on one GradScaler (a GAN's D and G), of which only some had Inf/NaN
    gradients. The timeline's ``optimizer_steps`` is the running count at each step's end."""
    n, last = 0, 0
    for t in timeline:
        now = t.get("optimizer_steps")
        if now is None:
            continue
        if t.get("skipped") and now > last:
            n += 1
        last = now
    return n


def _still_written(meta: dict) -> bool:
    """Whether the process that writes this trace is still running: this very process (a live
    ``Watch.report()``), or one on this machine (the trace's host) that is still alive."""
    try:
        pid = int(meta.get("pid"))
    except (TypeError, ValueError):
        return False
    if pid == os.getpid():
        return True
    return str(meta.get("host")) == socket.gethostname() and pid > 0 and _pid_alive(pid)


def loss_made_first(timeline: list[dict], events: list[dict], pick: dict | None) -> dict | None:
    """Where the loss itself was first non-finite in a recorded step in which no watched layer's output was
    (the forward is done before its backward), and ``pick`` (the first non-finite event otherwise chosen,
    as ``{"layer", "step", "kind", ...}``) is none or a gradient of that step or later: the loss's computation,
    outside the model, made it (a KL term's ``exp``), not the layer whose gradient showed it first (a VAE's
    decoder weight gradient, scaled into Inf at a start-up backoff, was named "produced from finite inputs").
    The pick to use instead: ``{"kind": "gradient", "from_loss", "loss_nonfinite", ...}``, else None."""
    bad = next((t for t in timeline if t.get("loss") is not None and not math.isfinite(t["loss"])), None)
    if bad is None or not bad.get("recorded", 1):  # (a step not recorded in detail: its outputs are not known)
        return None
    step = bad["step"]
    if pick is not None and (pick.get("kind") in ("activation", "weight") or pick.get("at_start") or pick["step"] < step):
        return None
    if any(e["detail"].get("kind") == "activation" and e["step"] <= step for e in events if e["kind"] == "first_nonfinite"):
        return None
    layer = pick.get("layer") if pick is not None and pick["step"] == step else None
    return {"kind": "gradient", "layer": layer, "step": step, "from_loss": True, "loss_nonfinite": True,
            "scaled": bool(pick and pick.get("scaled"))}


def _pick_first_nonfinite(events: list[dict], decision: Any, timeline: list[dict] | None = None) -> dict | None:
    d = _first_event(events, decision)
    if timeline:
        d = loss_made_first(timeline, events, d) or d
    return d


def _first_event(events: list[dict], decision: Any) -> dict | None:
    firsts = [e for e in events if e["kind"] == "first_nonfinite"]
    fwd = [e for e in firsts if e["detail"].get("kind") == "activation"]
    unscaled = [e for e in firsts if e["detail"].get("kind") != "activation" and not e["detail"].get("scaled")]
    grads = [e for e in events if e["kind"] == "grad_nonfinite"]
    pick = None
    at_start = [e for e in firsts if e["detail"].get("at_start")]
    if at_start:  # weights NaN/Inf before anything ran: whatever came next came from them
        pick = at_start[0]
    elif fwd or unscaled:
        # the earliest; at the same step a forward output first. A later forward event is an echo of an
        # earlier unscaled gradient/weight one (weights the optimizer step made non-finite give NaN outputs
        # from the next forward on), never the producer
        pick = min(fwd[:1] + unscaled[:1], key=lambda e: (e["step"], e["detail"].get("kind") != "activation"))
    elif grads and decision is not None and decision.reason in ("skipped_steps", "scale_collapse"):
        at = [e for e in grads if decision.step is None or e["step"] >= decision.step]
        pick = at[0] if at else grads[-1]
    elif firsts and decision is not None:
        pick = firsts[0]  # a GradScaler's overflow at an ordinary backoff is not news for a healthy run
    if pick is None:
        return None
    d = dict(pick["detail"])
    if pick["kind"] == "grad_nonfinite":
        d.setdefault("scaled", True)  # (written only while a GradScaler scales the loss, and without saying so)
    d.update(layer=pick["layer"], step=pick["step"], kind=d.get("kind"))
    return d


def _other_ranks(files: list[Path], shown: Path) -> list[str]:
    """One line per other rank's trace: did it break, where (the merged view of a torchrun run)."""
    notes = []
    for f in files:
        if f == shown:
            continue
        try:
            with TraceReader(f) as r, r.snapshot():
                meta, timeline, events = r.meta(), r.steps(), r.events()
                rows = None
                if never_stepped(timeline):  # whether its gradients held NaN without Inf decides (see _diagnose)
                    rows = _aggregate(r, get_format(meta.get("format", "fp16")), {row["id"]: row for row in r.layers()})
        except (OSError, ValueError) as e:
            notes.append(f"{f.name}: unreadable ({e})")
            continue
        d = _diagnose(timeline, events, meta, rows)
        notes.append(f"rank {meta.get('rank', '?')} ({f.name}): " + " ".join(d.lines[:2]))
    return notes


class NoSuchRank(ValueError):
    """``build_report(rank=N)`` on a run whose traces hold no rank N (a usage error for the CLI)."""


def build_report(path: str | Path, *, rank: int | None = None) -> Report:
    """Read a trace file (or a run folder's rank-``rank`` trace) into a :class:`Report`. ``rank``: of a
    run folder, that rank's trace (None: rank 0, else the lowest there); of a trace file, the trace of
    that rank beside it (``trace.rank1.sqlite`` for ``trace.sqlite``; None: the file itself)."""
    try:
        files = find_traces(path)
    except FileNotFoundError as e:
        result = Path(path) / "bisect.json" if Path(path).is_dir() else None
        if result is None or not result.exists():
            raise
        try:
            verdict = json.loads(result.read_text()).get("verdict")
        except (OSError, ValueError, AttributeError):
            verdict = None
        raise FileNotFoundError(
            f"{path} is a bisect folder that holds no trace of its baseline run (verdict: {verdict or 'unknown'}): "
            f"the result is in {result}, the trials' folders under {Path(path) / 'trials'}") from e
    trace = files[0]
    if Path(path).is_dir():  # a run folder: the trace of rank ``rank`` (trace.rankN.sqlite), not the N-th file
        ranks = {_rank_of(f)[0]: f for f in files}
        if (0 if rank is None else rank) in ranks:
            trace = ranks[0 if rank is None else rank]
        elif rank is not None:  # (no rank asked for: the lowest rank there)
            raise NoSuchRank(f"no trace of rank {rank} in {path}; ranks there: {', '.join(map(str, sorted(ranks)))}")
    elif rank is not None:  # a trace file: that rank's trace of the same run, beside it
        ranks = rank_siblings(trace)
        if rank not in ranks:
            raise NoSuchRank(f"no trace of rank {rank} beside {path} (its run's traces there: "
                             f"{', '.join(f'rank {r} {f.name}' for r, f in ranks.items())})")
        trace, files = ranks[rank], list(ranks.values())
    with TraceReader(trace) as reader, reader.snapshot():
        meta = reader.meta()
        fmt = get_format(meta.get("format", "fp16"))
        layers = {row["id"]: row for row in reader.layers()}
        rows = _aggregate(reader, fmt, layers)
        timeline = reader.steps()
        events = reader.events()
    notes = [e["detail"].get("message", "") if e["layer"] is None else f"{e['layer']}: {e['detail'].get('message', '')}"
             for e in events if e["kind"] == "note"]
    meta["format_dtype"] = str(fmt.dtype).replace("torch.", "")
    low = [r for r in rows if r.kind == "activation" and r.dtype in ("float16", "bfloat16")]
    if low:
        meta["activation_dtype"] = max(("float16", "bfloat16"), key=lambda d: sum(r.numel for r in low if r.dtype == d))
    diagnosis = _diagnose(timeline, events, meta, rows)
    report = Report(trace=str(trace), format=fmt.name, meta=meta, diagnosis=diagnosis, layers=rows,
                    timeline=timeline, events=[e for e in events if e["kind"] != "grad_nonfinite"][:200], notes=notes)
    report.module_types = {row["name"]: row["type"] for row in layers.values() if row.get("type")}
    if len(files) > 1:
        report.notes.extend(_other_ranks(files, trace))
    bisect_json = Path(path) / "bisect.json" if Path(path).is_dir() else None
    if bisect_json is not None and bisect_json.exists():
        try:
            got = json.loads(bisect_json.read_text())
        except ValueError:
            report.notes.append(f"{bisect_json} is not valid JSON; bisect result not shown")
        else:
            if isinstance(got, dict) and "verdict" in got:
                report.bisect = got
            else:
                report.notes.append(f"{bisect_json} is not a bisect result (no JSON object with a verdict); not shown")
    try:
        from .advice import advise
        report.advice = advise(report)
    except ImportError:
        pass
    return report
