// How fast can the H200 READ from HBM, against the copy bandwidth the bench's floor uses
// (cuMemcpyDtoD, bytes read + written)? The drafter step is almost all weight reads; if a
// read-only stream runs faster than the copy, the floor has room the copy does not show.
// Variants, each over a 2 GiB buffer of random bytes (far past the 60 MB L2), median of 9:
//   copy      cudaMemcpyAsync device to device of 1 GiB, (read + write) / time
//   ldg       16-byte ld.global.nc per thread, U loads in flight, grid-stride over the buffer
//   cpasync   each block streams one contiguous range through an S-stage ring of 16-byte
//             cp.async.cg copies into shared memory (the Q8_0A8 matmuls' pattern)
//   bulk      each block streams one contiguous range through an S-stage ring of
//             cp.async.bulk copies (the TMA unit), one mbarrier per stage
// each at several blocks per SM, and the per-SM rates on part of the chip (how much one SM
// can pull when few SMs stream, as in the step's small kernels); then the copy pattern of the
// streamed lm_head tried in the twenty-second session (branch stream-try) with no arithmetic,
// and rings refilled by a producer warp through `empty` mbarriers (ring_pattern, ring2).
// `./read_bw order` times the producer-warp ring and the bulk ring alone, interleaved (in the
// full run, after the other variants, the producer-warp rings measured ~25% slower than alone:
// docs/bench-gpu-log.md); `./read_bw ncu` launches the two once each, for ncu.
//
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o read_bw read_bw.cu && ./read_bw
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ck.cuh"

typedef unsigned long long u64;

template <int U>
__global__ void ldg(const uint4 *__restrict__ p, size_t n, unsigned *sink) {
    unsigned acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + (U - 1) * stride < n; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = __ldg(p + i + u * stride);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) acc ^= __ldg(p + i).x;
    if (acc == 0x12345678u) *sink = acc;
}

__device__ __forceinline__ unsigned sa(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

// Block b streams bytes [b len, (b + 1) len) in stages of STB bytes, 16 per thread per copy.
template <int S>
__global__ void cpasync(const char *__restrict__ p, size_t len, int stb, unsigned *sink) {
    extern __shared__ __align__(16) char sm[];
    const char *base = p + blockIdx.x * len;
    const int nst = (int)(len / stb);
    const int per = stb / 16 / blockDim.x;
    auto issue = [&](int st) {
        const char *g = base + (size_t)st * stb;
        const unsigned s = sa(sm + (st % S) * stb);
        for (int u = 0; u < per; ++u) {
            const int o = (threadIdx.x + u * blockDim.x) * 16;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s + o), "l"(g + o) : "memory");
        }
    };
    for (int s = 0; s < S - 1; ++s) {
        if (s < nst) issue(s);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    unsigned acc = 0;
    for (int st = 0; st < nst; ++st) {
        asm volatile("cp.async.wait_group %0;" ::"n"(S - 2) : "memory");
        __syncthreads();
        if (st + S - 1 < nst) issue(st + S - 1);
        asm volatile("cp.async.commit_group;" ::: "memory");
        acc ^= ((const unsigned *)(sm + (st % S) * stb))[threadIdx.x];
    }
    if (acc == 0x12345678u) *sink = acc;
}

__device__ __forceinline__ void mbar_init(unsigned a, int n) { asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(a), "r"(n)); }
__device__ __forceinline__ void mbar_expect(unsigned a, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned a, unsigned phase) {
    asm volatile(
        "{ .reg .pred p; W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1; @!p bra W; }" ::"r"(a), "r"(phase)
        : "memory");
}
// The same wait through test_wait (never suspends the thread) instead of try_wait.
__device__ __forceinline__ void mbar_wait_test(unsigned a, unsigned phase) {
    asm volatile(
        "{ .reg .pred p; T: mbarrier.test_wait.parity.shared.b64 p, [%0], %1; @!p bra T; }" ::"r"(a), "r"(phase)
        : "memory");
}
__device__ __forceinline__ void bulk(unsigned dst, const void *src, unsigned bytes, unsigned mbar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src),
                 "r"(bytes), "r"(mbar)
                 : "memory");
}

template <int S>
__global__ void bulkread(const char *__restrict__ p, size_t len, int stb, unsigned *sink) {
    extern __shared__ __align__(128) char sm[];
    __shared__ __align__(8) u64 bar[S];
    const char *base = p + blockIdx.x * len;
    const int nst = (int)(len / stb);
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) mbar_init(sa(&bar[s]), 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int st) {
        const int slot = st % S;
        mbar_expect(sa(&bar[slot]), (unsigned)stb);
        bulk(sa(sm + slot * stb), base + (size_t)st * stb, (unsigned)stb, sa(&bar[slot]));
    };
    if (threadIdx.x == 0)
        for (int s = 0; s < S && s < nst; ++s) issue(s);
    unsigned acc = 0;
    for (int st = 0; st < nst; ++st) {
        const int slot = st % S;
        mbar_wait(sa(&bar[slot]), (unsigned)((st / S) & 1));
        acc ^= ((const unsigned *)(sm + slot * stb))[threadIdx.x];
        __syncthreads();
        if (threadIdx.x == 0 && st + S < nst) issue(st + S);
    }
    if (acc == 0x12345678u) *sink = acc;
}

// The streaming Q8_0A8 kernel's copy pattern without its arithmetic: a producer warp fills an
// S-slot ring, 16 consumer warps wait for each slot, touch it and release it (full / empty
// mbarriers, as a8_stream). Block b streams 72 "tiles" of 64 KB codes + 4 KB scales (the 8B
// lm_head's share per SM) in rounds of 8 tiles, one stage = 8 blocks of 32 per tile:
//   mode 0: per stage 8 copies of 4 KB (one per tile, 64 KB apart) + 8 of 256 B (scales), as
//           a8_stream reads the tile-major layout
//   mode 1: per stage one contiguous copy of 34816 B (a stage-major layout)
//   mode 2: per stage 8 copies of 4352 B (codes and scales of a tile's stage side by side)
template <int S, int MODE, int WAIT>
__global__ void __launch_bounds__(544, 1) ring_pattern(const char *__restrict__ codes, const char *__restrict__ scales, int tiles_per_block,
                                                       unsigned *sink) {
    extern __shared__ __align__(128) char sm[];
    __shared__ __align__(8) u64 bars[2 * S];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nsr = 16, nround = tiles_per_block / 8, nst = nround * nsr;
    constexpr int STAGE = 8 * 8 * 544;
    const long long tile0 = (long long)blockIdx.x * tiles_per_block;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(sa(&bars[s]), 1);
            mbar_init(sa(&bars[S + s]), WAIT == 2 ? 1 : 16);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == 16) {
        if (lane == 0) {
            for (int st = 0; st < nst; ++st) {
                const int slot = st % S, r = st / nsr, sidx = st % nsr;
                if (st >= S) mbar_wait(sa(&bars[S + slot]), (unsigned)((st / S - 1) & 1));
                const unsigned full = sa(&bars[slot]), base = sa(sm + slot * STAGE);
                mbar_expect(full, STAGE);
                if (MODE == 1) {
                    bulk(base, codes + (((tile0 + r * 8) / 8) * 16 + sidx) * (long long)STAGE, STAGE, full);
                } else {
                    for (int i = 0; i < 8; ++i) {
                        const long long t = tile0 + r * 8 + i;
                        if (MODE == 0) {
                            bulk(base + i * 4096, codes + (t * 128 + sidx * 8) * 512, 4096, full);
                            bulk(base + 32768 + i * 256, scales + (t * 128 + sidx * 8) * 32, 256, full);
                        } else {
                            bulk(base + i * 4352, codes + (t * 16 + sidx) * 4352ll, 4352, full);
                        }
                    }
                }
            }
        }
        return;
    }
    // WAIT 0: every lane spins on the full barrier; 1: lane 0 of each warp spins, then
    // __syncwarp; 2: thread 0 spins, then a named barrier over the 16 consumer warps (and one
    // arrival on the empty barrier, whose count is then 1: see the init below).
    unsigned acc = 0;
    for (int st = 0; st < nst; ++st) {
        const int slot = st % S;
        if (WAIT == 0) {
            mbar_wait(sa(&bars[slot]), (unsigned)((st / S) & 1));
        } else if (WAIT == 1) {
            if (lane == 0) mbar_wait(sa(&bars[slot]), (unsigned)((st / S) & 1));
            __syncwarp();
        } else {
            if (threadIdx.x == 0) mbar_wait(sa(&bars[slot]), (unsigned)((st / S) & 1));
            asm volatile("bar.sync 1, 512;" ::: "memory");
        }
        acc ^= ((const unsigned *)(sm + slot * STAGE))[warp * 32 + lane];
        if (WAIT == 2) {
            asm volatile("bar.sync 1, 512;" ::: "memory");
            if (threadIdx.x == 0) asm volatile("mbarrier.arrive.shared.b64 _, [%0];" ::"r"(sa(&bars[S + slot])) : "memory");
        } else {
            __syncwarp();
            if (lane == 0) asm volatile("mbarrier.arrive.shared.b64 _, [%0];" ::"r"(sa(&bars[S + slot])) : "memory");
        }
    }
    if (acc == 0x12345678u) *sink = acc;
}

// The same ring with a contiguous stage of STAGE bytes per block and CW consumer warps (what
// sets the rate: the warps, the stage size, or the protocol).
template <int S, int CW, int STAGE, int WT = 0>
__global__ void __launch_bounds__(32 * (CW + 1), 1) ring2(const char *__restrict__ p, int nst, unsigned *sink) {
    extern __shared__ __align__(128) char sm[];
    __shared__ __align__(8) u64 bars[2 * S];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const char *base = p + (long long)blockIdx.x * nst * STAGE;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(sa(&bars[s]), 1);
            mbar_init(sa(&bars[S + s]), CW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int pw = (WT & 4) ? 0 : CW;  // the producer warp
    if (warp == pw) {
        if (lane == 0)
            for (int st = 0; st < nst; ++st) {
                const int slot = st % S;
                if (st >= S) {
                    if (WT & 1) mbar_wait_test(sa(&bars[S + slot]), (unsigned)((st / S - 1) & 1));
                    else mbar_wait(sa(&bars[S + slot]), (unsigned)((st / S - 1) & 1));
                }
                mbar_expect(sa(&bars[slot]), STAGE);
                bulk(sa(sm + slot * STAGE), base + (long long)st * STAGE, STAGE, sa(&bars[slot]));
            }
        return;
    }
    unsigned acc = 0;
    for (int st = 0; st < nst; ++st) {
        const int slot = st % S;
        if (WT & 2) mbar_wait_test(sa(&bars[slot]), (unsigned)((st / S) & 1));
        else mbar_wait(sa(&bars[slot]), (unsigned)((st / S) & 1));
        acc ^= ((const unsigned *)(sm + slot * STAGE))[(warp % CW) * 32 + lane];
        __syncwarp();
        if (lane == 0) asm volatile("mbarrier.arrive.shared.b64 _, [%0];" ::"r"(sa(&bars[S + slot])) : "memory");
    }
    if (acc == 0x12345678u) *sink = acc;
}

static cudaStream_t st;

template <class F>
static float time_ms(F f) {
    return median_ms(st, 9, f);
}

int main(int argc, char **argv) {
    // "ncu": the two rings below, one launch each (for the profiler); "order": they alone, timed.
    const bool ncu = argc > 1 && (std::string(argv[1]) == "ncu" || std::string(argv[1]) == "order");
    const size_t bytes = 2ull << 30;
    char *buf, *dst;
    unsigned *sink;
    CK(cudaMalloc(&buf, bytes));
    CK(cudaMalloc(&dst, bytes / 2));
    CK(cudaMalloc(&sink, 4));
    CK(cudaStreamCreate(&st));
    fill_random<<<1024, 256, 0, st>>>((uint4 *)buf, bytes / 16, 1);
    fill_random<<<1024, 256, 0, st>>>((uint4 *)dst, bytes / 32, 2);
    CK(cudaStreamSynchronize(st));
    int nsm = 0;
    CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    if (ncu) {
        const int stb = 16384, nb = nsm;
        const size_t len = bytes / nb / stb * stb;
        CK(cudaFuncSetAttribute(bulkread<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * stb));
        CK(cudaFuncSetAttribute(ring2<4, 1, 16384>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * stb));
        if (std::string(argv[1]) == "ncu") {
            bulkread<4><<<nb, 256, 4 * stb, st>>>(buf, len, stb, sink);
            ring2<4, 1, 16384><<<nb, 64, 4 * stb, st>>>(buf, (int)(len / stb), sink);
            CK(cudaStreamSynchronize(st));
            return 0;
        }
        // "order": the two rings event-timed first thing, in turn (is the harness's ring2 figure
        // a property of the kernel or of what ran before it?).
        for (int r = 0; r < 3; ++r) {
            const float a = time_ms([&] { ring2<4, 1, 16384><<<nb, 64, 4 * stb, st>>>(buf, (int)(len / stb), sink); });
            const float b = time_ms([&] { bulkread<4><<<nb, 256, 4 * stb, st>>>(buf, len, stb, sink); });
            std::printf("| order round %d: ring2 / bulkread | 1/SM | %.0f / %.0f |\n", r, (double)len * nb / a / 1e6,
                        (double)len * nb / b / 1e6);
        }
        return 0;
    }
    std::printf("| variant | blocks | GB/s |\n|---|---:|---:|\n");
    {
        const float ms = time_ms([&] { CK(cudaMemcpyAsync(dst, buf, bytes / 2, cudaMemcpyDeviceToDevice, st)); });
        std::printf("| copy 1 GiB (read + write) | | %.0f |\n", 2.0 * (bytes / 2) / ms / 1e6);
    }
    for (int bps : {1, 2, 4, 8})
        for (int thr : {256, 512}) {
            if (bps * thr > 2048) continue;
            const float ms = time_ms([&] { ldg<4><<<nsm * bps, thr, 0, st>>>((const uint4 *)buf, bytes / 16, sink); });
            const float ms8 = time_ms([&] { ldg<8><<<nsm * bps, thr, 0, st>>>((const uint4 *)buf, bytes / 16, sink); });
            std::printf("| ldg x4 / x8, %d threads | %d/SM | %.0f / %.0f |\n", thr, bps, bytes / ms / 1e6, bytes / ms8 / 1e6);
        }
    // Contiguous ranges per block (the matmuls' pattern).
    for (int bps : {1, 2, 3, 4}) {
        for (int stb : {8192, 16384, 32768}) {
            for (int S : {3, 4, 6}) {
                const size_t smem = (size_t)S * stb;
                if (smem * bps > 220 * 1024) continue;
                const int nb = nsm * bps;
                const size_t len = bytes / nb / stb * stb;
                auto f = S == 3 ? cpasync<3> : S == 4 ? cpasync<4> : cpasync<6>;
                CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
                const float ms = time_ms([&] { f<<<nb, 256, smem, st>>>(buf, len, stb, sink); });
                auto g = S == 3 ? bulkread<3> : S == 4 ? bulkread<4> : bulkread<6>;
                CK(cudaFuncSetAttribute(g, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
                const float mb = time_ms([&] { g<<<nb, 256, smem, st>>>(buf, len, stb, sink); });
                std::printf("| cp.async / bulk, %d KB x %d stages | %d/SM | %.0f / %.0f |\n", stb / 1024, S, bps,
                            (double)len * nb / ms / 1e6, (double)len * nb / mb / 1e6);
            }
        }
    }
    // The streaming kernel's pattern, 132 blocks x 72 tiles (the 8B lm_head: 9504 tiles of
    // 68 KB = 646 MB), codes and scales in two arrays as the Q8_0A8 layout (mode 0).
    {
        const int tpb = 72, nb = nsm;
        const size_t code_b = (size_t)nb * tpb * 65536, scale_b = (size_t)nb * tpb * 4096;
        if (code_b + scale_b <= bytes) {
            const char *codes = buf, *scales = buf + code_b;
            for (int mode = 0; mode < 2; ++mode)
                for (int wt = 0; wt < 3; ++wt) {
                    const int S = 4;
                    auto f = mode == 0 ? (wt == 0 ? ring_pattern<4, 0, 0> : wt == 1 ? ring_pattern<4, 0, 1> : ring_pattern<4, 0, 2>)
                                       : (wt == 0 ? ring_pattern<4, 1, 0> : wt == 1 ? ring_pattern<4, 1, 1> : ring_pattern<4, 1, 2>);
                    const int smem = S * 8 * 8 * 544;
                    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                    const float ms = time_ms([&] { f<<<nb, 544, smem, st>>>(codes, scales, tpb, sink); });
                    const float ms3 = time_ms([&] {
                        for (int i = 0; i < 3; ++i) f<<<nb, 544, smem, st>>>(codes, scales, tpb, sink);
                    });
                    std::printf("| a8_stream pattern mode %d, wait %d, %d slots of 34 KB (1 launch / 3 back to back) | 1/SM | %.0f / %.0f |\n", mode, wt, S,
                                (double)(code_b + scale_b) / ms / 1e6, 3.0 * (code_b + scale_b) / ms3 / 1e6);
                }
        }
    }
    // The simple ring (bulkread, thread 0 refills after a block barrier) over the same 662 MB.
    {
        const int nb = nsm, stb = 16384;
        const size_t len = (size_t)72 * 69632 / stb * stb;
        CK(cudaFuncSetAttribute(bulkread<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * stb));
        const float mb = time_ms([&] { bulkread<4><<<nb, 256, 4 * stb, st>>>(buf, len, stb, sink); });
        std::printf("| bulk 16 KB x 4 over 662 MB (one launch) | 1/SM | %.0f |\n", (double)len * nb / mb / 1e6);
    }
    // ring2: consumer warps x stage size, 2 GB per launch (no size effect), 4 slots.
    {
        const int nb = nsm;
        auto run_cw = [&](auto f, int cw, int stage, const char *name) {
            const int nst = (int)(bytes / nb / stage);
            CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * stage));
            const float ms = time_ms([&] { f<<<nb, 32 * (cw + 1), 4 * stage, st>>>(buf, nst, sink); });
            std::printf("| ring2 %s | 1/SM | %.0f |\n", name, (double)nst * stage * nb / ms / 1e6);
        };
        run_cw(ring2<4, 1, 16384>, 1, 16384, "1 consumer warp, 16 KB stages");
        run_cw(ring2<4, 8, 16384>, 8, 16384, "8 consumer warps, 16 KB stages");
        run_cw(ring2<4, 16, 16384>, 16, 16384, "16 consumer warps, 16 KB stages");
        run_cw(ring2<4, 1, 34816>, 1, 34816, "1 consumer warp, 34 KB stages");
        run_cw(ring2<4, 8, 34816>, 8, 34816, "8 consumer warps, 34 KB stages");
        run_cw(ring2<4, 16, 34816>, 16, 34816, "16 consumer warps, 34 KB stages");
        run_cw(ring2<4, 16, 32768>, 16, 32768, "16 consumer warps, 32 KB stages");
        run_cw(ring2<4, 16, 34816, 1>, 16, 34816, "16 consumer warps, 34 KB stages, producer test_wait");
        run_cw(ring2<4, 16, 34816, 2>, 16, 34816, "16 consumer warps, 34 KB stages, consumers test_wait");
        run_cw(ring2<4, 16, 34816, 3>, 16, 34816, "16 consumer warps, 34 KB stages, both test_wait");
        run_cw(ring2<4, 1, 16384, 3>, 1, 16384, "1 consumer warp, 16 KB stages, both test_wait");
        run_cw(ring2<4, 16, 34816, 4>, 16, 34816, "16 consumer warps, 34 KB stages, producer = warp 0");
        run_cw(ring2<4, 1, 16384, 4>, 1, 16384, "1 consumer warp, 16 KB stages, producer = warp 0");
        const int stb = 16384;
        const size_t len = bytes / nb / stb * stb;
        CK(cudaFuncSetAttribute(bulkread<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * stb));
        const float m5 = time_ms([&] { bulkread<4><<<nb, 512, 4 * stb, st>>>(buf, len, stb, sink); });
        std::printf("| bulk 16 KB x 4, 512 threads | 1/SM | %.0f |\n", (double)len * nb / m5 / 1e6);
    }
    // Part of the chip: per-SM rates.
    for (int nb : {8, 16, 33, 66, 99}) {
        const int stb = 16384, S = 6;
        const size_t smem = (size_t)S * stb;
        const size_t len = (256ull << 20) / nb / stb * stb;
        CK(cudaFuncSetAttribute(bulkread<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        CK(cudaFuncSetAttribute(cpasync<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        const float mc = time_ms([&] { cpasync<6><<<nb, 256, smem, st>>>(buf, len, stb, sink); });
        const float mb = time_ms([&] { bulkread<6><<<nb, 256, smem, st>>>(buf, len, stb, sink); });
        std::printf("| %d SMs, cp.async / bulk 16 KB x 6, GB/s per SM | %d | %.1f / %.1f |\n", nb, nb, (double)len / mc / 1e6,
                    (double)len / mb / 1e6);
    }
    return 0;
}
