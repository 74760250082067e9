// Does a weight stream get faster when part of its bytes were fetched into L2 just before?
// The draft step's matmuls stream their weights in one wave (block b streams its own tiles,
// contiguous in memory); the L2 prefetch hints tried since the fifth session fetched either the
// leading part of a matrix (whole leading tiles: only the blocks that own them can finish
// early, and the launch ends with its last block) or each tile's leading part. This measures
// the stream alone, after an L2 flush, with a fraction F of its bytes fetched beforehand by a
// finished kernel (no overlap, no queue: the best case for a prefetch):
//   lead F    the first F of the buffer (whole leading block ranges)
//   tile F    the first F of every block's range
// for a 42 MB matrix (the 8B q/k/v) and an 18 MB one (the 8B o projection), the stream as the
// Q8_0A8 matmuls issue it (cp.async 16 bytes, a ring of 32 KB stages, one block
// per SM or two), the prefetch as loads kept with the evict_normal priority.
//
// Measured (fortieth session, NVIDIA H100 80GB HBM3, copy bandwidth ~3040 GB/s; us per
// launch between two events, median of 15, two rounds alike):
//   matrix  blocks  cold   lead 0.25  lead 0.5  tile 0.25  tile 0.5  tile 1.0 (all in L2)
//   18 MB   132     10.2   9.1        8.4       9.4        8.7       7.8
//   18 MB   264     10.4   9.6        9.2       9.6        9.0       8.1
//   42 MB   132     19.1   16.5       15.5      17.2       15.8      14.7-15.1
//   42 MB   264     19.0   16.7       16.2      16.8       15.6      16.3-16.4
// Even a matrix wholly in L2 streams only 21-24% faster this way (one wave of blocks, each
// through 32 KB cp.async stages: the L2-to-SM path and the launch's fixed costs, not HBM,
// set most of its time), and a prefetch of half of it saves 2.3-3.6 us: at most that much per
// latency-bound phase, before the queueing cost `confined.cu` measures for the prefetch
// running beside the phase's kernels. That is the ceiling on what the L2 prefetch hints could
// give the step (they measured slower, bulk or paced).
//
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o l2_warm l2_warm.cu && ./l2_warm
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "ck.cuh"

typedef unsigned long long u64;

__device__ __forceinline__ u64 policy_normal() {
    u64 p;
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(p));
    return p;
}

// The stream: block b takes words [b * per16, (b + 1) * per16), 4 slots of 32 KB. Without an
// L2 hint (with one, as the matmuls issue it, this kernel raised an illegal instruction on an
// H100; not chased): the stream reads each block's prefetched leading part first, so its own
// misses do not evict what it is about to hit.
__global__ void __launch_bounds__(256) stream(const uint4 *__restrict__ src, u64 per16, u64 n16, unsigned *sink) {
    extern __shared__ __align__(16) uint4 ring[];
    constexpr int NS = 4, ST16 = 2048;
    const int tid = threadIdx.x;
    const u64 b0 = (u64)blockIdx.x * per16, b1 = min(n16, b0 + per16);
    const int nst = (int)((b1 - b0 + ST16 - 1) / ST16);
    const unsigned s0 = (unsigned)__cvta_generic_to_shared(ring);
    auto issue = [&](int st) {
        const unsigned sb = s0 + (st % NS) * ST16 * 16;
#pragma unroll
        for (int u = 0; u < ST16 / 256; ++u) {
            const u64 j = b0 + (u64)st * ST16 + tid + u * 256;
            if (j < b1) ck_cp16(sb + (tid + u * 256) * 16, src + j);
        }
    };
    ck_ring_stream<NS, ST16>(nst, ring, issue, sink);
}

// Loads (evict_normal, the data dropped) of the first f of each of `parts` ranges of per16
// words.
__global__ void prefetch(const uint4 *__restrict__ src, u64 per16, int parts, double f, unsigned *sink) {
    const u64 pol = policy_normal();
    unsigned acc = 0;
    const u64 len = (u64)(f * per16);
    const u64 total = len * parts;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 j = (i / len) * per16 + i % len;
        unsigned x, y, z, w;
        asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(x), "=r"(y), "=r"(z), "=r"(w)
                     : "l"(src + j), "l"(pol));
        acc ^= x ^ y ^ z ^ w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

__global__ void flush(const uint4 *__restrict__ p, u64 n16, unsigned *sink) {
    unsigned acc = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n16; i += (u64)gridDim.x * blockDim.x) acc ^= __ldcg(p + i).x;
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    printf("%s: %d SMs, L2 %.1f MB\n", prop.name, sms, prop.l2CacheSize / 1e6);
    const u64 fbytes = 512ull << 20, wmax = 128ull << 20;
    uint4 *fl, *w;
    unsigned *sink;
    CK(cudaMalloc(&fl, fbytes));
    CK(cudaMalloc(&w, wmax));
    CK(cudaMalloc(&sink, 4));
    fill_random<<<1024, 256>>>(fl, fbytes / 16, 1);
    fill_random<<<1024, 256>>>(w, wmax / 16, 2);
    CK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 32768));
    CK(cudaDeviceSynchronize());

    // One trial: flush, optional prefetch (tile: per block range; else the leading part), the
    // timed stream.
    auto trial = [&](u64 bytes, int blocks, double f, bool tile) {
        const u64 n16 = bytes / 16, per16 = (n16 + blocks - 1) / blocks;
        return median_us_after(
            0, 15, 1,
            [&] {
                flush<<<sms * 4, 256>>>(fl, fbytes / 16, sink);
                if (f > 0) {
                    if (tile)
                        prefetch<<<sms * 4, 256>>>(w, per16, blocks, f, sink);
                    else
                        prefetch<<<sms * 4, 256>>>(w, n16, 1, f, sink);
                }
            },
            [&] { stream<<<blocks, 256, 4 * 32768>>>(w, per16, n16, sink); });
    };
    printf("\n| matrix MB | blocks | cold us | lead 0.25 | lead 0.5 | tile 0.25 | tile 0.5 | tile 1.0 |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int round = 0; round < 2; ++round) {
        for (u64 mb : {18ull, 42ull}) {
            for (int bl : {sms, 2 * sms}) {
                const u64 b = mb << 20;
                printf("| %llu | %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", mb, bl, trial(b, bl, 0, false),
                       trial(b, bl, 0.25, false), trial(b, bl, 0.5, false), trial(b, bl, 0.25, true), trial(b, bl, 0.5, true),
                       trial(b, bl, 1.0, true));
            }
        }
    }
    return 0;
}
