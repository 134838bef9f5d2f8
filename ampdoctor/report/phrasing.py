"""How advice items write numbers and code: module paths as Python expressions, values in a
compact notation, powers of two as the literal a user would paste."""

from __future__ import annotations

import math

from ..naming import module_expr

__all__ = ["module_expr", "plural", "fmt_num", "fmt_pct", "fmt_bits", "pow2", "scale_literal"]


def plural(n: int, word: str, words: str | None = None) -> str:
    """``n`` and the word in the number it takes: ``1 step``, ``0 steps``, ``3 steps``
    (``words``: a plural other than ``word + "s"``)."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def fmt_num(v: float) -> str:
    """Three significant digits, in scientific notation outside ``[1e-3, 1e5)``; whole numbers in
    ``[1e4, 1e5)``, so a value just past the fp16 max (65505) does not print as the max itself."""
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return "inf" if v > 0 else "-inf"
    if 1e4 <= abs(v) and abs(round(v)) < 1e5:
        return f"{v:.0f}"
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e4 else f"{v:.2e}"


def fmt_pct(v: float) -> str:
    """A table percentage: ``-`` for none, ``<0.001%`` for a trace."""
    if v == 0:
        return "-"
    return f"{v:.3g}%" if v >= 0.001 else "<0.001%"


def fmt_bits(v: float) -> str:
    """Headroom in bits, signed; ``-`` when undefined (a layer with no finite value)."""
    if math.isnan(v):
        return "-"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:+.1f}"


def pow2(k: int) -> str:
    """``2**k = value``: the exponent a reader reasons in, and the number it stands for."""
    return f"2**{k} = {fmt_num(2.0 ** k)}"


def scale_literal(k: int) -> str:
    """A power-of-two scale as Python: ``65536`` up to 2**24, ``2.0**33`` beyond (or below 1)."""
    return str(2 ** k) if 0 <= k <= 24 else f"2.0**{k}"


def shown_layer(name: str | None) -> str:
    """A layer's name in prose: ``(root)`` for the model itself (``""``); a second model's root (``D:``) as
    ``D: (whole model)``, which ``D:`` alone does not say."""
    if not name:
        return "(root)"
    return f"{name} (whole model)" if name.endswith(":") else name
