// Does the Q8_0A8 weight layout cost the matmuls' weight stream? The repacked layout keeps a
// tile's codes (16 features x 32 k = 512 bytes per block, tile-major) and its f16 scales (32
// bytes per block) in two arrays, so every stage of the split kernels copies, per tile, 4 KB
// of codes and, from elsewhere, 256 bytes of scales: a small read from another DRAM page per
// 4 KB. In the step the 8B paired gate / up streams at ~3.7-3.9 TB/s and the lm_head at ~4.1,
// against a 4.6 TB/s read ceiling (read_bw.cu). Here the kernels' copy pattern without their
// arithmetic: G blocks (B per SM), each W tiles x KS k-slices, S-stage cp.async ring of
// A8_KC = 8 blocks per tile and slice per stage, plus the x codes and scales per stage (one
// small buffer, L2 hits), over these layouts of the same bytes:
//   0 split:   codes [tile][kb][512], scales [tile][kb][32] (the repacked layout)
//   1 stage:   [tile][stage of 8 blocks][4096 codes + 256 scales] (scales beside their codes)
//   2 panel:   [tile][128.. kb x 512 codes, then kb x 32 scales] (a tile's scales after its codes)
//   3 codes:   codes only (what the scales cost at all)
//   4 group:   [group of 4 tiles][stage][4 tiles x (4096 codes + 256 scales)] (a 4-tile block's
//              stage of one slice is one contiguous 17 KB range)
//   5 no x:    layout 0 without the x copies (what re-reading x from L2 costs the stream)
//   6 bare:    codes only, no x (this launch shape's ceiling)
// One launch streams one projection's bytes (as the step: ~25 us at 8B gate / up), each launch
// from another offset of a 2 GiB buffer so nothing is in L2; median of 15, GB/s of the weight
// bytes (codes + scales; layouts 3 and 6: codes + scales as if read, so their rate is the layout's
// ceiling). Interleaved rounds (microbenchmarks here are only compared so, read_bw.cu).
// Twenty-seventh session (docs/bench-gpu-log.md): "stage" streams 2-5% faster than "split" here,
// but the kernels over that layout (branch stage-layout-try) ran the 8B step 0.4-0.8% faster
// and the 27B step 0.3-0.9% slower; the launch shape mattered more: the lm_head's copies in
// 3 blocks of 8 warps per SM (4 x 1 x 3) stream 6% faster than in the 4 x 2 x 2 blocks it ran
// as, and so did the real lm_head (170 -> 165 us alone): Auto's choice since.
// Twenty-eighth session: the 27B down / o and the 8B down with K in two halves across blocks
// (rows below): the 27B down's copies ~15% faster alone (not built into a kernel yet).
//
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o a8_layout a8_layout.cu && ./a8_layout
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "ck.cuh"

static cudaStream_t st;

__device__ __forceinline__ unsigned sa(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cpa(unsigned d, const void *g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(g) : "memory");
}

// Block b: tiles [b W, (b + 1) W), KB blocks per tile, KS slices (slice ks runs chunks ks, ks +
// KS, ...; a chunk = 32 blocks = 4 stages), as a8_ksplit issues them.
template <int S, int LAYOUT>
__global__ void stream(const char *__restrict__ w, int W, int KS, int KB, const char *__restrict__ x, unsigned *sink) {
    extern __shared__ __align__(16) char sm[];
    const int stage_b = KS * (W * 4352 + 4608);
    const int nch = KB / 32, nst = (nch + KS - 1) / KS * 4;
    const long long tiles = (long long)gridDim.x * W;
    const char *scales = w + tiles * KB * 512;  // layout 0: after all codes
    auto issue = [&](int s) {
        const unsigned d0 = sa(sm + (s % S) * stage_b);
        for (int ks = 0; ks < KS; ++ks) {
            const int c = (s / 4) * KS + ks, kb = c * 32 + (s % 4) * 8;
            if (c >= nch) continue;
            const unsigned d = d0 + ks * (W * 4352 + 4608);
            for (int i = threadIdx.x; i < W * 272 + 288; i += blockDim.x) {
                if (i >= W * 272) {  // x: 4608 bytes of one small buffer (L2)
                    if (LAYOUT >= 5) continue;
                    const int o = (i - W * 272) * 16;
                    cpa(d + W * 4352 + o, x + (long long)kb * 576 + o);
                    continue;
                }
                const int tl = i / 272, r = i % 272;  // 256 code copies + 16 scale copies per tile
                const long long t = (long long)blockIdx.x * W + tl;
                const char *g;
                if (LAYOUT == 1) {
                    g = w + (t * (KB / 8) + kb / 8) * 4352 + r * 16;
                } else if (LAYOUT == 4) {
                    g = w + (((t / 4) * (KB / 8) + kb / 8) * 4 + t % 4) * 4352 + r * 16;
                } else if (r < 256) {
                    g = LAYOUT == 2 ? w + t * KB * 544 + (long long)kb * 512 + r * 16 : w + (t * KB + kb) * 512 + r * 16;  // 0, 3, 5, 6
                } else {
                    if (LAYOUT == 3 || LAYOUT == 6) continue;
                    g = LAYOUT == 2 ? w + t * KB * 544 + (long long)KB * 512 + kb * 32 + (r - 256) * 16
                                    : scales + (t * KB + kb) * 32 + (r - 256) * 16;
                }
                cpa(d + tl * 4352 + r * 16, g);
            }
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
        acc ^= ((const unsigned *)(sm + (s % S) * stage_b))[threadIdx.x];
    }
    if (acc == 0x12345678u) *sink = acc;
}

int main() {
    const size_t bytes = 2ull << 30;
    char *buf, *x;
    unsigned *sink;
    CK(cudaMalloc(&buf, bytes));
    CK(cudaMalloc(&x, 1 << 20));
    CK(cudaMalloc(&sink, 4));
    CK(cudaStreamCreate(&st));
    fill_random<<<1024, 256, 0, st>>>((uint4 *)buf, bytes / 16, 1);
    fill_random<<<64, 256, 0, st>>>((uint4 *)x, (1 << 20) / 16, 2);
    CK(cudaStreamSynchronize(st));
    // The step's split launches (matmul.cu A8K / A8KP; backend.rs a8_pair_auto and the Auto
    // rules): name, blocks, threads, W tiles, KS slices, S stages, KB blocks per tile.
    struct Cfg {
        const char *name;
        int blocks, threads, W, KS, S, KB;
    };
    const Cfg cfgs[] = {
        {"8B gate/up (paired 1x3, 3/SM)", 384, 256, 4, 1, 3, 128},
        {"8B down (1,4,3: 2/SM)", 256, 256, 1, 4, 3, 384},
        {"8B lm_head (4,2,2: 2/SM, 9 waves; Auto before)", 2374, 512, 4, 2, 2, 128},
        {"8B lm_head as (4,1,3: 3/SM, 6 waves; Auto now)", 2374, 256, 4, 1, 3, 128},
        {"8B lm_head as (4,4,2: 1/SM, 18 waves)", 2374, 1024, 4, 4, 2, 128},
        {"27B gate/up (paired 1x2, 5/SM)", 544, 256, 4, 1, 2, 160},
        // Twenty-eighth session: the 27B down (320 tiles of 17 chunks: 2.4 blocks per SM in
        // one wave, SMs with 3 ending ~6 us after SMs with 2) and o (320 tiles, 4 chunks) with K
        // cut in two halves across blocks (~4.85 blocks per SM; each half as 9 chunks here).
        {"27B down (1,2,3: 3/SM, 320 blocks; Auto)", 320, 128, 1, 2, 3, 544},
        {"27B down halves (1,1,3: 8/SM, 640 blocks)", 640, 64, 1, 1, 3, 288},
        {"27B down halves (1,1,4: 6/SM, 640 blocks)", 640, 64, 1, 1, 4, 288},
        {"27B down halves (1,2,2: 6/SM, 640 blocks)", 640, 128, 1, 2, 2, 288},
        {"27B down halves (1,2,3: 4/SM, 640 blocks, 2 waves)", 640, 128, 1, 2, 3, 288},
        {"27B o (1,2,3: 3/SM, 320 blocks; Auto)", 320, 128, 1, 2, 3, 128},
        {"27B o halves (1,1,3: 8/SM, 640 blocks)", 640, 64, 1, 1, 3, 64},
        {"8B down (1,4,3) again", 256, 256, 1, 4, 3, 384},
        {"8B down halves (1,2,3: 3/SM, 512 blocks, 1.3 waves)", 512, 128, 1, 2, 3, 192},
        {"8B down halves (1,1,3: 8/SM, 512 blocks)", 512, 64, 1, 1, 3, 192},
    };
    std::printf("| launch | MB | split | stage | panel | codes only | group | split, no x | codes only, no x |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const Cfg &c : cfgs) {
        const size_t wbytes = (size_t)c.blocks * c.W * c.KB * 544;
        const size_t smem = (size_t)c.S * c.KS * (c.W * 4352 + 4608);
        const int ncopies = (int)(bytes / wbytes);
        double gbs[7][3];
        for (int round = 0; round < 3; ++round) {
            for (int lay = 0; lay < 7; ++lay) {
                void (*const fs[3][7])(const char *, int, int, int, const char *, unsigned *) = {
                    {stream<2, 0>, stream<2, 1>, stream<2, 2>, stream<2, 3>, stream<2, 4>, stream<2, 5>, stream<2, 6>},
                    {stream<3, 0>, stream<3, 1>, stream<3, 2>, stream<3, 3>, stream<3, 4>, stream<3, 5>, stream<3, 6>},
                    {stream<4, 0>, stream<4, 1>, stream<4, 2>, stream<4, 3>, stream<4, 4>, stream<4, 5>, stream<4, 6>}};
                auto f = fs[c.S - 2][lay];
                CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
                int k = 0;
                const float ms = median_ms(st, 15, [&] {
                    const char *w = buf + (size_t)(k++ % ncopies) * wbytes;
                    f<<<c.blocks, c.threads, smem, st>>>(w, c.W, c.KS, c.KB, x, sink);
                });
                gbs[lay][round] = wbytes / ms / 1e6;
            }
        }
        std::printf("| %s | %.1f |", c.name, wbytes / 1e6);
        for (int lay = 0; lay < 7; ++lay) std::printf(" %.0f / %.0f / %.0f |", gbs[lay][0], gbs[lay][1], gbs[lay][2]);
        std::printf("\n");
    }
    return 0;
}
