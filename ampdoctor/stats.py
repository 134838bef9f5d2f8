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
        row = torch.zeros(width, dtype=torch.float64, device=dev)
        row[_IDX["min"]] = float("inf")
        row[_IDX["max"]] = float("-inf")
        row[_IDX["nzmin"]] = float("inf")
        return row
    x = x.reshape(-1).to(_compute_dtype(x))
    a = x.abs()
    finite = torch.isfinite(x)
    nan = torch.isnan(x)
    inf = ~(finite | nan)
    posinf = (inf & (x > 0)).sum()
    neginf = (inf & (x < 0)).sum()
    zero = (x == 0).sum()
    inf_t = torch.tensor(float("inf"), dtype=x.dtype, device=dev)
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
        torch.tensor(float(x.numel()), dtype=torch.float64, device=dev),
        nan.sum().to(torch.float64), posinf.to(torch.float64), neginf.to(torch.float64),
        zero.to(torch.float64), xmin.to(torch.float64), xmax.to(torch.float64),
        absmax.to(torch.float64), nzmin.to(torch.float64), overflow.to(torch.float64),
        subnormal.to(torch.float64), ftz.to(torch.float64),
    ])
    return torch.cat([head, hist[:nb]])


def _torch_batch(tensors: Sequence[torch.Tensor], fmt: Format) -> torch.Tensor:
    return torch.stack([tensor_stats(t, fmt) for t in tensors])


_backend: Callable[[Sequence[torch.Tensor], Format], torch.Tensor] | None = None


def set_backend(fn: Callable[[Sequence[torch.Tensor], Format], torch.Tensor] | None) -> None:
    """Install a batched backend (e.g. a fused CUDA kernel); ``None`` restores the torch path."""
    global _backend
    _backend = fn


def batch_stats(tensors: Sequence[torch.Tensor], fmt: Format) -> torch.Tensor:
    """Rows for many tensors on one device, shape ``(len(tensors), row_width(fmt))``."""
    if not tensors:
        return torch.zeros((0, row_width(fmt)), dtype=torch.float64)
    if _backend is not None:
        out = _backend(tensors, fmt)
        if out is not None:
            return out
    return _torch_batch(tensors, fmt)


def decode_row(row: Sequence[float], fmt: Format) -> dict:
    """A host-side row (list/ndarray) as a dict: fields plus ``hist`` (list of ints)."""
    d = {name: float(row[i]) for i, name in enumerate(FIELDS)}
    for name in ("numel", "nan", "posinf", "neginf", "zero", "overflow", "subnormal", "flush_to_zero"):
        d[name] = int(d[name])
    d["hist"] = [int(v) for v in row[N_FIELDS:N_FIELDS + fmt.n_bins]]
    return d
