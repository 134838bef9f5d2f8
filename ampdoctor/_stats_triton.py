"""Triton kernels of :mod:`ampdoctor.stats_cuda` (imported by it on first use only: importing
this module imports Triton). See that module for why every step is exact."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["c0"])
def stage1(addr_ptr, numel_ptr, clen_ptr, chunk_t_ptr, chunk_s_ptr, hist_ptr, keys_ptr, c0,
           KIND: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, INF: tl.constexpr,
           BMAX: tl.constexpr, NB: tl.constexpr, MIN_EXP: tl.constexpr, P: tl.constexpr,
           BLOCK: tl.constexpr, FAST: tl.constexpr, FAST_ADD: tl.constexpr, CLAMP_LO: tl.constexpr,
           CLAMP_HI: tl.constexpr, NEED_OVF: tl.constexpr, SUB: tl.constexpr):
    c = tl.program_id(0).to(tl.int64) + c0
    ti = tl.load(chunk_t_ptr + c)
    start = tl.load(chunk_s_ptr + c)
    n = tl.load(numel_ptr + ti)
    addr = tl.load(addr_ptr + ti)
    clen = tl.load(clen_ptr + ti)
    if KIND == 3:
        base = addr.to(tl.pointer_type(tl.int64))
        ity = tl.int64
    elif KIND == 2:
        base = addr.to(tl.pointer_type(tl.int32))
        ity = tl.int32
    else:
        base = addr.to(tl.pointer_type(tl.int16))
        ity = tl.int32
    end = tl.minimum(start + clen, n)
    hist = tl.zeros([P * SUB], dtype=tl.int32)
    # SUB copies of each bin, picked per lane, so neighbouring lanes never add to the same counter
    # (for a tl.histogram lowered to shared-memory atomics; see stats_cuda._sub_bins)
    lane = tl.arange(0, BLOCK)
    lane = (lane ^ (lane >> 3)) & (SUB - 1)
    vmin = tl.full([BLOCK], INF, ity)
    vmax = tl.full([BLOCK], -INF, ity)
    vabs = tl.zeros([BLOCK], ity)
    vnz = tl.full([BLOCK], INF, ity)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < end
        x = tl.load(base + idx, mask=m, other=0)
        if KIND == 3:
            ab = x & 0x7FFFFFFFFFFFFFFF
            neg = x < 0
        elif KIND == 2:
            ab = x & 0x7FFFFFFF
            neg = x < 0
        else:
            b = x.to(tl.int32) & 0xFFFF
            ab = b & 0x7FFF
            neg = b > 0x7FFF
        ex = ab >> MBITS
        go_fast = False
        if FAST:
            # the common block: full, no NaN/Inf, no subnormal input; its bin is the exponent field
            rare = ((ex == 0) & (ab != 0)) | (ab >= INF) | (idx >= end)
            go_fast = tl.max(rare.to(tl.int32), 0) == 0
        if go_fast:
            zero = ab == 0
            code = ex + FAST_ADD
            if CLAMP_LO:
                code = tl.maximum(code, 0)
            if CLAMP_HI:
                code = tl.minimum(code, NB - 1)
            if NEED_OVF:
                code = tl.where((code == NB - 2) & (ab > BMAX), NB + 4, code)
            code = tl.where(zero, NB, code)
            hist += tl.histogram(code.to(tl.int32) * SUB + lane, P * SUB)
            key = tl.where(neg, -ab, ab)
            vmin = tl.minimum(vmin, key)
            vmax = tl.maximum(vmax, key)
            vabs = tl.maximum(vabs, ab)
            vnz = tl.minimum(vnz, tl.where(zero, INF, ab))
        else:
            mant = ab & ((1 << MBITS) - 1)
            if KIND == 3:
                lg = (mant.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1023
            else:
                lg = (mant.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
            finite = ab < INF
            isnan = ab > INF
            isinf = ab == INF
            nz = finite & (ab != 0)
            # floor(log2|x|): the exponent field, or the mantissa's leading bit for subnormals
            e = tl.where(ex > 0, ex - BIAS, lg + 1 - BIAS - MBITS)
            b_idx = tl.minimum(tl.maximum(e - MIN_EXP + 1, 0), NB - 1)
            code = tl.where(nz, b_idx, NB)
            code = tl.where(isnan, NB + 1, code)
            code = tl.where(isinf & (~neg), NB + 2, code)
            code = tl.where(isinf & neg, NB + 3, code)
            code = tl.where(nz & (b_idx == NB - 2) & (ab > BMAX), NB + 4, code)
            code = tl.where(m, code, P - 1)
            hist += tl.histogram(code.to(tl.int32) * SUB + lane, P * SUB)
            key = tl.where(neg, -ab, ab)
            ok = m & finite
            vmin = tl.minimum(vmin, tl.where(ok, key, INF))
            vmax = tl.maximum(vmax, tl.where(ok, key, -INF))
            vabs = tl.maximum(vabs, tl.where(ok, ab, 0))
            vnz = tl.minimum(vnz, tl.where(m & nz, ab, INF))
    if SUB > 1:
        hist = tl.sum(tl.reshape(hist, (P, SUB)), 1)
    tl.store(hist_ptr + c * P + tl.arange(0, P), hist)
    tl.store(keys_ptr + c * 4 + 0, tl.min(vmin, 0).to(tl.int64))
    tl.store(keys_ptr + c * 4 + 1, tl.max(vmax, 0).to(tl.int64))
    tl.store(keys_ptr + c * 4 + 2, tl.max(vabs, 0).to(tl.int64))
    tl.store(keys_ptr + c * 4 + 3, tl.min(vnz, 0).to(tl.int64))


@triton.jit
def decode(key, kind, mbits, bias, inf):
    # exact float64 of the value whose sign/magnitude bits are ``key`` (+-inf for the sentinel)
    neg = key < 0
    ab = tl.where(neg, -key, key)
    one = tl.full(ab.shape, 1, tl.int64)
    ex = ab >> mbits
    mant = ab & ((one << mbits) - 1)
    full = tl.where(ex > 0, mant + (one << mbits), mant)
    k = tl.where(ex > 0, ex, 1) - bias - mbits
    scale = ((k + 1023) << 52).to(tl.float64, bitcast=True)
    v = full.to(tl.float64) * scale
    v = tl.where(ab >= inf, float("inf"), v)
    v = tl.where(kind == 3, ab.to(tl.float64, bitcast=True), v)
    return tl.where(neg, -v, v)

@triton.jit
def stage2(hist_ptr, keys_ptr, first_ptr, nchunk_ptr, numel_ptr, row_ptr, kind_ptr, out_ptr,
           W: tl.constexpr, NB: tl.constexpr, MIN_EXP: tl.constexpr, NORMAL_EXP: tl.constexpr,
           P: tl.constexpr, CB: tl.constexpr):
    t = tl.program_id(0)
    c0 = tl.load(first_ptr + t)
    nc = tl.load(nchunk_ptr + t)
    numel = tl.load(numel_ptr + t)
    row = tl.load(row_ptr + t)
    kind = tl.load(kind_ptr + t)
    mbits = tl.where(kind == 0, 10, tl.where(kind == 1, 7, tl.where(kind == 2, 23, 52))).to(tl.int64)
    bias = tl.where(kind == 0, 15, tl.where(kind == 1, 127, tl.where(kind == 2, 127, 1023))).to(tl.int64)
    inf = tl.where(kind == 0, 0x7C00, tl.where(kind == 1, 0x7F80,
                                               tl.where(kind == 2, 0x7F800000, 0x7FF0000000000000)))
    inf = inf.to(tl.int64)
    cols = tl.arange(0, P)
    rows = tl.arange(0, CB)
    k4 = tl.arange(0, 4)
    hist = tl.zeros([P], dtype=tl.int64)
    # key lanes: 0 min, 1 max, 2 absmax, 3 nzmin; max-lanes are reduced as negated minima
    sgn = tl.where((k4 == 1) | (k4 == 2), -1, 1).to(tl.int64)
    init = tl.where(k4 == 0, inf, tl.where(k4 == 1, inf, tl.where(k4 == 2, 0, inf)))
    acc = init.to(tl.int64)
    for b in range(0, nc, CB):
        r = b + rows
        rm = r < nc
        h = tl.load(hist_ptr + (c0 + r)[:, None] * P + cols[None, :], mask=rm[:, None], other=0)
        hist += tl.sum(h.to(tl.int64), 0)
        kk = tl.load(keys_ptr + (c0 + r)[:, None] * 4 + k4[None, :], mask=rm[:, None], other=0)
        kk = tl.where(rm[:, None], kk * sgn[None, :], init[None, :])
        acc = tl.minimum(acc, tl.min(kk, 0))
    keys = acc * sgn
    vals = decode(keys, kind, mbits, bias, inf)
    over_top = tl.sum(tl.where(cols == NB + 4, hist, 0), 0)
    o = out_ptr + row * W
    tl.store(o + 0, numel.to(tl.float64))
    tl.store(o + 1, tl.sum(tl.where(cols == NB + 1, hist, 0), 0).to(tl.float64))
    tl.store(o + 2, tl.sum(tl.where(cols == NB + 2, hist, 0), 0).to(tl.float64))
    tl.store(o + 3, tl.sum(tl.where(cols == NB + 3, hist, 0), 0).to(tl.float64))
    tl.store(o + 4, tl.sum(tl.where(cols == NB, hist, 0), 0).to(tl.float64))
    tl.store(o + 5 + k4, vals)
    tl.store(o + 9, (tl.sum(tl.where(cols == NB - 1, hist, 0), 0) + over_top).to(tl.float64))
    sub = (cols >= 1) & (cols <= NORMAL_EXP - MIN_EXP)
    tl.store(o + 10, tl.sum(tl.where(sub, hist, 0), 0).to(tl.float64))
    tl.store(o + 11, tl.sum(tl.where(cols == 0, hist, 0), 0).to(tl.float64))
    hist = tl.where(cols == NB - 2, hist + over_top, hist)
    tl.store(o + 12 + cols, hist.to(tl.float64), mask=cols < NB)

