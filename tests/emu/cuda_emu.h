// Host stand-ins for the CUDA built-ins used by ampdoctor/_stats_cuda_kernel.cu, so that its
// arithmetic can be checked on a CPU (tests/test_stats_kernel_emu.py). One thread per block:
// barriers are no-ops, a shuffle returns its own value, atomics are plain adds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#define __global__
#define __restrict__
#define __shared__ static
#define DEV static inline
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;
struct dim3_ { unsigned x, y, z; };
static dim3_ threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
struct uint4 { u32 x, y, z, w; };
using std::max;
using std::min;
static inline void __syncthreads() {}
static inline int __syncthreads_or(int p) { return p; }
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int) { return v; }
template <class T> static inline T atomicAdd(T* p, T v) { T o = *p; *p += v; return o; }
template <class T> static inline T atomicMax(T* p, T v) { T o = *p; *p = std::max(o, v); return o; }
template <class T> static inline T atomicOr(T* p, T v) { T o = *p; *p |= v; return o; }
static inline u32 __float_as_uint(float f) { u32 u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline float h2f(u32 h) {  // fp16 bits -> float, exact
    u32 s = (h >> 15) & 1u, e = (h >> 10) & 31u, m = h & 1023u;
    float v;
    if (e == 31) v = m ? NAN : INFINITY;
    else if (e == 0) v = std::ldexp((float)m, -24);
    else v = std::ldexp((float)(m | 1024u), (int)e - 25);
    return s ? -v : v;
}
static inline u32 f2h(float f) {  // float that fp16 holds exactly (or +-inf) -> fp16 bits
    u32 s = std::signbit(f) ? 0x8000u : 0u;
    float a = std::fabs(f);
    if (std::isinf(a)) return s | 0x7C00u;
    if (a == 0.0f) return s;
    int e;
    float fr = std::frexp(a, &e);  // a = fr * 2^e, fr in [0.5, 1)
    int ex = e - 1 + 15;           // biased exponent of a
    if (ex <= 0) return s | (u32)std::ldexp(a, 24);  // subnormal: a / 2^-24
    return s | ((u32)ex << 10) | ((u32)std::ldexp(fr * 2.0f - 1.0f, 10));
}
// The packed fp16 instructions (PACKED): per 16-bit half of a 32-bit word.
static inline bool h_nan(u32 h) { return (h & 0x7FFFu) > 0x7C00u; }
static inline u32 h_pick(u32 a, u32 b, bool want_min) {  // a, b: fp16 bits; NaN if either is NaN
    if (h_nan(a) || h_nan(b)) return 0x7FFFu;
    float fa = h2f(a), fb = h2f(b);
    if (fa == fb) return (want_min ? (a | b) : (a & b)) & 0xFFFFu;  // -0 below +0
    return (want_min ? fa < fb : fa > fb) ? a : b;
}
static inline u32 hmin2n(u32 a, u32 b) {
    return h_pick(a & 0xFFFFu, b & 0xFFFFu, true) | (h_pick(a >> 16, b >> 16, true) << 16);
}
static inline u32 hmax2n(u32 a, u32 b) {
    return h_pick(a & 0xFFFFu, b & 0xFFFFu, false) | (h_pick(a >> 16, b >> 16, false) << 16);
}
static inline u32 vmins2(u32 a, u32 b) {
    int16_t al = (int16_t)(a & 0xFFFFu), bl = (int16_t)(b & 0xFFFFu);
    int16_t ah = (int16_t)(a >> 16), bh = (int16_t)(b >> 16);
    return (u32)(uint16_t)std::min(al, bl) | ((u32)(uint16_t)std::min(ah, bh) << 16);
}
static inline void cvt2(u32 w, float& lo, float& hi) { lo = h2f(w & 0xFFFFu); hi = h2f(w >> 16); }
