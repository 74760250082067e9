// Argmax over long rows and the DSpark Markov chain, both kept on the device.

// Stage 1: grid (n_chunks, rows). Partial winners per chunk of a row.
extern "C" __global__ void argmax_partial(const float *x, long long row0, int cols, int chunk, float *pv, u32 *pi) {
    __shared__ float rv[32];
    __shared__ u32 ri[32];
    const long long row = row0 + blockIdx.y;
    const float *xr = x + row * cols;
    const int c0 = blockIdx.x * chunk, c1 = min(cols, c0 + chunk);
    float bv = 0.0f;
    u32 bi = ARGMAX_NONE;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        float v = xr[c];
        if (am_better(v, (u32)c, bv, bi)) { bv = v; bi = (u32)c; }
    }
    block_argmax(bv, bi, rv, ri);
    if (threadIdx.x == 0) {
        pv[blockIdx.y * gridDim.x + blockIdx.x] = bv;
        pi[blockIdx.y * gridDim.x + blockIdx.x] = bi;
    }
}

// Stage 2: one warp per row over its n_chunks partials (in chunk order). Rows with no
// candidate (all NaN) give 0. Optionally also stores the winner into *prev (Markov chain).
extern "C" __global__ void argmax_final(const float *pv, const u32 *pi, int n_chunks, u32 *out, u32 *prev) {
    const int row = blockIdx.x;
    float bv = 0.0f;
    u32 bi = ARGMAX_NONE;
    for (int c = threadIdx.x; c < n_chunks; c += 32) {
        float v = pv[row * n_chunks + c];
        u32 i = pi[row * n_chunks + c];
        if (i != ARGMAX_NONE && am_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    warp_argmax(bv, bi);
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

extern "C" __global__ void markov_step(int fmt1, const void *__restrict__ w1q, const u16 *__restrict__ w1d, int fmt2,
                                       const void *__restrict__ w2q, const u16 *__restrict__ w2d, int rank, int vocab,
                                       const u32 *__restrict__ prev, float *__restrict__ logits, int chunk, float *__restrict__ pv,
                                       u32 *__restrict__ pi) {
    extern __shared__ float emb[];
    __shared__ float rv[32];
    __shared__ u32 ri[32];
    const u32 p = *prev;
    for (int i = threadIdx.x; i < rank; i += blockDim.x) emb[i] = load_w(fmt1, w1q, w1d, p, i, rank);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int o0 = blockIdx.x * chunk, o1 = min(vocab, o0 + chunk);
    float bv = 0.0f;
    u32 bi = ARGMAX_NONE;
    for (int o = o0 + warp; o < o1; o += MARKOV_R * nw) {
        int rows[MARKOV_R];
        float lg[MARKOV_R], acc[MARKOV_R];
#pragma unroll
        for (int r = 0; r < MARKOV_R; ++r) {
            rows[r] = o + r * nw < o1 ? o + r * nw : -1;
            lg[r] = rows[r] >= 0 ? logits[rows[r]] : 0.0f;
        }
        // The format switch outside the inner loop (load_w folds to one format's decode).
        switch (fmt2) {
        case FMT_F32: markov_dots<FMT_F32>(w2q, w2d, rows, rank, emb, lane, acc); break;
        case FMT_BF16: markov_dots<FMT_BF16>(w2q, w2d, rows, rank, emb, lane, acc); break;
        case FMT_F16: markov_dots<FMT_F16>(w2q, w2d, rows, rank, emb, lane, acc); break;
        case FMT_Q8_0: markov_dots<FMT_Q8_0>(w2q, w2d, rows, rank, emb, lane, acc); break;
        case FMT_Q4_0: markov_dots<FMT_Q4_0>(w2q, w2d, rows, rank, emb, lane, acc); break;
        default: markov_dots<FMT_Q8A8>(w2q, w2d, rows, rank, emb, lane, acc); break;
        }
#pragma unroll
        for (int r = 0; r < MARKOV_R; ++r) {
            if (rows[r] < 0) break;
            const float v = lg[r] + warp_sum(acc[r]);
            if (lane == 0) logits[rows[r]] = v;
            if (am_better(v, (u32)rows[r], bv, bi)) { bv = v; bi = (u32)rows[r]; }
        }
    }
    block_argmax(bv, bi, rv, ri);
    if (threadIdx.x == 0) { pv[blockIdx.x] = bv; pi[blockIdx.x] = bi; }
}

// The same step one row per warp iteration (the kernel before markov_step took 4 rows at a
// time), kept for Q8_0A8, whose fragment-ordered bytes made the 4-row kernel slower on the
// H200 (8B DSpark step 3.59 -> 3.93 ms, 27B 4.52 -> 5.79 ms) while it sped up bf16 / q8_0 /
// q4_0 (3.58 -> 2.56, 3.69 -> 2.69, 4.40 -> 2.94 ms). Same arithmetic, same bits.
template <int F>
__device__ __forceinline__ float markov_dot1(const void *w2q, const u16 *w2d, int o, int rank, const float *emb, int lane) {
    float acc = 0.0f;
    for (int i = lane; i < rank; i += 32) acc = fmaf(load_w(F, w2q, w2d, o, i, rank), emb[i], acc);
    return acc;
}

extern "C" __global__ void markov_step_r1(int fmt1, const void *w1q, const u16 *w1d, int fmt2, const void *w2q, const u16 *w2d,
                                       int rank, int vocab, const u32 *prev, float *logits, int chunk, float *pv, u32 *pi) {
    extern __shared__ float emb[];
    __shared__ float rv[32];
    __shared__ u32 ri[32];
    const u32 p = *prev;
    for (int i = threadIdx.x; i < rank; i += blockDim.x) emb[i] = load_w(fmt1, w1q, w1d, p, i, rank);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int o0 = blockIdx.x * chunk, o1 = min(vocab, o0 + chunk);
    float bv = 0.0f;
    u32 bi = ARGMAX_NONE;
    for (int o = o0 + warp; o < o1; o += nw) {
        // The format switch outside the inner loop (load_w folds to one format's decode).
        float acc;
        switch (fmt2) {
        case FMT_F32: acc = markov_dot1<FMT_F32>(w2q, w2d, o, rank, emb, lane); break;
        case FMT_BF16: acc = markov_dot1<FMT_BF16>(w2q, w2d, o, rank, emb, lane); break;
        case FMT_F16: acc = markov_dot1<FMT_F16>(w2q, w2d, o, rank, emb, lane); break;
        case FMT_Q8_0: acc = markov_dot1<FMT_Q8_0>(w2q, w2d, o, rank, emb, lane); break;
        case FMT_Q4_0: acc = markov_dot1<FMT_Q4_0>(w2q, w2d, o, rank, emb, lane); break;
        default: acc = markov_dot1<FMT_Q8A8>(w2q, w2d, o, rank, emb, lane); break;
        }
        acc = warp_sum(acc);
        float v = logits[o] + acc;
        if (lane == 0) logits[o] = v;
        if (am_better(v, (u32)o, bv, bi)) { bv = v; bi = (u32)o; }
    }
    block_argmax(bv, bi, rv, ri);
    if (threadIdx.x == 0) { pv[blockIdx.x] = bv; pi[blockIdx.x] = bi; }
}
