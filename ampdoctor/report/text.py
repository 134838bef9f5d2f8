"""The terminal report: the diagnosis, then one table per kind, in execution order or worst first."""

from __future__ import annotations

import io
from typing import Sequence

from rich.console import Console
from rich.table import Table

from .model import KIND_TITLES, LayerRow, Report
from .phrasing import fmt_bits, fmt_num, fmt_pct, plural

DEFAULT_KINDS = ("activation", "gradient")


def select_rows(report: Report, kind: str, *, sort: str = "order", top: int | None = None,
                only_bad: bool = False, match: str | None = None) -> list[LayerRow]:
    rows = report.rows(kind)
    if match:
        rows = [r for r in rows if match in r.layer or match in r.type]
    if only_bad:
        rows = [r for r in rows if r.bad or r.subnormal or r.flush_to_zero]
    if sort == "worst":
        rows = sorted(rows, key=lambda r: worst_first_key(report, r))
    elif sort != "order":
        raise ValueError(f"sort must be 'order' or 'worst', got {sort!r}")
    return rows[:top] if top else rows


def worst_first_key(report: Report, r: LayerRow) -> tuple:
    """``LayerRow.severity``, with two things only the report knows: among the rows that went bad at the same
    step, the diagnosis' first non-finite producer comes first (a module called twice, an in-place ReLU before
    and after it, is ordered by its first call, which may come before the producer); and activation gradients
    are produced in backward order, the reverse of the forward's."""
    key = r.severity()
    if not r.bad:
        return key
    fn = report.diagnosis.first_nonfinite or {}
    producer = (r.layer, r.kind, r.first_bad_step) == (fn.get("layer") or "(root)", fn.get("kind"), fn.get("step"))
    order = -key[2] if r.kind == "gradient" else key[2]
    return (key[0], key[1], not producer, order, key[3])


def render_text(report: Report, *, kinds: Sequence[str] = DEFAULT_KINDS, sort: str = "order", top: int | None = None,
                only_bad: bool = False, match: str | None = None, width: int = 120) -> str:
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, force_jupyter=False, color_system=None,
                  highlight=False, emoji=False)
    fmt = report.fmt
    d = report.diagnosis
    con.print(f"ampdoctor report  trace={report.trace}")
    con.print(f"format {fmt.name}: max {fmt.max:.6g}, smallest normal {fmt.smallest_normal:.3g}, "
              f"smallest subnormal {fmt.smallest_subnormal:.3g}"
              + (f" (the run's: {report.meta['format_detected']})" if report.meta.get("format_detected") else "")
              + f"; {d.steps_said()}, {plural(d.optimizer_steps, 'optimizer step')}")
    con.print("")
    con.print("Diagnosis")
    for line in d.lines:
        con.print(f"  - {line}")
    if report.bisect:
        b = report.bisect
        con.print(f"  - bisect verdict: {b.get('verdict')}; culprits: {', '.join(b.get('culprits') or []) or '-'}")
    shown = 0
    for kind in kinds:
        rows = select_rows(report, kind, sort=sort, top=top, only_bad=only_bad, match=match)
        if not rows:
            continue
        shown += 1
        con.print("")
        table = Table(title=KIND_TITLES.get(kind, kind), title_justify="left", box=None, pad_edge=False,
                      show_edge=False, header_style="bold")
        for col, just in (("layer", "left"), ("type", "left"), ("dtype", "left"), ("abs-max", "right"),
                          ("headroom", "right"), ("overflow", "right"), ("subnormal", "right"), ("flush", "right"),
                          ("NaN", "right"), ("Inf", "right"), ("first bad", "right")):
            # a long layer or type name folds onto more lines rather than losing its end (which tells
            # blocks.3.attn.q_proj from blocks.3.attn.k_proj)
            names = col in ("layer", "type")
            table.add_column(col, justify=just, no_wrap=not names, overflow="fold" if names else "ellipsis")
        for r in rows:
            calls = f" x{r.calls}" if r.calls > 1 else ""
            table.add_row(r.layer + calls, r.type, r.dtype, fmt_num(r.absmax) if r.finite else "-", fmt_bits(r.headroom_bits), fmt_pct(r.overflow_pct),
                          fmt_pct(r.subnormal_pct), fmt_pct(r.flush_pct), str(r.nan) if r.nan else "-",
                          str(r.inf) if r.inf else "-", "-" if r.first_bad_step is None else str(r.first_bad_step))
        con.print(table)
    if not shown and (only_bad or match):
        con.print("")
        what = " with NaN/Inf, overflow, subnormal or flushed values" if only_bad else ""
        con.print(f"No layer{what}{f' matching {match!r}' if match else ''} among {', '.join(kinds)}.")
    if report.advice:
        con.print("")
        con.print("Advice")
        for a in report.advice:
            con.print(f"  - {a}")
    if report.notes:
        con.print("")
        con.print("Notes")
        for n in report.notes[:20]:
            con.print(f"  - {n}")
        if len(report.notes) > 20:
            con.print(f"  - ... {len(report.notes) - 20} more in the JSON report")
    return buf.getvalue()
