"""One self-contained HTML file: inline CSS, PNG plots as base64 data URIs, a few lines of inline
JS to sort the tables; no network access, opens offline. Every name from the trace is escaped.

Sections (each with an ``id``): ``diagnosis``, ``verdict`` (bisect), ``fix``, ``advice``, ``plots``,
``layers`` (one sortable table per kind, the terminal's columns) and ``notes``.
"""

from __future__ import annotations

import base64
import datetime as _dt
import logging
import math
import os
import re
from html import escape
from pathlib import Path
from typing import Iterable, Sequence

from ..naming import half_weights_under, root_hint, wrapper_of
from .culprit import trains_without_autocast
from .model import KIND_TITLES, LayerRow, Report, write_whole
from .phrasing import fmt_bits as _bits
from .phrasing import fmt_num as _num
from .phrasing import fmt_pct as _pct
from .phrasing import plural
from .readiness import ran_in

log = logging.getLogger(__name__)

__all__ = ["render_html", "write_html", "SECTION_IDS"]

SECTION_IDS = ("diagnosis", "verdict", "fix", "advice", "plots", "layers", "notes")
KINDS = ("activation", "gradient", "weight", "weight_grad")
COLUMNS = ("layer", "type", "dtype", "min", "max", "abs-max", "headroom bits", "overflow %", "subnormal %", "flush %", "NaN", "Inf",
           "first bad step")

_CODE = re.compile(r"`([^`]+)`")
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,'DejaVu Sans',sans-serif;margin:0;color:#1d2430;background:#f5f6f8}
main{max-width:1320px;margin:0 auto;padding:18px 28px 40px}
header.top{background:#1d2430;color:#fff;padding:14px 28px}
header.top h1{margin:0;font-size:20px;font-weight:600}
header.top .meta{color:#b8c0cc;font-size:12.5px;margin-top:4px;word-break:break-all}
nav{background:#fff;border-bottom:1px solid #dde1e6;padding:6px 28px;position:sticky;top:0;z-index:2}
nav a{margin-right:16px;color:#2b5fad;text-decoration:none;font-size:13px}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:14px 20px;margin:16px 0}
h2{font-size:17px;margin:0 0 10px}
h3{font-size:14.5px;margin:18px 0 6px}
ul{margin:6px 0;padding-left:22px}
li{margin:3px 0}
code,pre{font-family:'DejaVu Sans Mono',Menlo,Consolas,monospace;font-size:12.5px}
pre{background:#f0f2f5;border:1px solid #dde1e6;border-radius:4px;padding:8px 10px;overflow-x:auto;white-space:pre-wrap}
.badge{display:inline-block;padding:2px 10px;border-radius:12px;font-weight:600;font-size:13px;margin-right:8px;color:#fff}
.broke{background:#c0392b}.healthy{background:#2e8b57}.readiness{background:#b7791f}.neutral{background:#6b7280}
table{border-collapse:collapse;font-size:12.5px;width:100%}
th,td{padding:3px 8px;border-bottom:1px solid #eceef1;text-align:right;white-space:nowrap}
th{background:#f0f2f5;position:sticky;top:33px;cursor:pointer;user-select:none}
th.l,td.l{text-align:left}
td.name{max-width:420px;overflow:hidden;text-overflow:ellipsis;font-family:'DejaVu Sans Mono',Menlo,monospace;font-size:12px}
tr.bad td{background:#fdecea}tr.under td{background:#f3effa}
tr:hover td{background:#eef4ff}
tr.first td{font-weight:600}tr.first td:first-child{box-shadow:inset 4px 0 #c0392b}
.tag{background:#c0392b;color:#fff;border-radius:3px;padding:0 5px;font-size:11px;font-weight:600;font-family:system-ui,sans-serif}
.muted{color:#6b7280}
figure{margin:14px 0 22px}figure img{max-width:100%;height:auto;border:1px solid #eceef1}
figcaption{color:#4b5563;font-size:12.5px;margin-top:2px}
.kv{width:auto}.kv td{text-align:left;border:none;padding:1px 18px 1px 0}
table.compact{width:auto;min-width:60%}table.compact th{position:static}
"""

_JS = """
document.querySelectorAll('table.sortable').forEach(function(t){t.querySelectorAll('th').forEach(function(th,i){
th.addEventListener('click',function(){var b=t.tBodies[0],rs=Array.from(b.rows),up=th.dataset.dir!=='up';th.dataset.dir=up?'up':'down';
rs.sort(function(a,c){var x=a.cells[i].dataset.v,y=c.cells[i].dataset.v,r=(x!==undefined&&y!==undefined)?
(parseFloat(x)-parseFloat(y))||0:a.cells[i].textContent.localeCompare(c.cells[i].textContent);return up?r:-r;});
rs.forEach(function(r){b.appendChild(r);});});});});
"""


def _e(v: object) -> str:
    return escape(str(v), quote=True)


def _maybe(x: float | None) -> str:
    """A number, or ``-`` for none (min/max of a layer that had no finite value)."""
    return "-" if x is None else _num(x)


def _v(x: float | int | None) -> str:
    """Sort key for a numeric cell (JS parseFloat reads Infinity/-Infinity)."""
    if x is None:
        return "Infinity"
    if isinstance(x, float) and math.isnan(x):
        return "0"
    if isinstance(x, float) and math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return repr(x)


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{_e(title)}</h2>\n{body}\n</section>\n'


def _rich(text: str) -> str:
    """Escaped text with `backticked` spans set as code (the advice's convention)."""
    return _CODE.sub(lambda m: f"<code>{m.group(1)}</code>", _e(text))


def _ul(items: Iterable[str], cls: str = "") -> str:
    items = list(items)
    if not items:
        return ""
    c = f' class="{cls}"' if cls else ""
    return f"<ul{c}>" + "".join(f"<li>{_rich(i)}</li>" for i in items) + "</ul>"


# -- sections ---------------------------------------------------------------------------------------
def _diagnosis(report: Report, ready: dict | None) -> str:
    d = report.diagnosis
    fmt = report.fmt
    if ready is not None:
        n_over = len({r.layer for rows in ready["overflow"].values() for r in rows})
        n_under = len({r.layer for rows in ready["underflow"].values() for r in rows})
        badge = (f'<span class="badge readiness">{_e(fmt.name)} readiness</span>'
                 f"would overflow in {_e(fmt.name)}: {plural(n_over, 'layer')}; would underflow: "
                 f"{plural(n_under, 'layer')} "
                 f"<span class=\"muted\">({_e(ran_in(ready))})</span>")
        title = f"Diagnosis: {fmt.name} readiness"
    elif d.broke:
        badge = f'<span class="badge broke">broke at step {_e(d.step)}</span>{_e(d.reason or "")}'
        title = "Diagnosis"
    else:
        badge = f'<span class="badge healthy">did not break</span>{_e(plural(d.steps_seen, "step"))} seen{_e(d.steps_note)}'
        title = "Diagnosis"
    rng = (f"{fmt.name}: max {fmt.max:.6g}, smallest normal {fmt.smallest_normal:.3g}, smallest subnormal "
           f"{fmt.smallest_subnormal:.3g}; {d.steps_said()}, "
           f"{plural(d.optimizer_steps, 'optimizer step')}, "
           f"{d.skipped_steps} skipped")
    return _section("diagnosis", title, f"<p>{badge}</p>{_ul(d.lines)}<p class=\"muted\">{_e(rng)}</p>")


def _verdict(report: Report) -> str:
    b = report.bisect
    if not b:
        body = ('<p class="muted">No bisect result in this run folder. <code>ampdoctor bisect SCRIPT</code> finds the '
                "smallest set of layers whose FP32 cast makes training pass, and the op that overflows.</p>")
        return _section("verdict", "Bisect verdict", body)
    verdict = str(b.get("verdict", "?"))
    cls = {"culprit": "broke", "healthy": "healthy"}.get(verdict, "neutral")
    parts = [f'<p><span class="badge {cls}">{_e(verdict)}</span>']
    if b.get("culprits"):
        parts.append("culprits: " + ", ".join(f"<code>{_e(c)}</code>" for c in b["culprits"]))
    parts.append("</p>")
    kv = []
    f = b.get("failure") or {}
    if f:
        kv.append(("failure", f"step {f.get('step')}: {f.get('reason')}"))
    fn = b.get("first_nonfinite") or {}
    if fn:
        kv.append(("first non-finite", f"{fn.get('kind')} of {fn.get('layer')} at step {fn.get('step')}"))
    if kv:
        parts.append('<table class="kv">' + "".join(f"<tr><td class=\"muted\">{_e(k)}</td><td>{_e(v)}</td></tr>"
                                                    for k, v in kv) + "</table>")
    ops = [o for o in b.get("ops") or [] if isinstance(o, dict)]
    if ops:
        parts.append("<h3>First overflowing op (drill-down)</h3><table class=\"compact\"><thead><tr>"
                     + "".join(f'<th class="l">{h}</th>' for h in ("layer", "op", "where", "phase")) + "<th>abs-max</th>"
                     + "</tr></thead><tbody>")
        for o in ops:
            amax = o.get("absmax")
            shown = _num(float(amax)) if isinstance(amax, (int, float)) else ("non-finite" if o.get("nonfinite") else "")
            if shown and o.get("absmax_of") == "fp32_recompute":
                shown += " (recomputed in FP32)"
            phase = "backward (gradient)" if o.get("phase") == "backward" else o.get("phase", "forward")
            parts.append(f'<tr><td class="l name">{_e(o.get("layer", ""))}</td><td class="l"><code>{_e(o.get("op", ""))}'
                         f'</code></td><td class="l"><code>{_e(o.get("where", ""))}</code></td>'
                         f'<td class="l">{_e(phase)}</td><td>{_e(shown)}</td></tr>')
        parts.append("</tbody></table>")
    trials = [t for t in b.get("trials") or [] if isinstance(t, dict)]
    if trials:
        parts.append(f"<h3>Trials ({len(trials)})</h3><table class=\"compact\"><thead><tr><th>#</th><th class=\"l\">forced to FP32</th>"
                     "<th class=\"l\">outcome</th><th>step</th><th>seconds</th></tr></thead><tbody>")
        for i, t in enumerate(trials):
            fp32 = ["(whole model)" if n == "" else str(n) for n in t.get("fp32") or []]
            shown = ", ".join(fp32[:8]) + (f" (+{len(fp32) - 8})" if len(fp32) > 8 else "") if fp32 else "(none)"
            sec = t.get("seconds")
            parts.append(f"<tr><td>{i}</td><td class=\"l name\">{_e(shown)}</td><td class=\"l\">{_e(t.get('outcome', ''))}"
                         f"</td><td>{_e('' if t.get('step') is None else t['step'])}</td>"
                         f"<td>{_e(f'{sec:.1f}' if isinstance(sec, (int, float)) else '')}</td></tr>")
        parts.append("</tbody></table>")
    return _section("verdict", "Bisect verdict", "".join(parts))


def _fix(report: Report, ready: dict | None) -> str:
    from .advice import culprits, module_expr
    from .culprit import half_weights, model_dtype
    names, source = culprits(report)
    if ready is not None and not names:
        names = sorted({r.layer for r in ready["overflow"].get("activation", [])},
                       key=lambda n: next(r.order for r in report.rows("activation") if r.layer == n))[:1]
        source = "readiness"
    verdict = (report.bisect or {}).get("verdict")
    if not names:
        if trains_without_autocast(report.bisect):
            body = ('<p class="muted">No layer to keep in FP32: bisect found that training breaks with every layer in FP32 '
                    "too, and trains with autocast off in the whole script: the NaN/Inf is made by the script's own code "
                    "under autocast, outside the model (see the advice).")
        elif verdict == "not_precision":
            body = ('<p class="muted">Not a precision problem: bisect found that training breaks with every layer in '
                    "FP32 too, so no FP32 cast fixes it.")
        elif ready is None:
            body = '<p class="muted">No layer to keep in FP32: no layer produced a non-finite value from finite inputs.'
        else:
            body = f'<p class="muted">No layer would overflow in {_e(report.format)}.'
        if report.advice:
            body += " See the advice below."
        return _section("fix", "The fix", body + "</p>")
    why = {"bisect": "bisect verified that running these layers in FP32 makes training pass.",
           "first_nonfinite": "the first layer that produced a non-finite value from finite inputs (run "
                              "<code>ampdoctor bisect</code> to verify).",
           "readiness": f"the first layer whose output would overflow in {_e(report.format)}."}[source]
    code = "import ampdoctor\n" + "\n".join(f"ampdoctor.keep_fp32({module_expr(n, types=report.module_types)})" for n in names)
    wrapper = wrapper_of(report.notes)
    if (hint := root_hint(names, report.module_types, wrapper)):
        var, _, what = hint.strip(" ()").partition(":")
        code += f"\n# {var.strip('`')}:{what}"
    if wrapper:
        code += f"\n# model: the module inside {wrapper} (call this before wrapping it, or use wrapped.module under autocast; a pure half model: before wrapping)"
    half = half_weights(report)
    halves = [(module_expr(n, types=report.module_types), dt) for n in names if (dt := half_weights_under(n, half))]
    if halves:  # a pure .half()/.bfloat16() model: no autocast to turn off
        plain = (f"# or, in plain PyTorch (the weights are {halves[0][1]}: there is no autocast to turn off),\n"
                 "# once, before building the optimizer:\n" + "\n".join(f"{p}.float()" for p, _ in halves)
                 + "\n# and where it is called:\n" + "\n".join(f"y = {p}(x.float()).to(x.dtype)" for p, _ in halves))
    elif (dtype := model_dtype(report)):  # a pure half model, the culprit has no weights
        plain = (f"# or, in plain PyTorch (the model is {dtype}: there is no autocast to turn off), where it is called:\n"
                 + "\n".join(f"y = {module_expr(n, types=report.module_types)}(x.float()).to(x.dtype)" for n in names)
                 + f"\n# (an output beyond {dtype}'s range overflows again at that cast: the layers after it need FP32 too)")
    else:
        plain = ("# or, in plain PyTorch, around the call in forward():\n"
                 "with torch.autocast(device_type=x.device.type, enabled=False):\n    out = layer(x.float())")
    body = (f"<p>Keep {', '.join(f'<code>{_e(n)}</code>' for n in names)} in FP32: {why}</p>"
            f"<pre>{_e(code)}</pre><pre>{_e(plain)}</pre>")
    return _section("fix", "The fix", body)


def _row_class(r: LayerRow, first: dict) -> str:
    cls = []
    if r.bad:
        cls.append("bad")
    elif r.subnormal_pct + r.flush_pct >= 1.0:
        cls.append("under")
    if first and first.get("layer") == r.layer and first.get("kind") == r.kind:
        cls.append("first")
    return f' class="{" ".join(cls)}"' if cls else ""


def _table(rows: Sequence[LayerRow], first: dict) -> str:
    head = "".join(f'<th class="l">{c}</th>' if c in ("layer", "type", "dtype") else f"<th>{c}</th>" for c in COLUMNS)
    out = [f'<table class="sortable"><thead><tr>{head}</tr></thead><tbody>']
    for r in rows:
        calls = f" x{r.calls}" if r.calls > 1 else ""
        mark = ' <span class="tag">first NaN/Inf</span>' if "first" in _row_class(r, first) else ""
        cells = [
            f'<td class="l name" title="{_e(r.layer)}">{_e(r.layer + calls)}{mark}</td>',
            f'<td class="l">{_e(r.type)}</td>', f'<td class="l">{_e(r.dtype)}</td>',
            f'<td data-v="{_v(r.min)}">{_maybe(r.min)}</td>', f'<td data-v="{_v(r.max)}">{_maybe(r.max)}</td>',
            f'<td data-v="{_v(r.absmax if r.finite else None)}">{_maybe(r.absmax if r.finite else None)}</td>',
            f'<td data-v="{_v(r.headroom_bits)}">{_bits(r.headroom_bits)}</td>',
            f'<td data-v="{_v(r.overflow_pct)}">{_pct(r.overflow_pct)}</td>',
            f'<td data-v="{_v(r.subnormal_pct)}">{_pct(r.subnormal_pct)}</td>',
            f'<td data-v="{_v(r.flush_pct)}">{_pct(r.flush_pct)}</td>',
            f'<td data-v="{r.nan}">{r.nan or "-"}</td>', f'<td data-v="{r.inf}">{r.inf or "-"}</td>',
            f'<td data-v="{_v(r.first_bad_step)}">{"-" if r.first_bad_step is None else r.first_bad_step}</td>',
        ]
        out.append(f"<tr{_row_class(r, first)}>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _layers(report: Report) -> str:
    parts = ['<p class="muted">Execution order; click a column to sort. Red rows hold NaN/Inf/overflow (the layer '
             "tagged <i>first NaN/Inf</i> produced them, the rest propagate them), lavender rows have at least 1% of "
             "values subnormal or flushed to zero. Headroom: bits left below the format's max (log2 max/abs-max).</p>"]
    for kind in KINDS:
        rows = report.rows(kind)
        if rows:
            parts.append(f'<h3 id="layers-{kind}">{_e(KIND_TITLES.get(kind, kind))}</h3>'
                         f"{_table(rows, report.diagnosis.first_nonfinite or {})}")
    if len(parts) == 1:
        parts.append("<p>No layer statistics were recorded.</p>")
    return _section("layers", "Per-layer table", "".join(parts))


def _plots(report: Report) -> str:
    try:
        from . import plots
    except ImportError as e:  # matplotlib is a dependency, but a broken install must not lose the report
        return _section("plots", "Plots", f"<p class=\"muted\">plots unavailable: {_e(e)}</p>")
    parts = []
    makers = plots.figure_makers(report)
    for pid, caption, make in makers:
        try:
            png = plots.to_png(make())
        except Exception as e:  # one plot failing must not lose the rest
            log.warning("ampdoctor: plot %s failed: %s: %s", pid, type(e).__name__, e, exc_info=True)
            parts.append(f'<p class="muted">plot {_e(pid)} failed: {_e(type(e).__name__)}: {_e(e)}</p>')
            continue
        data = base64.b64encode(png).decode("ascii")
        parts.append(f'<figure id="plot-{pid}"><img alt="{_e(caption)}" src="data:image/png;base64,{data}">'
                     f"<figcaption>{_e(caption)}</figcaption></figure>")
    return _section("plots", "Plots", "".join(parts))


# -- the page ---------------------------------------------------------------------------------------
def render_html(report: Report) -> str:
    """The whole report as one HTML document (a string)."""
    from .advice import readiness
    try:
        ready = readiness(report)
    except Exception as e:  # pragma: no cover - advice must not lose the page
        log.warning("ampdoctor: readiness check failed: %s", e)
        ready = None
    meta = report.meta
    title = f"ampdoctor report: {Path(report.trace).parent.name or report.trace}"
    argv = " ".join(str(a) for a in meta.get("argv") or [])
    started = meta.get("started")
    when = _dt.datetime.fromtimestamp(started).strftime("%Y-%m-%d %H:%M:%S") if isinstance(started, (int, float)) else ""
    detected = f" (the run's: {meta['format_detected']})" if meta.get("format_detected") else ""
    info = "; ".join(x for x in (f"trace {report.trace}", f"format {report.format}{detected}",
                                 f"torch {meta.get('torch')}" if meta.get("torch") else "", when,
                                 f"status {meta.get('status')}" if meta.get("status") else "") if x)
    nav = "".join(f'<a href="#{s}">{s}</a>' for s in SECTION_IDS)
    body = [
        _diagnosis(report, ready),
        _verdict(report),
        _fix(report, ready),
        _section("advice", "Advice", _ul(report.advice) or '<p class="muted">No advice: nothing to fix was recorded.</p>'),
        _plots(report),
        _layers(report),
        _section("notes", "Notes", _ul(report.notes) or '<p class="muted">No notes.</p>'),
    ]
    cmd = f'<div class="meta">{_e(argv)}</div>' if argv else ""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>\n"
            f'<header class="top"><h1>{_e(title)}</h1><div class="meta">{_e(info)}</div>{cmd}</header>\n'
            f"<nav>{nav}</nav>\n<main>\n{''.join(body)}</main>\n<script>{_JS}</script>\n</body></html>\n")


def write_html(report: Report, path: str | os.PathLike) -> None:
    """Write :func:`render_html` to ``path`` (UTF-8), creating its folder."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_whole(p, render_html(report))
