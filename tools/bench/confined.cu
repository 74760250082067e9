// Can the weight stream go on during the draft step's latency-bound kernels if those kernels
// keep to a few SMs of their own? The step's norms, q/k norm, attention and combine leave the
// memory idle for ~135 us at the 8B shape on the H200 (bench-gpu.md, the timeline); the
// fifteenth session found that the next matmul's weight prefetch, issued from the SMs those
// kernels run on, delays their loads by more than it saves. This measures the other placement:
// the latency-bound kernel S on nbS SMs that it reserves (dynamic shared memory no other block
// fits beside), a weight stream B on every other SM at the same time.
//
//   S  nbS blocks of 256 threads, R dependent rounds: 16 KB of loads per block (the next
//      round's address depends on the last round's block sum), a block reduction, a store; the
//      loads hit L2 (a 4 MB buffer read just before, as a norm reads the residual its producer
//      wrote) or HBM (a 1 GiB buffer, a new range each round and repetition)
//   B  one block per SM it gets, each streaming its own contiguous range through a ring of
//      cp.async 16-byte copies into shared memory (6 x 32 KB, evict-first in L2: the Q8_0A8
//      matmuls' pattern), long enough to cover S
// Modes (S's time between two events on its stream, after B has streamed for 15 us; median of
// 25):
//   alone       S with the SMs to itself
//   +B apart    B on the 132 - nbS SMs that S does not hold (S reserves 200 KB per block)
//   +B beside   B on all 132 SMs with a 3 x 32 KB ring, S's blocks beside its blocks (the
//               placement the fifteenth session measured)
// and B's own rate alone and during S.
//
// Measured (fortieth session, NVIDIA H100 80GB HBM3, copy bandwidth ~3040 GB/s; us, S = 16
// blocks): S alone 3.7 (1 round from L2), 5.0 (4 rounds from L2), 7.0 (4 rounds from HBM).
// With B apart on the other 116 SMs, by B's bytes in flight (blocks x (slots - 1) x 32 KB):
//   in flight  B alone GB/s  S 1 round L2  S 4 rounds L2  S 4 rounds HBM
//   1.0 MB     1388          3.97          5.50           6.88
//   1.9 MB     2235-2371     4.00-4.13     5.50-5.73      6.85-7.30
//   3.8 MB     3136-3137     4.38-4.42     6.43-6.46      8.70-8.90
//   5.7 MB     3173          5.66          9.09           12.61
//   7.6 MB     3185          11.74         17.02          20.99
//   11.4 MB    3109          18.53         27.20          30.88
//   19.0 MB    3105          27.10         44.00          46.78
// B beside S on all 132 SMs: 2 slots (4.3 MB) 4.67 / 7.26, 3 slots (8.7 MB) 14.59 / 21.76.
// So a stream needs only ~3.8 MB in flight for the whole copy bandwidth, and every byte in
// flight beyond that is queue that a latency-bound kernel's loads wait behind (an L2 hit ~1.3
// us per MB past the bandwidth-delay product), wherever the stream runs: apart or beside makes
// little difference. Keeping S's SMs free of the stream does not help; keeping the stream's
// bytes in flight near 4 MB does (S +0.7 us per round). The same pacing applied to the
// library's L2 prefetch hints (branch l2-paced-prefetch-try) still made the step slower (8B
// 0.704 -> 0.730-0.745 ms at ctx 512, 27B 1.199 -> 1.226-1.243), as the bulk hints do.
//
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o confined confined.cu && ./confined
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "ck.cuh"

typedef unsigned long long u64;

__device__ __forceinline__ u64 gtimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// A block of 256 threads spins for `ns` (on one SM, no shared memory): lets B ramp up first.
__global__ void spin(u64 ns) {
    const u64 t0 = gtimer();
    while (gtimer() - t0 < ns) {
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// S: R dependent rounds of 16 KB of loads + a block reduction + a store per block. src holds
// zeros, so carry stays 0 but the compiler cannot know it (no fast math: x * 0 is not folded).
__global__ void __launch_bounds__(256) small_chain(const float4 *__restrict__ src, u64 mask4, u64 salt, int R, float *out) {
    extern __shared__ float red[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float carry = 0.0f;
    for (int r = 0; r < R; ++r) {
        const u64 base = (((u64)blockIdx.x * 64 + r + salt * 4096) * 1024 + (u64)(long long)carry) & mask4;
        const float4 a = __ldcg(src + base + tid), b = __ldcg(src + base + 256 + tid), c = __ldcg(src + base + 512 + tid),
                     d = __ldcg(src + base + 768 + tid);
        float s = a.x + a.y + a.z + a.w + b.x + b.y + b.z + b.w + c.x + c.y + c.z + c.w + d.x + d.y + d.z + d.w;
        s = warp_sum(s);
        if (lane == 0) red[warp] = s;
        __syncthreads();
        s = lane < 8 ? red[lane] : 0.0f;
        s = warp_sum(s);
        if (tid == 0) out[blockIdx.x * 64 + r] = s;
        carry = s * 0.0f;
        __syncthreads();
    }
}

__device__ __forceinline__ u64 evict_first_policy() {
    u64 p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}

// B: block b streams words [b * per16, (b + 1) * per16) through an NS-slot ring of 32 KB stages.
template <int NS>
__global__ void __launch_bounds__(256) bg_stream(const uint4 *__restrict__ src, u64 per16, unsigned *sink) {
    extern __shared__ __align__(16) uint4 ring[];
    constexpr int ST16 = 2048;  // 32 KB per stage
    const int tid = threadIdx.x;
    const uint4 *p = src + (u64)blockIdx.x * per16;
    const int nst = (int)(per16 / ST16);
    const u64 pol = evict_first_policy();
    const unsigned s0 = (unsigned)__cvta_generic_to_shared(ring);
    auto issue = [&](int st) {
        const unsigned sb = s0 + (st % NS) * ST16 * 16;
        const uint4 *g = p + (u64)st * ST16;
#pragma unroll
        for (int u = 0; u < ST16 / 256; ++u) ck_cp16_hint(sb + (tid + u * 256) * 16, g + tid + u * 256, pol);
    };
    ck_ring_stream<NS, ST16>(nst, ring, issue, sink);
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    printf("%s: %d SMs, %.0f KB shared memory per SM\n", prop.name, sms, prop.sharedMemPerMultiprocessor / 1024.0);

    const u64 hbm_bytes = 1ull << 30, l2_bytes = 4ull << 20, bg_bytes = 3ull << 30;
    float4 *hbm, *l2buf;
    uint4 *bg;
    float *out;
    unsigned *sink;
    CK(cudaMalloc(&hbm, hbm_bytes));
    CK(cudaMalloc(&l2buf, l2_bytes));
    CK(cudaMalloc(&bg, bg_bytes));
    CK(cudaMalloc(&out, 132 * 64 * 4 * 4));
    CK(cudaMalloc(&sink, 4));
    CK(cudaMemset(hbm, 0, hbm_bytes));
    CK(cudaMemset(l2buf, 0, l2_bytes));
    fill_random<<<1024, 256>>>(bg, bg_bytes / 16, 7);
    CK(cudaDeviceSynchronize());

    const int big = 200 * 1024, ring6 = 6 * 32 * 1024, ring3 = 3 * 32 * 1024;
    CK(cudaFuncSetAttribute(small_chain, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
    CK(cudaFuncSetAttribute(bg_stream<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, ring6));
    CK(cudaFuncSetAttribute(bg_stream<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, ring3));
    CK(cudaFuncSetAttribute(bg_stream<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * 32768));
    CK(cudaFuncSetAttribute(bg_stream<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 32768));

    cudaStream_t sS, sB;
    CK(cudaStreamCreateWithFlags(&sS, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&sB, cudaStreamNonBlocking));
    cudaEvent_t b0, b1;
    CK(cudaEventCreate(&b0));
    CK(cudaEventCreate(&b1));

    // B with ns ring slots of 32 KB (2, 3, 4 or 6) on nblocks blocks; the bytes it streams.
    auto launch_bg = [&](int nblocks, int ns, u64 bytes) {
        const u64 per16 = bytes / 16 / nblocks / 2048 * 2048;
        switch (ns) {
        case 2: bg_stream<2><<<nblocks, 256, 2 * 32768, sB>>>(bg, per16, sink); break;
        case 3: bg_stream<3><<<nblocks, 256, ring3, sB>>>(bg, per16, sink); break;
        case 4: bg_stream<4><<<nblocks, 256, 4 * 32768, sB>>>(bg, per16, sink); break;
        default: bg_stream<6><<<nblocks, 256, ring6, sB>>>(bg, per16, sink); break;
        }
        return per16 * 16 * nblocks;
    };
    auto bg_rate = [&](int nblocks, int ns) {
        std::vector<float> v;
        for (int i = 0; i < 7; ++i) {
            CK(cudaEventRecord(b0, sB));
            const u64 b = launch_bg(nblocks, ns, 2ull << 30);
            CK(cudaEventRecord(b1, sB));
            CK(cudaEventSynchronize(b1));
            float ms;
            CK(cudaEventElapsedTime(&ms, b0, b1));
            v.push_back((float)(b / (ms * 1e-3) / 1e9));
        }
        std::sort(v.begin(), v.end());
        return v[3];
    };
    u64 salt = 1;
    // S's time (us, median of 25): alone (nbB = 0), with B of nbB blocks x ns slots apart from S
    // (S reserves 200 KB per block) or beside S's blocks (S with 1 KB).
    auto s_time = [&](int nbS, int R, bool from_hbm, int nbB, int ns, bool beside) {
        const float4 *src = from_hbm ? hbm : l2buf;
        const u64 mask4 = (from_hbm ? hbm_bytes : l2_bytes) / 16 - 1;  // rounds start at multiples of 1024
        const int smem = beside ? 1024 : big;
        return median_us_after(
            sS, 25, 1,
            [&] {
                if (!from_hbm) small_chain<<<nbS, 256, smem, sS>>>(src, mask4, 0, R, out);  // warm L2
                if (nbB > 0) launch_bg(nbB, ns, 1ull << 30);
                spin<<<1, 256, 0, sS>>>(15000);
            },
            [&] { small_chain<<<nbS, 256, smem, sS>>>(src, mask4, from_hbm ? salt++ : 0, R, out); });
    };
    // The trade: B's in-flight bytes (blocks x slots x 32 KB, one slot being consumed) against
    // its rate alone and the latency S sees beside it.
    printf("\n| B (apart from 16 S blocks) | B in flight MB | B alone GB/s | S 16 x 1 L2 us | S 16 x 4 L2 us | S 16 x 4 HBM us |\n|---|---:|---:|---:|---:|---:|\n");
    printf("| none | 0 | - | %.2f | %.2f | %.2f |\n", s_time(16, 1, false, 0, 0, false), s_time(16, 4, false, 0, 0, false),
           s_time(16, 4, true, 0, 0, false));
    const int nbs[] = {sms - 16, (sms - 16) / 2, (sms - 16) / 4};
    for (int nb : nbs) {
        for (int ns : {2, 3, 4, 6}) {
            const double mb = nb * (ns - 1) * 32768.0 / 1e6;
            printf("| %d blocks x %d slots | %.1f | %.0f | %.2f | %.2f | %.2f |\n", nb, ns, mb, bg_rate(nb, ns),
                   s_time(16, 1, false, nb, ns, false), s_time(16, 4, false, nb, ns, false), s_time(16, 4, true, nb, ns, false));
        }
    }
    printf("\n| B beside S (%d blocks) | S 16 x 1 L2 us | S 16 x 4 L2 us |\n|---|---:|---:|\n", sms);
    for (int ns : {2, 3}) printf("| %d slots | %.2f | %.2f |\n", ns, s_time(16, 1, false, sms, ns, true), s_time(16, 4, false, sms, ns, true));
    return 0;
}
