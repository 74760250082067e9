#ifndef A8_WQ4
// Skinny matmul out[t, o] = sum_k x[t, k] * W[o, k] for T <= 16 rows of x.
//
// PER-ROW DETERMINISM: every output element is reduced in an order that depends only on
// (N, K, the device's SM count; for a launch of several matrices, all their N), never on T: the k-split, the warp interleave, the mma
// sequence and the final fixed-order sums are all chosen from N and K alone, and a token
// column of an mma never mixes with another token's column. So the value of row t is
// bit-identical whether 1 or 16 rows are processed.
//
// Tensor-core path (bf16, q8_0, q4_0): A = W tile (16 output rows x 16 k), B = x^T tile
// (16 k x 8 tokens), m16n8k16 bf16 mma with f32 accumulation. x is split into bf16 hi + lo
// parts (two mmas; the split is done once per call by split_bf16), so activations keep ~16
// significant bits; weights are exact in bf16
// (bf16 itself, int8 and 4-bit values), and block scales are applied in f32 after each
// 32-wide block. Within a 32-wide k tile, thread (g, t) owns the 8 consecutive k values
// 8t..8t+7 for both A and B (a permutation of the k index, which a dot product allows):
// 16-byte weight loads, 32-byte x loads.

#define SK_WARPS 4

// Raw (undecoded) weight bytes of one thread for one 32-wide k tile and one output row:
// bf16: 8 values (16 B); q8_0: 8 codes (8 B) + the f16 scale; q4_0: 8 nibbles (4 B) + scale.
// Loads are issued one tile ahead of the math (register double buffering), decoding is done
// with integer / FP32-add tricks instead of int->float conversions.
struct RawA {
    uint4 w;
    u32 d;
};

template <int FMT>
__device__ __forceinline__ void load_raw(const void *__restrict__ wq, const u16 *__restrict__ wd, int N, int K, int KT, int o, int kt,
                                         int t, RawA &ra) {
    if (o >= N) { ra.w = make_uint4(0u, 0u, 0u, 0u); ra.d = 0u; return; }
    if (FMT == FMT_BF16) {
        ra.w = __ldg((const uint4 *)((const u16 *)wq + (long long)o * K + kt * 32 + 8 * t));
        ra.d = 0u;
    } else if (FMT == FMT_BF16P) {
        // The same 8 values, from the fragment-order copy (a warp's 32 lanes: 512 bytes).
        ra.w = __ldg((const uint4 *)((const u16 *)wq + bf16p_index(o, kt * 32 + 8 * t, K)));
        ra.d = 0u;
    } else if (FMT == FMT_Q8_0) {
        const uint2 w = __ldg((const uint2 *)((const i8 *)wq + (long long)o * K + kt * 32 + 8 * t));
        ra.w = make_uint4(w.x, w.y, 0u, 0u);
        ra.d = __ldg(wd + (long long)o * KT + kt);
    } else {
        ra.w = make_uint4(__ldg((const u32 *)wq + ((long long)o * KT + kt) * 4 + t), 0u, 0u, 0u);
        ra.d = __ldg(wd + (long long)o * KT + kt);
    }
}

// int8 code byte (signed) -> exact f32 via 2^23 magic: (0x4B0000uu as float) - (2^23 + 128).
__device__ __forceinline__ float q8_byte(u32 wx, int i) {
    return __int_as_float(__byte_perm(wx, 0x4B000000u, (u32)i | 0x7650u)) - 8388736.0f;
}
// Two small-integer f32 (exact in bf16) -> bf16x2 by taking their high half-words.
__device__ __forceinline__ u32 hi_halves(float lo, float hi) {
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632u);
}

template <int FMT>
__device__ __forceinline__ void decode_a(const RawA &ra, u32 a[4], float &d) {
    if (FMT == FMT_BF16 || FMT == FMT_BF16P) {
        a[0] = ra.w.x; a[1] = ra.w.y; a[2] = ra.w.z; a[3] = ra.w.w;
        d = 1.0f;
    } else if (FMT == FMT_Q8_0) {
        const u32 x0 = ra.w.x ^ 0x80808080u, x1 = ra.w.y ^ 0x80808080u;
        a[0] = hi_halves(q8_byte(x0, 0), q8_byte(x0, 1));
        a[1] = hi_halves(q8_byte(x0, 2), q8_byte(x0, 3));
        a[2] = hi_halves(q8_byte(x1, 0), q8_byte(x1, 1));
        a[3] = hi_halves(q8_byte(x1, 2), q8_byte(x1, 3));
        d = f16_to_f32((u16)ra.d);
    } else {
        // nibble pair p = (w >> 4p) & 0x000f000f; 0x4300 | n is bf16 (128 + n); minus 136.
        const u32 one = 0x3f803f80u, m136 = 0xc308c308u;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const u32 v = ((ra.w.x >> (4 * p)) & 0x000f000fu) | 0x43004300u;
            u32 r;
            asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(one), "r"(m136));
            a[p] = r;
        }
        d = f16_to_f32((u16)ra.d);
    }
}

struct RawB {
    uint4 h, l;
};

// The SiLU product of a gate and an up value written as the down projection's bf16 hi / lo x
// at i (silu_mul_split's bits: put_row<true> of silu_f(gate) * up).
__device__ __forceinline__ void glu_store(u16 *__restrict__ yh, u16 *__restrict__ yl, long long i, float gate, float up) {
    u32 h, l;
    split_bf16x2(silu_f(gate) * up, 0.0f, h, l);
    yh[i] = (u16)(h & 0xffffu);
    yl[i] = (u16)(l & 0xffffu);
}

// The S split partials p[0], p[stride], ... added strictly in split order (loads in groups of
// 4, in flight together).
__device__ __forceinline__ float split_sum(const float *p, long long stride, int S) {
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
    return sum;
}

// GLU = 0: out[t, o] (+)= x W^T for the block's 16 SK_R rows of W (wq / wd). GLU = 1: the block's
// first SK_R / 2 row tiles are rows of the gate W (wq / wd), the others the same rows of the up
// W (wq2 / wd2), 8 SK_R rows of each; every output's sum is the one GLU = 0 makes for that row
// of its matrix (the same k tiles, warps and split order), and the block writes silu(gate) *
// up as the next matmul's bf16 hi / lo x (yh / yl, [T, N]) instead of out. Split partials of
// GLU = 1: gate rows at 0..N, up rows at N..2N.
template <int FMT, int NT, int SK_R, int GLU>
__device__ __forceinline__ void skinny_mma(const void *__restrict__ wq, const u16 *__restrict__ wd, const void *__restrict__ wq2,
                                           const u16 *__restrict__ wd2, const u16 *__restrict__ xh, const u16 *__restrict__ xl,
                                           float *__restrict__ out, u16 *__restrict__ yh, u16 *__restrict__ yl, float *__restrict__ ws,
                                           u32 *__restrict__ counters, int N, int K, int T, int S, int tiles_per_split, int tile, int s,
                                           int acc_out) {
    __shared__ float red[SK_WARPS][SK_R * NT * 4][32];
    __shared__ int s_last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int KT = K / 32;
    constexpr int RH = GLU ? SK_R / 2 : SK_R;  // row tiles of each matrix
    const int o_base = tile * (16 * RH);
    const int kt0 = s * tiles_per_split;
    const int kt1 = min(KT, kt0 + tiles_per_split);
    float acc[SK_R][NT][4];
#pragma unroll
    for (int r = 0; r < SK_R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[r][j][c] = 0.0f;

    RawA ca[SK_R][2], na[SK_R][2];
    RawB cb[NT], nb[NT];
    auto load_w = [&](int kt, RawA (&ra)[SK_R][2]) {
#pragma unroll
        for (int r = 0; r < SK_R; ++r) {
            const bool second = GLU && r >= RH;
            const void *q = second ? wq2 : wq;
            const u16 *d = second ? wd2 : wd;
            const int o = o_base + (r % RH) * 16 + g;
            load_raw<FMT>(q, d, N, K, KT, o, kt, t, ra[r][0]);
            load_raw<FMT>(q, d, N, K, KT, o + 8, kt, t, ra[r][1]);
        }
    };
    auto load_x = [&](int kt, RawB (&rb)[NT]) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int tok = g + 8 * j;
            if (tok < T) {
                const long long off = (long long)tok * K + kt * 32 + 8 * t;
                rb[j].h = *(const uint4 *)(xh + off);
                rb[j].l = *(const uint4 *)(xl + off);
            } else {
                rb[j].h = make_uint4(0u, 0u, 0u, 0u);
                rb[j].l = rb[j].h;
            }
        }
    };
    // A programmatic dependent launch (when the host asks for one): the kernel after this one
    // may launch now (its blocks take the slots this grid leaves), and this warp's first
    // weight tile loads before the wait for the kernel before (no kernel of the chain writes
    // the weights); x, the split partials, the counters and the outputs only after it, in
    // every thread (the epilogue's stores are spread over the block). (A second tile before
    // the wait, into the next-tile registers, measured no faster and took the 32-row bf16
    // kernels from 76 to 96 registers: fifty-eighth session.)
    griddep_launch();
    int kt = kt0 + warp;
    if (kt < kt1) load_w(kt, ca);
    griddep_wait();
    if (kt < kt1) load_x(kt, cb);
    for (; kt < kt1; kt += SK_WARPS) {
        const bool more = kt + SK_WARPS < kt1;
        if (more) {
            load_w(kt + SK_WARPS, na);
            load_x(kt + SK_WARPS, nb);
        }
        u32 bh[NT][4], bl[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            bh[j][0] = cb[j].h.x; bh[j][1] = cb[j].h.y; bh[j][2] = cb[j].h.z; bh[j][3] = cb[j].h.w;
            bl[j][0] = cb[j].l.x; bl[j][1] = cb[j].l.y; bl[j][2] = cb[j].l.z; bl[j][3] = cb[j].l.w;
        }
#pragma unroll
        for (int r = 0; r < SK_R; ++r) {
            u32 ga[4], gb[4];
            float da, db;
            decode_a<FMT>(ca[r][0], ga, da);
            decode_a<FMT>(ca[r][1], gb, db);
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                if (FMT == FMT_BF16 || FMT == FMT_BF16P) {
                    mma_bf16_16816(acc[r][j], ga[0], gb[0], ga[1], gb[1], bh[j][0], bh[j][1]);
                    mma_bf16_16816(acc[r][j], ga[0], gb[0], ga[1], gb[1], bl[j][0], bl[j][1]);
                    mma_bf16_16816(acc[r][j], ga[2], gb[2], ga[3], gb[3], bh[j][2], bh[j][3]);
                    mma_bf16_16816(acc[r][j], ga[2], gb[2], ga[3], gb[3], bl[j][2], bl[j][3]);
                } else {
                    float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    mma_bf16_16816(tmp, ga[0], gb[0], ga[1], gb[1], bh[j][0], bh[j][1]);
                    mma_bf16_16816(tmp, ga[0], gb[0], ga[1], gb[1], bl[j][0], bl[j][1]);
                    mma_bf16_16816(tmp, ga[2], gb[2], ga[3], gb[3], bh[j][2], bh[j][3]);
                    mma_bf16_16816(tmp, ga[2], gb[2], ga[3], gb[3], bl[j][2], bl[j][3]);
                    acc[r][j][0] = fmaf(da, tmp[0], acc[r][j][0]);
                    acc[r][j][1] = fmaf(da, tmp[1], acc[r][j][1]);
                    acc[r][j][2] = fmaf(db, tmp[2], acc[r][j][2]);
                    acc[r][j][3] = fmaf(db, tmp[3], acc[r][j][3]);
                }
            }
        }
        if (more) {
#pragma unroll
            for (int r = 0; r < SK_R; ++r) { ca[r][0] = na[r][0]; ca[r][1] = na[r][1]; }
#pragma unroll
            for (int j = 0; j < NT; ++j) cb[j] = nb[j];
        }
    }
    block_trace_end();  // warp 0's main loop end (a no-op unless traced)

#pragma unroll
    for (int r = 0; r < SK_R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) red[warp][(r * NT + j) * 4 + c][lane] = acc[r][j][c];
    __syncthreads();

    // Fixed-order sum over the warps; value (v, lane) -> (r, j, c) -> (o, tok). GLU: v of the
    // gate's rows and v + VH, the same (j, c) of the up's, together.
    constexpr int VH = RH * NT * 4;
    const int NV = VH * 32;
    for (int idx = threadIdx.x; idx < NV; idx += blockDim.x) {
        const int ln = idx & 31, v = idx >> 5;
        const float sum = ((red[0][v][ln] + red[1][v][ln]) + red[2][v][ln]) + red[3][v][ln];
        const int c = v & 3, j = (v >> 2) % NT, r = (v >> 2) / NT;
        const int o = o_base + r * 16 + (ln >> 2) + (c >= 2 ? 8 : 0);
        const int tok = 8 * j + 2 * (ln & 3) + (c & 1);
        if (o < N && tok < T) {
            if (GLU) {
                const int v2 = v + VH;
                const float up = ((red[0][v2][ln] + red[1][v2][ln]) + red[2][v2][ln]) + red[3][v2][ln];
                if (S == 1) {
                    glu_store(yh, yl, (long long)tok * N + o, sum, up);
                } else {
                    ws[((long long)s * 2 * N + o) * 16 + tok] = sum;
                    ws[((long long)s * 2 * N + N + o) * 16 + tok] = up;
                }
            } else if (S == 1) {
                float *d = out + (long long)tok * N + o;
                *d = acc_out ? *d + sum : sum;
            } else {
                ws[((long long)s * N + o) * 16 + tok] = sum;
            }
        }
    }
    if (S == 1) return;

    // Split-k: the last block of this column tile sums the S partials in split order.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 prev = atomicAdd(&counters[tile], 1u);
        s_last = (prev == (u32)(S - 1));
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const long long stride = (long long)(GLU ? 2 : 1) * N * 16;
    for (int idx = threadIdx.x; idx < 16 * RH * 16; idx += blockDim.x) {
        const int o = o_base + idx / 16, tok = idx % 16;
        if (o < N && tok < T) {
            const float sum = split_sum(ws + (long long)o * 16 + tok, stride, S);
            if (GLU) {
                glu_store(yh, yl, (long long)tok * N + o, sum, split_sum(ws + (long long)(N + o) * 16 + tok, stride, S));
            } else {
                float *d = out + (long long)tok * N + o;
                *d = acc_out ? *d + sum : sum;
            }
        }
    }
    if (threadIdx.x == 0) counters[tile] = 0u;
}

// Up to 3 matrices of one K (and one x) in one launch: blocks [0, c1) take matrix 0, [c1, c2)
// matrix 1, [c2, grid) matrix 2; matrix i has ceil(n_i / (16 R)) column tiles x s_i k splits
// of tps_i k tiles (the host passes one split-k for the launch, from the matrices' total
// tiles), its split partials after those of the split matrices before it (s_j > 1) and its
// tile counters after those of the matrices before it. acc_out != 0: out += the product
// (add_assign's f32 add), else out = the product.
#define SKINNY(NAME, FMT, NT, R, MINB)                                                                                           \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                                                      \
        NAME(const void *wq0, const u16 *wd0, float *out0, int n0, int s0, int tps0, const void *wq1, const u16 *wd1, float *out1,  \
             int n1, int s1, int tps1, const void *wq2, const u16 *wd2, float *out2, int n2, int s2, int tps2, int c1, int c2,      \
             const u16 *xh, const u16 *xl, float *ws, u32 *counters, int K, int T, int acc_out) {                                 \
        const int bx = blockIdx.x, sel = bx < c1 ? 0 : bx < c2 ? 1 : 2;                                                         \
        const int nb0 = (n0 + 16 * R - 1) / (16 * R), nb1 = (n1 + 16 * R - 1) / (16 * R);                                        \
        const void *wq = sel == 0 ? wq0 : sel == 1 ? wq1 : wq2;                                                                 \
        const u16 *wd = sel == 0 ? wd0 : sel == 1 ? wd1 : wd2;                                                                  \
        float *out = sel == 0 ? out0 : sel == 1 ? out1 : out2;                                                                  \
        const int n = sel == 0 ? n0 : sel == 1 ? n1 : n2, sp = sel == 0 ? s0 : sel == 1 ? s1 : s2;                              \
        const int tps = sel == 0 ? tps0 : sel == 1 ? tps1 : tps2;                                                               \
        const long long w1 = s0 > 1 ? (long long)s0 * n0 * 16 : 0, w2 = w1 + (s1 > 1 ? (long long)s1 * n1 * 16 : 0);            \
        const long long wo = sel == 0 ? 0 : sel == 1 ? w1 : w2;                                                                 \
        const int co = sel == 0 ? 0 : sel == 1 ? nb0 : nb0 + nb1;                                                               \
        const int local = bx - (sel == 0 ? 0 : sel == 1 ? c1 : c2), nb = (n + 16 * R - 1) / (16 * R);                           \
        skinny_mma<FMT, NT, R, 0>(wq, wd, nullptr, nullptr, xh, xl, out, nullptr, nullptr, ws + wo, counters + co, n, K, T, sp, tps, \
                                  local % nb, local / nb, acc_out);                                                          \
    }

// Four matrices of one K (and one x) in one launch (SKINNY4: a Gated DeltaNet layer's q / k / v,
// z, b, a; a gated attention layer's q, gate, k, v): SKINNY's launch with one more matrix, blocks
// [c3, grid) taking it, one split-k (sp splits of tps k tiles) for all four, and each matrix's
// split partials at ws + wo_i and tile counters at counters + co_i as the host lays them out (the
// offsets SKINNY computes). Kernels of their own, so that the launches of 1-3 matrices keep
// SKINNY's code and occupancy: its n1 kernels built as these took 72 registers on an H100 where
// SKINNY's take 78 (7 blocks per SM for 6), and their launches of more than one wave (a 1088-block
// gate / up) ran 13% slower for the longer last wave.
#define SKINNY4(NAME, FMT, NT, R, MINB)                                                                                           \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                                                      \
        NAME(const void *wq0, const u16 *wd0, float *out0, int n0, const void *wq1, const u16 *wd1, float *out1, int n1,          \
             const void *wq2, const u16 *wd2, float *out2, int n2, const void *wq3, const u16 *wd3, float *out3, int n3, int sp,   \
             int tps, int c1, int c2, int c3, long long wo1, long long wo2, long long wo3, int co1, int co2, int co3,              \
             const u16 *xh, const u16 *xl, float *ws, u32 *counters, int K, int T, int acc_out) {                                \
        const int bx = blockIdx.x, sel = bx < c1 ? 0 : bx < c2 ? 1 : bx < c3 ? 2 : 3;                                          \
        const void *wq = sel == 0 ? wq0 : sel == 1 ? wq1 : sel == 2 ? wq2 : wq3;                                                \
        const u16 *wd = sel == 0 ? wd0 : sel == 1 ? wd1 : sel == 2 ? wd2 : wd3;                                                 \
        float *out = sel == 0 ? out0 : sel == 1 ? out1 : sel == 2 ? out2 : out3;                                                \
        const int n = sel == 0 ? n0 : sel == 1 ? n1 : sel == 2 ? n2 : n3;                                                      \
        const long long wo = sel == 0 ? 0 : sel == 1 ? wo1 : sel == 2 ? wo2 : wo3;                                              \
        const int co = sel == 0 ? 0 : sel == 1 ? co1 : sel == 2 ? co2 : co3;                                                    \
        const int local = bx - (sel == 0 ? 0 : sel == 1 ? c1 : sel == 2 ? c2 : c3), nb = (n + 16 * R - 1) / (16 * R);          \
        skinny_mma<FMT, NT, R, 0>(wq, wd, nullptr, nullptr, xh, xl, out, nullptr, nullptr, ws + wo, counters + co, n, K, T, sp, tps, \
                                  local % nb, local / nb, acc_out);                                                          \
    }

// R = output tiles of 16 rows per warp (32 or 64 rows per block): 2 for most shapes, 4 for
// very tall matrices (the lm_head), where x is re-read from L2 once per block.
SKINNY(skinny_bf16_n1, FMT_BF16, 1, 2, 5)
SKINNY(skinny_bf16_n2, FMT_BF16, 2, 2, 5)
SKINNY(skinny_q8_0_n1, FMT_Q8_0, 1, 2, 5)
SKINNY(skinny_q8_0_n2, FMT_Q8_0, 2, 2, 5)
SKINNY(skinny_q4_0_n1, FMT_Q4_0, 1, 2, 5)
SKINNY(skinny_q4_0_n2, FMT_Q4_0, 2, 2, 5)
SKINNY(skinny_bf16p_n1, FMT_BF16P, 1, 2, 5)
SKINNY(skinny_bf16p_n2, FMT_BF16P, 2, 2, 5)
SKINNY(skinny_bf16p_n1_r4, FMT_BF16P, 1, 4, 4)
SKINNY(skinny_bf16p_n2_r4, FMT_BF16P, 2, 4, 3)
SKINNY(skinny_bf16_n1_r4, FMT_BF16, 1, 4, 4)
SKINNY(skinny_bf16_n2_r4, FMT_BF16, 2, 4, 3)
SKINNY(skinny_q8_0_n1_r4, FMT_Q8_0, 1, 4, 4)
SKINNY(skinny_q8_0_n2_r4, FMT_Q8_0, 2, 4, 3)
SKINNY(skinny_q4_0_n1_r4, FMT_Q4_0, 1, 4, 4)
SKINNY(skinny_q4_0_n2_r4, FMT_Q4_0, 2, 4, 3)

// Four matrices: 32-row tiles (a launch of four runs these whatever its height and row count:
// the 64-row kernels change no bit).
SKINNY4(skinny4_bf16_n1, FMT_BF16, 1, 2, 5)
SKINNY4(skinny4_bf16_n2, FMT_BF16, 2, 2, 5)
SKINNY4(skinny4_bf16p_n1, FMT_BF16P, 1, 2, 5)
SKINNY4(skinny4_bf16p_n2, FMT_BF16P, 2, 2, 5)
SKINNY4(skinny4_q8_0_n1, FMT_Q8_0, 1, 2, 5)
SKINNY4(skinny4_q8_0_n2, FMT_Q8_0, 2, 2, 5)
SKINNY4(skinny4_q4_0_n1, FMT_Q4_0, 1, 2, 5)
SKINNY4(skinny4_q4_0_n2, FMT_Q4_0, 2, 2, 5)

// Gate and up of one K (and one x) in one launch, the SiLU product written as the down
// projection's bf16 hi / lo x (yh / yl, [T, n]): a block per (column tile of 8 R rows of each,
// split), tile-major as SKINNY's; the host passes the split-k of the gate / up launch of SKINNY
// (from both matrices' 32-row tiles), so every gate and up sum has SKINNY's bits and the x has
// silu_mul_split's. The split partials: gate rows at ws[0..n), up at [n..2n) per split; a
// counter per column tile. Never accumulates.
#define SKINNY_GLU(NAME, FMT, NT, R, MINB)                                                                                       \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                                                      \
        NAME(const void *wqg, const u16 *wdg, const void *wqu, const u16 *wdu, int n, int sp, int tps, const u16 *xh,            \
             const u16 *xl, u16 *yh, u16 *yl, float *ws, u32 *counters, int K, int T) {                                          \
        const int nb = (n + 8 * R - 1) / (8 * R);                                                                                \
        skinny_mma<FMT, NT, R, 1>(wqg, wdg, wqu, wdu, xh, xl, nullptr, yh, yl, ws, counters, n, K, T, sp, tps, blockIdx.x % nb, \
                                  blockIdx.x / nb, 0);                                                                           \
    }

SKINNY_GLU(skinny_glu_bf16_n1, FMT_BF16, 1, 2, 5)
SKINNY_GLU(skinny_glu_bf16_n2, FMT_BF16, 2, 2, 5)
SKINNY_GLU(skinny_glu_bf16p_n1, FMT_BF16P, 1, 2, 5)
SKINNY_GLU(skinny_glu_bf16p_n2, FMT_BF16P, 2, 2, 5)
SKINNY_GLU(skinny_glu_q8_0_n1, FMT_Q8_0, 1, 2, 5)
SKINNY_GLU(skinny_glu_q8_0_n2, FMT_Q8_0, 2, 2, 5)
SKINNY_GLU(skinny_glu_q4_0_n1, FMT_Q4_0, 1, 2, 5)
SKINNY_GLU(skinny_glu_q4_0_n2, FMT_Q4_0, 2, 2, 5)
SKINNY_GLU(skinny_glu_bf16_n1_r4, FMT_BF16, 1, 4, 4)
SKINNY_GLU(skinny_glu_bf16_n2_r4, FMT_BF16, 2, 4, 3)
SKINNY_GLU(skinny_glu_bf16p_n1_r4, FMT_BF16P, 1, 4, 4)
SKINNY_GLU(skinny_glu_bf16p_n2_r4, FMT_BF16P, 2, 4, 3)
SKINNY_GLU(skinny_glu_q8_0_n1_r4, FMT_Q8_0, 1, 4, 4)
SKINNY_GLU(skinny_glu_q8_0_n2_r4, FMT_Q8_0, 2, 4, 3)
SKINNY_GLU(skinny_glu_q4_0_n1_r4, FMT_Q4_0, 1, 4, 4)
SKINNY_GLU(skinny_glu_q4_0_n2_r4, FMT_Q4_0, 2, 4, 3)

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
        const float w = load_w<false>(fmt, wq, wd, o, k, K);  // never FMT_BF16P (K % 32 != 0 or f32 / f16)
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

// Rows n0 .. n0 + rows - 1 of a fragment-order bf16 matrix (FMT_BF16P) back to row-major
// [rows, cols] (for the cuBLAS prefill path; cols % 32 == 0). Grid: one block per row; a
// thread moves 8 values (a k run that is contiguous in both layouts) as one 16-byte load and
// store. (One value per thread, with a 64-bit division each, took ~4x the copy time.)
extern "C" __global__ void unpack_bf16p(const u16 *__restrict__ p, u16 *__restrict__ out, long long n0, int rows, int cols) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    for (int c = threadIdx.x * 8; c < cols; c += blockDim.x * 8)
        *(uint4 *)(out + (long long)r * cols + c) = *(const uint4 *)(p + bf16p_index(n0 + r, c, cols));
}

// The value of weight (o, k) of a block-format matrix as the skinny and Q8_0A8 kernels
// read it: the f16 scale times the code, exact in f32 (at most 11 + 8 significant bits).
// fmt: FMT_Q8_0, FMT_Q4_0 (CudaWeightBuf's repacked layouts), FMT_Q8A8, FMT_Q4A8 (their tiles of
// 16 rows over kbp blocks; backend.rs, repack_q8_a8 / repack_q4_a8).
__device__ __forceinline__ float quant_weight(int fmt, const void *__restrict__ qs, const u16 *__restrict__ d, long long o, int k,
                                              int K, int kbp) {
    const int KT = K / 32, b = k / 32, kk = k % 32;
    if (fmt == FMT_Q8_0) return f16_to_f32(d[o * KT + b]) * (float)((const i8 *)qs)[o * K + k];
    if (fmt == FMT_Q4_0) {
        const u32 w = ((const u32 *)qs)[(o * KT + b) * 4 + kk / 8];
        const int i = kk % 8, shift = (i & 1) ? 16 + 2 * (i - 1) : 2 * i;
        return f16_to_f32(d[o * KT + b]) * (float)((int)((w >> shift) & 0xfu) - 8);
    }
    const long long pb = (o / 16) * kbp + b;
    const int r = (int)(o % 16), g = r % 8, hi = r / 8;
    const float sc = f16_to_f32(d[(pb * 8 + g) * 2 + hi]);
    const u8 *q = (const u8 *)qs;
    if (fmt == FMT_Q8A8) return sc * (float)(i8)q[pb * 512 + (g * 4 + (kk % 16) / 4) * 16 + ((kk / 16) * 2 + hi) * 4 + kk % 4];
    const int j = kk % 16;
    const u8 byte = q[pb * 256 + (g * 4 + j / 4) * 8 + hi * 4 + j % 4];
    return sc * (float)((int)(kk < 16 ? byte & 0xfu : byte >> 4) - 8);
}

// Rows n0 .. n0 + rows - 1 of a block-format weight, dequantized and split into row-major
// bf16 hi + lo [rows, cols] (W = hi + lo to ~16 significant bits; the cuBLAS prefill of the
// quantized formats, three products hi x + lo x_hi). Grid: one block per row; a thread
// splits 8 consecutive values and stores each half as one 16-byte store (cols % 32 == 0).
// lo == null: hi only (the fast prefill's one product).
extern "C" __global__ void unpack_quant_hilo(int fmt, const void *__restrict__ qs, const u16 *__restrict__ d, u16 *__restrict__ hi,
                                             u16 *__restrict__ lo, long long n0, int rows, int cols, int kbp) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const long long o = n0 + r;
    for (int c = threadIdx.x * 8; c < cols; c += blockDim.x * 8) {
        u32 h[4], l[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            split_bf16x2(quant_weight(fmt, qs, d, o, c + 2 * j, cols, kbp), quant_weight(fmt, qs, d, o, c + 2 * j + 1, cols, kbp),
                         h[j], l[j]);
        const long long i = (long long)r * cols + c;
        *(uint4 *)(hi + i) = make_uint4(h[0], h[1], h[2], h[3]);
        if (lo) *(uint4 *)(lo + i) = make_uint4(l[0], l[1], l[2], l[3]);
    }
}

// x [T, K] f32 quantized to q8_0 per 32-value block as a8_quant_x quantizes it (the codes and
// the f16 scale of a8_store_block), the dequantized values (scale x code) split into bf16 hi +
// lo: what the Q8_0A8 / Q4_0A8 product multiplies, for the cuBLAS prefill path. One warp per
// (token, block). lo == null: hi only.
extern "C" __global__ void a8_split_x(const float *__restrict__ x, u16 *__restrict__ hi, u16 *__restrict__ lo, int T, int K) {
    const long long wid = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (wid >= (long long)T * (K / 32)) return;
    const long long i = wid * 32 + lane;
    const float v = x[i];
    const float amax = warp_max(fabsf(v));
    const float dd = amax / 127.0f;
    float id = dd != 0.0f ? 1.0f / dd : 0.0f;
    if (fabsf(id) == __int_as_float(0x7f800000)) id = 0.0f;
    const float q = (float)(int)roundf(__fmul_rn(v, id));
    u32 h, l;
    split_bf16x2(f16_to_f32(f32_to_f16_bits(dd)) * q, 0.0f, h, l);
    hi[i] = (u16)(h & 0xffffu);
    if (lo) lo[i] = (u16)(l & 0xffffu);
}

// f32 -> bf16 hi/lo split (for the cuBLAS prefill path): 4 values per thread (a 16-byte
// load, two 8-byte stores) where the three pointers allow it, else one. lo == null: hi only.
extern "C" __global__ void split_bf16(const float *x, u16 *hi, u16 *lo, long long n) {
    griddep_launch();  // a skinny matmul (launched programmatically) may start
    const long long t0 = blockIdx.x * (long long)blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if ((((unsigned long long)x & 15) | ((unsigned long long)hi & 7) | ((unsigned long long)lo & 7)) == 0) {
        const long long n4 = n >> 2;
        for (long long i = t0; i < n4; i += step) {
            const float4 v = ((const float4 *)x)[i];
            u32 h0, l0, h1, l1;
            split_bf16x2(v.x, v.y, h0, l0);
            split_bf16x2(v.z, v.w, h1, l1);
            ((uint2 *)hi)[i] = make_uint2(h0, h1);
            if (lo) ((uint2 *)lo)[i] = make_uint2(l0, l1);
        }
        done = n4 << 2;
    }
    for (long long i = done + t0; i < n; i += step) {
        u32 h, l;
        split_bf16x2(x[i], 0.0f, h, l);
        hi[i] = (u16)(h & 0xffffu);
        if (lo) lo[i] = (u16)(l & 0xffffu);
    }
}

#endif  // !A8_WQ4

// ---------------------------------------------------------------------------------------
// Q8_0A8: q8_0 weights x activations quantized to q8_0 (ggml's CPU q8_0 dot), on the int8
// tensor cores (mma m16n8k32 s8.s8.s32). Contract (backend WeightFormat::Q8_0A8, the CPU
// backend's a8panel): per output (row r, feature o), the blocks in chunks of A8_CB = 32
// (dflash_backend::A8_CHUNK_BLOCKS; the last chunk may be shorter):
//     acc_c = 0; for b in chunk c (in order): acc_c = fma((float)isum_b, d_w[o,b] * d_x[r,b], acc_c)
//     out = acc_0 + acc_1 + ... (plain f32 adds, chunk order)
// with isum_b the exact int32 block dot. Each chunk's blocks are accumulated by ONE thread, in
// block order, and the chunk sums are added in chunk order, so results are bit-identical to
// the CPU transcription and independent of the row count and of the launch shape.
#define A8_CB 32

// The weights' bytes per (16-row tile, 32-value block) and the scale that undoes the q4 codes'
// factor of 16. The module is compiled twice (registry.rs, Module::MatmulQ4): as is for
// WeightFormat::Q8_0A8 (512 bytes: int8 A fragments, a lane's 16 bytes), and with A8_WQ4 for
// WeightFormat::Q4_0A8 (256 bytes: a lane's 8 bytes are rows g and g + 8's q4_0 bytes
// 4t .. 4t + 3 of the block, low nibbles the codes of k = 4t .., high nibbles k = 16 + 4t ..;
// a8_frag widens them). The same kernels, launch shapes and shared memory either way.
// The shared-memory stages hold A8_WB bytes per tile and block (Q4_0A8: half of Q8_0A8's).
#ifdef A8_WQ4
#define A8_WB 256
#else
#define A8_WB 512
#endif

#ifndef A8_WQ4
// x [T, K] f32 -> q8_0 codes in mma B-fragment order + f32 scales (the f16 value), padded
// to NT*8 tokens and KBp blocks with zeros (layout and arithmetic: a8_store_block in
// prelude.cuh, byte-exact with dflash_quant::quantize_q8_0).
// With up != nullptr the quantized x is silu(x) * up (silu_mul's arithmetic, same bits).
extern "C" __global__ void a8_quant_x(const float *__restrict__ x, const float *__restrict__ up, int T, int K, int NT, int KBp,
                                      u32 *__restrict__ xq, float *__restrict__ xd) {
    // One warp per (block, token); lane = position in the block. The matmul that reads xq may
    // start now (it prefetches its weights, then waits for this grid).
    griddep_launch();
    griddep_wait();
    const int ntok = NT * 8;
    const int wid = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (wid >= KBp * ntok) return;
    const int b = wid / ntok, tok = wid % ntok;
    const bool live = tok < T && b < K / 32;
    const long long xi = (long long)tok * K + b * 32 + lane;
    const float v = live ? (up != nullptr ? silu_f(x[xi]) * up[xi] : x[xi]) : 0.0f;
    a8_store_block(v, b, tok, NT, xq, xd);
}
#endif  // !A8_WQ4

__device__ __forceinline__ u32 smem_addr(const void *p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16(u32 s, const void *g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
// L2 eviction priority of the weight stream (read once per call): evict_first keeps it from
// pushing the activations, the KV cache and x out of L2; evict_normal = no hint.
__device__ __forceinline__ u64 l2_stream_policy(int evict_first) {
    u64 p;
    if (evict_first) asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    else asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(p));
    return p;
}
__device__ __forceinline__ void cp_async16_pol(u32 s, const void *g, u64 pol) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(s), "l"(g), "l"(pol) : "memory");
}

// Not volatile: a pure function of its inputs, so the compiler may overlap blocks.
__device__ __forceinline__ void mma_s8_16832(int c[4], const uint4 &a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}
// Exact int -> f32 for |i| < 2^24 (block sums are at most 32 * 128 * 127 in magnitude): one
// I2FP.F32.S32 on sm_86 and later (where the integer add + float subtract of the bits of
// 1.5 * 2^23 take two instructions).
__device__ __forceinline__ float i2f_small(int i) { return __int2float_rn(i); }

// A lane's int8 A fragment of block bb of a stage's (or a piece's) weights `sw`. Q8_0A8: the
// 16 bytes as stored. Q4_0A8: its 8 bytes of q4_0 codes c (0..15), each widened to the byte
// 16 (c - 8) (the nibble moved to the high half, its top bit flipped: one shift and one LOP3
// per word): the fragment of 16 times the widened q8_0 codes, so the mma sums are 16 isum,
// exact in int32 and in f32 (|16 isum| <= 16 * 32 * 8 * 127 < 2^24).
__device__ __forceinline__ uint4 a8_frag(const u8 *sw, int bb, int lane) {
#ifdef A8_WQ4
    const uint2 w = ((const uint2 *)sw)[bb * 32 + lane];
    return make_uint4(((w.x << 4) & 0xf0f0f0f0u) ^ 0x80808080u, ((w.y << 4) & 0xf0f0f0f0u) ^ 0x80808080u,
                      (w.x & 0xf0f0f0f0u) ^ 0x80808080u, (w.y & 0xf0f0f0f0u) ^ 0x80808080u);
#else
    return ((const uint4 *)sw)[bb * 32 + lane];
#endif
}
// The weight scale of a block as the f32 products take it (d_w, the f16 value). Q4_0A8's mma
// sums are 16 isum, so its chain runs fma(16 isum, d_w * d_x, acc16): d_w * d_x is exact (two
// 11-bit significands), and each fma of the 16-times-larger operands rounds 16 times the real
// number the contract's fma(isum, d_w * d_x, acc) rounds (a power of two; every nonzero value
// of the chain is a multiple of 2^-75 and far below f32's largest, so none is subnormal or
// overflows), so acc16 = 16 acc exactly, and A8_CSUM turns a chunk's sum back into the
// contract's, once per chunk instead of a multiply per scale and block: the same bits.
__device__ __forceinline__ float a8_dw(u16 h) { return f16_to_f32(h); }
#ifdef A8_WQ4
#define A8_CSUM(x) __fmul_rn((x), 0.0625f)
#else
#define A8_CSUM(x) (x)
#endif

// Token groups per warp (A8_NTW): a warp of a tile runs NTW of its NT token groups of 8, so the
// tile has NT / NTW warps (A8_WPT). The Q4_0A8 twins take both groups of 16 rows in one warp
// (its weight fragment widened, its scales converted and its stage bookkeeping done once for
// both mmas: those kernels are bound by their instruction issue, ncu 81% of the issue slots
// on the lm_head); Q8_0A8 keeps a warp per group (its kernels stream at the memory's rate,
// and more warps hide the latency of the short launches). The bits are the same either way:
// each output's chain is still one thread's, block after block. A8_MERGE forces either.
#ifndef A8_MERGE
#ifdef A8_WQ4
#define A8_MERGE 1
#else
#define A8_MERGE 0
#endif
#endif
#define A8_NTW(NT) (A8_MERGE ? (NT) : 1)
// The split kernels' stage bookkeeping stepped on (a8_ksplit): the Q4_0A8 twins only.
#ifndef A8_STEPPED
#ifdef A8_WQ4
#define A8_STEPPED 1
#else
#define A8_STEPPED 0
#endif
#endif
#define A8_WPT(NT) ((NT) / A8_NTW(NT))

// One block (32 k values) of one warp's tile and token groups j0 .. j0 + NTW - 1: an mma per
// group, then the f32 block-ordered update of the warp's 16 x 8 outputs of each group.
template <int NT, int NTW>
__device__ __forceinline__ void a8_block(const u8 *sw, const u32 *ss, const uint2 *sx, const float *sd, int bb, int j0, int lane,
                                         int g, int t, float (&acc)[NTW][4]) {
    const uint4 a = a8_frag(sw, bb, lane);
    const u32 sc = ss[bb * 8 + g];
    const float dw0 = a8_dw((u16)(sc & 0xffffu)), dw1 = a8_dw((u16)(sc >> 16));
#pragma unroll
    for (int jj = 0; jj < NTW; ++jj) {
        const int j = j0 + jj;
        const uint2 bx = sx[(bb * NT + j) * 32 + lane];
        const float2 dx = *(const float2 *)(sd + bb * NT * 8 + j * 8 + 2 * t);
        int c[4] = {0, 0, 0, 0};
        mma_s8_16832(c, a, bx.x, bx.y);
        acc[jj][0] = fmaf(i2f_small(c[0]), __fmul_rn(dw0, dx.x), acc[jj][0]);
        acc[jj][1] = fmaf(i2f_small(c[1]), __fmul_rn(dw0, dx.y), acc[jj][1]);
        acc[jj][2] = fmaf(i2f_small(c[2]), __fmul_rn(dw1, dx.x), acc[jj][2]);
        acc[jj][3] = fmaf(i2f_small(c[3]), __fmul_rn(dw1, dx.y), acc[jj][3]);
    }
}

// A whole stage (A8_KC blocks) of one warp's tile and token groups j0 ..: the int8 mmas of
// HB blocks first (independent, exact), then their f32 updates in block order (the same chain
// as a8_block, block after block), so the chain waits on no load or mma latency but the first
// (HB = the whole stage for one group; half of it for two, to keep the sums in registers).
template <int NT, int NTW>
__device__ __forceinline__ void a8_stage(const u8 *sw, const u32 *ss, const uint2 *sx, const float *sd, int j0, int lane, int g,
                                         int t, float (&acc)[NTW][4]) {
    constexpr int HB = NTW == 1 ? A8_KC : A8_KC / 2;
#pragma unroll
    for (int h = 0; h < A8_KC; h += HB) {
        int c[HB][NTW][4];
#pragma unroll
        for (int bi = 0; bi < HB; ++bi) {
            const uint4 a = a8_frag(sw, h + bi, lane);
#pragma unroll
            for (int jj = 0; jj < NTW; ++jj) {
                const uint2 bx = sx[((h + bi) * NT + j0 + jj) * 32 + lane];
                c[bi][jj][0] = 0, c[bi][jj][1] = 0, c[bi][jj][2] = 0, c[bi][jj][3] = 0;
                mma_s8_16832(c[bi][jj], a, bx.x, bx.y);
            }
        }
#pragma unroll
        for (int bi = 0; bi < HB; ++bi) {
            const int bb = h + bi;
            const u32 sc = ss[bb * 8 + g];
            const float dw0 = a8_dw((u16)(sc & 0xffffu)), dw1 = a8_dw((u16)(sc >> 16));
#pragma unroll
            for (int jj = 0; jj < NTW; ++jj) {
                const float2 dx = *(const float2 *)(sd + bb * NT * 8 + (j0 + jj) * 8 + 2 * t);
                acc[jj][0] = fmaf(i2f_small(c[bi][jj][0]), __fmul_rn(dw0, dx.x), acc[jj][0]);
                acc[jj][1] = fmaf(i2f_small(c[bi][jj][1]), __fmul_rn(dw0, dx.y), acc[jj][1]);
                acc[jj][2] = fmaf(i2f_small(c[bi][jj][2]), __fmul_rn(dw1, dx.x), acc[jj][2]);
                acc[jj][3] = fmaf(i2f_small(c[bi][jj][3]), __fmul_rn(dw1, dx.y), acc[jj][3]);
            }
        }
    }
}

// Up to 3 matrices with the same K (and the same quantized x) in one launch: blocks
// [0, c1) take matrix 0, [c1, c2) matrix 1, [c2, grid) matrix 2.
struct A8Mat {
    const u8 *wq;
    const u16 *wsc;
    float *out;
    int N;
    float *ws;  // chunk sums [chunk][tile][token group][32 lanes][4] (split across blocks only)
    int accum;  // 1: out += the result (one f32 add per output: the bits of add_assign after)
};

// The 4 outputs a lane of a tile's warp stores (rows g / g + 8 of the tile, tokens 2t / 2t + 1
// of token group j): flat index, or -1 past N / T.
__device__ __forceinline__ long long a8_out_index(int N, int T, int tile, int j, int g, int t, int c) {
    const int o = tile * 16 + g + (c >= 2 ? 8 : 0);
    const int tok = 8 * j + 2 * t + (c & 1);
    return o < N && tok < T ? (long long)tok * N + o : -1;
}
// accum: the values the outputs are added to, loaded right after the grid dependency wait
// (their producer is done), so the final store waits for no load.
__device__ __forceinline__ void a8_prev(const A8Mat &m, int T, int tile, int j, int g, int t, float (&prev)[4]) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const long long i = a8_out_index(m.N, T, tile, j, g, t, c);
        prev[c] = m.accum && i >= 0 ? m.out[i] : 0.0f;
    }
}
// Store a lane's 4 outputs: out = r, or out = prev + r (accum: add_assign's bits after a plain
// store; each output is written by one thread).
__device__ __forceinline__ void a8_put4(const A8Mat &m, int T, int tile, int j, int g, int t, const float (&r)[4],
                                        const float (&prev)[4]) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const long long i = a8_out_index(m.N, T, tile, j, g, t, c);
        if (i >= 0) m.out[i] = m.accum ? __fadd_rn(prev[c], r[c]) : r[c];
    }
}

// A Q8_0A8 kernel's pipeline prologue (whole-K and split): the weights of the first PRE
// stages before the dependency wait (griddepcontrol.wait: the kernel before has finished),
// then the x of the first S - 1 stages with the weights of the others; S - 1 commit groups
// after the wait, whatever PRE, so the main loop's waits count the same.
template <int S, int PRE, class IW, class IX>
__device__ __forceinline__ void a8_prologue(int nst, const IW &issue_w, const IX &issue_x) {
#pragma unroll
    for (int s = 0; s < PRE; ++s) {
        if (s < nst) issue_w(s, s);
        cp_async_commit();
    }
    griddep_wait();
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (s < nst) issue_x(s, s);
        if (s >= PRE && s < nst) issue_w(s, s);
        cp_async_commit();
    }
}

// Whole-K: a block = W tiles of 16 output features x NT token groups of 8: one warp per
// (tile, token group), over all of K (chunk after chunk: the chain restarts every A8_CB
// blocks = 4 stages and the chunk sums are added in order); the NT warps of a tile share its
// weight stages, all warps share the x stages. S-stage cp.async pipeline of A8_KC blocks per
// stage (weights, scales, x codes and x scales all land in shared memory; each thread reads
// only whole fragments).
template <int NT, int W, int S>
__device__ __forceinline__ void a8_mma(const A8Mat &m, int cta, const u32 *__restrict__ xq, const float *__restrict__ xd, int K,
                                       int T, int ef) {
    extern __shared__ __align__(16) u8 a8_smem[];
    constexpr int NTW = A8_NTW(NT), WPT = A8_WPT(NT);  // token groups per warp, warps per tile
    constexpr int NTH = 32 * W * WPT;
    constexpr int XQ_B = A8_KC * NT * 256, XD_B = A8_KC * NT * 32, WQ_B = A8_KC * A8_WB, WS_B = A8_KC * 32;
    constexpr int WL_B = WQ_B;
    constexpr int STAGE_B = XQ_B + XD_B + W * (WQ_B + WS_B);
    constexpr int XQ_PER_T = XQ_B / 16 / NTH;
    constexpr int W_PER_T = WL_B / 16 / (32 * WPT);  // 16-byte weight copies per thread and stage
    static_assert(W_PER_T * 32 * WPT * 16 == WL_B, "weight stage split");
    constexpr int ST_PER_CHUNK = A8_CB / A8_KC;
    static_assert(XQ_PER_T * NTH * 16 == XQ_B, "x stage split");
    static_assert(XD_B / 16 <= NTH, "x scale stage split");
    static_assert(ST_PER_CHUNK * A8_KC == A8_CB, "whole stages per chunk");
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int tl = warp / WPT, jw = warp % WPT, j0 = jw * NTW;
    const int KB = K / 32, KBp = (KB + A8_KC - 1) / A8_KC * A8_KC, nst = KBp / A8_KC;
    const int N = m.N;
    const int tile = cta * W + tl;
    const bool tile_ok = tile * 16 < N;
    const u32 s0 = smem_addr(a8_smem);
    const u32 s_wq = s0 + XQ_B + XD_B + tl * (WQ_B + WS_B);
    // Per-thread global sources at stage 0 (advanced by a constant stride per stage).
    const u8 *gx = (const u8 *)xq + tid * 16;
    const u8 *gd = (const u8 *)xd + tid * 16;
    const long long pb0 = (long long)(tile_ok ? tile : 0) * KBp;
    const u8 *gw = m.wq + pb0 * A8_WB + (jw * 32 + lane) * 16;
    const u8 *gs = (const u8 *)m.wsc + pb0 * 32 + lane * 16;

    auto issue_x = [&](int st, int slot) {
        const u32 base = s0 + slot * STAGE_B;
        const long long xo = (long long)st * XQ_B, dofs = (long long)st * XD_B;
#pragma unroll
        for (int u = 0; u < XQ_PER_T; ++u) cp_async16(base + (tid + u * NTH) * 16, gx + xo + u * NTH * 16);
        if (tid < XD_B / 16) cp_async16(base + XQ_B + tid * 16, gd + dofs);
    };
    const u64 pol = l2_stream_policy(ef);
    auto issue_w = [&](int st, int slot) {
        if (tile_ok) {
            const u32 wb = s_wq + slot * STAGE_B + (jw * 32 + lane) * 16;
            const long long wo = (long long)st * WL_B, so = (long long)st * WS_B;
#pragma unroll
            for (int i = 0; i < W_PER_T; ++i) cp_async16_pol(wb + i * WPT * 512, gw + wo + i * WPT * 512, pol);
            if (jw == 0 && lane < WS_B / 16) cp_async16_pol(s_wq + slot * STAGE_B + WQ_B + lane * 16, gs + so, pol);
        }
    };
    auto issue = [&](int st, int slot) {
        issue_x(st, slot);
        issue_w(st, slot);
    };

    // The weights of the first stage before x exists (PDL: while the kernel before runs), then
    // the x of the first S - 1 stages with the weights of the others: groups W0, G0 .. G(S-2)
    // (G_s = X_s + W_s, W0 already in flight); stage st needs G(st), after which at most
    // S - 2 groups are newer, as in the steady state. One stage, not S - 1: the prefetch shares
    // each SM's load path with the latency-bound kernel before (a norm, the attention's chain),
    // whose loads wait behind it (H200, fifteenth session: 8B ctx 512 0.589 -> 0.574 ms with the
    // later triggers of rms_norm_q8, qk_norm_rope_kv and the combine; no stage: slower).
    griddep_launch();
    a8_prologue<S, 1>(nst, issue_w, issue_x);
    float prev[NTW][4];
#pragma unroll
    for (int jj = 0; jj < NTW; ++jj) a8_prev(m, tile_ok ? T : 0, tile, j0 + jj, g, t, prev[jj]);
    float acc[NTW][4] = {};
    float tot[NTW][4] = {};

    for (int st = 0; st < nst; ++st) {
        cp_async_wait<S - 2>();
        __syncthreads();
        const int nx = st + S - 1;
        if (nx < nst) issue(nx, nx % S);
        cp_async_commit();
        if (tile_ok) {
            const u8 *base = a8_smem + (st % S) * STAGE_B;
            const uint2 *sx = (const uint2 *)base;
            const float *sd = (const float *)(base + XQ_B);
            const u8 *sw = base + XQ_B + XD_B + tl * (WQ_B + WS_B);
            const u32 *ss = (const u32 *)(sw + WQ_B);
            const int nb = KB - st * A8_KC;
            if (nb >= A8_KC) {
                a8_stage<NT, NTW>(sw, ss, sx, sd, j0, lane, g, t, acc);
            } else {
                for (int bb = 0; bb < nb; ++bb) a8_block<NT, NTW>(sw, ss, sx, sd, bb, j0, lane, g, t, acc);
            }
            // End of a chunk: out = acc_0, then out += acc_c in chunk order.
            if (st % ST_PER_CHUNK == ST_PER_CHUNK - 1 || st == nst - 1) {
#pragma unroll
                for (int jj = 0; jj < NTW; ++jj)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const float v = A8_CSUM(acc[jj][c]);
                        tot[jj][c] = st < ST_PER_CHUNK ? v : __fadd_rn(tot[jj][c], v);
                        acc[jj][c] = 0.0f;
                    }
            }
        }
    }
    cp_async_wait<0>();
    block_trace_end();  // the main loop's end (a no-op unless traced)
    if (!tile_ok) return;
#pragma unroll
    for (int jj = 0; jj < NTW; ++jj) a8_put4(m, T, tile, j0 + jj, g, t, tot[jj], prev[jj]);
}

// W tiles per block, pipeline depth S (host side: a8_stages in backend.rs); ef: the weight
// stream evict-first in L2.
#define A8(NAME, NT, W, S)                                                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * W * A8_WPT(NT))                                                           \
        NAME(const u8 *wq0, const u16 *ws0, float *out0, int n0, const u8 *wq1, const u16 *ws1, float *out1, int n1,            \
             const u8 *wq2, const u16 *ws2, float *out2, int n2, int c1, int c2, const u32 *xq, const float *xd, int K, int T,  \
             int ef, int accum) {                                                                                                        \
        /* One copy of the body: the matrix picked as a value (block-uniform). */                                             \
        const int bx = blockIdx.x, sel = bx < c1 ? 0 : bx < c2 ? 1 : 2;                                                         \
        const A8Mat m = sel == 0 ? A8Mat{wq0, ws0, out0, n0, nullptr, accum}                                                    \
                      : sel == 1 ? A8Mat{wq1, ws1, out1, n1, nullptr, accum}                                                    \
                                 : A8Mat{wq2, ws2, out2, n2, nullptr, accum};                                                   \
        a8_mma<NT, W, S>(m, bx - (sel == 0 ? 0 : sel == 1 ? c1 : c2), xq, xd, K, T, ef);                                         \
    }
A8(a8_n1_w1, 1, 1, 12)
A8(a8_n1_w2, 1, 2, 8)
A8(a8_n1_w4, 1, 4, 4)
A8(a8_n2_w1, 2, 1, 12)
A8(a8_n2_w2, 2, 2, 8)
A8(a8_n2_w4, 2, 4, 4)

// ---------------------------------------------------------------------------------------
// Q8_0A8, K split over the warps of a block (A8Kernel::Split): a block = W tiles of 16
// features x NT token groups of 8 x KS k-slices, one warp per (slice, tile, token group).
// Slice ks runs the chains of chunks ks, ks + KS, ks + 2 KS, ... (each chunk's chain by one
// thread, block after block, as the contract says). The slices share one S-slot cp.async
// pipeline: stage st = (round r, sub-stage s) holds, for every slice, the A8_KC blocks
// [c A8_CB + s A8_KC, + A8_KC) of its chunk c = r KS + ks (weights, scales, x codes, x
// scales). Each chunk sum goes to shared memory; at the start of each round the warps of
// slice 0 add the sums of the round before to a running total, in chunk order (out = acc_0 +
// acc_1 + ..., the contract's adds; two rounds of slots, whatever K). So the bits are
// those of the whole-K kernel, with KS times its warps per tile: at N = 4096-5120 whole-K
// runs one 4-warp block per SM, whose per-warp latency chain (not HBM) sets its time.
// PAIR (the gate / up projections of a SwiGLU MLP, rounds_apart == 0): m is the gate, m1 the
// up matrix (same N, a multiple of 32); a block's first W / 2 tile warps take gate tiles, the
// others the up tiles of the same features, and instead of storing the two results the block
// writes silu(gate) * up of its 16 W / 2 features as the down projection's Q8_0A8 activation
// (xq2 / xd2, K = N padded to KBp2 blocks; a8_quant_x's arithmetic on silu_mul's output: the
// same bytes; the block's warps take the NT * 8 tokens in turns). Needs 16 W / 2 a multiple of 32.
// tot = v for a tile's first chunk sum, else tot += v (the contract's adds, in chunk order).
__device__ __forceinline__ void a8_fold4(float4 &tot, const float4 v, bool first) {
    if (first) {
        tot = v;
    } else {
        tot.x = __fadd_rn(tot.x, v.x);
        tot.y = __fadd_rn(tot.y, v.y);
        tot.z = __fadd_rn(tot.z, v.z);
        tot.w = __fadd_rn(tot.w, v.w);
    }
}
struct A8Pair {
    A8Mat up;
    u32 *xq2;
    float *xd2;
    int KBp2;
};

// The paired launch's store (PAIR below): the block's gate and up sums (tot, from the
// lanes with `live`) through shared memory (the now idle pipeline stages) into silu(gate) * up
// of its 16 W / 2 features, quantized as the down projection's Q8_0A8 activation.
template <int NT, int W, int KS>
__device__ __forceinline__ void a8_pair_store(const float4 (&tot)[A8_NTW(NT)], bool live, int grp, int N, int T, int tl, int j0, int g,
                                              int t, int warp, int lane, const A8Pair &pair) {
    extern __shared__ __align__(16) u8 a8_smem[];
    constexpr int WH = W / 2, NTW = A8_NTW(NT), WARPS = W * A8_WPT(NT) * KS;
    // [matrix][token][16 WH features].
    float *res = (float *)a8_smem;
    if (live) {
#pragma unroll
        for (int jj = 0; jj < NTW; ++jj) {
            const float r[4] = {tot[jj].x, tot[jj].y, tot[jj].z, tot[jj].w};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int f = (tl % WH) * 16 + g + (c >= 2 ? 8 : 0), tok = 8 * (j0 + jj) + 2 * t + (c & 1);
                res[((tl / WH) * NT * 8 + tok) * 16 * WH + f] = r[c];
            }
        }
    }
    __syncthreads();
    // One warp per token (tokens warp, warp + warps, ...): its 32-feature blocks of
    // silu(gate) * up (silu_mul's arithmetic), quantized as a8_quant_x does; tokens
    // T .. NT*8-1 get zeros.
    for (int tok = warp; tok < NT * 8 && grp * WH * 16 < N; tok += WARPS) {
#pragma unroll
        for (int qb = 0; qb < WH / 2; ++qb) {
            const int f = qb * 32 + lane;
            const float gv = res[tok * 16 * WH + f], uv = res[(NT * 8 + tok) * 16 * WH + f];
            const float v = tok < T ? silu_f(gv) * uv : 0.0f;
            a8_store_block(v, (grp * WH * 16 + qb * 32) / 32, tok, NT, pair.xq2, pair.xd2);
        }
        // The last group zeroes the padding blocks N/32 .. KBp2-1 of its token.
        if ((grp + 1) * WH * 16 >= N && lane == 0) {
            for (int b = N / 32; b < pair.KBp2; ++b) {
#pragma unroll
                for (int e = 0; e < 8; ++e) pair.xq2[((long long)(b * NT + tok / 8) * 32 + (tok % 8) * 4 + (e >> 1)) * 2 + (e & 1)] = 0u;
                pair.xd2[(long long)b * NT * 8 + tok] = 0.0f;
            }
        }
    }
}

template <int NT, int W, int KS, int S, bool PAIR = false>
__device__ __forceinline__ void a8_ksplit(const A8Mat &m_, int cta, const u32 *__restrict__ xq, const float *__restrict__ xd, int K,
                                          int T, int ef, int rounds_apart, const A8Pair pair = A8Pair{}) {
    extern __shared__ __align__(16) u8 a8_smem[];
    constexpr int NTW = A8_NTW(NT), WPT = A8_WPT(NT);  // token groups per warp, warps per tile
    constexpr int SW = 32 * W * WPT;                   // threads per slice
    constexpr int XQ_B = A8_KC * NT * 256, XD_B = A8_KC * NT * 32, WQ_B = A8_KC * A8_WB, WS_B = A8_KC * 32;
    constexpr int SL_B = XQ_B + XD_B + W * (WQ_B + WS_B);  // one slice's part of a stage
    constexpr int STAGE_B = KS * SL_B;
    constexpr int XQ_PER_T = XQ_B / 16 / SW;
    constexpr int W_PER_T = A8_KC * A8_WB / 16 / (32 * WPT);  // as in a8_mma
    static_assert(W_PER_T * 32 * WPT * 16 == A8_KC * A8_WB, "weight stage split");
    constexpr int NS = A8_CB / A8_KC;  // stages per chunk
    static_assert(XQ_PER_T * SW * 16 == XQ_B, "x stage split");
    static_assert(XD_B / 16 <= SW, "x scale stage split");
    static_assert(NS * A8_KC == A8_CB, "whole stages per chunk");
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int ks = warp / (W * WPT), wi = warp % (W * WPT), tl = wi / WPT, jw = wi % WPT, j0 = jw * NTW;
    const int sid = tid % SW;  // thread index within the slice
    const int KB = K / 32, KBp = (KB + A8_KC - 1) / A8_KC * A8_KC, nch = (KB + A8_CB - 1) / A8_CB;
    // rounds_apart > 0 (= the rounds of K): K split across thread blocks too, one round
    // (KS chunks) per block; the chunk sums go to m.ws and a8_sum adds them in chunk order.
    const int r0 = rounds_apart > 0 ? cta % rounds_apart : 0;
    const int grp = rounds_apart > 0 ? cta / rounds_apart : cta;
    const int nst = rounds_apart > 0 ? NS : (nch + KS - 1) / KS * NS;
    constexpr int WH = PAIR ? W / 2 : W;  // tiles of one matrix per block
    static_assert(!PAIR || (W % 2 == 0 && (16 * WH) % 32 == 0), "paired gate / up blocks");
    const A8Mat m = PAIR && tl >= WH ? pair.up : m_;  // a value: the pointers stay in registers
    const int N = m.N;
    const int tile = grp * WH + tl % WH;
    const bool tile_ok = tile * 16 < N;
    const u32 s0 = smem_addr(a8_smem);
    float4 *part = (float4 *)(a8_smem + S * STAGE_B);  // [round parity][slice][W][NT][32 lanes]
    const long long pbt = (long long)(tile_ok ? tile : 0) * KBp;
    // First block of this slice's part of stage st (or -1: no chunk / past the end of K): of
    // round r = st / NS and sub-stage u = st % NS (the main loop steps (r, u) on, no divisions).
    auto first_block_ru = [&](int r, int u) {
        const int c = (r0 + r) * KS + ks, b = c * A8_CB + u * A8_KC;
        return c < nch && b < KB ? b : -1;
    };
    auto first_block = [&](int st) { return first_block_ru(st / NS, st % NS); };
    // A8_STEPPED (the Q4_0A8 twins, whose kernels are bound by their instruction issue): the
    // copies' sources and destinations computed once but for the block offset and the slot
    // (64-bit bases; the stage's offsets in 32 bits: b < KB < 2^16 blocks), and the main loop's
    // slots, rounds and sub-stages stepped on instead of divided. Q4_0A8 step -2% to -4%; the
    // same for Q8_0A8 made its projections no faster alone and its step 1-2% slower (H200,
    // thirty-fourth session), so Q8_0A8 keeps the plain forms. Scheduling only: the same bits.
    const u32 sx0 = s0 + ks * SL_B + sid * 16;
    const u8 *gx0 = (const u8 *)xq + sid * 16, *gd0 = (const u8 *)xd + sid * 16;
    const u32 sw0 = s0 + ks * SL_B + XQ_B + XD_B + tl * (WQ_B + WS_B) + (jw * 32 + lane) * 16;
    const u32 ss0 = s0 + ks * SL_B + XQ_B + XD_B + tl * (WQ_B + WS_B) + WQ_B + lane * 16;
    const u8 *gw0 = m.wq + pbt * A8_WB + (jw * 32 + lane) * 16;
    const u8 *gs0 = (const u8 *)m.wsc + pbt * 32 + lane * 16;
    auto issue_xb = [&](int b, int slot) {
        if (b < 0) return;
        if constexpr (A8_STEPPED) {
            const u32 base = sx0 + slot * STAGE_B;
            const u8 *gx = gx0 + b * (NT * 256);
#pragma unroll
            for (int u = 0; u < XQ_PER_T; ++u) cp_async16(base + u * SW * 16, gx + u * SW * 16);
            if (sid < XD_B / 16) cp_async16(base + XQ_B, gd0 + b * (NT * 32));
        } else {
            const u32 base = s0 + slot * STAGE_B + ks * SL_B;
            const u8 *gx = (const u8 *)xq + (long long)b * (NT * 256);
#pragma unroll
            for (int u = 0; u < XQ_PER_T; ++u) cp_async16(base + (sid + u * SW) * 16, gx + (sid + u * SW) * 16);
            if (sid < XD_B / 16) cp_async16(base + XQ_B + sid * 16, (const u8 *)xd + (long long)b * (NT * 32) + sid * 16);
        }
    };
    const u64 pol = l2_stream_policy(ef & 1);
    auto issue_wb = [&](int b, int slot) {
        if (b < 0 || !tile_ok) return;
        if constexpr (A8_STEPPED) {
            const u32 wb = sw0 + slot * STAGE_B;
            const u8 *gw = gw0 + b * A8_WB;
#pragma unroll
            for (int i = 0; i < W_PER_T; ++i) cp_async16_pol(wb + i * WPT * 512, gw + i * WPT * 512, pol);
            if (jw == 0 && lane < WS_B / 16) cp_async16_pol(ss0 + slot * STAGE_B, gs0 + b * 32, pol);
        } else {
            const u32 wb = s0 + slot * STAGE_B + ks * SL_B + XQ_B + XD_B + tl * (WQ_B + WS_B);
            const u8 *gw = m.wq + (pbt + b) * A8_WB + (jw * 32 + lane) * 16;
#pragma unroll
            for (int i = 0; i < W_PER_T; ++i) cp_async16_pol(wb + (jw * 32 + lane) * 16 + i * WPT * 512, gw + i * WPT * 512, pol);
            if (jw == 0 && lane < WS_B / 16)
                cp_async16_pol(wb + WQ_B + lane * 16, (const u8 *)m.wsc + (pbt + b) * 32 + lane * 16, pol);
        }
    };
    auto issue_x = [&](int st, int slot) { issue_xb(first_block(st), slot); };
    auto issue_w = [&](int st, int slot) { issue_wb(first_block(st), slot); };

    // The first stage's weights before x exists (PDL), then the rest as in a8_mma.
    // ef >> 1 != 0 (bit 1; 3-stage and deeper kernels): S - 1 weight stages before the wait, where
    // the kernel before leaves the memory idle (the down projection after the paired gate / up).
    griddep_launch();
    if (S > 2 && (ef >> 1) != 0) {
        a8_prologue<S, (S > 2 ? S - 1 : 1)>(nst, issue_w, issue_x);
    } else {
        a8_prologue<S, 1>(nst, issue_w, issue_x);
    }
    // The outputs' previous values (accum), by the lanes that store them: slice 0, K within
    // the block.
    float prev[NTW][4];
#pragma unroll
    for (int jj = 0; jj < NTW; ++jj)
        a8_prev(m, !PAIR && ks == 0 && rounds_apart == 0 && tile_ok ? T : 0, tile, j0 + jj, g, t, prev[jj]);
    float acc[NTW][4] = {};
    float4 tot[NTW];
#pragma unroll
    for (int jj = 0; jj < NTW; ++jj) tot[jj] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // Slice 0: add the chunk sums of round r (chunks r KS .. r KS + KS - 1) to tot, in chunk
    // order (tot = acc_0 for chunk 0).
    auto fold = [&](int r) {
        for (int q = 0; q < KS; ++q) {
            const int c = r * KS + q;
            if (c >= nch) break;
#pragma unroll
            for (int jj = 0; jj < NTW; ++jj)
                a8_fold4(tot[jj], part[((((r & 1) * KS + q) * W + tl) * NT + j0 + jj) * 32 + lane], c == 0);
        }
    };
    // Stage st: slot st % S, round rs = st / NS, sub-stage us = st % NS; the stage issued now,
    // nx = st + S - 1: slot nslot, (rn, un). Stepped on, not divided.
    int slot = 0, nslot = S - 1, rs = 0, us = 0, rn = (S - 1) / NS, un = (S - 1) % NS;
    for (int st = 0; st < nst; ++st) {
        cp_async_wait<S - 2>();
        __syncthreads();
        const int nx = st + S - 1;
        if constexpr (!A8_STEPPED) {
            slot = st % S, nslot = nx % S, rs = st / NS, us = st % NS, rn = nx / NS, un = nx % NS;
        }
        if (nx < nst) {
            const int bn = first_block_ru(rn, un);
            issue_wb(bn, nslot);
            issue_xb(bn, nslot);
        }
        cp_async_commit();
        // Round st / NS begins: every chunk of the round before is parked (the barrier above).
        if (KS > 1 && rounds_apart == 0 && ks == 0 && tile_ok && us == 0 && st > 0) fold(rs - 1);
        const int b = first_block_ru(rs, us);
        if (tile_ok && b >= 0) {
            const u8 *base = a8_smem + slot * STAGE_B + ks * SL_B;
            const uint2 *sx = (const uint2 *)base;
            const float *sd = (const float *)(base + XQ_B);
            const u8 *sw = base + XQ_B + XD_B + tl * (WQ_B + WS_B);
            const u32 *ss = (const u32 *)(sw + WQ_B);
            const int nb = KB - b;
            if (nb >= A8_KC) {
                a8_stage<NT, NTW>(sw, ss, sx, sd, j0, lane, g, t, acc);
            } else {
                for (int bb = 0; bb < nb; ++bb) a8_block<NT, NTW>(sw, ss, sx, sd, bb, j0, lane, g, t, acc);
            }
            // End of this slice's chunk (its last stage, or the end of K): park acc_c in the
            // slot of (round parity, slice); slice 0 reads it after the next round's first
            // barrier, and the slot is written again two rounds later.
            if (us == NS - 1 || b + A8_KC >= KB) {
#pragma unroll
                for (int jj = 0; jj < NTW; ++jj) {
                    const float4 v = make_float4(A8_CSUM(acc[jj][0]), A8_CSUM(acc[jj][1]), A8_CSUM(acc[jj][2]),
                                                 A8_CSUM(acc[jj][3]));
                    const int j = j0 + jj;
                    if (rounds_apart > 0) {
                        const int c = r0 * KS + ks, ntiles = (N + 15) >> 4;
                        __stcg((float4 *)(m.ws + ((long long)c * ntiles * NT + tile * NT + j) * 128 + lane * 4), v);
                    } else if constexpr (KS == 1) {
                        // One slice: its chunk sums added to tot right here, in chunk order
                        // (what fold does through shared memory for several slices; no part
                        // buffer).
                        a8_fold4(tot[jj], v, rs == 0);
                    } else {
                        part[((((rs & 1) * KS + ks) * W + tl) * NT + j) * 32 + lane] = v;
                    }
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[jj][q] = 0.0f;
                }
            }
        }
        if constexpr (A8_STEPPED) {
            slot = slot + 1 == S ? 0 : slot + 1;
            nslot = nslot + 1 == S ? 0 : nslot + 1;
            if (++us == NS) us = 0, ++rs;
            if (++un == NS) un = 0, ++rn;
        }
    }
    cp_async_wait<0>();
    block_trace_end();  // the main loop's end (a no-op unless traced)
    if (rounds_apart > 0) return;
    __syncthreads();
    if constexpr (PAIR) {
        if constexpr (KS > 1) {
            if (ks == 0 && tile_ok) fold(nst / NS - 1);
        }
        a8_pair_store<NT, W, KS>(tot, ks == 0 && tile_ok, grp, N, T, tl, j0, g, t, warp, lane, pair);
        return;
    }
    if (ks != 0 || !tile_ok) return;
    if constexpr (KS > 1) fold(nst / NS - 1);
#pragma unroll
    for (int jj = 0; jj < NTW; ++jj) {
        const float r[4] = {tot[jj].x, tot[jj].y, tot[jj].z, tot[jj].w};
        a8_put4(m, T, tile, j0 + jj, g, t, r, prev[jj]);
    }
}

// The blocks per multiprocessor that a split block's shared memory allows (host side:
// a8k_smem_bytes, + the 1 KiB per block the driver reserves), at most 2048 threads: the
// occupancy the host's one-wave choices count on. Where that occupancy leaves at most 64
// registers per thread (the lm_heads' 4 x 2 x 2 blocks, 2 x 512 threads; the 27B gate / up's
// 2-stage blocks, 5 x 256) it is the launch bound's minimum, so that a register more cannot
// silently halve it (the lm_head at 65 registers ran 18% slower); elsewhere the bound names no
// minimum (0: a minimum there made the compiler take more registers and the kernels no
// faster).
#if __CUDA_ARCH__ >= 900
#define A8_SM_SMEM 233472
#elif __CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 870
#define A8_SM_SMEM 167936
#else
#define A8_SM_SMEM 102400
#endif
#define A8K_THREADS(NT, W, KS) (32 * (W) * A8_WPT(NT) * (KS))
#define A8K_SMEM(NT, W, KS, S) ((S) * (KS) * (A8_KC * (NT) * 288 + (W) * A8_KC * (A8_WB + 32)) + ((KS) > 1 ? 2 * (KS) * (W) * (NT) * 512 : 0))
#define A8K_FIT(NT, W, KS, S) (A8_SM_SMEM / (A8K_SMEM(NT, W, KS, S) + 1024))
#define A8K_OCC(NT, W, KS, S)                                                                                         \
    (A8K_FIT(NT, W, KS, S) * A8K_THREADS(NT, W, KS) > 2048 ? 2048 / A8K_THREADS(NT, W, KS) : A8K_FIT(NT, W, KS, S))
#define A8K_MINB(NT, W, KS, S) (A8K_OCC(NT, W, KS, S) * A8K_THREADS(NT, W, KS) * 64 >= 65536 ? A8K_OCC(NT, W, KS, S) : 0)
// (NT, W, KS, S): host side a8k_kernel / a8k_smem_bytes in backend.rs. The parameters of A8,
// then rounds_apart (0: K within the block) and the chunk-sum workspace of SplitApart (ws, and
// wso1 / wso2: where matrices 1 and 2 start in it).
#define A8K(NAME, NT, W, KS, S)                                                                                                 \
    extern "C" __global__ void __launch_bounds__(A8K_THREADS(NT, W, KS), A8K_MINB(NT, W, KS, S))                               \
        NAME(const u8 *wq0, const u16 *ws0, float *out0, int n0, const u8 *wq1, const u16 *ws1, float *out1, int n1,            \
             const u8 *wq2, const u16 *ws2, float *out2, int n2, int c1, int c2, const u32 *xq, const float *xd, int K, int T,  \
             int ef, int rounds_apart, float *ws, long long wso1, long long wso2, int accum) {                                  \
        /* One copy of the body: the matrix picked as a value (block-uniform). */                                             \
        const int bx = blockIdx.x, sel = bx < c1 ? 0 : bx < c2 ? 1 : 2;                                                         \
        const A8Mat m = sel == 0 ? A8Mat{wq0, ws0, out0, n0, ws, accum}                                                         \
                      : sel == 1 ? A8Mat{wq1, ws1, out1, n1, ws + wso1, accum}                                                  \
                                 : A8Mat{wq2, ws2, out2, n2, ws + wso2, accum};                                                 \
        a8_ksplit<NT, W, KS, S>(m, bx - (sel == 0 ? 0 : sel == 1 ? c1 : c2), xq, xd, K, T, ef, rounds_apart);            \
    }
A8K(a8k_n1_w1_k4_s3, 1, 1, 4, 3)
A8K(a8k_n1_w1_k2_s3, 1, 1, 2, 3)
A8K(a8k_n1_w2_k2_s4, 1, 2, 2, 4)
A8K(a8k_n1_w2_k4_s3, 1, 2, 4, 3)
A8K(a8k_n1_w2_k4_s2, 1, 2, 4, 2)
A8K(a8k_n1_w4_k1_s3, 1, 4, 1, 3)
A8K(a8k_n1_w4_k2_s3, 1, 4, 2, 3)
A8K(a8k_n1_w4_k2_s2, 1, 4, 2, 2)
A8K(a8k_n1_w4_k4_s2, 1, 4, 4, 2)
A8K(a8k_n2_w1_k4_s3, 2, 1, 4, 3)
A8K(a8k_n2_w1_k2_s3, 2, 1, 2, 3)
A8K(a8k_n2_w2_k2_s4, 2, 2, 2, 4)
A8K(a8k_n2_w2_k4_s3, 2, 2, 4, 3)
A8K(a8k_n2_w2_k4_s2, 2, 2, 4, 2)
A8K(a8k_n2_w4_k1_s3, 2, 4, 1, 3)
A8K(a8k_n2_w4_k2_s3, 2, 4, 2, 3)
A8K(a8k_n2_w4_k2_s2, 2, 4, 2, 2)
A8K(a8k_n2_w4_k4_s2, 2, 4, 4, 2)

// The paired gate / up launch (PAIR above): grid = ceil(N / (16 W / 2)) blocks, K within the
// block; the down projection's activation in xq2 / xd2.
#define A8KP(NAME, NT, W, KS, S)                                                                                                \
    extern "C" __global__ void __launch_bounds__(A8K_THREADS(NT, W, KS), A8K_MINB(NT, W, KS, S))                               \
        NAME(const u8 *wq0, const u16 *ws0, const u8 *wq1, const u16 *ws1, int n, const u32 *xq, const float *xd, int K, int T,  \
             int ef, u32 *xq2, float *xd2, int kbp2) {                                                                          \
        const A8Mat m = {wq0, ws0, nullptr, n, nullptr, 0};                                                                     \
        const A8Pair pr = {{wq1, ws1, nullptr, n, nullptr, 0}, xq2, xd2, kbp2};                                                 \
        a8_ksplit<NT, W, KS, S, true>(m, blockIdx.x, xq, xd, K, T, ef, 0, pr);                                          \
    }
A8KP(a8kp_n1_w4_k2_s2, 1, 4, 2, 2)
A8KP(a8kp_n2_w4_k2_s2, 2, 4, 2, 2)
A8KP(a8kp_n1_w4_k1_s3, 1, 4, 1, 3)
A8KP(a8kp_n2_w4_k1_s3, 2, 4, 1, 3)
A8KP(a8kp_n1_w4_k1_s2, 1, 4, 1, 2)
A8KP(a8kp_n2_w4_k1_s2, 2, 4, 1, 2)

// The paired launch with a queue for the groups left over (A8KPQ; backend.rs
// a8_pair_queue): where the groups of 2 gate + 2 up tiles do not spread evenly over the SMs
// (the 27B shape: 544 groups on 132 SMs in one wave of up to 5 blocks per SM; the SMs that got
// 5 ended ~18 us after those that got 3), the grid is `whole` = bps x SMs blocks, the host's
// shared memory per block letting no more than bps fit an SM, and block b runs group b over
// all of K as A8KP does (the weight stream then runs at the read ceiling). The other groups
// run as pieces of one tile x one chunk (a8_tile_piece: 4 tiles x the chunks of each group)
// from a queue, each taken by whichever block is free when its group is done (pieces of 4
// tiles through the 2-stage pipeline were latency-bound: ~7 us each, a ~10 us tail at 27B):
// a piece writes its chunk sums to cs0 / cs1
// ([chunk][tile][token group][128], as SplitApart's), and the group's last piece to finish (a
// counter per group) adds the chunk sums in chunk order and stores silu(gate) * up as A8KP
// does. The same bits as A8KP (the contract's chunk sums in chunk order); no
// block waits for another. ctr: [0] the next piece, [1] blocks done, [2 + i] pieces done of
// group whole + i; zero between launches (the last block to finish resets [0] and [1], each
// group's last piece its counter).

// One piece of the queue: one tile (16 features of one matrix) x one chunk of K, its x and
// weights loaded in one go (one round trip, not one per pipeline stage), its chunk sums by
// the NT warps of token groups 0 .. NT-1 (the contract's chain: one thread per output, block
// after block) into the workspace cs ([chunk][tile][token group][128], as SplitApart's).
// (The matrix's fields by value: a struct picked by a condition would go through local memory.)
template <int NT>
__device__ __forceinline__ void a8_tile_piece(const u8 *wq, const u16 *wsc, float *ws, int N, int mt, int c,
                                              const u32 *__restrict__ xq, const float *__restrict__ xd, int K, u64 pol) {
    extern __shared__ __align__(16) u8 a8_smem[];
    constexpr int XQ = NT * 256, XD = NT * 32;  // bytes per block: x codes, x scales
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int KB = K / 32, KBp = (KB + A8_KC - 1) / A8_KC * A8_KC, ntiles = N >> 4;
    const int b0 = c * A8_CB, nb = min(A8_CB, KB - b0);
    // [x codes nb][x scales nb][weight codes nb][weight scales nb], each block's bytes as in
    // global memory (so a8_block / a8_stage read them as from a stage of nb blocks).
    const int oxd = nb * XQ, ow = oxd + nb * XD, ows = ow + nb * A8_WB;
    const u32 s0 = smem_addr(a8_smem);
    const u8 *gx = (const u8 *)xq + (long long)b0 * XQ, *gd = (const u8 *)xd + (long long)b0 * XD;
    const long long wb = (long long)mt * KBp + b0;
    const u8 *gw = wq + wb * A8_WB, *gs = (const u8 *)wsc + wb * 32;
    const int nthr = blockDim.x;
    for (int i = tid; i < nb * (XQ / 16); i += nthr) cp_async16(s0 + i * 16, gx + i * 16);
    for (int i = tid; i < nb * (XD / 16); i += nthr) cp_async16(s0 + oxd + i * 16, gd + i * 16);
    for (int i = tid; i < nb * (A8_WB / 16); i += nthr) cp_async16_pol(s0 + ow + i * 16, gw + i * 16, pol);
    for (int i = tid; i < nb * 2; i += nthr) cp_async16_pol(s0 + ows + i * 16, gs + i * 16, pol);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    // A warp per token group whatever A8_NTW (a piece's chain is latency-bound: two warps
    // finish it in half the time of one; the block has at least NT warps).
    if (warp >= NT) return;
    const int j = warp;
    const uint2 *sx = (const uint2 *)a8_smem;
    const float *sd = (const float *)(a8_smem + oxd);
    const u8 *sw = a8_smem + ow;
    const u32 *ss = (const u32 *)(a8_smem + ows);
    float acc[1][4] = {};
    int bb = 0;
    for (; bb + A8_KC <= nb; bb += A8_KC) {
        a8_stage<NT, 1>(sw + bb * A8_WB, ss + bb * 8, sx + bb * NT * 32, sd + bb * NT * 8, j, lane, g, t, acc);
    }
    for (; bb < nb; ++bb) a8_block<NT, 1>(sw, ss, sx, sd, bb, j, lane, g, t, acc);
    __stcg((float4 *)(ws + ((long long)c * ntiles * NT + mt * NT + j) * 128 + lane * 4),
           make_float4(A8_CSUM(acc[0][0]), A8_CSUM(acc[0][1]), A8_CSUM(acc[0][2]), A8_CSUM(acc[0][3])));
}

template <int NT, int W, int KS, int S>
__device__ __forceinline__ void a8_pair_queue(const A8Mat &m, const A8Pair &pr, const u32 *__restrict__ xq,
                                              const float *__restrict__ xd, int K, int T, int ef, u32 *ctr, int pieces) {
    static_assert(KS == 1 && W == 4, "2 + 2 tiles, one k-slice");
    extern __shared__ __align__(16) u8 a8_smem[];
    constexpr int WH = W / 2;
    // The host's shared memory has room for it past a piece's bytes (a8_pair_queue_smem).
    u32 *tk = (u32 *)(a8_smem + A8_CB * (NT * 288 + A8_WB + 32));
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    constexpr int NTW = A8_NTW(NT), WPT = A8_WPT(NT);
    const int tl = warp / WPT, j0 = (warp % WPT) * NTW;
    const int nch = (K / 32 + A8_CB - 1) / A8_CB, per_grp = W * nch;
    const int whole = gridDim.x, N = m.N, ntiles = N >> 4;
    const u64 pol = l2_stream_policy(ef & 1);
    a8_ksplit<NT, W, KS, S, true>(m, blockIdx.x, xq, xd, K, T, ef, 0, pr);
    for (;;) {
        __syncthreads();  // the store or the piece before has read its shared memory
        if (tid == 0) tk[0] = atomicAdd(&ctr[0], 1u);
        __syncthreads();
        const int p = (int)tk[0];
        if (p >= pieces) break;
        // Piece p: tile q = (p % per_grp) / nch of group whole + p / per_grp (gate tiles 0, 1,
        // up tiles 2, 3), chunk p % nch.
        const int grp = whole + p / per_grp, q = (p % per_grp) / nch;
        const int pt = grp * WH + q % WH;
        const bool up = q >= WH;
        if (pt * 16 < N)
            a8_tile_piece<NT>(up ? pr.up.wq : m.wq, up ? pr.up.wsc : m.wsc, up ? pr.up.ws : m.ws, N, pt, p % nch, xq, xd, K, pol);
        __threadfence();  // this piece's chunk sums, before its count
        __syncthreads();
        bool last = false;
        if (tid == 0) last = atomicAdd(&ctr[2 + grp - whole], 1u) == (u32)(per_grp - 1);
        if (!__syncthreads_or(last)) continue;
        __threadfence();
        const int mt = grp * WH + tl % WH;
        const bool live = mt * 16 < N;
        const float *cs = (tl >= WH ? pr.up.ws : m.ws) + ((long long)(live ? mt : 0) * NT + j0) * 128 + lane * 4;
        float4 tot[NTW];
#pragma unroll
        for (int jj = 0; jj < NTW; ++jj) tot[jj] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int cc = 0; cc < nch && live; ++cc) {
#pragma unroll
            for (int jj = 0; jj < NTW; ++jj)
                a8_fold4(tot[jj], __ldcg((const float4 *)(cs + (long long)cc * ntiles * NT * 128 + jj * 128)), cc == 0);
        }
        a8_pair_store<NT, W, KS>(tot, live, grp, N, T, tl, j0, g, t, warp, lane, pr);
        if (tid == 0) ctr[2 + grp - whole] = 0u;
    }
    // The last block to finish: the queue back to zero.
    if (tid == 0) {
        __threadfence();
        if (atomicAdd(&ctr[1], 1u) == (u32)(whole - 1)) {
            ctr[0] = 0u;
            ctr[1] = 0u;
        }
    }
}
// A8KP's parameters, then the chunk-sum workspaces, the counters and the pieces; MINB: the
// blocks per SM the launch bound keeps registers for (A8K_MINB at the host's padded shared
// memory for 4 per SM; none where 4 blocks leave more than 64 registers per thread).
#define A8KPQ(NAME, NT, W, KS, S, MINB)                                                                                        \
    extern "C" __global__ void __launch_bounds__(A8K_THREADS(NT, W, KS), MINB)                                                 \
        NAME(const u8 *wq0, const u16 *ws0, const u8 *wq1, const u16 *ws1, int n, const u32 *xq, const float *xd, int K, int T,  \
             int ef, u32 *xq2, float *xd2, int kbp2, float *cs0, float *cs1, u32 *ctr, int pieces) {                            \
        const A8Mat m = {wq0, ws0, nullptr, n, cs0, 0};                                                                        \
        const A8Pair pr = {{wq1, ws1, nullptr, n, cs1, 0}, xq2, xd2, kbp2};                                                    \
        a8_pair_queue<NT, W, KS, S>(m, pr, xq, xd, K, T, ef, ctr, pieces);                                              \
    }
A8KPQ(a8kpq_n1_w4_k1_s2, 1, 4, 1, 2, 0)
A8KPQ(a8kpq_n2_w4_k1_s2, 2, 4, 1, 2, 4 * A8K_THREADS(2, 4, 1) * 64 >= 65536 ? 4 : 0)




#ifndef A8_WQ4
// SplitApart's second kernel: out = acc_0 + acc_1 + ... (the chunk sums in ws, in chunk
// order) for up to 3 matrices; one thread per output, outputs of matrix i at [e_i, e_{i+1}) of
// the flattened index (T x N_i). ws per matrix: [chunk][tile][token group][32 lanes][4].
__device__ __forceinline__ void a8_sum_one(const float *ws, float *out, int N, int NT, int T, int nch, int e, int accum) {
    const int tok = e / N, o = e % N;
    const int ntiles = (N + 15) >> 4, tile = o >> 4, r = o & 15, gg = r & 7, hi = r >> 3;
    const int j = tok >> 3, tt = (tok & 7) >> 1, c = hi * 2 + (tok & 1);
    const long long chunk_stride = (long long)ntiles * NT * 128;
    const float *p = ws + ((long long)tile * NT + j) * 128 + (gg * 4 + tt) * 4 + c;
    float *dst = out + (long long)tok * N + o;
    const float prev = accum ? *dst : 0.0f;  // loaded with the chunk sums
    float s = __ldcg(p);
    for (int q = 1; q < nch; ++q) s = __fadd_rn(s, __ldcg(p + q * chunk_stride));
    *dst = accum ? __fadd_rn(prev, s) : s;
}
extern "C" __global__ void a8_sum(float *out0, int n0, float *out1, int n1, float *out2, int n2, const float *ws, long long wso1,
                                  long long wso2, int NT, int T, int nch, int accum) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    const int e1 = T * n0, e2 = e1 + T * n1, e3 = e2 + T * n2;
    if (e < e1) a8_sum_one(ws, out0, n0, NT, T, nch, e, accum);
    else if (e < e2) a8_sum_one(ws + wso1, out1, n1, NT, T, nch, e - e1, accum);
    else if (e < e3) a8_sum_one(ws + wso2, out2, n2, NT, T, nch, e - e2, accum);
}

// ---------------------------------------------------------------------------------------
// One DSpark Markov step over a bf16 (fragment order), q8_0 or q4_0 W2 on the tensor cores
// (rank % 32 == 0): logits[o] += dot(W2[o, :], W1[*prev, :]) for the block's rows [blockIdx.x
// chunk, + chunk), and the block's argmax candidate (pv / pi, for argmax_final). A T = 1 skinny
// product: one warp per 16-row tile at a time, all of the rank's 32-wide k tiles in order (no
// split: a row's sum is one warp's); A = the tile's weights as the skinny kernels load and
// decode them (load_raw / decode_a: bf16 exact, q8_0 / q4_0 codes exact, the block scale
// applied in f32 per 32-wide k tile); B = emb split into bf16 hi (column 0) and lo (column 1),
// the other columns zero, so lane t = 0 of each quad gets rows g and g + 8's hi and lo sums.
// emb's hi + lo is within 2^-16 of it: the logits are within f32 rounding of the exact dot (the
// CPU backend's order differs anyway); the argmax rule is the same (am_better: order-free).
// Dynamic shared memory: emb (rank floats), then its B fragments (rank / 32 x 32 x 16 bytes).
// The lane-contiguous kernel (markov_step_vq / markov_step_v) issued ~10 us of instructions per
// step for the 8B vocabulary (ncu: q4_0 38 us per step, 65% of the SMs' issue, 12% of DRAM).
template <int FMT>
__device__ __forceinline__ void markov_step_mma_impl(int fmt1, const void *__restrict__ w1q, const u16 *__restrict__ w1d,
                                                     const void *__restrict__ w2q, const u16 *__restrict__ w2d, int rank, int vocab,
                                                     const u32 *__restrict__ prev, float *__restrict__ logits, int chunk,
                                                     float *__restrict__ pv, u32 *__restrict__ pi) {
    extern __shared__ __align__(16) float emb[];
    __shared__ float rv[32];
    __shared__ u32 ri[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5, g = lane >> 2, t = lane & 3;
    const int KT = rank >> 5;
    const int o0 = blockIdx.x * chunk, o1 = min(vocab, o0 + chunk);
    uint4 *fb = (uint4 *)(emb + rank);
    markov_load_emb(fmt1, w1q, w1d, prev, rank, emb);
    for (int i = threadIdx.x; i < KT * 32; i += blockDim.x) {
        const int kt = i >> 5, gg = (i & 31) >> 2, tt = i & 3;
        uint4 f = make_uint4(0u, 0u, 0u, 0u);
        if (gg < 2) {
            const float *e = emb + kt * 32 + 8 * tt;
            u32 h[4], l[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) split_bf16x2(e[2 * j], e[2 * j + 1], h[j], l[j]);
            f = gg == 0 ? make_uint4(h[0], h[1], h[2], h[3]) : make_uint4(l[0], l[1], l[2], l[3]);
        }
        fb[i] = f;
    }
    __syncthreads();
    float bv = 0.0f;
    u32 bi = ARGMAX_NONE;
    for (int ob = o0 + 16 * warp; ob < o1; ob += 16 * nw) {
        const int r0 = ob + g, r1 = r0 + 8;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const float l0 = r0 < o1 ? logits[r0] : 0.0f, l1 = r1 < o1 ? logits[r1] : 0.0f;
#pragma unroll 4
        for (int kt = 0; kt < KT; ++kt) {
            RawA ra0, ra1;
            load_raw<FMT>(w2q, w2d, o1, rank, KT, r0, kt, t, ra0);
            load_raw<FMT>(w2q, w2d, o1, rank, KT, r1, kt, t, ra1);
            const uint4 b = fb[kt * 32 + lane];
            u32 ga[4], gb[4];
            float da, db;
            decode_a<FMT>(ra0, ga, da);
            decode_a<FMT>(ra1, gb, db);
            if (FMT == FMT_BF16P) {
                mma_bf16_16816(acc, ga[0], gb[0], ga[1], gb[1], b.x, b.y);
                mma_bf16_16816(acc, ga[2], gb[2], ga[3], gb[3], b.z, b.w);
            } else {
                float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_bf16_16816(tmp, ga[0], gb[0], ga[1], gb[1], b.x, b.y);
                mma_bf16_16816(tmp, ga[2], gb[2], ga[3], gb[3], b.z, b.w);
                acc[0] = fmaf(da, tmp[0], acc[0]);
                acc[1] = fmaf(da, tmp[1], acc[1]);
                acc[2] = fmaf(db, tmp[2], acc[2]);
                acc[3] = fmaf(db, tmp[3], acc[3]);
            }
        }
        if (t == 0) {
            if (r0 < o1) {
                const float v = l0 + (acc[0] + acc[1]);
                logits[r0] = v;
                if (am_better(v, (u32)r0, bv, bi)) { bv = v; bi = (u32)r0; }
            }
            if (r1 < o1) {
                const float v = l1 + (acc[2] + acc[3]);
                logits[r1] = v;
                if (am_better(v, (u32)r1, bv, bi)) { bv = v; bi = (u32)r1; }
            }
        }
    }
    block_argmax(bv, bi, rv, ri);
    if (threadIdx.x == 0) { pv[blockIdx.x] = bv; pi[blockIdx.x] = bi; }
}
// Same parameters as markov_step (fmt2 fixed by the kernel).
#define MARKOV_MMA(NAME, FMT)                                                                                                     \
    extern "C" __global__ void NAME(int fmt1, const void *__restrict__ w1q, const u16 *__restrict__ w1d, int fmt2,               \
                                    const void *__restrict__ w2q, const u16 *__restrict__ w2d, int rank, int vocab,              \
                                    const u32 *__restrict__ prev, float *__restrict__ logits, int chunk, float *__restrict__ pv, \
                                    u32 *__restrict__ pi) {                                                                       \
        markov_step_mma_impl<FMT>(fmt1, w1q, w1d, w2q, w2d, rank, vocab, prev, logits, chunk, pv, pi);                          \
    }
MARKOV_MMA(markov_step_mma_bf16p, FMT_BF16P)
MARKOV_MMA(markov_step_mma_q8_0, FMT_Q8_0)
MARKOV_MMA(markov_step_mma_q4_0, FMT_Q4_0)
#endif  // !A8_WQ4
