"""The statistics kernels of ``_stats_cuda_kernel.cu``, compiled at run time with NVRTC (which
ships with CUDA builds of torch) through ``torch.cuda._compile_kernel``, and launched for
:mod:`ampdoctor.stats_cuda`.

Why a CUDA kernel and not only Triton: the exponent histogram. Each element adds one to one of
~64 counters; in CUDA each lane keeps its own column of counters in shared memory (a load, an
add and a store, no atomics, no bank conflicts), where Triton's ``tl.histogram`` lowers to warp
ballots whose cost grows with the number of bins (about 4x slower than this kernel on an H200).

:func:`defines` (the per-(dtype, format) constants) is shared with the host-compiled check of
the kernel's arithmetic in ``tests/test_stats_kernel_emu.py``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .formats import Format

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_stats_cuda_kernel.cu")
NT = 128              # stage-1 threads per block
NT2 = 64              # stage-2 threads per block
MIN_CHUNK = 1 << 16   # elements per stage-1 block, at least (the histogram fold costs ~P loads a thread)
MIN_CHUNK_FP32 = MIN_CHUNK  # the same for fp32 tensors (twice the bytes an element)
MAX_CHUNKS = 8192     # per tensor: huge tensors get longer chunks, not more
FEW_BLOCKS = 1024     # a launch with fewer 64K-element chunks than this (about one wave of resident
SMALL_CHUNK = 4096    # blocks on an H200) gets shorter chunks, down to this: more SMs read its bytes
ALIGN = 1024          # chunk starts are multiples of this many elements (16-byte vector loads)

# dtype -> (kind, bits, mantissa bits, exponent bias); fp64 and fp8 are not ours (torch path)
KINDS = {
    torch.float16: (0, 16, 10, 15),
    torch.bfloat16: (1, 16, 7, 127),
    torch.float32: (2, 32, 23, 127),
}
_INT_VIEW = {16: torch.int16, 32: torch.int32, 64: torch.int64}


def inf_bits(bits: int, mbits: int) -> int:
    """Magnitude bits of +Inf in a float format of ``bits`` bits with ``mbits`` mantissa bits."""
    return ((1 << (bits - 1 - mbits)) - 1) << mbits


def bits_of(value: float, dtype: torch.dtype) -> int:
    """Magnitude bits of the largest finite value of ``dtype`` that is ``<= value`` (value >= 0)."""
    fi = torch.finfo(dtype)
    bits, mbits = fi.bits, int(round(-math.log2(fi.eps)))
    t = torch.tensor(value, dtype=torch.float64).to(dtype)  # round to nearest
    b = int(t.view(_INT_VIEW[bits]).item()) & ((1 << (bits - 1)) - 1)
    if float(t.to(torch.float64)) > value:
        b -= 1  # positive floats: one step down in bits is one step down in value
    return min(b, inf_bits(bits, mbits) - 1)


def hist_width(fmt: Format) -> int:
    """Per-chunk histogram width P: the format's bins, zero, NaN, +Inf, -Inf, "overflowing
    values of the top exponent bin", a dump bin; a multiple of 16, at least 32 (fp16: 48; the
    per-lane histograms of a block take P * 512 bytes, which bounds the resident blocks)."""
    return max(32, -(-(fmt.n_bins + 6) // 16) * 16)


@functools.cache
def defines(dtype: torch.dtype, fmt: Format) -> dict[str, int]:
    """The constants the kernel source is compiled with for inputs of ``dtype`` against ``fmt``.

    Fast path: ``E`` is the exponent field of the value as an fp32 (fp16 subnormals are fp32
    normals; bf16/fp32 subnormals have ``E = 0``), and the bin is ``E + C`` clamped."""
    kind, bits, mbits, bias = KINDS[dtype]
    nb, p = fmt.n_bins, hist_width(fmt)
    c = -127 - fmt.min_exp + 1
    e_min_nz = 127 - 24 if kind == 0 else 0       # smallest E of a non-zero input
    e_max = 127 + 15 if kind == 0 else 254        # largest E of a finite input
    inf = inf_bits(bits, mbits)
    top = fmt.max_exp + bias  # exponent field of the format's top bin, in the input dtype
    bmax = bits_of(fmt.max, dtype)
    need_ovf = 1 <= top <= (inf >> mbits) - 1 and ((top << mbits) | ((1 << mbits) - 1)) > bmax
    # fp16 inputs whose zeros (E = 0) fall below bin 0 and whose non-zero finite values all have an
    # in-range bin E + C: the two-elements-a-word fast path (fp16 inputs, fp16 format)
    packed = kind == 0 and c < 0 and e_min_nz + c >= 0 and e_max + c <= nb - 1 and not need_ovf
    return dict(
        DT=kind, NB=nb, P=p, MIN_EXP=fmt.min_exp, NORMAL_EXP=fmt.normal_exp, C=c, BMAX=bmax,
        LO_CLAMP=int(c < 0),
        HI_CLAMP=int(e_max + c > nb - 1),
        # zero has E = 0; when no non-zero input can land in bin 0, zeros are counted there and moved
        ZERO_IN_BIN0=int(c <= 0 and e_min_nz + c >= 1 and not packed),
        NEED_OVF=int(need_ovf),
        # bf16/fp32 subnormals (E = 0) belong in bin 0 only when the format's range starts above them
        SUBN_SPECIAL=int(kind != 0 and c > 0),
        LANE_HIST=int(p <= 64),
        PACKED=int(packed),
        # the next vectors' loads in flight while the current ones are counted; for the other inputs,
        # the bin of E from a 256-entry table (when every bin's code fits a byte)
        PREFETCH=1,
        BIN_LUT=int(not packed and nb + 5 <= 255),
        NT=NT,
    )


def source(consts: dict[str, int]) -> str:
    return "".join(f"#define {k} ({v})\n" for k, v in consts.items()) + SOURCE.read_text()


class _Kernel:
    """A loaded kernel, launched straight through the driver (``cuLaunchKernel``) with ctypes
    argument buffers built per call in a few microseconds."""

    CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    NUM_REGS = 4

    def __init__(self, compiled: Any):
        from torch.cuda._utils import _get_gpu_runtime_library
        self._keep = compiled  # owns the module
        self.func = compiled.func
        self.lib = _get_gpu_runtime_library()
        self.launch = self.lib.cuLaunchKernel
        # as much shared memory as the SM has: more resident blocks of this histogram-heavy kernel
        self.lib.cuFuncSetAttribute(self.func, self.CARVEOUT, 100)
        regs = ctypes.c_int(0)
        self.lib.cuFuncGetAttribute(ctypes.byref(regs), self.NUM_REGS, self.func)
        self.regs = regs.value
        self._arr: dict[int, Any] = {}

    def pack(self, args: Sequence[Any]) -> tuple[Any, list]:
        """The argument buffer of a launch with ``args`` (tensors by address, ctypes values as they
        are, ints as ``int``), and the values it points to (keep them alive while it is used; a
        ``c_void_p`` among ``args`` can be changed in place between launches)."""
        vals = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else
                (a if isinstance(a, (ctypes.Array, ctypes.c_void_p)) else ctypes.c_int(a)) for a in args]
        arr_t = self._arr.get(len(vals))
        if arr_t is None:
            arr_t = self._arr[len(vals)] = ctypes.c_void_p * len(vals)
        return arr_t(*[ctypes.addressof(v) for v in vals]), vals

    def launch_packed(self, grid: int, block: int, arr: Any, stream: int) -> None:
        err = self.launch(self.func, grid, 1, 1, block, 1, 1, 0, ctypes.c_void_p(stream), arr, None)
        if err:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA error {err}")

    def __call__(self, grid: int, block: int, args: Sequence[Any], stream: int) -> None:
        """Launch on the stream whose handle is ``stream`` (see :func:`raw_stream`)."""
        arr, vals = self.pack(args)
        self.launch_packed(grid, block, arr, stream)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def raw_stream(dev: torch.device) -> int:
    """The handle of ``dev``'s current stream: ``torch.cuda.current_stream(dev).cuda_stream``, without
    building the Stream object (a few microseconds a launch)."""
    if _raw_stream is not None:
        try:
            return _raw_stream(dev.index if dev.index is not None else torch.cuda.current_device())
        except Exception:  # pragma: no cover - another signature in another torch
            pass
    return torch.cuda.current_stream(dev).cuda_stream


_cache: dict[tuple, _Kernel] = {}


def _kernel(name: str, dtype: torch.dtype, fmt: Format, dev: torch.device) -> _Kernel:
    key = (name, dev.index, dtype, fmt)
    k = _cache.get(key)
    if k is None:
        with torch.cuda.device(dev):
            k = _Kernel(torch.cuda._compile_kernel(source(defines(dtype, fmt)), name))
        _cache[key] = k
    return k


def available(dev: torch.device | None = None) -> bool:
    """Whether NVRTC compiles and loads the kernels here (tries once per device)."""
    from .formats import get_format
    dev = dev or torch.device("cuda", torch.cuda.current_device())
    try:
        fmt = get_format("fp16")
        _kernel("stage1", torch.float16, fmt, dev)
        _kernel("stage2", torch.float16, fmt, dev)
        return True
    except Exception as e:  # no NVRTC, an older torch, another GPU vendor: the Triton path stays
        log.info("ampdoctor: NVRTC statistics kernels unavailable (%s: %s)", type(e).__name__, e)
        return False


def chunking(n: int, min_chunk: int = MIN_CHUNK) -> tuple[int, int]:
    """(chunk length, number of chunks) of a tensor of ``n`` elements whose launch table chunks
    at ``min_chunk`` (see :func:`table_chunk`); chunk lengths are multiples of ALIGN (0 chunks for
    an empty tensor)."""
    nchunk = min(max(-(-n // min_chunk), 1), MAX_CHUNKS)
    clen = max(-(-n // (nchunk * ALIGN)) * ALIGN, ALIGN)
    return clen, -(-n // clen)


def _short_chunk(n: np.ndarray) -> int:
    """The chunk length that gives tensors of element counts ``n`` about FEW_BLOCKS chunks in all,
    a multiple of ALIGN between SMALL_CHUNK and MIN_CHUNK."""
    want = -(-int(n.sum()) // FEW_BLOCKS)
    return min(MIN_CHUNK, max(SMALL_CHUNK, -(-want // ALIGN) * ALIGN))


def table_chunk(numel: Sequence[int]) -> int:
    """The chunk length a launch table of tensors of these element counts chunks at, at least:
    MIN_CHUNK, or, for a table of fewer than FEW_BLOCKS such chunks (a step's weights, a small
    flush), the length that gives it about FEW_BLOCKS chunks, not below SMALL_CHUNK (as
    :func:`tables` chunks it). A launch of a few hundred 64K-element blocks leaves most of the
    GPU's SMs idle: each block reads its chunk at a small fraction of the memory bandwidth. Any
    chunking gives the same rows (integer counts, exact minima and maxima)."""
    n = np.asarray(numel, dtype=np.int64)
    few = int(np.clip(-(-n // MIN_CHUNK), 1, MAX_CHUNKS).sum()) < FEW_BLOCKS
    return _short_chunk(n) if few else MIN_CHUNK


MAXT = 64                        # tensors a launch takes (the table is a kernel parameter)
_Table = ctypes.c_int64 * (6 * MAXT + 1)
_acc: dict[tuple, torch.Tensor] = {}  # (device, stream, width) -> zeroed accumulators (stage 2 re-zeroes)


def _accumulators(dev: torch.device, stream: int, width: int) -> torch.Tensor:
    key = (dev.index, stream, width)
    acc = _acc.get(key)
    if acc is None:
        acc = _acc[key] = torch.zeros((MAXT, width), dtype=torch.int64, device=dev)
    return acc


def tables(numel: Sequence[int], ptr: Sequence[int], rows: Sequence[int], kinds: Sequence[int]) -> list[np.ndarray]:
    """The launch tables of tensors given by their element counts, addresses, output rows and
    dtype kinds, MAXT tensors a table (numpy, one pass for all: no Python loop per tensor).
    Layout: addresses, element counts, first chunk of each tensor plus the total (MAXT + 1),
    chunk lengths, rows, kinds."""
    n = np.asarray(numel, dtype=np.int64)
    if MIN_CHUNK_FP32 == MIN_CHUNK:
        nchunk = np.clip(-(-n // MIN_CHUNK), 1, MAX_CHUNKS)
    else:
        minc = np.where(np.asarray(kinds, dtype=np.int64) == 2, MIN_CHUNK_FP32, MIN_CHUNK)
        nchunk = np.clip(-(-n // minc), 1, MAX_CHUNKS)
    for lo in range(0, len(n), MAXT):  # a table of few chunks: shorter ones (table_chunk)
        if int(nchunk[lo:lo + MAXT].sum()) < FEW_BLOCKS:
            part = n[lo:lo + MAXT]
            nchunk[lo:lo + MAXT] = np.clip(-(-part // _short_chunk(part)), 1, MAX_CHUNKS)
    clen = np.maximum(-(-n // (nchunk * ALIGN)) * ALIGN, ALIGN)
    nch = -(-n // clen)  # as chunking(), per tensor
    cols = (np.asarray(ptr, dtype=np.int64), n, clen, np.asarray(rows, dtype=np.int64),
            np.asarray(kinds, dtype=np.int64))
    out = []
    for lo in range(0, len(n), MAXT):
        hi = min(lo + MAXT, len(n))
        m = hi - lo
        t = np.zeros(6 * MAXT + 1, dtype=np.int64)
        t[:m] = cols[0][lo:hi]
        t[MAXT:MAXT + m] = n[lo:hi]
        np.cumsum(nch[lo:hi], out=t[2 * MAXT + 1:2 * MAXT + 1 + m])
        t[3 * MAXT + 1:3 * MAXT + 1 + m] = clen[lo:hi]
        t[4 * MAXT + 1:4 * MAXT + 1 + m] = cols[3][lo:hi]
        t[5 * MAXT + 1:5 * MAXT + 1 + m] = cols[4][lo:hi]
        out.append(t)
    return out


def _scratch_gate(dev: torch.device) -> torch.Tensor:
    """A device int for stage 2 to set when no gate is given (nothing reads it)."""
    g = _scratch.get(dev.index)
    if g is None:
        g = _scratch[dev.index] = torch.zeros(1, dtype=torch.int32, device=dev)
    return g


_scratch: dict[int | None, torch.Tensor] = {}


class Plan:
    """The launches that write the rows of tensors given by their element counts, addresses,
    output rows and dtypes (as ``(dtype, count)`` runs, in order): per MAXT tensors a stage-1
    launch per dtype and one stage-2 launch, the tensor table passed by value. Built once, it can
    be launched again for the same tensors (the same addresses, sizes and dtypes) into another
    ``out``, with another gate, on another stream, with no table built or argument packed again."""

    def __init__(self, numel: Sequence[int], ptr: Sequence[int], rows: Sequence[int],
                 runs: Sequence[tuple[torch.dtype, int]], fmt: Format, dev: torch.device, width: int):
        self.dev = dev
        self.acc_width = hist_width(fmt) + 4
        self._out, self._gate, self._acc = ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_void_p(0)
        k2 = _kernel("stage2", torch.float16, fmt, dev)
        kinds: list[int] = []
        bounds = []  # (first, end, dtype) of each run
        pos = 0
        for dt, c in runs:
            kinds += [KINDS[dt][0]] * c
            bounds.append((pos, pos + c, dt))
            pos += c
        n = len(kinds)
        self._launches: list[tuple[_Kernel, int, int, Any]] = []
        self._keep: list = []  # the tables and packed values the argument buffers point to
        for lo, t in zip(range(0, n, MAXT), tables(numel, ptr, rows, kinds)):
            hi = min(lo + MAXT, n)
            m = hi - lo
            table = _Table.from_buffer(t)
            self._keep.append((t, table))
            for first, end, dt in bounds:  # a stage-1 launch per dtype among this table's tensors
                g0, g1 = max(first, lo) - lo, min(end, hi) - lo
                if g1 <= g0:
                    continue
                c0, c1 = int(t[2 * MAXT + g0]), int(t[2 * MAXT + g1])
                if c1 > c0:
                    self._add(_kernel("stage1", dt, fmt, dev), c1 - c0, NT, (table, m, g0, g1, c0, self._acc))
            self._add(k2, m, NT2, (table, m, self._acc, self._out, width, self._gate))

    def _add(self, k: _Kernel, grid: int, block: int, args: tuple) -> None:
        arr, vals = k.pack(args)
        self._keep.append(vals)
        self._launches.append((k, grid, block, arr))

    def launch(self, out: torch.Tensor, gate: torch.Tensor | None) -> None:
        """Write the rows into ``out`` (float64, on the plan's device, ``width`` columns) on the
        current stream; ``gate``: as in :func:`run`. No host sync, no copy."""
        dev = self.dev
        stream = raw_stream(dev)
        self._out.value = out.data_ptr()
        self._gate.value = (gate if gate is not None else _scratch_gate(dev)).data_ptr()
        self._acc.value = _accumulators(dev, stream, self.acc_width).data_ptr()
        for k, grid, block, arr in self._launches:
            k.launch_packed(grid, block, arr, stream)


def run(views: Sequence[torch.Tensor], rows: Sequence[int], fmt: Format, out: torch.Tensor,
        numel: Sequence[int], ptr: Sequence[int], gate: torch.Tensor | None,
        runs: Sequence[tuple[torch.dtype, int]]) -> None:
    """Write the rows of ``views`` (contiguous, 16-byte aligned fp16/bf16/fp32 tensors on
    ``out``'s device, grouped by dtype) into ``out[rows]``: the :class:`Plan` of these tensors,
    launched once. No host sync, no copy.
    ``numel``/``ptr``: the views' element counts and addresses; ``runs``: their dtypes as
    (dtype, count) runs, in order (the views are kept alive until the launches are queued).
    ``gate``: an int32 device tensor that stage 2 sets to 1 when a row counts a NaN or an Inf
    (see :func:`run_flags`)."""
    Plan(numel, ptr, rows, runs, fmt, out.device, out.shape[1]).launch(out, gate)


# -- NaN/Inf flags behind a gate (_flags_cuda_kernel.cu) ---------------------------------------
FLAG_SOURCE = Path(__file__).with_name("_flags_cuda_kernel.cu")
FMAXT = 64                     # tensors a flags launch takes
FCHUNK = 1 << 16               # elements per block of the flags kernel
FNT = 256                      # threads per block
FGRID = 4096                   # blocks at most (each loops over chunks): few to exit when the gate is shut
_FTable = ctypes.c_int64 * (4 * FMAXT + 1)


def _flag_kernel(dev: torch.device) -> _Kernel:
    key = ("nonfinite", dev.index)
    k = _cache.get(key)
    if k is None:
        with torch.cuda.device(dev):
            k = _Kernel(torch.cuda._compile_kernel(FLAG_SOURCE.read_text(), "nonfinite"))
        _cache[key] = k
    return k


def flags_available(dev: torch.device) -> bool:
    """Whether NVRTC compiles and loads the flags kernel here (tries once per device)."""
    ok = _flags_ok.get(dev.index)
    if ok is None:
        try:
            _flag_kernel(dev)
            ok = True
        except Exception as e:  # pragma: no cover - as available()
            log.info("ampdoctor: NVRTC flags kernel unavailable (%s: %s)", type(e).__name__, e)
            ok = False
        _flags_ok[dev.index] = ok
    return ok


_flags_ok: dict[int | None, bool] = {}


def run_flags(numel: Sequence[int], ptr: Sequence[int], kinds: Sequence[int], gate: torch.Tensor,
              out: torch.Tensor) -> None:
    """Set ``out[i]`` (float64, zeroed by the caller) to 1.0 where tensor ``i`` (its element count,
    16-byte aligned address and dtype kind; contiguous) holds a NaN or an Inf, if ``gate`` (int32,
    same device) is non-zero when the launch runs; if it is zero, nothing is read. One launch per
    FMAXT tensors, the table passed by value. No host sync, no copy."""
    dev = out.device
    stream = raw_stream(dev)
    k = _flag_kernel(dev)
    n = np.asarray(numel, dtype=np.int64)
    nch = -(-n // FCHUNK)
    base = out.data_ptr()
    for lo in range(0, len(n), FMAXT):
        hi = min(lo + FMAXT, len(n))
        m = hi - lo
        t = np.zeros(4 * FMAXT + 1, dtype=np.int64)
        t[:m] = np.asarray(ptr[lo:hi], dtype=np.int64)
        t[FMAXT:FMAXT + m] = n[lo:hi]
        t[2 * FMAXT:2 * FMAXT + m] = np.asarray(kinds[lo:hi], dtype=np.int64)
        np.cumsum(nch[lo:hi], out=t[3 * FMAXT + 1:3 * FMAXT + 1 + m])
        t[3 * FMAXT + 1 + m:] = t[3 * FMAXT + m]  # first[m] is the total
        total = int(t[3 * FMAXT + m])
        if total:
            k(min(total, FGRID), FNT, (_FTable.from_buffer(t), m, gate, ctypes.c_void_p(base + 8 * lo)), stream)
