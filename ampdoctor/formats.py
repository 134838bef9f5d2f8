"""Target number formats (fp16, bf16, fp8) and their ranges, read from ``torch.finfo``.

A *format* is what a tensor will be cast to under mixed precision. Statistics are always
measured against a format, so an FP32 run can be checked for "would this overflow in fp16?".

Definitions used everywhere (and in the README):

* ``overflow``: finite values with ``|x| > max`` (cast, they become Inf from the max plus half a step
  up, e.g. 65520 for fp16, and round to the max below that; e4m3fn has no Inf: this torch saturates);
* ``subnormal``: ``smallest_subnormal <= |x| < smallest_normal`` (kept, but with fewer
  significant bits; zero on flush-to-zero hardware);
* ``flush_to_zero``: ``0 < |x| < smallest_subnormal`` (lost, or rounded to the smallest
  subnormal, on cast);
* the exponent histogram bins ``floor(log2|x|)`` of finite non-zero values from
  ``min_exp = log2(smallest_subnormal)`` to ``max_exp = floor(log2(max))``, with one
  *under* bin before and one *over* bin after.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Format", "get_format", "FORMATS"]


@dataclass(frozen=True)
class Format:
    name: str
    dtype: torch.dtype
    max: float
    smallest_normal: float
    smallest_subnormal: float

    @property
    def min_exp(self) -> int:
        return int(round(math.log2(self.smallest_subnormal)))

    @property
    def max_exp(self) -> int:
        return int(math.floor(math.log2(self.max)))

    @property
    def normal_exp(self) -> int:
        return int(round(math.log2(self.smallest_normal)))

    @property
    def n_bins(self) -> int:
        """Histogram length: under bin + one bin per exponent + over bin."""
        return self.max_exp - self.min_exp + 3

    def headroom_bits(self, absmax: float) -> float:
        """``log2(max / absmax)``: how many doublings are left before overflow."""
        if not math.isfinite(absmax):
            return -math.inf
        if absmax <= 0:
            return math.inf
        return math.log2(self.max / absmax)


def _from_finfo(name: str, dtype: torch.dtype) -> Format:
    fi = torch.finfo(dtype)
    # smallest subnormal = smallest normal * eps (one unit in the last place at the bottom).
    return Format(name, dtype, float(fi.max), float(fi.tiny), float(fi.tiny) * float(fi.eps))


def _build() -> dict[str, Format]:
    table = {
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
        "fp32": torch.float32,
    }
    for name, attr in (("fp8_e4m3fn", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")):
        if hasattr(torch, attr):
            table[name] = getattr(torch, attr)
    return {name: _from_finfo(name, dt) for name, dt in table.items()}


FORMATS: dict[str, Format] = _build()

_ALIASES = {
    "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32",
    "float8_e4m3fn": "fp8_e4m3fn", "e4m3": "fp8_e4m3fn", "fp8": "fp8_e4m3fn",
    "float8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2",
}


def get_format(fmt: str | torch.dtype | Format) -> Format:
    """Return the :class:`Format` named by a string (``"fp16"``), a dtype or a Format."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        for f in FORMATS.values():
            if f.dtype == fmt:
                return f
        raise ValueError(f"no ampdoctor format for dtype {fmt}; use one of {sorted(FORMATS)}")
    key = _ALIASES.get(str(fmt).lower(), str(fmt).lower())
    if key not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {sorted(FORMATS)}")
    return FORMATS[key]


def wider_than(dtype: str, fmt: str | torch.dtype | Format) -> bool:
    """Whether values held in ``dtype`` (a dtype's name: ``bfloat16``) can exceed format ``fmt``'s range:
    a run in that dtype measured against ``fmt`` is a readiness check for ``fmt`` (FP32 against any, bf16
    against fp16, fp16 against fp8)."""
    if dtype in ("float32", "float64"):
        return True
    try:
        return get_format(dtype).max > get_format(fmt).max
    except ValueError:
        return False


AUTO = "auto"  # the format of what the run trains in, decided at the first watched forward (detect_format)


def detect_format(module: torch.nn.Module, default: bool = True) -> tuple[str, str] | None:
    """(format name, why) for a run whose format was not given, where a watched forward of
    ``module`` starts: the dtype autocast casts to, when autocast is on for the parameters' device
    type (float16: fp16, bfloat16: bf16); else the parameters' own dtype when it is float16 or
    bfloat16 (a pure ``.half()``/``.bfloat16()`` model); else fp16 (an FP32 run: the FP16
    readiness check), or None without ``default`` (autocast may still be entered further in)."""
    p = next((q for q in module.parameters() if q.is_floating_point()), None)
    kinds = [p.device.type] if p is not None else ["cuda", "cpu"]
    for kind in kinds:
        try:
            if torch.is_autocast_enabled(kind):
                dt = torch.get_autocast_dtype(kind)
                name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dt)
                if name is not None:
                    return name, f"autocast to {str(dt).replace('torch.', '')}"
        except (RuntimeError, TypeError, AttributeError):  # a device type without autocast, an older torch
            continue
    if p is not None and p.dtype in (torch.float16, torch.bfloat16):
        return ("fp16" if p.dtype == torch.float16 else "bf16"), f"{str(p.dtype).replace('torch.', '')} parameters"
    if not default:
        return None
    return "fp16", READINESS_WHY


READINESS_WHY = "no autocast and no fp16/bf16 parameters: the FP16 readiness check"
