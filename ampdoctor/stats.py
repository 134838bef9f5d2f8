"""Batched per-tensor statistics against a target :class:`~ampdoctor.formats.Format`.

One statistics *row* per tensor, a float64 vector laid out as :data:`FIELDS` followed by the
exponent histogram (``fmt.n_bins`` counts). Rows stay on the tensor's device: nothing here
syncs with the GPU. :func:`batch_stats` is the seam for a fused multi-tensor kernel: a
backend that gives identical rows can replace the torch-ops path.

Field meanings (see :mod:`ampdoctor.formats` for the range definitions):
``numel``, ``nan``, ``posinf``, ``neginf``, ``zero``; ``min``/``max`` of finite values
(``+inf``/``-inf`` when there are none); ``absmax`` of finite values (0 when none);
``nzmin``, the smallest non-zero finite ``|x|`` (``+inf`` when none); ``overflow``,
``subnormal``, ``flush_to_zero`` counts.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .formats import Format

__all__ = ["FIELDS", "N_FIELDS", "row_width", "tensor_stats", "batch_stats", "decode_row", "set_backend"]

FIELDS = (
    "numel", "nan", "posinf", "neginf", "zero", "min", "max", "absmax", "nzmin",
    "overflow", "subnormal", "flush_to_zero",
)
N_FIELDS = len(FIELDS)
_IDX = {name: i for i, name in enumerate(FIELDS)}


def row_width(fmt: Format) -> int:
    return N_FIELDS + fmt.n_bins


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # Upcasts are exact: fp16/bf16/fp8 all embed in fp32; fp64 keeps its own range.
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def tensor_stats(t: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Statistics row of one floating tensor (torch ops, no host sync)."""
    x = t.detach()
    dev = x.device
    width = row_width(fmt)
    if x.numel() == 0:
        # fills on the device (an element assignment from a Python float would copy and sync)
        z = torch.zeros(width, dtype=torch.float64, device=dev)
        inf = torch.full_like(z, float("inf"))
        pos = torch.arange(width, device=dev)
        row = torch.where((pos == _IDX["min"]) | (pos == _IDX["nzmin"]), inf, z)
        return torch.where(pos == _IDX["max"], -inf, row)
    x = x.reshape(-1).to(_compute_dtype(x))
    a = x.abs()
    finite = torch.isfinite(x)
    nan = torch.isnan(x)
    inf = ~(finite | nan)
    posinf = (inf & (x > 0)).sum()
    neginf = (inf & (x < 0)).sum()
    zero = (x == 0).sum()
    inf_t = torch.full((), float("inf"), dtype=x.dtype, device=dev)  # a fill: no copy, no sync
    xmin = torch.where(finite, x, inf_t).amin()
    xmax = torch.where(finite, x, -inf_t).amax()
    afin = torch.where(finite, a, torch.zeros((), dtype=x.dtype, device=dev))
    absmax = afin.amax()
    nonzero = finite & (a > 0)
    nzmin = torch.where(nonzero, a, inf_t).amin()
    overflow = (finite & (a > fmt.max)).sum()
    subnormal = ((a >= fmt.smallest_subnormal) & (a < fmt.smallest_normal)).sum()
    ftz = (nonzero & (a < fmt.smallest_subnormal)).sum()
    # floor(log2|x|) exactly: frexp gives |x| = m * 2**e with m in [0.5, 1).
    e = torch.frexp(torch.where(nonzero, a, torch.ones((), dtype=x.dtype, device=dev)))[1].to(torch.int64) - 1
    nb = fmt.n_bins
    idx = (e - fmt.min_exp + 1).clamp_(0, nb - 1)
    idx = torch.where(nonzero, idx, torch.full((), nb, dtype=torch.int64, device=dev))
    hist = torch.zeros(nb + 1, dtype=torch.float64, device=dev)
    hist.scatter_add_(0, idx, torch.ones(idx.shape, dtype=torch.float64, device=dev))
    head = torch.stack([
        torch.full((), float(x.numel()), dtype=torch.float64, device=dev),
        nan.sum().to(torch.float64), posinf.to(torch.float64), neginf.to(torch.float64),
        zero.to(torch.float64), xmin.to(torch.float64), xmax.to(torch.float64),
        absmax.to(torch.float64), nzmin.to(torch.float64), overflow.to(torch.float64),
        subnormal.to(torch.float64), ftz.to(torch.float64),
    ])
    return torch.cat([head, hist[:nb]])


def _top_bin_can_overflow(dtype: torch.dtype, fmt: Format) -> bool:
    """Whether ``dtype`` has values in the top exponent bin of ``fmt`` that exceed ``fmt.max``
    (else every overflowing value is in the *over* bin)."""
    if not dtype.is_floating_point:
        return True
    fi = torch.finfo(dtype)
    top = min(float(fi.max), (2 - float(fi.eps)) * 2.0 ** fmt.max_exp)
    return top >= 2.0 ** fmt.max_exp and top > fmt.max


def _torch_batch(tensors: Sequence[torch.Tensor], fmt: Format) -> torch.Tensor:
    """Rows of many tensors with one pass of torch ops per input dtype, not per tensor: the
    tensors are concatenated and reduced by segment. Identical to stacking :func:`tensor_stats`:
    the same element-wise definitions, exact segment reductions, and every count from one
    ``bincount`` of a per-element bin (exponent bins, zero, NaN, +Inf, -Inf, and overflowing values
    of the top exponent bin; ``subnormal`` and ``flush_to_zero`` are exponent bins, the format's
    limits being powers of two). No host sync."""
    if len(tensors) == 1:
        return tensor_stats(tensors[0], fmt)[None]
    dev = tensors[0].device
    nb = fmt.n_bins
    p = nb + 5
    out = torch.empty((len(tensors), row_width(fmt)), dtype=torch.float64, device=dev)
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    for idx in groups.values():
        ts = [tensors[i].detach().reshape(-1) for i in idx]
        m = len(ts)
        sizes = [t.numel() for t in ts]
        lengths = torch.tensor(sizes, dtype=torch.int64).to(dev, non_blocking=True)
        x = torch.cat(ts).to(_compute_dtype(ts[0]))
        a = x.abs()
        inf = torch.full((), float("inf"), dtype=x.dtype, device=dev)
        finite = a < inf  # as isfinite (NaN compares false), in one op
        nonzero = finite & (a > 0)
        # floor(log2|x|) - min_exp + 1, clamped to the under/over bins (frexp's exponent of 0/Inf/NaN is unused)
        if x.dtype == torch.float32 and fmt.min_exp > -126:
            # the exponent field is floor(log2|x|) + 127 for normal floats; fp32 subnormals (< 2**-126) land in
            # the under bin either way. Two integer ops instead of frexp (the costliest op here on a CPU).
            code = ((a.view(torch.int32) >> 23) - (126 + fmt.min_exp)).clamp_(0, nb - 1)
        else:
            code = (torch.frexp(a)[1].to(torch.int32) - fmt.min_exp).clamp_(0, nb - 1)
        if _top_bin_can_overflow(ts[0].dtype, fmt):
            code = torch.where(nonzero & (code == nb - 2) & (a > fmt.max), nb + 4, code)
        code.masked_fill_(~nonzero, nb)  # zero; NaN and Inf overwritten next (int32 in place: cheap)
        code.masked_fill_(x != x, nb + 1)
        code.masked_fill_(a == inf, nb + 2)
        code.masked_fill_(x == -inf, nb + 3)
        seg = torch.repeat_interleave(torch.arange(m, dtype=torch.int32, device=dev), lengths, output_size=x.numel())
        cnt = torch.bincount(seg * p + code, minlength=m * p).view(m, p).to(torch.float64)
        lo = x.masked_fill(~finite, float("inf"))
        hi = x.masked_fill(~finite, float("-inf"))
        nz = a.masked_fill(~nonzero, float("inf"))
        if dev.type == "cpu":  # a reduction per slice beats a scatter on the CPU; on a GPU it is a launch each
            parts = [(lo_.amin().item(), hi_.amax().item(), nz_.amin().item()) if n else (inf_, -inf_, inf_)
                     for lo_, hi_, nz_, n, inf_ in zip(lo.split(sizes), hi.split(sizes), nz.split(sizes), sizes,
                                                       [float("inf")] * m)]
            mins = torch.tensor(parts, dtype=torch.float64)
            xmin, xmax, nzmin = mins[:, 0], mins[:, 1], mins[:, 2]
        else:
            def seg_reduce(vals: torch.Tensor, how: str, init: float, seg: torch.Tensor = seg,
                           m: int = m) -> torch.Tensor:
                base = torch.full((m,), init, dtype=vals.dtype, device=vals.device)
                return base.scatter_reduce_(0, seg.long(), vals, how, include_self=True).to(torch.float64)

            xmin, xmax, nzmin = seg_reduce(lo, "amin", float("inf")), seg_reduce(hi, "amax", float("-inf")), \
                seg_reduce(nz, "amin", float("inf"))
        rows = torch.empty((m, out.shape[1]), dtype=torch.float64, device=dev)
        rows[:, 0] = lengths.to(torch.float64)
        rows[:, 1] = cnt[:, nb + 1]
        rows[:, 2] = cnt[:, nb + 2]
        rows[:, 3] = cnt[:, nb + 3]
        rows[:, 4] = cnt[:, nb]
        rows[:, 5] = xmin
        rows[:, 6] = xmax
        rows[:, 7] = torch.maximum(torch.maximum(-xmin, xmax), torch.zeros_like(xmax))  # |x| <= max(-min, max)
        rows[:, 8] = nzmin
        rows[:, 9] = cnt[:, nb - 1] + cnt[:, nb + 4]
        rows[:, 10] = cnt[:, 1:1 + fmt.normal_exp - fmt.min_exp].sum(1)
        rows[:, 11] = cnt[:, 0]
        rows[:, N_FIELDS:] = cnt[:, :nb]
        rows[:, N_FIELDS + nb - 2] += cnt[:, nb + 4]
        out[idx] = rows
    return out


_backend: Callable[[Sequence[torch.Tensor], Format], torch.Tensor] | None = None


def set_backend(fn: Callable[[Sequence[torch.Tensor], Format], torch.Tensor] | None) -> None:
    """Install a batched backend (e.g. a fused CUDA kernel); ``None`` restores the torch path."""
    global _backend
    _backend = fn


def batch_stats(tensors: Sequence[torch.Tensor], fmt: Format, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Rows for many tensors on one device, shape ``(len(tensors), row_width(fmt))``.
    ``gate``: an int32 tensor on that device, set to 1 (no sync) if a row counts a NaN or an Inf."""
    if not tensors:
        return torch.zeros((0, row_width(fmt)), dtype=torch.float64)
    if _backend is not None:
        out = _backend(tensors, fmt) if gate is None else _backend(tensors, fmt, gate=gate)
        if out is not None:
            return out
    out = _torch_batch(tensors, fmt)
    if gate is not None:
        torch.bitwise_or(gate, (out[:, 1:4] != 0).any().to(gate.dtype), out=gate)
    return out


def nonfinite_any(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` holds a NaN or an Inf: a device bool (torch ops, no host sync). fp8 (which
    ``isfinite`` does not take) is upcast first, exactly."""
    x = t.detach()
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = x.to(torch.float32)
    return (~torch.isfinite(x)).any()


def batch_nonfinite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor, 1.0 if it holds a NaN or an Inf, else 0.0 (float64, torch ops, no host sync)."""
    return torch.stack([nonfinite_any(t) for t in tensors]).to(torch.float64)


def decode_row(row: Sequence[float], fmt: Format) -> dict:
    """A host-side row (list/ndarray) as a dict: fields plus ``hist`` (list of ints)."""
    d = {name: float(row[i]) for i, name in enumerate(FIELDS)}
    for name in ("numel", "nan", "posinf", "neginf", "zero", "overflow", "subnormal", "flush_to_zero"):
        d[name] = int(d[name])
    d["hist"] = [int(v) for v in row[N_FIELDS:N_FIELDS + fmt.n_bins]]
    return d
