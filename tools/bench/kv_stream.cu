// How fast can the drafter's attention read its f16 K / V cache at a long context, with no
// arithmetic? The FA kernel (attn_fa16kv_*) takes ~19-22 us in the step for the 8B shape at
// ctx 8192 (34 MB of K / V, 8 us at the copy bandwidth). This streams the same bytes the same
// way (one block per (split, kv head), 64-key chunks of 256-byte rows copied by cp.async into a
// pipeline of shared-memory stages, one barrier per chunk), nothing computed, under:
//   layout   the cache's [key][kv head][d] rows (a block reads 256 B of every 2 KB), or
//            head-major [kv head][key][d] (a block reads one contiguous range)
//   splits   15 (one block per SM, as the FA kernel) or 33 (two per SM)
//   stages   2-4
// Each timing: a CUDA graph of 20 calls over 4 copies of the cache in turn (136 MB, so each
// call reads from HBM), us per call, median of 7 replays.
//
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o kv_stream kv_stream.cu && ./kv_stream
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ck.cuh"

constexpr int D = 128, HKV = 8, CKEYS = 64, PH = D + 8;

__device__ __forceinline__ void cp16(unsigned sa, const void *g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(g));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait_n() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// grid (splits, HKV), 128 threads; headmajor: element (h, j, d) at (h n_kv + j) D + d, else
// (j HKV + h) D + d.
template <int NST>
__global__ void __launch_bounds__(128) kv_stream(const unsigned short *k, const unsigned short *v, int n_kv, int split_keys,
                                                 int headmajor, float *sink) {
    extern __shared__ __align__(16) unsigned short sm[];
    const int split = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const long long j0 = (long long)split * split_keys;
    const int nch = (int)((min((long long)n_kv, j0 + split_keys) - j0 + CKEYS - 1) / CKEYS);
    const int kk0 = tid / 16, d8 = (tid % 16) * 8;  // 16 threads per 256-byte row, 8 rows per pass
    const unsigned tile = CKEYS * PH * 2;
    auto load = [&](int c, int slot) {
        const unsigned base = (unsigned)__cvta_generic_to_shared(sm) + (unsigned)slot * 2 * tile;
        for (int kk = kk0; kk < CKEYS; kk += 8) {
            const long long j = j0 + (long long)c * CKEYS + kk;
            if (j >= n_kv) continue;
            const long long off = headmajor ? ((long long)h * n_kv + j) * D + d8 : (j * HKV + h) * D + d8;
            const unsigned sa = base + (unsigned)(kk * PH + d8) * 2;
            cp16(sa, k + off);
            cp16(sa + tile, v + off);
        }
    };
    for (int p = 0; p < NST - 1; ++p) {
        if (p < nch) load(p, p);
        commit();
    }
    float acc = 0.0f;
    for (int c = 0, slot = 0; c < nch; ++c, slot = slot + 1 == NST ? 0 : slot + 1) {
        wait_n<NST - 2>();
        __syncthreads();
        const int f = c + NST - 1;
        if (f < nch) load(f, f % NST);
        commit();
        acc += (float)sm[slot * 2 * CKEYS * PH + (tid % CKEYS) * PH + tid / CKEYS];
    }
    if (acc == 12345.0f) *sink = acc;
}

int main() {
    const int n_kv = 8208;
    const size_t n = (size_t)n_kv * HKV * D;
    constexpr int NC = 4;
    unsigned short *k[NC], *v[NC];
    float *sink;
    for (int c = 0; c < NC; ++c) {
        CK(cudaMalloc(&k[c], n * 2));
        CK(cudaMalloc(&v[c], n * 2));
        CK(cudaMemset(k[c], 1, n * 2));
        CK(cudaMemset(v[c], 1, n * 2));
    }
    CK(cudaMalloc(&sink, 4));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    int nsm = 0;
    CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    for (auto f : {kv_stream<2>, kv_stream<3>, kv_stream<4>})
        CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 2 * CKEYS * PH * 2));
    std::printf("K / V %.1f MB x %d copies, %d SMs; us per call (graph of 20)\n", 2.0 * n * 2 / 1e6, NC, nsm);
    std::printf("| layout | splits | stages | us | GB/s |\n|---|---:|---:|---:|---:|\n");
    for (int hm = 0; hm < 2; ++hm)
        for (int splits : {15, 33})
            for (int nst = 2; nst <= 4; ++nst) {
                const int sk = ((n_kv + splits - 1) / splits + 63) / 64 * 64;
                const int ns = (n_kv + sk - 1) / sk;
                auto f = nst == 2 ? kv_stream<2> : nst == 3 ? kv_stream<3> : kv_stream<4>;
                const size_t smem = (size_t)nst * 2 * CKEYS * PH * 2;
                cudaGraph_t g;
                cudaGraphExec_t ge;
                CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                for (int i = 0; i < 20; ++i) f<<<dim3(ns, HKV), 128, smem, st>>>(k[i % NC], v[i % NC], n_kv, sk, hm, sink);
                CK(cudaStreamEndCapture(st, &g));
                CK(cudaGraphInstantiate(&ge, g, 0));
                std::vector<float> t;
                cudaEvent_t a, b;
                CK(cudaEventCreate(&a));
                CK(cudaEventCreate(&b));
                for (int r = 0; r < 7; ++r) {
                    CK(cudaEventRecord(a, st));
                    CK(cudaGraphLaunch(ge, st));
                    CK(cudaEventRecord(b, st));
                    CK(cudaStreamSynchronize(st));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, a, b));
                    t.push_back(ms * 1000.0f / 20.0f);
                }
                std::sort(t.begin(), t.end());
                const float us = t[3];
                std::printf("| %s | %d (%d blocks) | %d | %.2f | %.0f |\n", hm ? "head-major" : "[key][head][d]", ns, ns * HKV, nst, us,
                            2.0 * n * 2 / (us * 1e3));
            }
    return 0;
}
