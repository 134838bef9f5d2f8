"""Fused multi-tensor statistics for CUDA tensors: the rows of
:func:`ampdoctor.stats.tensor_stats`, bit for bit, for many tensors in two or three launches.

Two implementations: the CUDA kernel of ``_stats_cuda_kernel.cu``, compiled at first use by NVRTC
(:mod:`ampdoctor._stats_nvrtc`; the default wherever it compiles), and the Triton kernels of
``_stats_triton.py`` (where NVRTC does not work). ``AMPDOCTOR_FUSED_BACKEND`` picks one
(``auto``, ``nvrtc``, ``triton``); ``AMPDOCTOR_FUSED=0`` turns both off. What follows describes
the Triton kernels; the CUDA kernel computes the same codes the same way (see its source).

Why it is exact: nothing is computed in floating point. Each element is classified from its
bit pattern (sign, exponent field, mantissa field), so no rounding, flush-to-zero or NaN
ordering can creep in:

* ``floor(log2|x|)`` comes from the exponent field (subnormals: from the mantissa's leading bit);
  the exponent histogram, ``subnormal`` (bins ``min_exp .. normal_exp-1``) and
  ``flush_to_zero`` (the *under* bin) follow from it, since the format's limits are powers of two;
* ``overflow`` (``|x| > fmt.max``) compares the magnitude bits with the bits of the largest value
  of the input dtype that is ``<= fmt.max`` (same-sign floats order like their bit patterns);
* min/max/absmax/nzmin are reduced as integers (``key = ±magnitude bits``) and turned into float64
  at the end by integer arithmetic and one exact power-of-two multiply.

Every element lands in one bin of a small per-block histogram (``tl.histogram``): the exponent
bins, plus bins for zero, NaN, +Inf, -Inf and "overflowing values of the top exponent bin", so a
block does one histogram and four integer reductions. Stage 1 writes per-chunk partials (no float
atomics, deterministic); stage 2, one program per tensor, folds its chunks and writes the float64
row. The one difference from the torch path: a minimum or maximum of zero is ``+0.0`` even where
the torch path may return ``-0.0`` (equal as numbers).

Triton is imported on first use only (never at package import, never on CPU-only machines).
:func:`install` sets :func:`fused_batch_stats` as the backend of :func:`ampdoctor.stats.batch_stats`;
tensors it does not handle (fp8, other devices) get their rows from the torch path.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from typing import Any, Sequence

import numpy as np
import torch

from . import _stats_nvrtc
from . import stats as _stats
from .formats import Format

log = logging.getLogger(__name__)

__all__ = ["available", "install", "uninstall", "fused_batch_stats"]

ENV_DISABLE = "AMPDOCTOR_FUSED"  # "0" turns the fused path off (the torch path is used)
ENV_BACKEND = "AMPDOCTOR_FUSED_BACKEND"  # auto (default), nvrtc or triton

_BLOCK = 1024            # elements per inner iteration of a stage-1 program
_CHUNK = 16 * _BLOCK     # elements per stage-1 program (one partial row each), at least
_MAX_CHUNKS = 1024       # per tensor: a huge tensor gets longer chunks, not more (stage 2 folds them)
_FAST = os.environ.get("AMPDOCTOR_FUSED_FAST", "1") != "0"  # the exponent-field shortcut (see stage1)
_MAX_NUMEL = 2 ** 31 - 1  # per-chunk histogram counts are int32

# dtype -> (kind, bits, mantissa bits, exponent bias)
_KINDS = {
    torch.float16: (0, 16, 10, 15),
    torch.bfloat16: (1, 16, 7, 127),
    torch.float32: (2, 32, 23, 127),
    torch.float64: (3, 64, 52, 1023),
}
_INT_VIEW = {16: torch.int16, 32: torch.int32, 64: torch.int64}

_state: dict[str, Any] = {"kernels": None, "error": None, "nvrtc": {}, "which": {}}


_inf_bits = _stats_nvrtc.inf_bits
_bits_of = _stats_nvrtc.bits_of


def _hist_bins(fmt: Format) -> int:
    """Power-of-two histogram width: ``n_bins`` exponent bins, 5 class bins, one dump bin; at
    least 64 (narrower ``tl.histogram``s gave wrong counts on an H200 with Triton 3.6)."""
    need = fmt.n_bins + 6
    p = 64
    while p < need:
        p *= 2
    return p


def _build_kernels() -> dict:
    from . import _stats_triton as k
    return {"stage1": k.stage1, "stage2": k.stage2, "sub": _sub_bins(k)}


def _sub_bins(k: Any) -> int:
    """How many copies of each histogram bin stage 1 keeps (``AMPDOCTOR_HIST_SUB``, default 1).
    Copies picked per lane would help a ``tl.histogram`` lowered to shared-memory atomics; Triton
    3.6 lowers it to warp ballots, where 32 copies measured 8x slower on an H200."""
    return int(os.environ.get("AMPDOCTOR_HIST_SUB", "1"))


def _kernels() -> dict | None:
    if _state["kernels"] is None and _state["error"] is None:
        try:
            _state["kernels"] = _build_kernels()
        except Exception as e:  # Triton missing or broken: the torch path stays
            _state["error"] = f"{type(e).__name__}: {e}"
            log.info("ampdoctor: fused CUDA statistics unavailable (%s); using the torch path", _state["error"])
    return _state["kernels"]


def _nvrtc_ok(dev: torch.device) -> bool:
    """Whether the NVRTC kernels serve ``dev`` (``AMPDOCTOR_FUSED_BACKEND``: ``nvrtc``,
    ``triton`` or ``auto``, the default: NVRTC where it compiles, else Triton)."""
    choice = os.environ.get(ENV_BACKEND, "auto")
    if choice == "triton":
        return False
    ok = _state["nvrtc"].get(dev.index)
    if ok is None:
        from . import _stats_nvrtc
        ok = _state["nvrtc"][dev.index] = _stats_nvrtc.available(dev)
    return ok


def backend(dev: torch.device | None = None) -> str | None:
    """The fused path that serves ``dev`` (``"nvrtc"`` or ``"triton"``), or ``None``."""
    if os.environ.get(ENV_DISABLE, "1") == "0" or not torch.cuda.is_available():
        return None
    dev = dev or torch.device("cuda", torch.cuda.current_device())
    if _nvrtc_ok(dev):
        return "nvrtc"
    if os.environ.get(ENV_BACKEND, "auto") == "nvrtc":
        return None
    return "triton" if _kernels() is not None else None


def _which(dev: torch.device) -> str | None:
    """:func:`backend` of ``dev``, remembered until the next :func:`install`/:func:`uninstall`
    (a flush asks for every batch; the environment is read once)."""
    which = _state["which"].get(dev.index, False)
    if which is False:
        which = _state["which"][dev.index] = backend(dev)
    return which


def available() -> bool:
    """Whether a fused path can run here: CUDA present, NVRTC or Triton usable, not disabled."""
    return backend() is not None


def install() -> bool:
    """Make :func:`fused_batch_stats` the backend of :func:`ampdoctor.stats.batch_stats`, if
    :func:`available` and no other backend is set. Returns whether it is installed."""
    _state["which"].clear()
    if _stats._backend is fused_batch_stats:
        return True
    if _stats._backend is not None or not available():
        return False
    _stats.set_backend(fused_batch_stats)
    return True


def uninstall() -> None:
    _state["which"].clear()
    if _stats._backend is fused_batch_stats:
        _stats.set_backend(None)


@cache
def _consts(fmt: Format, dtype: torch.dtype, fast: bool, sub: int) -> dict:
    kind, bits, mbits, bias = _KINDS[dtype]
    inf, bmax, nb = _inf_bits(bits, mbits), _bits_of(fmt.max, dtype), fmt.n_bins
    # the fast path bins a normal value by its exponent field alone: bin = field + FAST_ADD
    fast_add = 1 - bias - fmt.min_exp
    emax = inf >> mbits  # all-ones exponent field
    top = fmt.max_exp + bias  # exponent field of the format's top bin, if the input has it as a normal
    need_ovf = 1 <= top <= emax - 1 and ((top << mbits) | ((1 << mbits) - 1)) > bmax
    return dict(KIND=kind, MBITS=mbits, BIAS=bias, INF=inf, BMAX=bmax, NB=nb, MIN_EXP=fmt.min_exp,
                P=_hist_bins(fmt), FAST=fast, FAST_ADD=fast_add, CLAMP_LO=1 + fast_add < 0,
                CLAMP_HI=emax - 1 + fast_add > nb - 1, NEED_OVF=need_ovf,
                SUB=max(1, min(sub, 2048 // _hist_bins(fmt))))


_compiled: dict[tuple, Any] = {}  # (kernel, constexprs) -> Triton's compiled kernel, for cheap launches


def _launch(kern: dict, name: str, grid: int, args: tuple, consts: dict, num_warps: int, dev: torch.device) -> None:
    """Launch through the compiled kernel once it exists: the JIT's per-call argument binding
    and cache lookup cost tens of microseconds, more than the launch itself. Every argument
    of ours keeps one specialisation (16-byte aligned tensors, ``c0`` not specialised)."""
    key = (name, tuple(sorted(consts.items())), num_warps)
    ck = _compiled.get(key)
    if ck is not None and _state.get("direct", True):
        try:
            rest = [consts[n] for n in kern[name].arg_names[len(args):]]  # the signature's order
            ck[(grid, 1, 1)](*args, *rest, stream=torch.cuda.current_stream(dev).cuda_stream)
            return
        except Exception as e:  # another Triton: its own launch path from now on
            log.info("ampdoctor: direct Triton launch unavailable (%s: %s)", type(e).__name__, e)
            _state["direct"] = False
    ck = kern[name][(grid,)](*args, **consts, num_warps=num_warps)
    if dev.type == "cuda" and ck is not None:
        _compiled[key] = ck


def _to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(arr)
    if device.type != "cuda":
        return host.to(device)
    # pinned + non_blocking: no host sync; the caching host allocator keeps the block until the copy ran
    return host.pin_memory().to(device, non_blocking=True)


def _or_gate(gate: torch.Tensor, rows: torch.Tensor) -> None:
    """``gate |= any row counts a NaN or an Inf`` (device ops, no sync)."""
    torch.bitwise_or(gate, (rows[:, 1:4] != 0).any().to(gate.dtype), out=gate)


def _aligned_copy(t: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
    """A contiguous copy of ``t`` (``k`` elements) at a 16-byte aligned address, and that address:
    every pointer the kernels get is aligned (one kernel specialisation, 16-byte loads)."""
    t = t.detach().contiguous()
    a = t.data_ptr()
    if k and a % 16:
        t = t.clone()
        a = t.data_ptr()
    return t, a


def fused_batch_stats(tensors: Sequence[torch.Tensor], fmt: Format, *, _allow_cpu: bool = False,
                      gate: torch.Tensor | None = None) -> torch.Tensor | None:
    """Rows of ``tensors`` (all on one CUDA device), shape ``(N, row_width(fmt))``, float64.
    Returns ``None`` (the caller falls back to the torch path) when the tensors are not on one
    CUDA device or Triton is unavailable. Never syncs with the device. ``gate``: an int32 device
    tensor set to 1 if a row counts a NaN or an Inf (see :func:`fused_nonfinite`)."""
    if not tensors:
        return None
    dev = tensors[0].device
    if (dev.type != "cuda" and not _allow_cpu) or any(t.device != dev for t in tensors):
        return None
    which = _which(dev) if dev.type == "cuda" else ("triton" if _kernels() is not None else None)
    if which is None:
        return None
    width = _stats.row_width(fmt)
    n = len(tensors)
    out = torch.empty((n, width), dtype=torch.float64, device=dev)
    if which == "nvrtc":
        return _nvrtc_rows(tensors, fmt, out, gate)
    kinds = _KINDS
    gate_all = False
    groups: dict[torch.dtype, list[int]] = {}
    other: list[int] = []
    views: list[torch.Tensor | None] = [None] * n
    numel = [0] * n
    ptr = [0] * n
    for i, t in enumerate(tensors):  # the hot loop of a flush: a few attribute reads a tensor
        dt = t.dtype
        k = t.numel()
        if dt not in kinds or k > _MAX_NUMEL:
            other.append(i)
            continue
        a = t.data_ptr()
        if a % 16 or not t.is_contiguous():
            t, a = _aligned_copy(t, k)
        views[i] = t
        numel[i] = k
        ptr[i] = a
        g = groups.get(dt)
        if g is None:
            groups[dt] = [i]
        else:
            g.append(i)
    if groups and gate is not None:
        gate_all = True  # the Triton kernels do not set it: from all rows at the end
    kern = _kernels() if groups else None
    if groups:
        order = [i for g in groups.values() for i in g]
        numel = np.array([views[i].numel() for i in order], dtype=np.int64)
        nchunk = np.minimum((numel + _CHUNK - 1) // _CHUNK, _MAX_CHUNKS)
        clen = (numel + np.maximum(nchunk, 1) * _BLOCK - 1) // (np.maximum(nchunk, 1) * _BLOCK) * _BLOCK
        clen = np.maximum(clen, _BLOCK)
        nchunk = (numel + clen - 1) // clen
        first = np.zeros(len(order), dtype=np.int64)
        np.cumsum(nchunk[:-1], out=first[1:])
        total = int(nchunk.sum())
        chunk_t = np.repeat(np.arange(len(order), dtype=np.int64), nchunk)
        chunk_s = (np.arange(total, dtype=np.int64) - np.repeat(first, nchunk)) * np.repeat(clen, nchunk)
        addr = np.array([views[i].data_ptr() for i in order], dtype=np.int64)
        kind = np.array([_KINDS[views[i].dtype][0] for i in order], dtype=np.int64)
        row = np.array(order, dtype=np.int64)
        m = len(order)
        # one host-to-device copy; every segment starts 16-byte aligned (one kernel specialisation)
        parts = [addr, numel, first, nchunk, row, kind, clen, chunk_t, chunk_s]
        sizes = [len(a) + (len(a) & 1) for a in parts]
        buf = np.zeros(sum(sizes), dtype=np.int64)
        offs = np.concatenate([[0], np.cumsum(sizes)])
        for a, o in zip(parts, offs):
            buf[o:o + len(a)] = a
        meta = _to_device(buf, dev)
        d_addr, d_numel, d_first, d_nchunk, d_row, d_kind, d_clen, d_chunk_t, d_chunk_s = (
            meta[o:o + len(a)] for a, o in zip(parts, offs))
        p = _hist_bins(fmt)
        hist = torch.empty((max(total, 1), p), dtype=torch.int32, device=dev)
        keys = torch.empty((max(total, 1), 4), dtype=torch.int64, device=dev)
        pos = 0
        for dtype, idx in groups.items():
            c0, c1 = int(first[pos]), int(first[pos + len(idx) - 1] + nchunk[pos + len(idx) - 1])
            pos += len(idx)
            if c1 > c0:
                consts = dict(_consts(fmt, dtype, _FAST, kern["sub"]))
                consts["BLOCK"] = _BLOCK
                _launch(kern, "stage1", c1 - c0, (d_addr, d_numel, d_clen, d_chunk_t, d_chunk_s, hist, keys, c0),
                        consts, 4, dev)
        _launch(kern, "stage2", m, (hist, keys, d_first, d_nchunk, d_numel, d_row, d_kind, out),
                dict(W=width, NB=fmt.n_bins, MIN_EXP=fmt.min_exp, NORMAL_EXP=fmt.normal_exp, P=p,
                     CB=max(1, 8192 // p)), 8, dev)
    for i in other:
        out[i] = _stats.tensor_stats(tensors[i], fmt)
    if gate is not None and (other or gate_all):
        _or_gate(gate, out)
    return out


def _nvrtc_groups(tensors: Sequence[torch.Tensor]) -> tuple[list, list, list, list, list, list]:
    """The tensors the NVRTC kernels take, grouped by dtype (in order of first appearance), in
    one pass: (views, numel, ptr, rows, (dtype, count) runs, the indices they do not take). A view
    is the tensor itself, or its aligned contiguous copy (see :func:`_aligned_copy`)."""
    kinds = _stats_nvrtc.KINDS
    groups: dict[torch.dtype, tuple[list, list, list, list]] = {}  # dtype -> (views, numel, ptr, rows)
    other: list[int] = []
    for i, t in enumerate(tensors):  # the hot loop of a flush: a few attribute reads a tensor
        dt = t.dtype
        g = groups.get(dt)
        if g is None:
            if dt not in kinds:
                other.append(i)
                continue
            g = groups[dt] = ([], [], [], [])
        k = t.numel()
        if k > _MAX_NUMEL:
            other.append(i)
            continue
        a = t.data_ptr()
        if a % 16 or not t.is_contiguous():
            t, a = _aligned_copy(t, k)
        g[0].append(t)
        g[1].append(k)
        g[2].append(a)
        g[3].append(i)
    views, numel, ptr, rows, runs = [], [], [], [], []
    for dt, g in groups.items():
        if g[0]:
            views += g[0]
            numel += g[1]
            ptr += g[2]
            rows += g[3]
            runs.append((dt, len(g[0])))
    return views, numel, ptr, rows, runs, other


def _nvrtc_rows(tensors: Sequence[torch.Tensor], fmt: Format, out: torch.Tensor,
                gate: torch.Tensor | None) -> torch.Tensor:
    """:func:`fused_batch_stats` through the NVRTC kernels: ``out``'s rows, tensors grouped by dtype
    (one stage-1 launch per dtype and table), in one pass over them."""
    views, numel, ptr, rows, runs, other = _nvrtc_groups(tensors)
    if views:
        _stats_nvrtc.run(views, rows, fmt, out, numel, ptr, gate, runs)
    for i in other:
        out[i] = _stats.tensor_stats(tensors[i], fmt)
    if gate is not None and other:
        _or_gate(gate, out)
    return out


_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous


def planned_rows(tensors: Sequence[torch.Tensor], fmt: Format, gate: torch.Tensor | None,
                 memo: dict) -> torch.Tensor | None:
    """:func:`fused_batch_stats` of tensors that come back step after step, such as the
    parameters (all on one CUDA device; the caller checks that their dtypes and sizes are those
    of the last call): the NVRTC launches are planned once (:class:`_stats_nvrtc.Plan`, kept in
    ``memo``) and launched again while the tensors keep their addresses and stay contiguous, with
    no launch table built again. The same rows as :func:`fused_batch_stats`. ``None`` where the
    plan does not apply (no NVRTC here, a dtype or size the kernels do not take, a tensor that is
    not contiguous or aligned): the caller measures them as any batch."""
    dev = tensors[0].device
    ptrs = list(map(_data_ptr, tensors))
    plan = memo.get("plan")
    if plan is None or memo["ptrs"] != ptrs or memo["fmt"] != fmt or not all(map(_is_contiguous, tensors)):
        memo.clear()
        if _which(dev) != "nvrtc":
            return None
        views, numel, ptr, rows, runs, other = _nvrtc_groups(tensors)
        if other or ptr != [ptrs[i] for i in rows]:  # another path, or an aligned copy: not reusable
            return None
        plan = _stats_nvrtc.Plan(numel, ptr, rows, runs, fmt, dev, _stats.row_width(fmt))
        memo.update(plan=plan, ptrs=ptrs, fmt=fmt)
    out = torch.empty((len(ptrs), _stats.row_width(fmt)), dtype=torch.float64, device=dev)
    plan.launch(out, gate)
    return out


_FLAG_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def flags_backend(dev: torch.device) -> bool:
    """Whether :func:`fused_nonfinite` serves ``dev``: the NVRTC statistics path (whose stage 2
    sets the gate) and the flags kernel both work there."""
    return dev.type == "cuda" and _which(dev) == "nvrtc" and _stats_nvrtc.flags_available(dev)


def fused_nonfinite(tensors: Sequence[torch.Tensor], gate: torch.Tensor) -> torch.Tensor:
    """Per tensor (all on ``gate``'s CUDA device), 1.0 if it holds a NaN or an Inf, else 0.0,
    float64 ``(N,)``: read only if ``gate`` is non-zero when the launch runs (set by the statistics
    rows measured before it with that gate); all 0.0 otherwise. Tensors of other dtypes (fp64, fp8)
    are checked with torch ops whatever the gate. Never syncs with the device."""
    dev = gate.device
    n = len(tensors)
    out = torch.zeros(n, dtype=torch.float64, device=dev)
    numel: list[int] = []
    ptr: list[int] = []
    kinds: list[int] = []
    rows: list[int] = []
    keep = []
    for i, t in enumerate(tensors):
        kind = _FLAG_KINDS.get(t.dtype)
        k = t.numel()
        if kind is None or k > _MAX_NUMEL:
            out[i] = _stats.nonfinite_any(t)
            continue
        a = t.data_ptr()
        if a % 16 or not t.is_contiguous():
            t, a = _aligned_copy(t, k)
            keep.append(t)
        numel.append(k)
        ptr.append(a)
        kinds.append(kind)
        rows.append(i)
    if rows:
        if len(rows) == n:
            _stats_nvrtc.run_flags(numel, ptr, kinds, gate, out)
        else:  # write into a compact buffer, then scatter (the kernel writes entries in order)
            part = torch.zeros(len(rows), dtype=torch.float64, device=dev)
            _stats_nvrtc.run_flags(numel, ptr, kinds, gate, part)
            out[_to_device(np.asarray(rows, dtype=np.int64), dev)] = part
    del keep  # contiguous copies: the caching allocator keeps their memory until the kernel ran
    return out
