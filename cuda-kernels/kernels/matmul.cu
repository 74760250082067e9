// Skinny matmul out[t, o] = sum_k x[t, k] * W[o, k] for T <= 16 rows of x.
//
// PER-ROW DETERMINISM: every output element is reduced in an order that depends only on
// (N, K, the device's SM count), never on T: the k-split, the warp interleave, the mma
// sequence and the final fixed-order sums are all chosen from N and K alone, and a token
// column of an mma never mixes with another token's column. So the value of row t is
// bit-identical whether 1 or 16 rows are processed.
//
// Tensor-core path (bf16, q8_0, q4_0): A = W tile (16 output rows x 16 k), B = x^T tile
// (16 k x 8 tokens), m16n8k16 bf16 mma with f32 accumulation. x is split into bf16 hi + lo
// parts (two mmas), so activations keep ~16 significant bits; weights are exact in bf16
// (bf16 itself, int8 and 4-bit values), and block scales are applied in f32 after each
// 32-wide block. Within a 32-wide k tile, thread (g, t) owns the 8 consecutive k values
// 8t..8t+7 for both A and B (a permutation of the k index, which a dot product allows):
// 16-byte weight loads, 32-byte x loads.

#define SK_WARPS 4
#define SK_R 4

template <int FMT>
__device__ __forceinline__ void load_a(const void *__restrict__ wq, const u16 *__restrict__ wd, int N, int K, int KT, int o, int kt,
                                       int t, u32 a[4], float &d) {
    if (o >= N) { a[0] = a[1] = a[2] = a[3] = 0u; d = 0.0f; return; }
    if (FMT == FMT_BF16) {
        const uint4 w = *(const uint4 *)((const u16 *)wq + (long long)o * K + kt * 32 + 8 * t);
        a[0] = w.x; a[1] = w.y; a[2] = w.z; a[3] = w.w;
        d = 1.0f;
    } else if (FMT == FMT_Q8_0) {
        const uint2 w = *(const uint2 *)((const i8 *)wq + (long long)o * K + kt * 32 + 8 * t);
        d = f16_to_f32(wd[(long long)o * KT + kt]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 word = h == 0 ? w.x : w.y;
            const float v0 = (float)(signed char)(word & 0xff), v1 = (float)(signed char)((word >> 8) & 0xff);
            const float v2 = (float)(signed char)((word >> 16) & 0xff), v3 = (float)(signed char)(word >> 24);
            a[2 * h] = pack_bf16x2(v0, v1);
            a[2 * h + 1] = pack_bf16x2(v2, v3);
        }
    } else {
        const u32 w = ((const u32 *)wq)[((long long)o * KT + kt) * 4 + t];
        d = f16_to_f32(wd[(long long)o * KT + kt]);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const float v0 = (float)((int)((w >> (8 * p)) & 0xfu) - 8);
            const float v1 = (float)((int)((w >> (8 * p + 4)) & 0xfu) - 8);
            a[p] = pack_bf16x2(v0, v1);
        }
    }
}

template <int FMT, int NT>
__device__ __forceinline__ void skinny_mma(const void *__restrict__ wq, const u16 *__restrict__ wd, const float *__restrict__ x,
                                           float *__restrict__ out, float *__restrict__ ws, u32 *__restrict__ counters, int N, int K,
                                           int T, int S, int tiles_per_split) {
    __shared__ float red[SK_WARPS][SK_R * NT * 4][32];
    __shared__ int s_last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int KT = K / 32;
    const int o_base = blockIdx.x * (16 * SK_R);
    const int s = blockIdx.y;
    const int kt0 = s * tiles_per_split;
    const int kt1 = min(KT, kt0 + tiles_per_split);
    float acc[SK_R][NT][4];
#pragma unroll
    for (int r = 0; r < SK_R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[r][j][c] = 0.0f;

    for (int kt = kt0 + warp; kt < kt1; kt += SK_WARPS) {
        u32 bh[NT][4], bl[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int tok = g + 8 * j;
            if (tok < T) {
                const float *xp = x + (long long)tok * K + kt * 32 + 8 * t;
                const float4 v0 = *(const float4 *)xp;
                const float4 v1 = *(const float4 *)(xp + 4);
                split_bf16x2(v0.x, v0.y, bh[j][0], bl[j][0]);
                split_bf16x2(v0.z, v0.w, bh[j][1], bl[j][1]);
                split_bf16x2(v1.x, v1.y, bh[j][2], bl[j][2]);
                split_bf16x2(v1.z, v1.w, bh[j][3], bl[j][3]);
            } else {
#pragma unroll
                for (int q = 0; q < 4; ++q) { bh[j][q] = 0u; bl[j][q] = 0u; }
            }
        }
        u32 ga[SK_R][4], gb[SK_R][4];
        float da[SK_R], db[SK_R];
#pragma unroll
        for (int r = 0; r < SK_R; ++r) {
            const int o = o_base + r * 16 + g;
            load_a<FMT>(wq, wd, N, K, KT, o, kt, t, ga[r], da[r]);
            load_a<FMT>(wq, wd, N, K, KT, o + 8, kt, t, gb[r], db[r]);
        }
#pragma unroll
        for (int r = 0; r < SK_R; ++r) {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                if (FMT == FMT_BF16) {
                    mma_bf16_16816(acc[r][j], ga[r][0], gb[r][0], ga[r][1], gb[r][1], bh[j][0], bh[j][1]);
                    mma_bf16_16816(acc[r][j], ga[r][0], gb[r][0], ga[r][1], gb[r][1], bl[j][0], bl[j][1]);
                    mma_bf16_16816(acc[r][j], ga[r][2], gb[r][2], ga[r][3], gb[r][3], bh[j][2], bh[j][3]);
                    mma_bf16_16816(acc[r][j], ga[r][2], gb[r][2], ga[r][3], gb[r][3], bl[j][2], bl[j][3]);
                } else {
                    float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    mma_bf16_16816(tmp, ga[r][0], gb[r][0], ga[r][1], gb[r][1], bh[j][0], bh[j][1]);
                    mma_bf16_16816(tmp, ga[r][0], gb[r][0], ga[r][1], gb[r][1], bl[j][0], bl[j][1]);
                    mma_bf16_16816(tmp, ga[r][2], gb[r][2], ga[r][3], gb[r][3], bh[j][2], bh[j][3]);
                    mma_bf16_16816(tmp, ga[r][2], gb[r][2], ga[r][3], gb[r][3], bl[j][2], bl[j][3]);
                    acc[r][j][0] = fmaf(da[r], tmp[0], acc[r][j][0]);
                    acc[r][j][1] = fmaf(da[r], tmp[1], acc[r][j][1]);
                    acc[r][j][2] = fmaf(db[r], tmp[2], acc[r][j][2]);
                    acc[r][j][3] = fmaf(db[r], tmp[3], acc[r][j][3]);
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < SK_R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) red[warp][(r * NT + j) * 4 + c][lane] = acc[r][j][c];
    __syncthreads();

    // Fixed-order sum over the warps; value (v, lane) -> (r, j, c) -> (o, tok).
    const int NV = SK_R * NT * 4 * 32;
    for (int idx = threadIdx.x; idx < NV; idx += blockDim.x) {
        const int ln = idx & 31, v = idx >> 5;
        const float sum = ((red[0][v][ln] + red[1][v][ln]) + red[2][v][ln]) + red[3][v][ln];
        const int c = v & 3, j = (v >> 2) % NT, r = (v >> 2) / NT;
        const int o = o_base + r * 16 + (ln >> 2) + (c >= 2 ? 8 : 0);
        const int tok = 8 * j + 2 * (ln & 3) + (c & 1);
        if (o < N && tok < T) {
            if (S == 1) out[(long long)tok * N + o] = sum;
            else ws[((long long)s * N + o) * 16 + tok] = sum;
        }
    }
    if (S == 1) return;

    // Split-k: the last block of this column tile sums the S partials in split order.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 prev = atomicAdd(&counters[blockIdx.x], 1u);
        s_last = (prev == (u32)(S - 1));
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int idx = threadIdx.x; idx < 16 * SK_R * 16; idx += blockDim.x) {
        const int o = o_base + idx / 16, tok = idx % 16;
        if (o < N && tok < T) {
            float sum = __ldcg(ws + (long long)o * 16 + tok);
            for (int q = 1; q < S; ++q) sum += __ldcg(ws + ((long long)q * N + o) * 16 + tok);
            out[(long long)tok * N + o] = sum;
        }
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
}

#define SKINNY(NAME, FMT, NT)                                                                                                    \
    extern "C" __global__ void __launch_bounds__(128) NAME(const void *wq, const u16 *wd, const float *x, float *out, float *ws, \
                                                           u32 *counters, int N, int K, int T, int S, int tps) {               \
        skinny_mma<FMT, NT>(wq, wd, x, out, ws, counters, N, K, T, S, tps);                                                    \
    }

SKINNY(skinny_bf16_n1, FMT_BF16, 1)
SKINNY(skinny_bf16_n2, FMT_BF16, 2)
SKINNY(skinny_q8_0_n1, FMT_Q8_0, 1)
SKINNY(skinny_q8_0_n2, FMT_Q8_0, 2)
SKINNY(skinny_q4_0_n1, FMT_Q4_0, 1)
SKINNY(skinny_q4_0_n2, FMT_Q4_0, 2)

// CUDA-core skinny kernel for any format and any K (f32 / f16 weights, and shapes the
// tensor-core path does not take). One warp per output feature; lane l owns k = l + 32i;
// fixed warp tree per (o, t): per-row deterministic.
extern "C" __global__ void __launch_bounds__(128) skinny_simt(int fmt, const void *wq, const u16 *wd, const float *x, float *out,
                                                              int N, int K, int T) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int o = blockIdx.x * 4 + warp;
    if (o >= N) return;
    float acc[16];
#pragma unroll
    for (int t = 0; t < 16; ++t) acc[t] = 0.0f;
    for (int k = lane; k < K; k += 32) {
        const float w = load_w(fmt, wq, wd, o, k, K);
#pragma unroll
        for (int t = 0; t < 16; ++t)
            if (t < T) acc[t] = fmaf(w, x[(long long)t * K + k], acc[t]);
    }
#pragma unroll
    for (int t = 0; t < 16; ++t) {
        if (t < T) {
            const float v = warp_sum(acc[t]);
            if (lane == 0) out[(long long)t * N + o] = v;
        }
    }
}

// f32 -> bf16 hi/lo split (for the cuBLAS prefill path).
extern "C" __global__ void split_bf16(const float *x, u16 *hi, u16 *lo, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        u32 h, l;
        split_bf16x2(x[i], 0.0f, h, l);
        hi[i] = (u16)(h & 0xffffu);
        lo[i] = (u16)(l & 0xffffu);
    }
}
