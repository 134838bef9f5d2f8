// Fused per-tensor statistics (ampdoctor.stats rows) for fp16 / bf16 / fp32 CUDA tensors.
// Compiled at run time by NVRTC (ampdoctor/_stats_nvrtc.py), once per (input dtype, target
// format); the constants below are #defined in front of this source by that module:
//
//   DT            input dtype: 0 fp16, 1 bf16, 2 fp32
//   NB, P         histogram bins of the format, and the padded per-chunk histogram width
//   MIN_EXP, NORMAL_EXP   the format's exponents (see ampdoctor/formats.py)
//   C             fast path: bin = E + C, with E the exponent field of the value as an fp32
//   BMAX          magnitude bits of the largest input value <= the format's max
//   LO_CLAMP, HI_CLAMP, ZERO_IN_BIN0, NEED_OVF, SUBN_SPECIAL, LANE_HIST: see stage1
//   PREFETCH      the next vectors' loads issued before the current ones are counted (each_word)
//   BIN_LUT       the other inputs: the bin of E from a 256-entry table
//   PACKED        fp16 inputs whose every finite value has a bin E + C (no clamp, no overflow bin):
//                 the fast path works on two elements per 32-bit word (fast_word)
//   NT            threads per block
//
// Stage 1: one block per chunk of one tensor -> a histogram of P int32 counters and four
// integer keys (min, max, absmax, smallest non-zero |x|, as +-magnitude bits). Stage 2: one block
// per tensor folds its chunks and writes the float64 row. Nothing is computed by rounding
// arithmetic: classes and bins come from bit patterns, and the float min/max of the fast path
// are exact (a min or max is one of its inputs). See stats_cuda.py for the layout of the codes.
//
// The same source compiles on the host (tests/cuda_emu.h) to check the arithmetic on a CPU.

#ifdef __CUDACC__
#define DEV __device__ __forceinline__
typedef unsigned int u32;
typedef long long i64;
DEV float h2f(u32 h) {
    float f;
    unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}
DEV u32 f2h(float f) {  // exact for values that fp16 holds
    unsigned short s;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(s) : "f"(f));
    return (u32)s;
}
#if PACKED && __CUDA_ARCH__ < 800  // min/max.NaN.f16x2 need sm_80
#undef PACKED
#define PACKED 0
#endif
#if PACKED
// per 16-bit half: the smaller / larger fp16 value, NaN if either is NaN
DEV u32 hmin2n(u32 a, u32 b) { u32 d; asm("min.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
DEV u32 hmax2n(u32 a, u32 b) { u32 d; asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
// per 16-bit half: signed integer minimum
#if __CUDA_ARCH__ >= 900
DEV u32 vmins2(u32 a, u32 b) { u32 d; asm("min.s16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
#else
DEV u32 vmins2(u32 a, u32 b) { return __vmins2(a, b); }
#endif
// both fp16 halves of a word as floats (exact)
DEV void cvt2(u32 w, float& lo, float& hi) {
    asm("{.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
        : "=f"(lo), "=f"(hi) : "r"(w));
}
#endif
#endif

#define NW (NT / 32)

#if DT == 0
#define MB 10
#define BIAS 15
#define INFB 0x7C00
#define MAG 0x7FFFu
#define SIGN 0x8000u
#define VEC 8
#elif DT == 1
#define MB 7
#define BIAS 127
#define INFB 0x7F80
#define MAG 0x7FFFu
#define SIGN 0x8000u
#define VEC 8
#else
#define MB 23
#define BIAS 127
#define INFB 0x7F800000
#define MAG 0x7FFFFFFFu
#define SIGN 0x80000000u
#define VEC 4
#endif

DEV float to_float(u32 bits) {
#if DT == 0
    return h2f(bits);
#elif DT == 1
    return __uint_as_float(bits << 16);
#else
    return __uint_as_float(bits);
#endif
}

DEV u32 from_float(float f) {  // the input dtype's bits of a value it holds
#if DT == 0
    return f2h(f);
#elif DT == 1
    return __float_as_uint(f) >> 16;
#else
    return __float_as_uint(f);
#endif
}

DEV int key_of(u32 bits) {
    int a = (int)(bits & MAG);
    return (bits & SIGN) ? -a : a;
}

// h: this lane's own column of its warp's histogram (LANE_HIST: counters of a bin 32 words apart,
// one bank per lane, so a warp's adds never conflict), or its warp's histogram. A reduction
// (red.shared.add) does not wait for the old value: consecutive adds do not form a chain.
#if LANE_HIST
#define HIST_ADD(h, code) atomicAdd((h) + (code) * 32, 1u)
#else
#define HIST_ADD(h, code) atomicAdd((h) + (code), 1u)
#endif

// One element, fast path: no NaN/Inf (and, with SUBN_SPECIAL, no subnormal input) in the chunk;
// a chunk that has any is measured again by slow_el (see stage1).
// The bin of exponent field E on the fast path: E + C clamped to the format's bins (NaN/Inf
// only to P - 1, their chunk is measured again), zero (E = 0) to NB; with BIN_LUT a table of the
// 256 values of E in shared memory (bf16/fp32 subnormals, E = 0 too, are then measured again).
DEV int bin_of(u32 e, u32 a) {
    int code = (int)e + C;
#if LO_CLAMP
    code = max(code, 0);
#endif
#if HI_CLAMP
    code = min(code, NB - 1);
#else
    code = min(code, P - 1);
#endif
#if !ZERO_IN_BIN0
    code = (a == 0) ? NB : code;
#endif
    return code;
}

// One element, fast path: no NaN/Inf (and, with SUBN_SPECIAL, no subnormal input) in the chunk;
// a chunk that has any is measured again by slow_el (see stage1). No maximum of E is kept: E is
// largest where the magnitude bits are, so vabs >= INFB says a NaN/Inf was seen.
DEV void fast_el(u32 bits, float& vmin, float& vmax, u32& vabs, u32& vnzm1, u32* h, const unsigned char* lut) {
    u32 a = bits & MAG;
    float f = to_float(bits);
#if DT == 0
    u32 e = (__float_as_uint(f) >> 23) & 0xFFu;  // fp16 subnormals are fp32 normals: exact
#else
    u32 e = a >> MB;
#endif
    vmin = fminf(vmin, f);
    vmax = fmaxf(vmax, f);
    vabs = max(vabs, a);
    vnzm1 = min(vnzm1, a - 1u);  // zero wraps to the largest value
#if BIN_LUT
    int code = (int)lut[e];
#else
    int code = bin_of(e, a);
#endif
#if NEED_OVF
    code = (code == NB - 2 && a > (u32)BMAX) ? NB + 4 : code;
#endif
    HIST_ADD(h, code);
}

// The element(s) of one 32-bit word of a 16-byte vector: one fp32, or two 16-bit halves.
DEV void fast_vword(u32 w, float& vmin, float& vmax, u32& vabs, u32& vnzm1, u32* h, const unsigned char* lut) {
#if DT == 2
    fast_el(w, vmin, vmax, vabs, vnzm1, h, lut);
#else
    fast_el(w & 0xFFFFu, vmin, vmax, vabs, vnzm1, h, lut);
    fast_el(w >> 16, vmin, vmax, vabs, vnzm1, h, lut);
#endif
}

#if PACKED
// Two fp16 elements (one 32-bit word), fast path. min/max per half with NaN propagated: a chunk
// holding NaN or Inf shows it in mn/mx and is measured again (stage1), so nothing else checks.
// nz: per half, the signed 16-bit |x| + 0x7FFF (no carry between halves: |x| <= 0x7FFF), so 0
// maps to 0x7FFF, the largest, and |x| >= 1 to -0x8000 + |x| - 1: its minimum is the smallest
// non-zero |x|. The bin is E + C, E the fp32 exponent of |x| (fp16 subnormals are fp32 normals);
// zero (E = 0) and NaN/Inf (E = 255) land in the dump bin P - 1 (unsigned minimum).
DEV void hist_f(float f, u32* h) {
    HIST_ADD(h, min((__float_as_uint(f) >> 23) + (u32)(C), (u32)(P - 1)));
}

DEV void fast_word(u32 w, u32& mn, u32& mx, u32& nz, u32* h, bool both) {
    mn = hmin2n(mn, w);
    mx = hmax2n(mx, w);
    u32 a = w & 0x7FFF7FFFu;
    nz = vmins2(nz, a + 0x7FFF7FFFu);
    float f0, f1;
    cvt2(a, f0, f1);
    hist_f(f0, h);
    if (both) hist_f(f1, h);
}

DEV int half_key(u32 h16) { return key_of(h16 & 0xFFFFu); }
#endif

// Each 32-bit word of a chunk's whole 16-byte vectors (vector v, v + nt, ...; nvec of them) to
// count(w): two vectors at a time, with PREFETCH the next pair's loads in flight while the current
// pair is counted, then the one left over.
template <class F> DEV void each_word(const uint4* vp, i64 v, i64 nvec, int nt, F count) {
#if PREFETCH
    uint4 q0, q1;
    if (v + nt < nvec) {
        q0 = vp[v];
        q1 = vp[v + nt];
    }
    for (; v + nt < nvec; v += 2 * nt) {
        u32 w[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
        if (v + 3 * nt < nvec) {
            q0 = vp[v + 2 * nt];
            q1 = vp[v + 3 * nt];
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) count(w[k]);
    }
#else
    for (; v + nt < nvec; v += 2 * nt) {
        uint4 q0 = vp[v], q1 = vp[v + nt];
        u32 w[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) count(w[k]);
    }
#endif
    for (; v < nvec; v += nt) {
        uint4 q = vp[v];
        u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) count(w[k]);
    }
}

// One element, exact classification of anything (NaN, Inf, subnormal input).
DEV void slow_el(u32 bits, int& kmin, int& kmax, int& kabs, int& knz, u32* hw) {
    u32 a = bits & MAG;
    bool neg = (bits & SIGN) != 0;
    int code;
    if (a > (u32)INFB) {
        code = NB + 1;
    } else if (a == (u32)INFB) {
        code = neg ? NB + 3 : NB + 2;
    } else if (a == 0) {
        code = NB;
    } else {
        u32 ex = a >> MB;
        int e = ex ? (int)ex - BIAS : (31 - __clz((int)a)) + 1 - BIAS - MB;  // floor(log2|x|)
        int b = e - MIN_EXP + 1;
        b = b < 0 ? 0 : (b > NB - 1 ? NB - 1 : b);
        if (b == NB - 2 && a > (u32)BMAX) b = NB + 4;
        code = b;
    }
    if (a < (u32)INFB) {
        int key = neg ? -(int)a : (int)a;
        kmin = min(kmin, key);
        kmax = max(kmax, key);
        kabs = max(kabs, (int)a);
        if (a) knz = min(knz, (int)a);
    }
    HIST_ADD(hw, code);
}

#if LANE_HIST
#define HIST_WORDS (NW * P * 32)
#else
#define HIST_WORDS (NW * P)
#endif

// acc: per tensor, P counters then the four keys, all folded with 64-bit atomics from zero:
// bins add; keys are stored so that a max folds them: INF - min, max + INF, absmax, INF - nzmin
#define ACC (P + 4)

// The tensor table, passed by value (kernel parameter space: no host-to-device copy of its own):
// addr[MAXT] numel[MAXT] first[MAXT+1] (first chunk of each tensor, then the total) clen[MAXT]
// row[MAXT] kind[MAXT]
#define MAXT 64
struct Table { i64 v[6 * MAXT + 1]; };

extern "C" __global__ void stage1(const Table table, int m, int g0, int g1, int c0,
                                  unsigned long long* __restrict__ acc) {
    const i64* meta = table.v;
    __shared__ u32 hs[HIST_WORDS];
    __shared__ u32 tot[P];
#if LANE_HIST
    __shared__ u32 wsum[NW][P];
#endif
    __shared__ int kred[4][NW > 0 ? NW : 1];
    __shared__ i64 sh_t[2];
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
    const i64 c = (i64)c0 + blockIdx.x;
    const i64* addr = meta;
    const i64* numel = meta + MAXT;
    const i64* first = meta + 2 * MAXT;
    const i64* clen = meta + 3 * MAXT + 1;
    if (tid == 0) {  // the tensor of this chunk: the last one of the group starting at or before it
        int lo = g0, hi = g1 - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (first[mid] <= c) lo = mid; else hi = mid - 1;
        }
        sh_t[0] = lo;
        sh_t[1] = (c - first[lo]) * clen[lo];
    }
    for (int i = tid; i < HIST_WORDS; i += nt) hs[i] = 0u;
#if BIN_LUT && !PACKED
    __shared__ unsigned char lut[256];
    for (int i = tid; i < 256; i += nt) lut[i] = (unsigned char)(i == 0 ? NB : bin_of((u32)i, 1u));
#else
    const unsigned char* lut = 0;
#endif
    __syncthreads();
    const int ti = (int)sh_t[0];
    const i64 s = sh_t[1];
    const i64 e = min(s + clen[ti], numel[ti]);
#if DT == 2
    const u32* base = (const u32*)addr[ti];
#else
    const unsigned short* base = (const unsigned short*)addr[ti];
#endif
#if LANE_HIST
    u32* h = hs + warp * P * 32 + lane;
#else
    u32* h = hs + warp * P;
#endif
    int kmin, kmax, kabs, knz, special;
#if PACKED
    u32 mn = 0x7C007C00u, mx = 0xFC00FC00u, nz = 0x7FFF7FFFu;  // +Inf, -Inf, "no non-zero"
    const uint4* vp = (const uint4*)(base + s);
    const i64 nvec = (e - s) / VEC;
    each_word(vp, tid, nvec, nt, [&](u32 w) { fast_word(w, mn, mx, nz, h, true); });
    for (i64 i = s + nvec * VEC + tid; i < e; i += nt) {
        u32 b = (u32)base[i];
        fast_word(b | (b << 16), mn, mx, nz, h, false);  // the element in both halves, counted once
    }
    kmin = min(half_key(mn), half_key(mn >> 16));
    kmax = max(half_key(mx), half_key(mx >> 16));
    kabs = max(max(-kmin, kmax), 0);
    int n16 = min((int)(short)(nz & 0xFFFFu), (int)(short)(nz >> 16));
    knz = n16 == 0x7FFF ? INFB : n16 + 0x8000 + 1;
    // NaN anywhere, +Inf in a maximum or -Inf in a minimum (the initial values are neither)
    special = (mn & 0x7FFFu) > 0x7C00u || ((mn >> 16) & 0x7FFFu) > 0x7C00u ||
              (mx & 0x7FFFu) > 0x7C00u || ((mx >> 16) & 0x7FFFu) > 0x7C00u ||
              (mx & 0xFFFFu) == 0x7C00u || (mx >> 16) == 0x7C00u ||
              (mn & 0xFFFFu) == 0xFC00u || (mn >> 16) == 0xFC00u;
#else
    float vmin = __uint_as_float(0x7F800000u), vmax = -vmin;
    u32 vabs = 0u, vnzm1 = 0xFFFFFFFFu;
    // s is a multiple of 1024 elements and the tensor 16-byte aligned: whole 16-byte vectors first
    const uint4* vp = (const uint4*)(base + s);
    const i64 nvec = (e - s) / VEC;
    each_word(vp, tid, nvec, nt, [&](u32 w) { fast_vword(w, vmin, vmax, vabs, vnzm1, h, lut); });
    for (i64 i = s + nvec * VEC + tid; i < e; i += nt) {
        fast_el((u32)base[i], vmin, vmax, vabs, vnzm1, h, lut);
    }
    kmin = key_of(from_float(vmin));
    kmax = key_of(from_float(vmax));
    kabs = (int)vabs;
    knz = vnzm1 == 0xFFFFFFFFu ? INFB : (int)(vnzm1 + 1u);
    special = vabs >= (u32)INFB;  // a NaN or an Inf
#if SUBN_SPECIAL || (BIN_LUT && DT != 0)
    special |= knz < (1 << MB);  // a subnormal input: its bin is not the fast path's
#endif
#endif
    if (__syncthreads_or(special)) {  // rare: NaN/Inf (or subnormals): measure the chunk again, exactly
        for (int i = tid; i < HIST_WORDS; i += nt) hs[i] = 0u;
        __syncthreads();
        kmin = INFB; kmax = -INFB; kabs = 0; knz = INFB;
        for (i64 i = s + tid; i < e; i += nt) slow_el((u32)base[i], kmin, kmax, kabs, knz, h);
    }
    // keys: warp, then block
    for (int o = 16; o > 0; o >>= 1) {
        kmin = min(kmin, __shfl_xor_sync(0xFFFFFFFFu, kmin, o));
        kmax = max(kmax, __shfl_xor_sync(0xFFFFFFFFu, kmax, o));
        kabs = max(kabs, __shfl_xor_sync(0xFFFFFFFFu, kabs, o));
        knz = min(knz, __shfl_xor_sync(0xFFFFFFFFu, knz, o));
    }
    if (lane == 0) {
        kred[0][warp] = kmin; kred[1][warp] = kmax; kred[2][warp] = kabs; kred[3][warp] = knz;
    }
    __syncthreads();
#if LANE_HIST
    // each warp folds its own histogram (lane l: bins l, l + 32, ...; skewed reads, no bank
    // conflicts), then one thread a bin adds the warps' sums
    const int lanes = nt < 32 ? nt : 32;  // 32 (fewer only in the one-thread host build)
    for (int b = lane; b < P; b += lanes) {
        const u32* col = hs + (warp * P + b) * 32;
        u32 sum = 0u;
#pragma unroll 8
        for (int l = 0; l < 32; ++l) sum += col[(l + b) & 31];
        wsum[warp][b] = sum;
    }
    __syncthreads();
    for (int b = tid; b < P; b += nt) {
        u32 sum = 0u;
        for (int w = 0; w < NW; ++w) sum += wsum[w][b];
        tot[b] = sum;
    }
#else
    for (int b = tid; b < P; b += nt) {
        u32 sum = 0u;
        for (int w = 0; w < NW; ++w) sum += hs[w * P + b];
        tot[b] = sum;
    }
#endif
    __syncthreads();
    unsigned long long* a = acc + (i64)ti * ACC;
    for (int b = tid; b < P; b += nt) {
        u32 val = tot[b];
#if ZERO_IN_BIN0
        if (b == 0) val = 0u;          // zeros landed in bin 0 (nothing else can)
        if (b == NB) val += tot[0];
#endif
#if PACKED
        if (b == P - 1) val = 0u;      // zeros landed in the dump bin (in a chunk without NaN/Inf)
        if (b == NB) val += tot[P - 1];
#endif
        if (val) atomicAdd(a + b, (unsigned long long)val);
    }
    if (tid == 0) {
        int a0 = kred[0][0], a1 = kred[1][0], a2 = kred[2][0], a3 = kred[3][0];
        for (int w = 1; w < nt / 32; ++w) {
            a0 = min(a0, kred[0][w]); a1 = max(a1, kred[1][w]); a2 = max(a2, kred[2][w]); a3 = min(a3, kred[3][w]);
        }
        atomicMax(a + P + 0, (unsigned long long)((i64)INFB - a0));
        atomicMax(a + P + 1, (unsigned long long)((i64)a1 + INFB));
        atomicMax(a + P + 2, (unsigned long long)(i64)a2);
        atomicMax(a + P + 3, (unsigned long long)((i64)INFB - a3));
    }
}

DEV double decode(i64 key, i64 kind) {
    bool neg = key < 0;
    u32 a = (u32)(neg ? -key : key);
    float f;
    if (kind == 0) f = a >= 0x7C00u ? __uint_as_float(0x7F800000u) : h2f(a);
    else if (kind == 1) f = __uint_as_float(a << 16);
    else f = __uint_as_float(a);
    double d = (double)f;
    return neg ? -d : d;
}

DEV i64 inf_bits(i64 kind) { return kind == 0 ? 0x7C00 : (kind == 1 ? 0x7F80 : 0x7F800000); }

extern "C" __global__ void stage2(const Table table, int m, unsigned long long* __restrict__ acc,
                                  double* __restrict__ out, int width, int* __restrict__ gate) {
    // reads its tensor's accumulators and zeroes them for the next flush (same stream: ordered);
    // sets *gate when the row counts a NaN or an Inf (the gate of _flags_cuda_kernel.cu)
    __shared__ unsigned long long a[ACC];
    const i64* meta = table.v;
    const int tid = threadIdx.x, nt = blockDim.x;
    const int t = blockIdx.x;
    const i64 numel = meta[MAXT + t];
    const i64 row = meta[4 * MAXT + 1 + t];
    const i64 kind = meta[5 * MAXT + 1 + t];
    const i64 inf = inf_bits(kind);
    unsigned long long* g = acc + (i64)t * ACC;
    for (int b = tid; b < ACC; b += nt) a[b] = g[b];
    __syncthreads();
    for (int b = tid; b < ACC; b += nt) g[b] = 0ull;
    double* o = out + row * width;
    const i64 over_top = (i64)a[NB + 4];
    if (tid == 0) {
        o[0] = (double)numel;
        o[1] = (double)a[NB + 1];
        o[2] = (double)a[NB + 2];
        o[3] = (double)a[NB + 3];
        if (a[NB + 1] | a[NB + 2] | a[NB + 3]) atomicOr(gate, 1);
        o[4] = (double)a[NB];
        o[5] = decode(inf - (i64)a[P + 0], kind);
        o[6] = decode((i64)a[P + 1] - inf, kind);
        o[7] = decode((i64)a[P + 2], kind);
        o[8] = decode(inf - (i64)a[P + 3], kind);
        o[9] = (double)((i64)a[NB - 1] + over_top);
        i64 sub = 0;
        for (int b = 1; b <= NORMAL_EXP - MIN_EXP; ++b) sub += (i64)a[b];
        o[10] = (double)sub;
        o[11] = (double)a[0];
    }
    for (int b = tid; b < NB; b += nt) o[12 + b] = (double)((i64)a[b] + (b == NB - 2 ? over_top : 0));
}
