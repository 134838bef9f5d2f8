// NaN/Inf flags of many fp16 / bf16 / fp32 CUDA tensors, behind a gate (ampdoctor.rows: the
// tensors measured only for first-non-finite attribution). Compiled at run time by NVRTC
// (ampdoctor/_stats_nvrtc.py, run_flags); no constants are #defined in front of it.
//
// gate: an int on the device that the statistics kernel's stage 2 sets (atomicOr) when a row it
// writes counts a NaN or an Inf. While it is 0 (nothing measured so far in the step held one),
// every block returns at once: a step without NaN/Inf reads none of these tensors. Once it is set,
// each block reads one chunk of one tensor (16-byte loads) and writes 1.0 to its tensor's entry of
// out (zeroed by the caller) if an element's exponent field is all ones (NaN or Inf). Nothing is
// computed in floating point: the test is on bit patterns.

#ifdef __CUDACC__
#define DEV __device__ __forceinline__
typedef unsigned int u32;
typedef long long i64;
#endif

#define FMAXT 64        // tensors a launch takes (the table is a kernel parameter)
#define FCHUNK 65536    // elements per chunk: a multiple of 8, so every chunk starts 16-byte aligned

// addr[FMAXT] numel[FMAXT] kind[FMAXT] (0 fp16, 1 bf16, 2 fp32) first[FMAXT + 1] (the first chunk
// of each tensor, then the total)
struct FTable { i64 v[4 * FMAXT + 1]; };

// Whether a 32-bit word holds a NaN or an Inf: one fp32, or two 16-bit halves (a half of zero
// bits, as the upper half of a lone tail element, never does).
DEV int bad_word(u32 w, int kind) {
    if (kind == 2) return (w & 0x7F800000u) == 0x7F800000u;
    const u32 e = kind == 0 ? 0x7C00u : 0x7F80u;
    return ((w & e) == e) | (((w >> 16) & e) == e);
}

DEV int bad_vec(uint4 q, int kind) {
    return bad_word(q.x, kind) | bad_word(q.y, kind) | bad_word(q.z, kind) | bad_word(q.w, kind);
}

extern "C" __global__ void nonfinite(const FTable table, int m, const int* __restrict__ gate,
                                     double* __restrict__ out) {
    if (*(const volatile int*)gate == 0) return;
    const i64* addr = table.v;
    const i64* numel = table.v + FMAXT;
    const i64* kinds = table.v + 2 * FMAXT;
    const i64* first = table.v + 3 * FMAXT;
    const i64 total = first[m];
    const int tid = threadIdx.x, nt = blockDim.x;
    for (i64 c = blockIdx.x; c < total; c += gridDim.x) {
        int lo = 0, hi = m - 1;  // the tensor of this chunk: the last one starting at or before it
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (first[mid] <= c) lo = mid; else hi = mid - 1;
        }
        const int kind = (int)kinds[lo];
        const int esz = kind == 2 ? 4 : 2;
        const int per = 16 / esz;  // elements per 16-byte vector
        const i64 s = (c - first[lo]) * FCHUNK;
        const i64 e = min(s + (i64)FCHUNK, numel[lo]);
        const char* base = (const char*)addr[lo];
        const uint4* v = (const uint4*)(base + s * esz);
        const i64 nv = (e - s) / per;
        int bad = 0;
        i64 i = tid;
        for (; i + 3 * nt < nv; i += 4 * nt) {  // four loads in flight a thread
            uint4 a = v[i], b = v[i + nt], q = v[i + 2 * nt], d = v[i + 3 * nt];
            bad |= bad_vec(a, kind) | bad_vec(b, kind) | bad_vec(q, kind) | bad_vec(d, kind);
        }
        for (; i < nv; i += nt) bad |= bad_vec(v[i], kind);
        for (i64 j = s + nv * per + tid; j < e; j += nt) {  // the tensor's last elements (< 8)
            u32 w = esz == 4 ? ((const u32*)base)[j] : (u32)((const unsigned short*)base)[j];
            bad |= bad_word(w, kind);
        }
        if (__syncthreads_or(bad) && tid == 0) out[lo] = 1.0;
    }
}
