// Runs the kernel's stage 1 and stage 2 on one tensor, one block at a time, one thread per block.
// usage: driver IN OUT N CLEN WIDTH   (IN: the raw elements; OUT: WIDTH float64 values)
#include "cuda_emu.h"
#include <cstdio>
#include <cstdlib>
#include <vector>
#include KERNEL_SOURCE

int main(int argc, char** argv) {
    if (argc != 6) return 2;
    i64 n = atoll(argv[3]), clen = atoll(argv[4]);
    int width = atoi(argv[5]);
    const int esize = DT == 2 ? 4 : 2;
    size_t bytes = (size_t)(n * esize + 16);
    void* data = std::aligned_alloc(16, (bytes + 15) / 16 * 16);
    FILE* f = fopen(argv[1], "rb");
    if (!f || fread(data, esize, (size_t)n, f) != (size_t)n) return 3;
    fclose(f);
    i64 nch = (n + clen - 1) / clen;
    // meta: addr numel first[2] clen row kind (m = 1)
    i64 meta[7] = {(i64)(intptr_t)data, n, 0, nch, clen, 0, DT};
    std::vector<unsigned long long> acc((size_t)(P + 4), 0ull);
    for (i64 c = 0; c < nch; ++c) {
        blockIdx.x = (unsigned)c;
        stage1(meta, 1, 0, 1, 0, acc.data());
    }
    std::vector<double> out((size_t)width);
    blockIdx.x = 0;
    stage2(meta, 1, acc.data(), out.data(), width);
    f = fopen(argv[2], "wb");
    fwrite(out.data(), sizeof(double), (size_t)width, f);
    fclose(f);
    return 0;
}
