// Does the weight layout limit the bf16 skinny matmul? The skinny kernel (kernels/matmul.cu)
// reads W [N][K] row-major: per 32-wide k tile a warp loads 16 B per thread from 16 rows x R
// tiles, i.e. each load instruction covers 8 rows x 64 B, rows K * 2 bytes apart. The Q8_0A8
// kernels read weights repacked into mma-fragment order: every load instruction covers 512
// contiguous bytes. Same grid, same mma work, same split over K, only the addresses differ:
//   strided   the skinny kernel's addresses (row-major W)
//   packed    the same loads from a fragment-order copy (tile, k tile, fragment, lane)
// each with the next 1 or 2 k tiles loaded ahead in registers, for T = 1 and 16 rows.
// Weights come from HBM: each launch of a graph of 24 reads another copy of W.
//
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o skinny_layout skinny_layout.cu &&
// ./skinny_layout
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ck.cuh"

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ void mma16816(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

constexpr int R = 2;  // 16-row tiles per warp (the skinny kernel's default)

// One k tile's A loads of one warp: R tiles x rows (g, g + 8).
template <bool PACKED>
__device__ __forceinline__ void load_a(const u16 *__restrict__ w, int K, int KT, int col_tile, int kt, int g, int t, int lane,
                                       uint4 (&a)[R][2]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (PACKED) {
                const long long frag = (((long long)col_tile * KT + kt) * R + r) * 2 + h;
                a[r][h] = __ldg((const uint4 *)(w + frag * 256 + lane * 8));
            } else {
                const long long o = (long long)col_tile * 16 * R + r * 16 + g + 8 * h;
                a[r][h] = __ldg((const uint4 *)(w + o * K + kt * 32 + 8 * t));
            }
        }
}

__device__ __forceinline__ u32 f2bf(float f) { return __float_as_uint(f) + 0x7fffu + ((__float_as_uint(f) >> 16) & 1u) >> 16; }
// hi = bf16(x), lo = bf16(x - hi) for 8 consecutive f32, packed as bf16 pairs.
__device__ __forceinline__ void split8(const float4 p, const float4 q, uint4 &h, uint4 &l) {
    const float v[8] = {p.x, p.y, p.z, p.w, q.x, q.y, q.z, q.w};
    u32 hb[8], lb[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        hb[i] = f2bf(v[i]);
        lb[i] = f2bf(v[i] - __uint_as_float(hb[i] << 16));
    }
    h = make_uint4(hb[0] | hb[1] << 16, hb[2] | hb[3] << 16, hb[4] | hb[5] << 16, hb[6] | hb[7] << 16);
    l = make_uint4(lb[0] | lb[1] << 16, lb[2] | lb[3] << 16, lb[4] | lb[5] << 16, lb[6] | lb[7] << 16);
}

// EPI 0: each thread stores one float (no split-k sum: the main loop alone). EPI 1: the
// skinny kernel's epilogue (warp sums in shared memory; with S > 1 splits partials to a
// workspace, a fence, an atomic per column tile, the last block adds the S partials). EPI 2:
// the S split blocks of a column tile form a thread-block cluster; rank 0 adds the others'
// warp sums through distributed shared memory.
// ROWW: the 4 warps of a block take 4 column tiles (128 rows) and walk the same k tiles, so a
// k tile's x is loaded by 4 warps of one SM at about the same time (L1 hits for 3 of them)
// instead of by warps of different blocks; no sum across the block's warps.
template <bool PACKED, int NT, int AHEAD, int EPI, bool X32, bool ROWW = false>
__global__ void __launch_bounds__(128, 5) skinny(const u16 *__restrict__ w, const u16 *__restrict__ x, float *__restrict__ ws, int N,
                                              int K, int T, int tps, float *__restrict__ out, u32 *__restrict__ counters) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int KT = K / 32, col_tile = ROWW ? blockIdx.x * 4 + warp : blockIdx.x;
    constexpr int KSTEP = ROWW ? 1 : 4;
    const int kt0 = blockIdx.y * tps, kt1 = min(KT, kt0 + tps);
    float acc[R][NT][4] = {};
    uint4 a[AHEAD + 1][R][2];
    uint4 b[AHEAD + 1][NT][2];
    auto load = [&](int kt, uint4 (&ra)[R][2], uint4 (&rb)[NT][2]) {
        load_a<PACKED>(w, K, KT, col_tile, kt, g, t, lane, ra);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int tok = g + 8 * j;
            const long long off = (long long)(tok < T ? tok : 0) * K + kt * 32 + 8 * t;
            if (X32) {
                const float *xf = (const float *)x + off;
                split8(*(const float4 *)xf, *(const float4 *)(xf + 4), rb[j][0], rb[j][1]);
            } else {
                rb[j][0] = *(const uint4 *)(x + off);
                rb[j][1] = *(const uint4 *)(x + 16 * K + off);
            }
        }
    };
    int kt = kt0 + (ROWW ? 0 : warp);
#pragma unroll
    for (int p = 0; p < AHEAD; ++p)
        if (kt + p * KSTEP < kt1) load(kt + p * KSTEP, a[p], b[p]);
    // The ring unrolled by its length, so every slot index is a constant (registers only).
    while (kt < kt1) {
#pragma unroll
        for (int cur = 0; cur <= AHEAD; ++cur) {
            if (kt < kt1) {
                constexpr int NS = AHEAD + 1;
                const int nxt = (cur + AHEAD) % NS;
                if (kt + AHEAD * KSTEP < kt1) load(kt + AHEAD * KSTEP, a[nxt], b[nxt]);
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        const uint4 ga = a[cur][r][0], gb = a[cur][r][1], h = b[cur][j][0], l = b[cur][j][1];
                        mma16816(acc[r][j], ga.x, gb.x, ga.y, gb.y, h.x, h.y);
                        mma16816(acc[r][j], ga.x, gb.x, ga.y, gb.y, l.x, l.y);
                        mma16816(acc[r][j], ga.z, gb.z, ga.w, gb.w, h.z, h.w);
                        mma16816(acc[r][j], ga.z, gb.z, ga.w, gb.w, l.z, l.w);
                    }
                kt += KSTEP;
            }
        }
    }
    if (EPI == 0) {
        float s = 0.f;
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int j = 0; j < NT; ++j) s += acc[r][j][0] + acc[r][j][1] + acc[r][j][2] + acc[r][j][3];
        ws[((long long)blockIdx.y * gridDim.x + blockIdx.x) * 128 + threadIdx.x] = s;
        return;
    }
    __shared__ float red[4][R * NT * 4][32];
    __shared__ float blk[R * NT * 4][32];
    __shared__ int s_last;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) red[warp][(r * NT + j) * 4 + c][lane] = acc[r][j][c];
    __syncthreads();
    const int NV = R * NT * 4 * 32, S = gridDim.y, sidx = blockIdx.y;
    const int o_base = col_tile * 16 * R;
    for (int idx = threadIdx.x; idx < NV; idx += blockDim.x) {
        const int ln = idx & 31, v = idx >> 5;
        const float sum = ((red[0][v][ln] + red[1][v][ln]) + red[2][v][ln]) + red[3][v][ln];
        const int c = v & 3, j = (v >> 2) % NT, r = (v >> 2) / NT;
        const int o = o_base + r * 16 + (ln >> 2) + (c >= 2 ? 8 : 0);
        const int tok = 8 * j + 2 * (ln & 3) + (c & 1);
        if (EPI == 2) blk[v][ln] = sum;
        else if (o < N && tok < T) {
            if (S == 1) out[(long long)tok * N + o] = sum;
            else ws[((long long)sidx * N + o) * 16 + tok] = sum;
        }
    }
    if (S == 1) return;
    if (EPI == 1) {
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) s_last = atomicAdd(&counters[blockIdx.x], 1u) == (u32)(S - 1);
        __syncthreads();
        if (!s_last) return;
        __threadfence();
        for (int idx = threadIdx.x; idx < 16 * R * 16; idx += blockDim.x) {
            const int o = o_base + idx / 16, tok = idx % 16;
            if (o < N && tok < T) {
                const float *p = ws + (long long)o * 16 + tok;
                const long long stride = (long long)N * 16;
                float sum = __ldcg(p);
                for (int q = 1; q < S; ++q) sum += __ldcg(p + q * stride);
                out[(long long)tok * N + o] = sum;
            }
        }
        if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
        return;
    }
    // EPI 2: cluster of the S split blocks (cluster rank = blockIdx.y).
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
    if (sidx == 0) {
        const u32 base = (u32)__cvta_generic_to_shared(&blk[0][0]);
        for (int idx = threadIdx.x; idx < NV; idx += blockDim.x) {
            const int ln = idx & 31, v = idx >> 5;
            float sum = blk[v][ln];
            for (int q = 1; q < S; ++q) {
                u32 ra;
                float f;
                asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(base + idx * 4), "r"(q));
                asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(f) : "r"(ra) : "memory");
                sum += f;
            }
            const int c = v & 3, j = (v >> 2) % NT, r = (v >> 2) / NT;
            const int o = o_base + r * 16 + (ln >> 2) + (c >= 2 ? 8 : 0);
            const int tok = 8 * j + 2 * (ln & 3) + (c & 1);
            if (o < N && tok < T) out[(long long)tok * N + o] = sum;
        }
    }
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

struct Shape {
    const char *name;
    int n, k;
};

int main() {
    int dev = 0, sms = 0;
    CK(cudaSetDevice(dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    const size_t pool_bytes = 3ull << 30;
    u16 *pool;
    CK(cudaMalloc(&pool, pool_bytes));
    CK(cudaMemset(pool, 0x11, pool_bytes));
    u16 *x;
    CK(cudaMalloc(&x, 2 * 16 * 12288 * 2));
    CK(cudaMemset(x, 0x22, 2 * 16 * 12288 * 2)); // also read as 16 x 12288 f32 (X32)
    float *ws, *out;
    CK(cudaMalloc(&ws, 64 << 20));
    CK(cudaMalloc(&out, 16 << 20));
    u32 *counters;
    CK(cudaMalloc(&counters, 1 << 20));
    CK(cudaMemset(counters, 0, 1 << 20));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    // Copy bandwidth: 1 GiB device to device, read + write.
    const double bw_gbs = copy_gbs(pool, 1ull << 30, st);
    std::printf("%s, %d SMs, copy bandwidth %.0f GB/s (read + write)\n", prop.name, sms, bw_gbs);
    std::printf("| shape | N x K | MB | T | kernel | us | %% of copy bw |\n|---|---|---:|---:|---|---:|---:|\n");

    const Shape shapes[] = {{"8B q/k/v", 6144, 4096}, {"8B o", 4096, 4096},   {"8B gate/up", 24576, 4096},
                            {"8B down", 4096, 12288}, {"8B lm_head", 151936, 4096}};
    for (const Shape &sh : shapes) {
        const size_t wbytes = (size_t)sh.n * sh.k * 2;
        const int copies = std::max<int>(1, std::min<int>(12, (int)(pool_bytes / wbytes)));
        const int KT = sh.k / 32, tiles = sh.n / (16 * R);
        // The library's split rule: fill one wave at 5 blocks per SM, <= 8 splits, >= 8 k tiles.
        int S = std::max(1, std::min(8, (5 * sms) / tiles));
        S = std::max(1, std::min(S, KT / 8));
        const int tps = (KT + S - 1) / S;
        dim3 grid(tiles, S);
        for (int T : {1, 16}) {
            const char *names[] = {"strided", "packed", "packed +epi", "packed +cluster", "packed +epi +x32", "strided +epi",
                                   "strided rowwarps", "packed rowwarps"};
            // Rowwarps: tiles / 4 blocks, the split filling one wave at 5 blocks per SM (<= 16).
            const int rb = (tiles + 3) / 4;
            int S2 = std::max(1, std::min(16, (5 * sms) / rb));
            S2 = std::max(1, std::min(S2, KT / 8));
            const int tps2 = (KT + S2 - 1) / S2;
            for (int variant = 0; variant < 8; ++variant) {
                if (variant >= 2 && variant <= 5) continue;
                auto launch = [&](const u16 *w) {
                    cudaLaunchConfig_t cfg = {};
                    cfg.gridDim = grid;
                    cfg.blockDim = dim3(128);
                    cfg.stream = st;
                    cudaLaunchAttribute at[1];
                    at[0].id = cudaLaunchAttributeClusterDimension;
                    at[0].val.clusterDim.x = 1;
                    at[0].val.clusterDim.y = S;
                    at[0].val.clusterDim.z = 1;
                    cfg.attrs = at;
                    cfg.numAttrs = variant == 3 ? 1 : 0;
                    if (variant >= 6) {
                        cfg.gridDim = dim3(rb, S2);
                        if (T == 1) {
                            if (variant == 6) CK(cudaLaunchKernelEx(&cfg, skinny<false, 1, 1, 0, false, true>, w, (const u16 *)x, ws, sh.n, sh.k, T, tps2, out, counters));
                            else CK(cudaLaunchKernelEx(&cfg, skinny<true, 1, 1, 0, false, true>, w, (const u16 *)x, ws, sh.n, sh.k, T, tps2, out, counters));
                        } else {
                            if (variant == 6) CK(cudaLaunchKernelEx(&cfg, skinny<false, 2, 1, 0, false, true>, w, (const u16 *)x, ws, sh.n, sh.k, T, tps2, out, counters));
                            else CK(cudaLaunchKernelEx(&cfg, skinny<true, 2, 1, 0, false, true>, w, (const u16 *)x, ws, sh.n, sh.k, T, tps2, out, counters));
                        }
                        return;
                    }
#define L_(P, E, X)                                                                                            \
    do {                                                                                                       \
        if (T == 1) CK(cudaLaunchKernelEx(&cfg, skinny<P, 1, 1, E, X>, w, (const u16 *)x, ws, sh.n, sh.k, T, tps, out, counters)); \
        else CK(cudaLaunchKernelEx(&cfg, skinny<P, 2, 1, E, X>, w, (const u16 *)x, ws, sh.n, sh.k, T, tps, out, counters));       \
    } while (0)
                    switch (variant) {
                        case 0: L_(false, 0, false); break;
                        case 1: L_(true, 0, false); break;
                        case 2: L_(true, 1, false); break;
                        case 3: L_(true, 2, false); break;
                        case 4: L_(true, 1, true); break;
                        default: L_(false, 1, false); break;
                    }
#undef L_
                };
                const double us = graph_us_per_launch(st, 24, 9, [&](int l) {
                    launch((const u16 *)((const char *)pool + (size_t)(l % copies) * wbytes));
                });
                const double pct = 100.0 * (wbytes / (us * 1e-6)) / (bw_gbs * 1e9);
                std::printf("| %s | %d x %d (%d x %d blocks) | %.1f | %d | %s | %.1f | %.0f%% |\n", sh.name, sh.n, sh.k,
                            variant >= 6 ? rb : tiles, variant >= 6 ? S2 : S, wbytes / 1e6, T, names[variant], us, pct);
            }
        }
    }
    CK(cudaGetLastError());
    return 0;
}
