// Argmax over long rows and the DSpark Markov chain, both kept on the device.

// Stage 1: grid (n_chunks, rows). Partial winners per chunk of a row.
#define AM_PART_BATCH 16
extern "C" __global__ void argmax_partial(const float *x, long long row0, int cols, int chunk, float *pv, u32 *pi) {
    __shared__ float rv[32];
    __shared__ u32 ri[32];
    griddep_launch();  // argmax_final may launch (it waits for this grid)
    griddep_wait();    // a programmatic dependent launch: the logits first
    const long long row = row0 + blockIdx.y;
    const float *xr = x + row * cols;
    const int c0 = blockIdx.x * chunk, c1 = min(cols, c0 + chunk);
    float bv = 0.0f;
    u32 bi = ARGMAX_NONE;
    // Batches of AM_PART_BATCH loads per thread issued before any compare (one round trip
    // per batch, not per value; past the chunk: NaN, which never wins). am_better orders the
    // candidates totally, so the winner does not depend on the order they are visited in.
    for (int c = c0 + threadIdx.x; c < c1; c += AM_PART_BATCH * blockDim.x) {
        float v[AM_PART_BATCH];
#pragma unroll
        for (int u = 0; u < AM_PART_BATCH; ++u) {
            const int cc = c + u * blockDim.x;
            v[u] = cc < c1 ? xr[cc] : __int_as_float(0x7fc00000);
        }
#pragma unroll
        for (int u = 0; u < AM_PART_BATCH; ++u) {
            const u32 cc = (u32)(c + u * blockDim.x);
            if (am_better(v[u], cc, bv, bi)) { bv = v[u]; bi = cc; }
        }
    }
    block_argmax(bv, bi, rv, ri);
    if (threadIdx.x == 0) {
        pv[blockIdx.y * gridDim.x + blockIdx.x] = bv;
        pi[blockIdx.y * gridDim.x + blockIdx.x] = bi;
    }
}

// Stage 2: one block per row over its n_chunks partials (any number of threads up to 1024, a
// multiple of 32). Every thread loads its partials (c = tid, tid + blockDim, ...) in one batch of
// round trips, then the block reduces them: am_better orders the candidates totally, so the
// winner does not depend on the reduction order. Rows with no candidate (all NaN) give 0.
// Optionally also stores the winner into *prev (Markov chain).
#define AM_FINAL_BATCH 4
extern "C" __global__ void argmax_final(const float *pv, const u32 *pi, int n_chunks, u32 *out, u32 *prev) {
    __shared__ float rv[32];
    __shared__ u32 ri[32];
    griddep_launch();  // the next Markov step may launch (it waits for this grid)
    griddep_wait();    // a programmatic dependent launch: the partials first
    const int row = blockIdx.x;
    const float *rpv = pv + (long long)row * n_chunks;
    const u32 *rpi = pi + (long long)row * n_chunks;
    float bv = 0.0f;
    u32 bi = ARGMAX_NONE;
    for (int c0 = threadIdx.x; c0 < n_chunks; c0 += AM_FINAL_BATCH * blockDim.x) {
        float v[AM_FINAL_BATCH];
        u32 i[AM_FINAL_BATCH];
#pragma unroll
        for (int u = 0; u < AM_FINAL_BATCH; ++u) {
            const int c = c0 + u * blockDim.x;
            v[u] = c < n_chunks ? rpv[c] : 0.0f;
            i[u] = c < n_chunks ? rpi[c] : ARGMAX_NONE;
        }
#pragma unroll
        for (int u = 0; u < AM_FINAL_BATCH; ++u)
            if (i[u] != ARGMAX_NONE && am_better(v[u], i[u], bv, bi)) { bv = v[u]; bi = i[u]; }
    }
    block_argmax(bv, bi, rv, ri);
    if (threadIdx.x == 0) {
        u32 r = bi == ARGMAX_NONE ? 0u : bi;
        out[row] = r;
        if (prev) *prev = r;
    }
}

// One Markov step: logits[o] += dot(W2[o, :], W1[*prev, :]) for o in the block's range, and
// the block's argmax candidate. Dynamic shared memory: rank floats.
// Each warp takes its rows (o0 + warp, + nw, + 2 nw, ...) MARKOV_R at a time: the W2 loads and
// the logits of MARKOV_R rows are in flight together (one row at a time left each warp waiting
// on a global round trip per row). Per row the arithmetic and its order are unchanged: the lane
// sums over i = lane, lane + 32, ... then warp_sum, then logits + dot; the rows of a warp are
// visited in the same ascending order, so the argmax candidates are the same.
#define MARKOV_R 4
template <int F>
__device__ __forceinline__ void markov_dots(const void *__restrict__ w2q, const u16 *__restrict__ w2d, const int (&rows)[MARKOV_R],
                                            int rank, const float *__restrict__ emb, int lane, float (&acc)[MARKOV_R]) {
#pragma unroll
    for (int r = 0; r < MARKOV_R; ++r) acc[r] = 0.0f;
#pragma unroll 4
    for (int i = lane; i < rank; i += 32) {
        const float e = emb[i];
        float w[MARKOV_R];
#pragma unroll
        for (int r = 0; r < MARKOV_R; ++r) w[r] = rows[r] >= 0 ? load_w(F, w2q, w2d, rows[r], i, rank) : 0.0f;
#pragma unroll
        for (int r = 0; r < MARKOV_R; ++r) acc[r] = fmaf(w[r], e, acc[r]);
    }
}

// 8 consecutive weights (row, i0 .. i0+7) of W2 in format F (f32, bf16, bf16p, f16, q8_0, q4_0) as
// loaded: one or two 16-byte loads, or the codes and their block's scale (i0 % 8 == 0; the row
// start 16-byte aligned for the 16-bit formats and 32-byte for f32: cols % 8 == 0). Kept raw
// until w8_at decodes value j with load_w's arithmetic, so a warp's rows hold 4-8 registers
// each while their loads are in flight (decoded at the load, 8 rows took 168 registers).
struct Raw8 {
    uint4 a, b;  // b: f32's second half only
    float d;     // q8_0 / q4_0: the block's scale
};
template <int F>
__device__ __forceinline__ Raw8 load_raw8(const void *__restrict__ wq, const u16 *__restrict__ wd, long long row, int i0, int cols) {
    Raw8 r;
    if (F == FMT_F32) {
        const uint4 *p = (const uint4 *)((const float *)wq + row * cols + i0);
        r.a = p[0], r.b = p[1];
    } else if (F == FMT_BF16 || F == FMT_F16 || F == FMT_BF16P) {
        // FMT_BF16P: values i0 .. i0 + 7 of a row are one lane's 16 bytes of its fragment.
        r.a = *(const uint4 *)((const u16 *)wq + (F == FMT_BF16P ? bf16p_index(row, i0, cols) : row * cols + i0));
    } else if (F == FMT_Q8_0) {
        const uint2 u = *(const uint2 *)((const i8 *)wq + row * cols + i0);
        r.a.x = u.x, r.a.y = u.y;
        r.d = f16_to_f32(wd[row * (cols / 32) + i0 / 32]);
    } else {  // FMT_Q4_0
        const long long b = row * (cols / 32) + i0 / 32;
        r.a.x = ((const u32 *)wq)[b * 4 + ((i0 & 31) >> 3)];
        r.d = f16_to_f32(wd[b]);
    }
    return r;
}
template <int F>
__device__ __forceinline__ float w8_at(const Raw8 &r, int j) {
    const u32 h[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.b.x, r.b.y, r.b.z, r.b.w};
    if (F == FMT_F32) return __uint_as_float(h[j]);
    if (F == FMT_BF16 || F == FMT_F16 || F == FMT_BF16P) {
        const u16 v = (u16)((h[j >> 1] >> (16 * (j & 1))) & 0xffffu);
        return F == FMT_F16 ? f16_to_f32(v) : bf16_to_f32(v);
    }
    if (F == FMT_Q8_0) return (float)(int)(signed char)((h[j >> 2] >> (8 * (j & 3))) & 0xffu) * r.d;
    // FMT_Q4_0: value 8q + j at bit 2j (even j), 16 + 2(j - 1) (odd j)
    const int shift = (j & 1) ? 16 + 2 * (j - 1) : 2 * j;
    return (float)((int)((h[0] >> shift) & 0xfu) - 8) * r.d;
}

// markov_dots with lane-contiguous loads: lane L takes k = 8L .. 8L+7 of every 256 (one 16-byte
// load of a bf16 row segment, 8 bytes of q8_0 codes, one u32 of q4_0 nibbles: the warp reads a
// row's 256 values with one coalesced load where markov_dots issues 8 scattered ones). Another
// summation order than markov_dots' (the lane's 8 in order, then warp_sum): within f32 rounding.
template <int F, int R>
__device__ __forceinline__ void markov_dots8(const void *__restrict__ w2q, const u16 *__restrict__ w2d, const int (&rows)[R], int rank,
                                             const float *__restrict__ emb, int lane, float (&acc)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int i0 = 8 * lane; i0 < rank; i0 += 256) {
        const float4 e0 = *(const float4 *)(emb + i0), e1 = *(const float4 *)(emb + i0 + 4);
        const float e[8] = {e0.x, e0.y, e0.z, e0.w, e1.x, e1.y, e1.z, e1.w};
        Raw8 w[R];
#pragma unroll
        for (int r = 0; r < R; ++r) w[r] = load_raw8<F>(w2q, w2d, rows[r] >= 0 ? rows[r] : rows[0], i0, rank);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[r] = fmaf(w8_at<F>(w[r], j), e[j], acc[r]);
    }
}

// MODE: 0 the scalar kernel (markov_dots), 1 lane-contiguous f32 / bf16 / bf16p / f16, 2
// lane-contiguous q8_0 / q4_0 (markov_dots8); R rows per warp iteration.
template <int MODE, int R>
__device__ __forceinline__ void markov_step_impl(int fmt1, const void *__restrict__ w1q, const u16 *__restrict__ w1d, int fmt2,
                                                 const void *__restrict__ w2q, const u16 *__restrict__ w2d, int rank, int vocab,
                                                 const u32 *__restrict__ prev, float *__restrict__ logits, int chunk,
                                                 float *__restrict__ pv, u32 *__restrict__ pi) {
    extern __shared__ __align__(16) float emb[];
    __shared__ float rv[32];
    __shared__ u32 ri[32];
    markov_load_emb(fmt1, w1q, w1d, prev, rank, emb);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int o0 = blockIdx.x * chunk, o1 = min(vocab, o0 + chunk);
    float bv = 0.0f;
    u32 bi = ARGMAX_NONE;
    for (int o = o0 + warp; o < o1; o += R * nw) {
        int rows[R];
        float lg[R], acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            rows[r] = o + r * nw < o1 ? o + r * nw : -1;
            lg[r] = rows[r] >= 0 ? logits[rows[r]] : 0.0f;
        }
        // The format switch outside the inner loop (load_w folds to one format's decode).
        // FMT_BF16P (rank % 32 == 0) always takes the V kernel: a case for it here raised this
        // kernel from 128 to 159 registers (the q8_0 DSpark step +23%).
        if constexpr (MODE == 1) {  // fmt2 is f32, bf16, bf16p or f16, rank % 8 == 0
            switch (fmt2) {
            case FMT_F32: markov_dots8<FMT_F32, R>(w2q, w2d, rows, rank, emb, lane, acc); break;
            case FMT_BF16: markov_dots8<FMT_BF16, R>(w2q, w2d, rows, rank, emb, lane, acc); break;
            case FMT_BF16P: markov_dots8<FMT_BF16P, R>(w2q, w2d, rows, rank, emb, lane, acc); break;
            default: markov_dots8<FMT_F16, R>(w2q, w2d, rows, rank, emb, lane, acc); break;
            }
        } else if constexpr (MODE == 2) {  // fmt2 is q8_0 or q4_0, rank % 8 == 0
            if (fmt2 == FMT_Q8_0)
                markov_dots8<FMT_Q8_0, R>(w2q, w2d, rows, rank, emb, lane, acc);
            else
                markov_dots8<FMT_Q4_0, R>(w2q, w2d, rows, rank, emb, lane, acc);
        } else {
            switch (fmt2) {
            case FMT_F32: markov_dots<FMT_F32>(w2q, w2d, rows, rank, emb, lane, acc); break;
            case FMT_BF16: markov_dots<FMT_BF16>(w2q, w2d, rows, rank, emb, lane, acc); break;
            case FMT_F16: markov_dots<FMT_F16>(w2q, w2d, rows, rank, emb, lane, acc); break;
            case FMT_Q8_0: markov_dots<FMT_Q8_0>(w2q, w2d, rows, rank, emb, lane, acc); break;
            case FMT_Q4_0: markov_dots<FMT_Q4_0>(w2q, w2d, rows, rank, emb, lane, acc); break;
            default: markov_dots<FMT_Q8A8>(w2q, w2d, rows, rank, emb, lane, acc); break;
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (rows[r] < 0) break;
            const float v = lg[r] + warp_sum(acc[r]);
            if (lane == 0) logits[rows[r]] = v;
            if (am_better(v, (u32)rows[r], bv, bi)) { bv = v; bi = (u32)rows[r]; }
        }
    }
    block_argmax(bv, bi, rv, ri);
    if (threadIdx.x == 0) { pv[blockIdx.x] = bv; pi[blockIdx.x] = bi; }
}
extern "C" __global__ void markov_step(int fmt1, const void *__restrict__ w1q, const u16 *__restrict__ w1d, int fmt2,
                                       const void *__restrict__ w2q, const u16 *__restrict__ w2d, int rank, int vocab,
                                       const u32 *__restrict__ prev, float *__restrict__ logits, int chunk, float *__restrict__ pv,
                                       u32 *__restrict__ pi) {
    markov_step_impl<0, MARKOV_R>(fmt1, w1q, w1d, fmt2, w2q, w2d, rank, vocab, prev, logits, chunk, pv, pi);
}
// The same with lane-contiguous W2 loads (markov_dots8), rank % 8 == 0, one kernel per family of
// formats: a switch over all six held the kernel at 98 registers (2 blocks of 256 threads per
// multiprocessor), these take 61 (f32 / bf16 / bf16p / f16) and 64 (q8_0 / q4_0): 4 blocks,
// twice the rows in flight. (8 rows per warp iteration at 2 blocks per multiprocessor measured
// slower.) H200, DSpark step graph ms at ctx 512 (8B / 27B), the 1024-row blocks and one kernel
// -> one wave of blocks and one kernel -> these: bf16 2.144 -> 1.709 -> 1.644 / 2.796 -> 2.574
// -> 2.474; q8_0 (the scalar kernel before) 2.462 -> 2.002 -> 1.754 / 3.181 -> 3.117 -> 2.721;
// q4_0 2.330 -> 1.776 -> 1.660 / 2.939 -> 2.685 -> 2.480.
extern "C" __global__ void markov_step_v(int fmt1, const void *__restrict__ w1q, const u16 *__restrict__ w1d, int fmt2,
                                         const void *__restrict__ w2q, const u16 *__restrict__ w2d, int rank, int vocab,
                                         const u32 *__restrict__ prev, float *__restrict__ logits, int chunk, float *__restrict__ pv,
                                         u32 *__restrict__ pi) {
    markov_step_impl<1, MARKOV_R>(fmt1, w1q, w1d, fmt2, w2q, w2d, rank, vocab, prev, logits, chunk, pv, pi);
}
extern "C" __global__ void markov_step_vq(int fmt1, const void *__restrict__ w1q, const u16 *__restrict__ w1d, int fmt2,
                                          const void *__restrict__ w2q, const u16 *__restrict__ w2d, int rank, int vocab,
                                          const u32 *__restrict__ prev, float *__restrict__ logits, int chunk, float *__restrict__ pv,
                                          u32 *__restrict__ pi) {
    markov_step_impl<2, MARKOV_R>(fmt1, w1q, w1d, fmt2, w2q, w2d, rank, vocab, prev, logits, chunk, pv, pi);
}

// One Markov step for a Q8_0A8 W2 (the mma fragment layout of WeightFormat::Q8_0A8): one warp
// per 16-row tile. Lane L reads the tile's 16 bytes of each 32-value block (the warp reads
// 512 contiguous bytes per block: coalesced, where a row-wise kernel gathers single codes of
// the fragment layout: 8B DSpark step 3.25 ms with such a kernel, most of it the chain), and
// the block's products run on the f16 tensor cores (markov_blk); per row the blocks' sums are
// scaled and added in block order. Another summation order than markov_step's (within f32
// rounding); the argmax rule is the same (am_better: order-free). Same parameters as
// markov_step (fmt2 must be FMT_Q8A8, rank a multiple of 32, chunk a multiple of 16). At most 5
// blocks of 256 threads per multiprocessor by registers (48): the 8B vocabulary's 594 blocks in
// one wave on 132 SMs; the first tile's W2 is copied in before the dependency wait.
__device__ __forceinline__ void cp_async16_cg(void *s, const void *g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(s)), "l"(g) : "memory");
}

// The Q8_0A8 Markov tiles on the f16 tensor cores (mma m16n8k16, f32 accumulation). Per 32-value
// block of a 16-row tile: A = the tile's int8 codes as exact f16 (a byte permute into 1024 + code
// + 128, minus 1152), two k16 halves; B = emb split into f16 hi = f16(e) (column 0) and lo =
// f16(e - hi) (column 1), the other columns zero; so lane t = 0 of each quad gets the block's
// row sums of hi and lo products (exact int8 x f16 products, f32 accumulation), which it adds
// and scales into the row's sum (blocks in order). emb's hi + lo is within 2^-22 of e, so the
// logits are within f32 rounding of the exact dot (the CPU backend's order differs anyway).
// The k order inside a block is permuted alike in A and B: lane (g, t)'s 4 codes of row g at k =
// 4t .. 4t+3 (+16 for the second half) are the mma's k = 2t, 2t+1, 2t+8, 2t+9.
__device__ __forceinline__ void mma_f16_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Codes j, j + 1 (j = 0 or 2) of the word c ^ 0x80808080 as an exact f16 pair.
__device__ __forceinline__ u32 i8x2_h2(u32 cu, u32 sel) {
    const u32 x = __byte_perm(cu, 0x64646464u, sel);
    u32 r;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(0x64806480u));
    return r;
}
// The B fragments of emb (rank floats): frag[(b * 2 + half) * 32 + lane] for every block b and
// k16 half; every thread of the block takes part, a __syncthreads must follow.
__device__ __forceinline__ void markov_emb_frag(const float *emb, int kb, uint2 *frag) {
    for (int i = threadIdx.x; i < kb * 64; i += blockDim.x) {
        const int ln = i & 31, half = (i >> 5) & 1, b = i >> 6, gg = ln >> 2, tt = ln & 3;
        uint2 f = make_uint2(0u, 0u);
        if (gg < 2) {
            const float4 e = *(const float4 *)(emb + b * 32 + 16 * half + 4 * tt);
            const float v[4] = {e.x, e.y, e.z, e.w};
            u32 h[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u16 hi = f32_to_f16_bits(v[j]);
                h[j] = gg == 0 ? hi : f32_to_f16_bits(v[j] - f16_to_f32(hi));
            }
            f = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
        }
        frag[i] = f;
    }
}
// Block b of a tile: codes c (this lane's 16 bytes), scales sc (rows g / g + 8), into the row
// sums a0 / a1 (meaningful on lanes t = 0; the others add zeros).
__device__ __forceinline__ void markov_blk(const uint4 &c, u32 sc, const uint2 *frag, int b, int lane, float &a0, float &a1) {
    const u32 ux = c.x ^ 0x80808080u, uy = c.y ^ 0x80808080u, uz = c.z ^ 0x80808080u, uw = c.w ^ 0x80808080u;
    const uint2 f0 = frag[(b * 2) * 32 + lane], f1 = frag[(b * 2 + 1) * 32 + lane];
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma_f16_16816(d, i8x2_h2(ux, 0x4140u), i8x2_h2(uy, 0x4140u), i8x2_h2(ux, 0x4342u), i8x2_h2(uy, 0x4342u), f0.x, f0.y);
    mma_f16_16816(d, i8x2_h2(uz, 0x4140u), i8x2_h2(uw, 0x4140u), i8x2_h2(uz, 0x4342u), i8x2_h2(uw, 0x4342u), f1.x, f1.y);
    a0 = fmaf(d[0] + d[1], f16_to_f32((u16)(sc & 0xffffu)), a0);
    a1 = fmaf(d[2] + d[3], f16_to_f32((u16)(sc >> 16)), a1);
}
// The end of a Markov tile: the quad sums of rows r0 = 16 tile + g and r0 + 8 (a0 / a1), their
// logits l + sum for rows below o1 (stored by lane t = 0) and this thread's running winner.
__device__ __forceinline__ void markov_tile_end(float a0, float a1, float l0, float l1, int r0, int o1, int t, float *logits,
                                                float &bv, u32 &bi) {
    a0 += __shfl_xor_sync(0xffffffffu, a0, 1);
    a1 += __shfl_xor_sync(0xffffffffu, a1, 1);
    a0 += __shfl_xor_sync(0xffffffffu, a0, 2);
    a1 += __shfl_xor_sync(0xffffffffu, a1, 2);
    const int r1 = r0 + 8;
    if (r0 < o1) {
        const float v = l0 + a0;
        if (t == 0) logits[r0] = v;
        if (am_better(v, (u32)r0, bv, bi)) { bv = v; bi = (u32)r0; }
    }
    if (r1 < o1) {
        const float v = l1 + a1;
        if (t == 0) logits[r1] = v;
        if (am_better(v, (u32)r1, bv, bi)) { bv = v; bi = (u32)r1; }
    }
}
// The W2 blocks of its first tile that a warp copies into shared memory before the grid
// dependency wait (W2 does not depend on the step before): blocks 0 .. MARKOV_PRE-1.
#define MARKOV_PRE 8
extern "C" __global__ void __launch_bounds__(256, 5)
    markov_step_a8(int fmt1, const void *__restrict__ w1q, const u16 *__restrict__ w1d, int fmt2, const void *__restrict__ w2q,
                   const u16 *__restrict__ w2d, int rank, int vocab, const u32 *__restrict__ prev, float *__restrict__ logits,
                   int chunk, float *__restrict__ pv, u32 *__restrict__ pi) {
    // Dynamic shared memory: emb (rank floats), emb's mma fragments (kb x 64 uint2), then per
    // warp MARKOV_PRE blocks of codes (512 bytes each), then per warp MARKOV_PRE x 8 scale words.
    extern __shared__ __align__(16) float emb[];
    __shared__ float rv[32];
    __shared__ u32 ri[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kb = rank >> 5;
    const long long kbp = (long long)((kb + A8_KC - 1) / A8_KC) * A8_KC;
    const int o0 = blockIdx.x * chunk, o1 = min(vocab, o0 + chunk);
    const uint4 *wq4 = (const uint4 *)w2q;
    const u32 *wd2 = (const u32 *)w2d;
    uint2 *frag = (uint2 *)(emb + rank);
    uint4 *pre_c = (uint4 *)(frag + kb * 64) + warp * MARKOV_PRE * 32;
    u32 *pre_s = (u32 *)((uint4 *)(frag + kb * 64) + nw * MARKOV_PRE * 32) + warp * MARKOV_PRE * 8;
    const int tile0 = (o0 >> 4) + warp;
    if ((tile0 << 4) < o1) {
#pragma unroll
        for (int b = 0; b < MARKOV_PRE; ++b) {
            if (b >= kb) break;
            const long long pb = (long long)tile0 * kbp + b;
            cp_async16_cg(pre_c + b * 32 + lane, wq4 + pb * 32 + lane);
            if (lane < 2) cp_async16_cg(pre_s + b * 8 + 4 * lane, wd2 + pb * 8 + 4 * lane);
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    markov_load_emb(fmt1, w1q, w1d, prev, rank, emb);
    markov_emb_frag(emb, kb, frag);
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    float bv = 0.0f;
    u32 bi = ARGMAX_NONE;
    for (int tile = tile0; (tile << 4) < o1; tile += nw) {
        float a0 = 0.0f, a1 = 0.0f;  // rows 16 tile + g, + 8
        const long long pb0 = (long long)tile * kbp;
        const int r0 = (tile << 4) + g, r1 = r0 + 8;
        // The two logits in flight with the W2 loads (not a round trip after the dots).
        const float l0 = r0 < o1 ? logits[r0] : 0.0f, l1 = r1 < o1 ? logits[r1] : 0.0f;
        // Block b's update of the rows' sums (blocks in order).
        auto step = [&](int b, const uint4 &c, u32 sc) { markov_blk(c, sc, frag, b, lane, a0, a1); };
        int b = 0;
        if (tile == tile0) {
#pragma unroll
            for (int u = 0; u < MARKOV_PRE; ++u)
                if (u < kb) step(u, pre_c[u * 32 + lane], pre_s[u * 8 + g]);
            b = MARKOV_PRE;
        }
#pragma unroll 8
        for (; b < kb; ++b) step(b, wq4[(pb0 + b) * 32 + lane], wd2[(pb0 + b) * 8 + g]);
        markov_tile_end(a0, a1, l0, l1, r0, o1, t, logits, bv, bi);
    }
    block_argmax(bv, bi, rv, ri);
    if (threadIdx.x == 0) { pv[blockIdx.x] = bv; pi[blockIdx.x] = bi; }
}

// The whole Q8_0A8 Markov chain in one persistent launch (cooperative: every block resident,
// one per multiprocessor): n steps, each the bits of markov_step_a8 + argmax_final. Block b owns
// the contiguous tiles [b T / B, (b + 1) T / B) of W2 (T 16-row tiles, B blocks); its first `kt`
// tiles are copied into shared memory once and read from there at every step, the others
// stream from global memory (each warp's first such tile loaded into registers before the
// step's barrier: it does not depend on the step). Per step: every block reduces the step
// before's B partial winners itself (am_better: the same winner in any order, so every block
// gets the token argmax_final would), loads W1[token], runs its tiles (markov_step_a8's
// per-row arithmetic: the same logits bits), writes its partial winner into slot k % 2 of
// pv / pi, and the grid meets at a barrier (bar: [arrivals, generation], zero at rest).
// toks[k] = the token of step k; prev[0] = the starting token, then the last. Dynamic shared
// memory: emb (rank floats), then kt tiles of kb blocks: codes (512 bytes) then scales (32).
__device__ __forceinline__ void markov_grid_barrier(u32 *bar, u32 nblocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile u32 *gen = bar + 1;
        const u32 g = *gen;
        __threadfence();
        if (atomicAdd(bar, 1u) == nblocks - 1) {
            bar[0] = 0u;
            __threadfence();
            *gen = g + 1u;
        } else {
            while (*gen == g) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}
// The winner among the B partial winners (pv, pi) of a step, as argmax_final picks it (0 where
// there is none); every thread of the block calls it.
__device__ __forceinline__ u32 markov_partials_winner(const float *pv, const u32 *pi, int B, float *rv, u32 *ri) {
    float bv = 0.0f;
    u32 bi = ARGMAX_NONE;
    for (int c = threadIdx.x; c < B; c += blockDim.x) {
        const float v = __ldcg(pv + c);
        const u32 i = __ldcg(pi + c);
        if (i != ARGMAX_NONE && am_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    block_argmax(bv, bi, rv, ri);
    return bi == ARGMAX_NONE ? 0u : bi;
}
extern "C" __global__ void __launch_bounds__(512, 1)
    markov_chain_a8p(int fmt1, const void *__restrict__ w1q, const u16 *__restrict__ w1d, const void *__restrict__ w2q,
                     const u16 *__restrict__ w2d, int rank, int vocab, int n, u32 *__restrict__ prev, float *__restrict__ logits,
                     u32 *__restrict__ toks, float *pv, u32 *pi, u32 *bar, int kt) {
    extern __shared__ __align__(16) float emb[];
    __shared__ float rv[32];
    __shared__ u32 ri[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kb = rank >> 5;
    const long long kbp = (long long)((kb + A8_KC - 1) / A8_KC) * A8_KC;
    const int B = gridDim.x, T = (vocab + 15) >> 4;
    const int t_lo = (int)((long long)blockIdx.x * T / B), t_hi = (int)((long long)(blockIdx.x + 1) * T / B);
    const int ns = min(kt, t_hi - t_lo);  // tiles kept in shared memory
    const uint4 *wq4 = (const uint4 *)w2q;
    const u32 *wd2 = (const u32 *)w2d;
    uint2 *frag = (uint2 *)(emb + rank);              // [kb][2][32]
    uint4 *sc4 = (uint4 *)(frag + kb * 64);           // [ns][kb][32]
    u32 *ss = (u32 *)(sc4 + (size_t)ns * kb * 32);    // [ns][kb][8]
    // The kept tiles, once.
    for (int e = threadIdx.x; e < ns * kb * 34; e += blockDim.x) {
        const int tb = e / 34, j = e % 34;  // (tile, block) and 16-byte piece: 32 of codes, 2 of scales
        const long long pb = (long long)(t_lo + tb / kb) * kbp + tb % kb;
        if (j < 32) cp_async16_cg(sc4 + (size_t)tb * 32 + j, wq4 + pb * 32 + j);
        else cp_async16_cg(ss + (size_t)tb * 8 + 4 * (j - 32), wd2 + pb * 8 + 4 * (j - 32));
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    griddep_wait();  // the logits and prev first
    u32 p = *prev;
    asm volatile("cp.async.wait_all;" ::: "memory");
    for (int k = 0; k < n; ++k) {
        // This warp's first streamed tile, in registers before the barrier.
        const int gt0 = t_lo + ns + warp;
        uint4 pc[MARKOV_PRE];
        u32 pcs[MARKOV_PRE];
#pragma unroll
        for (int b = 0; b < MARKOV_PRE; ++b) {
            const bool ok = b < kb && gt0 < t_hi;
            const long long pb = (long long)gt0 * kbp + b;
            pc[b] = ok ? wq4[pb * 32 + lane] : make_uint4(0u, 0u, 0u, 0u);
            pcs[b] = ok ? wd2[pb * 8 + g] : 0u;
        }
        if (k > 0) {
            markov_grid_barrier(bar, (u32)B);
            // The step before's winner from its B partials (slot (k - 1) % 2).
            p = markov_partials_winner(pv + (size_t)((k - 1) & 1) * B, pi + (size_t)((k - 1) & 1) * B, B, rv, ri);
            if (blockIdx.x == 0 && threadIdx.x == 0) toks[k - 1] = p;
        }
        for (int i = threadIdx.x; i < rank; i += blockDim.x) emb[i] = load_w(fmt1, w1q, w1d, p, i, rank);
        __syncthreads();
        markov_emb_frag(emb, kb, frag);
        __syncthreads();
        float *lk = logits + (size_t)k * vocab;
        float bv = 0.0f;
        u32 bi = ARGMAX_NONE;
        // One tile in markov_step_a8's arithmetic: blk per block (in order) into the sums of
        // rows 16 tile + g / + 8, then fin (markov_tile_end).
        auto blk = [&](int b, const uint4 &c, u32 sc, float &a0, float &a1) { markov_blk(c, sc, frag, b, lane, a0, a1); };
        auto fin = [&](int tile, float a0, float a1, float l0, float l1) {
            markov_tile_end(a0, a1, l0, l1, (tile << 4) + g, vocab, t, lk, bv, bi);
        };
        // The logits of a tile's two rows of this lane (loaded ahead of the dots).
        auto lg = [&](int tile, float &l0, float &l1) {
            const int r0 = (tile << 4) + g, r1 = r0 + 8;
            l0 = r0 < vocab ? lk[r0] : 0.0f;
            l1 = r1 < vocab ? lk[r1] : 0.0f;
        };
        for (int st = warp; st < ns; st += nw) {
            const uint4 *cw = sc4 + (size_t)st * kb * 32;
            const u32 *cs = ss + (size_t)st * kb * 8;
            float a0 = 0.0f, a1 = 0.0f, l0, l1;
            lg(t_lo + st, l0, l1);
#pragma unroll 8
            for (int b = 0; b < kb; ++b) blk(b, cw[b * 32 + lane], cs[b * 8 + g], a0, a1);
            fin(t_lo + st, a0, a1, l0, l1);
        }
        for (int gt = gt0; gt < t_hi; gt += nw) {
            const long long pb0 = (long long)gt * kbp;
            float a0 = 0.0f, a1 = 0.0f, l0, l1;
            lg(gt, l0, l1);
            if (gt == gt0 && kb <= MARKOV_PRE) {
#pragma unroll
                for (int b = 0; b < MARKOV_PRE; ++b)
                    if (b < kb) blk(b, pc[b], pcs[b], a0, a1);
            } else {
#pragma unroll 8
                for (int b = 0; b < kb; ++b) blk(b, wq4[(pb0 + b) * 32 + lane], wd2[(pb0 + b) * 8 + g], a0, a1);
            }
            fin(gt, a0, a1, l0, l1);
        }
        block_argmax(bv, bi, rv, ri);
        if (threadIdx.x == 0) {
            pv[(size_t)(k & 1) * B + blockIdx.x] = bv;
            pi[(size_t)(k & 1) * B + blockIdx.x] = bi;
        }
    }
    // The last step's winner.
    if (n > 0) {
        markov_grid_barrier(bar, (u32)B);
        if (blockIdx.x == 0) {
            const u32 r = markov_partials_winner(pv + (size_t)((n - 1) & 1) * B, pi + (size_t)((n - 1) & 1) * B, B, rv, ri);
            if (threadIdx.x == 0) {
                toks[n - 1] = r;
                *prev = r;
            }
        }
    }
}
