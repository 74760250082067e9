// Which block shape should the bf16 skinny matmul (kernels/matmul.cu, skinny_mma) use? At 16
// rows the x tiles a block reads from L2 are as many bytes as its weights (skinny_layout.cu,
// eighteenth session: gate + up 48 us at 1 row, 62 at 16), so blocks that cover several column
// tiles and share each k tile's x (L1 hits for the other warps) should stream faster at 16 rows.
// A row's bits must not depend on the row count, so whatever shape is chosen serves 1 and 16
// rows alike: each variant is timed at both.
//
// Kernel sk<NT, R, G, KW>: a block = G tile groups (R 16-row tiles each) x KW warps per group;
// the KW warps of a group interleave the k tiles of the block's split (kt = kt0 + kw, step KW)
// and are summed in a fixed order through shared memory; K split over S blocks per column (the
// last block of a column adds the S partials in split order): the library's kernel is
// G = 1, KW = 4, R = 2. Weights in the library's fragment order (bf16p: per 16-row tile and k
// tile, 2 x 512 contiguous bytes), x as bf16 hi / lo, one k tile ahead in registers, the full
// epilogue. Weights come from HBM: each launch of a graph of 24 reads another copy of W.
//
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o skinny_share skinny_share.cu &&
// ./skinny_share
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
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

template <int NT, int R, int G, int KW, int MINB>
__global__ void __launch_bounds__(32 * G * KW, MINB)
    sk(const u16 *__restrict__ w, const u16 *__restrict__ xh, const u16 *__restrict__ xl, float *__restrict__ ws,
       u32 *__restrict__ counters, float *__restrict__ out, int N, int K, int T, int tps) {
    constexpr int NV = R * NT * 4;
    __shared__ float red[G * KW][NV][32];
    __shared__ int s_last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int grp = warp / KW, kw = warp % KW;
    const int KT = K / 32, S = gridDim.y, s = blockIdx.y;
    const int tg = blockIdx.x * G + grp;  // this warp's tile group
    const bool live = tg * 16 * R < N;
    const int kt0 = s * tps, kt1 = min(KT, kt0 + tps);
    float acc[R][NT][4];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[r][j][c] = 0.0f;
    uint4 ca[R][2], na[R][2], cbh[NT], cbl[NT], nbh[NT], nbl[NT];
    auto load = [&](int kt, uint4 (&a)[R][2], uint4 (&bh)[NT], uint4 (&bl)[NT]) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const long long frag = ((long long)(tg * R + r) * KT + kt) * 2 + h;
                a[r][h] = __ldg((const uint4 *)(w + frag * 256 + lane * 8));
            }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int tok = g + 8 * j;
            if (tok < T) {
                const long long off = (long long)tok * K + kt * 32 + 8 * t;
                bh[j] = *(const uint4 *)(xh + off);
                bl[j] = *(const uint4 *)(xl + off);
            } else {
                bh[j] = make_uint4(0u, 0u, 0u, 0u);
                bl[j] = bh[j];
            }
        }
    };
    int kt = kt0 + kw;
    if (live && kt < kt1) load(kt, ca, cbh, cbl);
    for (; live && kt < kt1; kt += KW) {
        const bool more = kt + KW < kt1;
        if (more) load(kt + KW, na, nbh, nbl);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const uint4 ga = ca[r][0], gb = ca[r][1], h = cbh[j], l = cbl[j];
                mma16816(acc[r][j], ga.x, gb.x, ga.y, gb.y, h.x, h.y);
                mma16816(acc[r][j], ga.x, gb.x, ga.y, gb.y, l.x, l.y);
                mma16816(acc[r][j], ga.z, gb.z, ga.w, gb.w, h.z, h.w);
                mma16816(acc[r][j], ga.z, gb.z, ga.w, gb.w, l.z, l.w);
            }
        if (more) {
#pragma unroll
            for (int r = 0; r < R; ++r) { ca[r][0] = na[r][0]; ca[r][1] = na[r][1]; }
#pragma unroll
            for (int j = 0; j < NT; ++j) { cbh[j] = nbh[j]; cbl[j] = nbl[j]; }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) red[warp][(r * NT + j) * 4 + c][lane] = acc[r][j][c];
    __syncthreads();
    // Fixed-order sum over a group's KW warps; value (group, v, lane) -> (o, tok).
    for (int idx = threadIdx.x; idx < G * NV * 32; idx += blockDim.x) {
        const int gr = idx / (NV * 32), rem = idx % (NV * 32), ln = rem & 31, v = rem >> 5;
        float sum = red[gr * KW][v][ln];
#pragma unroll
        for (int q = 1; q < KW; ++q) sum += red[gr * KW + q][v][ln];
        const int c = v & 3, j = (v >> 2) % NT, r = (v >> 2) / NT;
        const int o = (blockIdx.x * G + gr) * 16 * R + r * 16 + (ln >> 2) + (c >= 2 ? 8 : 0);
        const int tok = 8 * j + 2 * (ln & 3) + (c & 1);
        if (o < N && tok < T) {
            if (S == 1) out[(long long)tok * N + o] = sum;
            else ws[((long long)s * N + o) * 16 + tok] = sum;
        }
    }
    if (S == 1) return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&counters[blockIdx.x], 1u) == (u32)(S - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const int o0 = blockIdx.x * G * 16 * R;
    for (int idx = threadIdx.x; idx < G * 16 * R * 16; idx += blockDim.x) {
        const int o = o0 + idx / 16, tok = idx % 16;
        if (o < N && tok < T) {
            const float *p = ws + (long long)o * 16 + tok;
            const long long stride = (long long)N * 16;
            float sum = __ldcg(p);
            int q = 1;
            for (; q + 4 <= S; q += 4) {
                const float a = __ldcg(p + q * stride), b = __ldcg(p + (q + 1) * stride);
                const float c = __ldcg(p + (q + 2) * stride), e = __ldcg(p + (q + 3) * stride);
                sum += a;
                sum += b;
                sum += c;
                sum += e;
            }
            for (; q < S; ++q) sum += __ldcg(p + q * stride);
            out[(long long)tok * N + o] = sum;
        }
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
}

__global__ void fill(u16 *p, size_t n, u32 seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed;
        h ^= h >> 13;
        h *= 0x5bd1e995u;
        h ^= h >> 15;
        const float f = ((float)(h & 0xffff) / 65536.0f - 0.5f) * 0.05f;
        p[i] = (u16)(__float_as_uint(f) >> 16);
    }
}

struct Shape {
    const char *name;
    int n, k;
};

struct Variant {
    const char *name;
    int R, G, KW, threads, smax;
    const void *k1, *k2;  // NT = 1 / NT = 2 instantiations
};

#define V(NAME, R_, G_, KW_, MINB, SMAX) \
    Variant { NAME, R_, G_, KW_, 32 * G_ * KW_, SMAX, (const void *)sk<1, R_, G_, KW_, MINB>, (const void *)sk<2, R_, G_, KW_, MINB> }

int main() {
    int sms = 0;
    CK(cudaSetDevice(0));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const size_t pool_bytes = 3ull << 30;
    u16 *pool;
    CK(cudaMalloc(&pool, pool_bytes));
    fill<<<4096, 256>>>(pool, pool_bytes / 2, 1u);
    u16 *xh, *xl;
    CK(cudaMalloc(&xh, 16 * 12288 * 2));
    CK(cudaMalloc(&xl, 16 * 12288 * 2));
    fill<<<64, 256>>>(xh, 16 * 12288, 7u);
    fill<<<64, 256>>>(xl, 16 * 12288, 9u);
    float *ws, *out, *ref;
    CK(cudaMalloc(&ws, 256 << 20));
    CK(cudaMalloc(&out, 16 << 20));
    CK(cudaMalloc(&ref, 16 << 20));
    u32 *counters;
    CK(cudaMalloc(&counters, 1 << 20));
    CK(cudaMemset(counters, 0, 1 << 20));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

    const double bw_gbs = copy_gbs(pool, 1ull << 30, st);
    fill<<<4096, 256>>>(pool, pool_bytes / 2, 1u);  // the copy's second half back to distinct bytes
    std::printf("%s, %d SMs, copy bandwidth %.0f GB/s (read + write)\n", prop.name, sms, bw_gbs);

    const Variant vars[] = {
        V("G1 KW4 R2 (library)", 2, 1, 4, 5, 8),
        V("G1 KW4 R2 occ", 2, 1, 4, 5, 8),
        V("G2 KW2 R2", 2, 2, 2, 5, 8),
        V("G4 KW1 R2", 2, 4, 1, 5, 16),
        V("G2 KW4 R2", 2, 2, 4, 2, 8),
        V("G4 KW4 R2", 2, 4, 4, 1, 8),
        V("G1 KW4 R4", 4, 1, 4, 3, 8),
        V("G2 KW2 R4", 4, 2, 2, 3, 8),
    };
    const int nv = sizeof(vars) / sizeof(vars[0]);
    const Shape shapes[] = {{"8B q/k/v", 6144, 4096}, {"8B o", 4096, 4096}, {"8B gate/up", 24576, 4096},
                            {"8B down", 4096, 12288}, {"8B lm_head", 151936, 4096},
                            {"27B q/k/v", 6144, 5120}, {"27B gate/up", 34816, 5120}, {"27B down", 5120, 17408}};
    std::printf("| shape | variant | blocks x splits (occ) | T=1 us | T=16 us | T=1 %% bw | T=16 %% bw | max rel diff vs library |\n");
    std::printf("|---|---|---|---:|---:|---:|---:|---:|\n");
    double tot[16][2] = {};
    for (const Shape &sh : shapes) {
        const size_t wbytes = (size_t)sh.n * sh.k * 2;
        const int copies = std::max<int>(1, std::min<int>(12, (int)(pool_bytes / wbytes)));
        const int KT = sh.k / 32;
        for (int vi = 0; vi < nv; ++vi) {
            const Variant &v = vars[vi];
            const int tiles = (sh.n + 16 * v.R - 1) / (16 * v.R);
            const int B = (tiles + v.G - 1) / v.G;
            int occ = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, (const void *)v.k2, v.threads, 0));
            // Splits: the library's rule (5 blocks per SM) for the first, else the kernel's own
            // occupancy: one wave, at most smax, at least 8 k tiles per split.
            const int per_sm = vi == 0 ? 5 : occ;
            int S = std::max(1, std::min(v.smax, (per_sm * sms) / B));
            S = std::max(1, std::min(S, KT / 8));
            const int tps = (KT + S - 1) / S;
            S = (KT + tps - 1) / tps;
            double us[2];
            double maxrel = 0.0;
            for (int ti = 0; ti < 2; ++ti) {
                const int T = ti == 0 ? 1 : 16;
                const void *kern = T <= 8 ? v.k1 : v.k2;
                auto launch = [&](const u16 *w, float *o) {
                    cudaLaunchConfig_t cfg = {};
                    cfg.gridDim = dim3(B, S);
                    cfg.blockDim = dim3(v.threads);
                    cfg.stream = st;
                    int n = sh.n, k = sh.k, tt = T, tp = tps;
                    void *args[] = {(void *)&w, (void *)&xh, (void *)&xl, (void *)&ws, (void *)&counters, (void *)&o,
                                    (void *)&n, (void *)&k, (void *)&tt, (void *)&tp};
                    CK(cudaLaunchKernelExC(&cfg, kern, args));
                };
                // Check against the library variant's output (the first) on copy 0.
                launch(pool, vi == 0 ? ref : out);
                CK(cudaStreamSynchronize(st));
                if (vi > 0 && T == 16) {
                    std::vector<float> a(16 * sh.n), b(16 * sh.n);
                    CK(cudaMemcpy(a.data(), ref, a.size() * 4, cudaMemcpyDeviceToHost));
                    CK(cudaMemcpy(b.data(), out, b.size() * 4, cudaMemcpyDeviceToHost));
                    double mx = 0.0, md = 0.0;
                    for (size_t i = 0; i < a.size(); ++i) {
                        mx = std::max(mx, (double)std::fabs(a[i]));
                        md = std::max(md, (double)std::fabs(a[i] - b[i]));
                    }
                    maxrel = md / std::max(mx, 1e-30);
                }
                us[ti] = graph_us_per_launch(st, 24, 9, [&](int l) {
                    launch((const u16 *)((const char *)pool + (size_t)(l % copies) * wbytes), out);
                });
            }
            // The 8B layer's four launches (not the lm_head, not the 27B shapes).
            if (sh.name[0] == '8' && sh.n != 151936) {
                tot[vi][0] += us[0];
                tot[vi][1] += us[1];
            }
            const double f = wbytes / 1e3 / bw_gbs;  // us at the copy bandwidth
            std::printf("| %s | %s | %d x %d (%d/SM) | %.1f | %.1f | %.0f%% | %.0f%% | %.1e |\n", sh.name, v.name, B, S, occ, us[0],
                        us[1], 100.0 * f / us[0], 100.0 * f / us[1], maxrel);
        }
    }
    std::printf("\n8B layer (q/k/v + o + gate/up + down), us at T=1 / T=16:\n");
    for (int vi = 0; vi < nv; ++vi) std::printf("  %-22s %.1f / %.1f\n", vars[vi].name, tot[vi][0], tot[vi][1]);
    CK(cudaGetLastError());
    return 0;
}
