// Does re-reading the activation from L2 slow the weight stream? The Q8_0A8 split kernels
// with one 16-feature tile per block (the 8B q/k/v, o and down projections) copy, per stage
// and k-slice, 4352 bytes of weights (HBM, read once) and 4608 bytes of x codes and scales
// (one small buffer that every block reads whole: L2 hits). So L2 delivers ~2x the weight
// bytes to the SMs there, against ~1.26x for the 4-tile gate / up and lm_head blocks, which
// run nearer the copy bandwidth. Here each block streams its own range of a 2 GiB buffer
// through an S-stage cp.async ring, as those kernels do, and per stage also copies xst bytes
// of one shared x buffer (wrapping; every block starts at its beginning, as the matmul's
// blocks do): the weight GB/s against xst, with the x copies through L2 only (.cg, as the
// kernels copy now) or allocated in L1 too (.ca: the blocks on one SM read the same x at
// about the same time, so the second may hit in L1). The weights are copied without the
// kernels' evict-first L2 hint: with it this nvcc build stopped with an illegal instruction
// (not looked into; the NVRTC-built kernels use the hint).
//
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o l2_mix l2_mix.cu && ./l2_mix
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "ck.cuh"

typedef unsigned long long u64;

static cudaStream_t st;

__device__ __forceinline__ unsigned sa(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

// Block b: weights [b nst wst, (b + 1) nst wst) of w in stages of wst bytes, and per stage xst bytes
// of x at (stage * xst) mod xlen; x through L1 (XCA) or L2 only.
template <int S, bool XCA>
__global__ void mix(const char *__restrict__ w, int nst, int wst, const char *__restrict__ x, int xlen, int xst,
                    unsigned *sink) {
    extern __shared__ __align__(16) char sm[];
    const char *base = w + (size_t)blockIdx.x * nst * wst;
    const int stb = wst + xst;
    auto issue = [&](int s) {
        const char *g = base + (size_t)s * wst;
        const unsigned d = sa(sm + (s % S) * stb);
        for (int o = threadIdx.x * 16; o < wst; o += blockDim.x * 16)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d + o), "l"(g + o) : "memory");
        const char *gx = x + (size_t)s * xst % xlen;
        for (int o = threadIdx.x * 16; o < xst; o += blockDim.x * 16) {
            if (XCA)
                asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(d + wst + o), "l"(gx + o) : "memory");
            else
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d + wst + o), "l"(gx + o) : "memory");
        }
    };
    for (int s = 0; s < S - 1; ++s) {
        if (s < nst) issue(s);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    unsigned acc = 0;
    for (int s = 0; s < nst; ++s) {
        asm volatile("cp.async.wait_group %0;" ::"n"(S - 2) : "memory");
        __syncthreads();
        if (s + S - 1 < nst) issue(s + S - 1);
        asm volatile("cp.async.commit_group;" ::: "memory");
        acc ^= ((const unsigned *)(sm + (s % S) * stb))[threadIdx.x];
    }
    if (acc == 0x12345678u) *sink = acc;
}

template <class F>
static float time_ms(F f) {
    return median_ms(st, 7, f);
}

int main() {
    const size_t bytes = 2ull << 30;
    char *buf, *x;
    unsigned *sink;
    // x as the 8B down projection's activation: 16 x 12288 codes + 384 x 16 f32 scales.
    const int xlen = 16 * 12288 + 12288 / 32 * 16 * 4;
    CK(cudaMalloc(&buf, bytes));
    CK(cudaMalloc(&x, xlen));
    CK(cudaMalloc(&sink, 4));
    CK(cudaStreamCreate(&st));
    fill_random<<<1024, 256, 0, st>>>((uint4 *)buf, bytes / 16, 1);
    fill_random<<<64, 256, 0, st>>>((uint4 *)x, xlen / 16, 2);
    CK(cudaStreamSynchronize(st));
    int nsm = 0;
    CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    std::printf("| blocks per SM x threads | weight B / stage | x B / stage | x copy | weights GB/s | x GB/s | L2 -> SM GB/s |\n");
    std::printf("|---|---:|---:|---|---:|---:|---:|\n");
    // (blocks per SM, threads, weight bytes per stage, x bytes per stage at ratio 1): the 8B
    // o / down blocks (Split(1, 4, 3): 4 slices x 4352 / 4608, 2 per SM, 8 warps) and the
    // q/k/v blocks (Split(1, 2, 3): 2 slices, 3 per SM, 4 warps).
    struct Cfg {
        int bps, thr, wst, xst;
    };
    for (const Cfg c : {Cfg{2, 256, 4 * 4352, 4 * 4608}, Cfg{3, 128, 2 * 4352, 2 * 4608}}) {
        for (int xq : {0, 1, 2, 4, 5}) {  // x bytes per stage in quarters of c.xst (5: x only, no weights)
            const int xst = xq == 5 ? c.xst : c.xst * xq / 4;
            const int wst = xq == 5 ? 0 : c.wst;
            for (int ca = 0; ca < (xq == 0 ? 1 : 2); ++ca) {
                const int S = 3;
                const size_t smem = (size_t)S * (wst + xst);
                const int nb = nsm * c.bps;
                // Weight range per block; x-only runs stream as many stages as the 1.0 run.
                const int wst_t = wst > 0 ? wst : c.wst;
                const size_t wlen = bytes / nb / wst_t * wst_t;
                auto f = ca ? mix<3, true> : mix<3, false>;
                CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
                const int nst = (int)(wlen / wst_t);
                const float ms = time_ms([&] { f<<<nb, c.thr, smem, st>>>(buf, nst, wst, x, xlen, xst, sink); });
                const double wb = (double)nb * nst * wst, xb = (double)nb * nst * xst;
                std::printf("| %d x %d | %d | %d | %s | %.0f | %.0f | %.0f |\n", c.bps, c.thr, wst, xst, xq == 0 ? "-" : ca ? "ca" : "cg",
                            wb / ms / 1e6, xb / ms / 1e6, (wb + xb) / ms / 1e6);
            }
        }
    }
    return 0;
}
