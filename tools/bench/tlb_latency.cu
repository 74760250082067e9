// Is a latency-bound kernel's first load slow because of the address translation? The draft
// step streams ~1.7 GB of distinct weight pages per replay between its small kernels, and the
// per-block trace showed their first round trip of loads taking ~3-4 us after the dependency
// released them. This times a chain of dependent loads (one thread, clock64 between loads)
// from a small buffer A after different streams over a big buffer W:
//   warm      A read just before (L2 and translation warm)
//   l2cold    A pushed out of L2 by streaming a 256 MB region of W 8 times (128 pages of 2 MB)
//   tlbcold   A pushed out of L2 by streaming 2 GB of distinct W pages once (1024 pages)
//   written   as tlbcold, then a one-block kernel writes A's probe lines (data in L2)
//   written+  as written, the probe on another multiprocessor than the writer
// The chain: A + 0 (first touch of page 0), + 64 KB (same page, other line), + 2 MB (page 1),
// + 2 MB + 64 KB, then A + 0 again (L2 hit). Cycles per load, median over the repeats.
//
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o tlb_latency tlb_latency.cu &&
// ./tlb_latency
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ck.cuh"

constexpr int NP = 5;
__constant__ long long kOff[NP] = {0, 64 << 10, 2 << 20, (2 << 20) + (64 << 10), 0};

__global__ void stream_read(const int4 *w, long long n, int4 *sink) {
    int4 acc = make_int4(0, 0, 0, 0);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const int4 v = __ldcg(w + i);
        acc.x ^= v.x;
        acc.y ^= v.y;
        acc.z ^= v.z;
        acc.w ^= v.w;
    }
    if (acc.x == 0x7fffffff && acc.y == 1) *sink = acc;  // never true for the zeroed buffer
}

__global__ void write_lines(char *a, unsigned *smid) {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    if (threadIdx.x < NP) *(int *)(a + kOff[threadIdx.x]) = 0;
    if (threadIdx.x == 0) *smid = s;
}

// Block `who` probes (the others exit): a dependent chain, each address depends on the value
// loaded before (always 0).
__global__ void probe(const char *a, int who, long long *cyc, unsigned *smid) {
    if (blockIdx.x != who || threadIdx.x != 0) return;
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    int v = 0;
    long long t[NP + 1];
    t[0] = clock64();
#pragma unroll
    for (int p = 0; p < NP; ++p) {
        v = __ldcg((const int *)(a + kOff[p] + v));
        if (v == 0) t[p + 1] = clock64();  // a branch on the loaded value: waits for it
        else t[p + 1] = -1;
    }
    for (int p = 0; p < NP; ++p) cyc[p] = t[p + 1] - t[p];
    *smid = s;
}

int main() {
    const long long WB = 2ll << 30, AB = 8ll << 20;
    char *w, *a;
    int4 *sink;
    long long *cyc;
    unsigned *smid;
    CK(cudaMalloc(&w, WB));
    CK(cudaMalloc(&a, AB));
    CK(cudaMalloc(&sink, 64));
    CK(cudaMalloc(&cyc, 64 * sizeof(long long)));
    CK(cudaMalloc(&smid, 8 * sizeof(unsigned)));
    CK(cudaMemset(w, 0, WB));
    CK(cudaMemset(a, 0, AB));
    int nsm = 0, clk = 0;
    CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0));
    auto stream = [&](long long off, long long bytes) { stream_read<<<nsm * 4, 512>>>((const int4 *)(w + off), bytes / 16, sink); };
    const char *names[] = {"warm", "l2cold", "tlbcold", "written", "written+"};
    const int R = 25;
    std::printf("SM clock %.2f GHz; cycles per dependent load, median of %d\n", clk / 1e6, R);
    std::printf("%-10s %10s %10s %10s %10s %10s   smid probe/writer\n", "case", "A+0", "A+64K", "A+2M", "A+2M+64K", "A+0 again");
    for (int c = 0; c < 5; ++c) {
        std::vector<std::vector<long long>> col(NP);
        unsigned sp = 0, sw = 0;
        for (int r = 0; r < R; ++r) {
            int who = 0;
            if (c == 0) probe<<<1, 32>>>(a, 0, cyc, smid);
            if (c == 1)
                for (int i = 0; i < 8; ++i) stream(0, 256ll << 20);
            if (c >= 2) stream(0, WB);
            if (c >= 3) write_lines<<<1, 32>>>(a, smid + 1);
            if (c == 4) {
                CK(cudaDeviceSynchronize());
                // a probe grid of one block per SM; the block on another SM than the writer
                // probes (block 1 lands on another SM than block 0 in practice; checked below)
                who = 1;
            }
            probe<<<c == 4 ? nsm : 1, 32>>>(a, who, cyc, smid);
            CK(cudaDeviceSynchronize());
            long long h[NP];
            unsigned s[2];
            CK(cudaMemcpy(h, cyc, sizeof(h), cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(s, smid, sizeof(s), cudaMemcpyDeviceToHost));
            for (int p = 0; p < NP; ++p) col[p].push_back(h[p]);
            sp = s[0];
            sw = s[1];
        }
        std::printf("%-10s", names[c]);
        for (int p = 0; p < NP; ++p) {
            std::sort(col[p].begin(), col[p].end());
            std::printf(" %10lld", col[p][R / 2]);
        }
        if (c >= 3) std::printf("   %u/%u", sp, sw);
        std::printf("\n");
    }
    return 0;
}
