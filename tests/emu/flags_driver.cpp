// Runs the NaN/Inf flags kernel (ampdoctor/_flags_cuda_kernel.cu) on the CPU, one thread per block,
// for up to FMAXT tensors in one launch table; the bytes after each tensor's end are NaN patterns
// (0xFF), which the kernel must not read as elements.
// usage: flags_driver OUT GATE (IN KIND N)...   (IN: raw elements; KIND 0 fp16, 1 bf16, 2 fp32;
// OUT: one float64 flag per tensor)
#include "cuda_emu.h"
#include <cstdio>
#include <cstdlib>
#include <vector>
#include KERNEL_SOURCE

int main(int argc, char** argv) {
    if (argc < 6 || (argc - 3) % 3) return 2;
    const int m = (argc - 3) / 3;
    if (m > FMAXT) return 2;
    int gate = atoi(argv[2]);
    FTable table = {};
    std::vector<void*> bufs;
    i64 total = 0;
    for (int k = 0; k < m; ++k) {
        const char* path = argv[3 + 3 * k];
        int kind = atoi(argv[4 + 3 * k]);
        i64 n = atoll(argv[5 + 3 * k]);
        int esize = kind == 2 ? 4 : 2;
        size_t bytes = ((size_t)n * esize + 64 + 15) / 16 * 16;
        void* data = std::aligned_alloc(16, bytes);
        std::memset(data, 0xFF, bytes);
        FILE* f = fopen(path, "rb");
        if (!f || fread(data, esize, (size_t)n, f) != (size_t)n) return 3;
        fclose(f);
        bufs.push_back(data);
        table.v[k] = (i64)(intptr_t)data;
        table.v[FMAXT + k] = n;
        table.v[2 * FMAXT + k] = kind;
        table.v[3 * FMAXT + k] = total;
        total += (n + FCHUNK - 1) / FCHUNK;
    }
    table.v[3 * FMAXT + m] = total;
    std::vector<double> out((size_t)m, 0.0);
    blockIdx.x = 0;
    gridDim.x = 1;
    nonfinite(table, m, &gate, out.data());
    FILE* f = fopen(argv[1], "wb");
    fwrite(out.data(), sizeof(double), (size_t)m, f);
    fclose(f);
    for (void* b : bufs) std::free(b);
    return 0;
}
