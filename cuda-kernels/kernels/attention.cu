// Attention of a few queries over a long cached context, split over the context.
//
// Grid (n_split, n_kv_heads, ceil(n_q * G / 16)), ATT_NTH (256) threads. A block takes 16 query rows
// (query i, head h of the kv head's group) and one split of ATT_SPLIT keys, processed as
// sub-chunks of 64 keys with an online softmax; it writes the unnormalised partial output
// and (max, sum) per row. attn_combine merges the splits in split order.
// The split size is a constant: a row's partial in a split depends only on that row's query
// and the keys of the split (masked keys contribute exact zeros and alpha = 1), so a query's
// output is the same for any n_q (per-row determinism across verify widths and decode).

// ATT_SPLIT keys per split is a kernel argument (split_keys, a multiple of ATT_CK), fixed per
// backend (default 256): constant across calls, so the determinism argument above holds.
#define ATT_CK 64
#define ATT_QT 16
// Threads per block of the split kernel (8 warps: phase 1 = 4 query rows x 1 key per thread,
// phases 2-3 = 2 query rows per warp).
#define ATT_NTH 256
#define ATT_RPW (ATT_QT / (ATT_NTH / 32))

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const u32 sa = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(gmem));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

// x / d and x % d for 0 <= x by a float reciprocal where 0 <= x < 2^21 and d < 2^21 (the
// integer division is ~25 instructions; the GQA group size G divides every query row index of
// the tensor-core kernels several times). Exact there: (x + 0.5) / d lies at least 0.5 / d from
// an integer, and the float product is within (q + 1) 2^-23 of it, (q + 1) d <= x + d < 2^22.
struct IDiv {
    int d, lim;
    float inv;
    __device__ __forceinline__ explicit IDiv(int d_) : d(d_), lim(d_ < (1 << 21) ? (1 << 21) : 0), inv(1.0f / (float)d_) {}
    __device__ __forceinline__ int div(int x) const { return x < lim ? (int)(((float)x + 0.5f) * inv) : x / d; }
    __device__ __forceinline__ int mod(int x) const { return x - div(x) * d; }
};
// A 16-byte cp.async to a shared address.
__device__ __forceinline__ void cp_async16s(u32 sa, const void *gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(gmem));
}

__device__ __forceinline__ bool att_visible(long long j, int n_kv, long long kpos, long long qpos, int causal, long long window) {
    return j < n_kv && (!causal || kpos <= qpos) && (window < 0 || qpos < kpos + window);
}

template <int D>
__device__ __forceinline__ void attn_split_impl(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                                                float *__restrict__ ws_o, float *__restrict__ ws_ml, int n_q, int n_kv, int H, int Hkv,
                                                long long q_pos0, long long kv_pos0, int causal, long long window, float scale,
                                                int split_keys) {
    griddep_launch();  // the combine may launch (it waits for this grid)
    griddep_wait();    // a programmatic dependent launch: q and the cache first
    constexpr int DL = D / 32;
    constexpr int KP = D + 4;  // K row pitch: 16-byte rows, conflict-free float4 reads
    extern __shared__ float sm[];
    float *Qs = sm;                       // [D][16]
    float *Ks = Qs + D * ATT_QT;          // [64][D+4]
    float *Vs = Ks + ATT_CK * KP;         // [64][D]
    float *Ps = Vs + ATT_CK * D;          // [64][16]
    float *m_run = Ps + ATT_CK * ATT_QT;  // [16]
    float *l_run = m_run + ATT_QT;        // [16]
    float *alpha_s = l_run + ATT_QT;      // [16]
    long long *qpos = (long long *)(alpha_s + ATT_QT);  // [16]
    int *rvalid = (int *)(qpos + ATT_QT);               // [16]

    const int G = H / Hkv;
    const int QR = n_q * G;
    const int hk = blockIdx.y;
    const int qr0 = blockIdx.z * ATT_QT;
    const int split = blockIdx.x;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    {
        constexpr int QPER = ATT_QT * D / ATT_NTH;
        float qv[QPER];
#pragma unroll
        for (int u = 0; u < QPER; ++u) {
            const int idx = tid + ATT_NTH * u;
            const int r = idx / D, d = idx % D;
            const int qr = qr0 + r;
            qv[u] = 0.0f;
            if (qr < QR) {
                const int i = qr / G, h = hk * G + qr % G;
                qv[u] = q[((long long)i * H + h) * D + d];
            }
        }
#pragma unroll
        for (int u = 0; u < QPER; ++u) {
            const int idx = tid + ATT_NTH * u;
            Qs[(idx % D) * ATT_QT + idx / D] = qv[u];
        }
    }
    if (tid < ATT_QT) {
        const int qr = qr0 + tid;
        rvalid[tid] = qr < QR;
        qpos[tid] = q_pos0 + (qr < QR ? qr / G : 0);
        m_run[tid] = NEG_INF;
        l_run[tid] = 0.0f;
    }
    static_assert(ATT_RPW == 2, "phase 3 reads 2 probabilities per key (float2)");
    static_assert(ATT_NTH == 256, "phase 1 maps 256 threads to 64 keys x 4 row groups of 4");
    float o[ATT_RPW][DL];
#pragma unroll
    for (int r = 0; r < ATT_RPW; ++r)
#pragma unroll
        for (int e = 0; e < DL; ++e) o[r][e] = 0.0f;

    // Skip a split that no row of this block can see (sliding windows over long contexts):
    // an exact no-op for every row (its l stays 0, so the combine ignores the split).
    __shared__ int s_nsub;
    __syncthreads();
    if (tid == 0) {
        const long long jlo = (long long)split * split_keys;
        const long long jhi = min((long long)n_kv, jlo + split_keys) - 1;
        bool any = false;
        for (int r = 0; r < ATT_QT; ++r) {
            if (!rvalid[r]) continue;
            long long lo = kv_pos0 + jlo, hi = kv_pos0 + jhi;
            if (window >= 0) lo = max(lo, qpos[r] - window + 1);
            if (causal) hi = min(hi, qpos[r]);
            if (lo <= hi) any = true;
        }
        s_nsub = any ? split_keys / ATT_CK : 0;
    }
    __syncthreads();
    const int nsub = s_nsub;
    // K and V of a sub-chunk are loaded as separate cp.async groups, one step ahead: V(sub)
    // flies during the scores of sub, K(sub+1) during its softmax and PV.
    const long long jbase = (long long)split * split_keys;
    const int nsub_eff = jbase >= n_kv ? 0 : min(nsub, (int)((n_kv - jbase + ATT_CK - 1) / ATT_CK));
    constexpr int C4 = D / 4;
    auto load_rows = [&](const float *__restrict__ src, float *dst, int pitch, long long j0) {
        for (int c = tid; c < ATT_CK * C4; c += ATT_NTH) {
            const int kk = c / C4, d4 = (c % C4) * 4;
            const long long j = j0 + kk;
            float *dd = dst + kk * pitch + d4;
            if (j < n_kv) cp_async16(dd, src + (j * Hkv + hk) * D + d4);
            else *(float4 *)dd = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    if (nsub_eff > 0) load_rows(k, Ks, KP, jbase);
    cp_async_commit();
    for (int sub = 0; sub < nsub_eff; ++sub) {
        const long long j0 = jbase + sub * ATT_CK;
        __syncthreads();  // the previous PV is done with Vs
        load_rows(v, Vs, D, j0);
        cp_async_commit();
        cp_async_wait1();  // K(sub) has landed
        __syncthreads();
        // Phase 1: scores. Thread: key kk = tid % 64, rows rh*4 .. rh*4+3.
        {
            const int kk = tid & 63, rh = tid >> 6;
            float s[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) s[r] = 0.0f;
            for (int d0 = 0; d0 < D; d0 += 4) {
                const float4 k4 = *(const float4 *)(Ks + kk * KP + d0);
                const float kvs[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
                for (int dd = 0; dd < 4; ++dd) {
                    const float kv = kvs[dd];
                    const float4 qa = *(const float4 *)(Qs + (d0 + dd) * ATT_QT + rh * 4);
                    s[0] = fmaf(qa.x, kv, s[0]); s[1] = fmaf(qa.y, kv, s[1]);
                    s[2] = fmaf(qa.z, kv, s[2]); s[3] = fmaf(qa.w, kv, s[3]);
                }
            }
            const long long j = j0 + kk;
            const long long kpos = kv_pos0 + j;
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int rr = rh * 4 + r;
                const bool vis = rvalid[rr] && att_visible(j, n_kv, kpos, qpos[rr], causal, window);
                Ps[kk * ATT_QT + rr] = vis ? s[r] * scale : NEG_INF;
            }
        }
        __syncthreads();  // the scores are done with Ks
        if (sub + 1 < nsub_eff) load_rows(k, Ks, KP, j0 + ATT_CK);
        cp_async_commit();
        // Phase 2: online softmax bookkeeping, warp w owns rows ATT_RPW w ...
#pragma unroll
        for (int r4 = 0; r4 < ATT_RPW; ++r4) {
            const int r = warp * ATT_RPW + r4;
            const float a = Ps[lane * ATT_QT + r], b = Ps[(lane + 32) * ATT_QT + r];
            const float mx = warp_max(fmaxf(a, b));
            const float m_old = m_run[r];
            const float m_new = fmaxf(m_old, mx);
            float pa = 0.0f, pb = 0.0f, alpha = 1.0f;
            if (m_new != NEG_INF) {
                pa = a == NEG_INF ? 0.0f : expf(a - m_new);
                pb = b == NEG_INF ? 0.0f : expf(b - m_new);
                alpha = m_old == NEG_INF ? 0.0f : expf(m_old - m_new);
            }
            const float sum = warp_sum(pa + pb);
            Ps[lane * ATT_QT + r] = pa;
            Ps[(lane + 32) * ATT_QT + r] = pb;
            __syncwarp();
            if (lane == 0) {
                l_run[r] = l_run[r] * alpha + sum;
                m_run[r] = m_new;
                alpha_s[r] = alpha;
            }
        }
        cp_async_wait1();  // V(sub) has landed (K(sub+1) may still be in flight)
        __syncthreads();
        // Phase 3: O[r][d] = alpha * O + sum_k P[r][k] V[k][d]; rows 4w..; d = lane*DL + e when
        // DL is a multiple of 4 (float4 reads), else d = lane + 32e
#pragma unroll
        for (int r = 0; r < ATT_RPW; ++r) {
            const float al = alpha_s[warp * ATT_RPW + r];
#pragma unroll
            for (int e = 0; e < DL; ++e) o[r][e] *= al;
        }
        for (int kk = 0; kk < ATT_CK; ++kk) {
            const float2 p = *(const float2 *)(Ps + kk * ATT_QT + warp * ATT_RPW);
            float vv[DL];
            if (DL % 4 == 0) {
                // lane owns d = lane*DL .. lane*DL + DL-1: 16-byte reads
#pragma unroll
                for (int c = 0; c < DL / 4; ++c) {
                    const float4 v4 = *(const float4 *)(Vs + kk * D + lane * DL + 4 * c);
                    vv[4 * c] = v4.x; vv[4 * c + 1] = v4.y; vv[4 * c + 2] = v4.z; vv[4 * c + 3] = v4.w;
                }
            } else {
#pragma unroll
                for (int e = 0; e < DL; ++e) vv[e] = Vs[kk * D + lane + 32 * e];
            }
#pragma unroll
            for (int e = 0; e < DL; ++e) {
                o[0][e] = fmaf(p.x, vv[e], o[0][e]);
                o[1][e] = fmaf(p.y, vv[e], o[1][e]);
            }
        }
    }
    __syncthreads();
    const long long rows_total = (long long)n_q * H;
#pragma unroll
    for (int r = 0; r < ATT_RPW; ++r) {
        const int rr = warp * ATT_RPW + r;
        const int qr = qr0 + rr;
        if (qr < QR) {
            const int i = qr / G, h = hk * G + qr % G;
            const long long row = (long long)split * rows_total + (long long)i * H + h;
#pragma unroll
            for (int e = 0; e < DL; ++e) ws_o[row * D + (DL % 4 == 0 ? lane * DL + e : lane + 32 * e)] = o[r][e];
            if (lane == 0) {
                ws_ml[row * 2] = m_run[rr];
                ws_ml[row * 2 + 1] = l_run[rr];
            }
        }
    }
}

#define ATTN(D)                                                                                                                   \
    extern "C" __global__ void __launch_bounds__(ATT_NTH) attn_split_d##D(                                                           \
        const float *q, const float *k, const float *v, float *ws_o, float *ws_ml, int n_q, int n_kv, int H, int Hkv,             \
        long long q_pos0, long long kv_pos0, int causal, long long window, float scale, int split_keys) {                         \
        attn_split_impl<D>(q, k, v, ws_o, ws_ml, n_q, n_kv, H, Hkv, q_pos0, kv_pos0, causal, window, scale, split_keys);         \
    }
ATTN(32)
ATTN(64)
ATTN(128)
ATTN(256)

// Merge the splits. One block per (query, head) row, one thread per d (blockDim = D, D <= 256).
// M = max of the split maxima (order-free), then out = sum_s o_s w_s / sum_s l_s w_s with
// w_s = exp(m_s - M), summed in split order. Splits a row cannot see (l = 0) leave both sums
// unchanged (exactly as skipping them), so the result does not depend on how many such splits
// follow (decode == verify). Latency: the first ATT_CMB_PRE partial outputs are loaded while
// the (m, l) of all splits are (one round trip for both); the rest in unrolled batches.
// ATT_CMB_PRE: 16 (attn_combine) or 64 (attn_combine_wide, for more than 16 splits: one round
// trip instead of two or three at ctx 8192; the same bits, a register cost that slows the
// few-split case).
#define ATT_CMB_TILE 256
// With xq != null (D % 32 == 0, blockDim = D) the block also writes its D values as the
// Q8_0A8 activation of token i = row / H (K = H D; warp w: block (h D + 32 w) / 32, h = row %
// H; a8_store_block in prelude.cuh: the bytes a8_quant_x writes from out); the grid then has
// NT*8*H blocks: those past rows_total write the padding tokens' zeros, and the block of head
// H - 1 of each token zeroes its padding blocks K/32 .. KBp-1. With hi != null the block also
// writes its D values as the skinny matmuls' bf16 hi / lo x of the o projection (index row * D
// + d, the layout of out; split_bf16's bits of out, without that launch).
template <int ATT_CMB_PRE>
__device__ __forceinline__ void attn_combine_impl(const float *ws_o, const float *ws_ml, int n_split, long long rows_total, int D,
                                                  float *out, int H, int NT, int KBp, u32 *xq, float *xd, u16 *hi, u16 *lo) {
    griddep_wait();  // a programmatic dependent launch: the split partials first
    if (xq != nullptr && (long long)blockIdx.x >= rows_total) {  // a padding token: zeros
        const int i = blockIdx.x / H, h = blockIdx.x % H;
        a8_store_block(0.0f, (h * D >> 5) + (threadIdx.x >> 5), i, NT, xq, xd);
        if (h == H - 1) a8_zero_pad(i, H * D / 32, KBp, NT, xq, xd);
        return;
    }
    __shared__ float red[32];
    __shared__ float w_s[ATT_CMB_TILE];
    __shared__ float l_s[ATT_CMB_TILE];
    const long long row = blockIdx.x;
    const int tid = threadIdx.x, nth = blockDim.x, lane = tid & 31, warp = tid >> 5;
    const bool col = tid < D;
    // Every partial slot is written (o = 0, l = 0 for a split the row cannot see), so these
    // loads need no condition; a dead split's o is multiplied by nothing (selected away).
    // (Each unrolled loop over the first ATT_CMB_PRE splits stops at n_split: a block-uniform
    // branch instead of the dead splits' predicated-off code.)
    float pre[ATT_CMB_PRE];
#pragma unroll
    for (int s = 0; s < ATT_CMB_PRE; ++s) {
        if (s >= n_split) break;
        pre[s] = col ? ws_o[((long long)s * rows_total + row) * D + tid] : 0.0f;
    }
    // (m, l) of the first tile into shared memory; the maximum over every split.
    float mx = NEG_INF;
    for (int s = tid; s < n_split; s += nth) {
        const long long pr = (long long)s * rows_total + row;
        const float m = ws_ml[pr * 2], l = ws_ml[pr * 2 + 1];
        if (l > 0.0f) mx = fmaxf(mx, m);
        if (s < ATT_CMB_TILE) {
            w_s[s] = m;
            l_s[s] = l;
        }
    }
    // The o projection may launch now (it prefetches its first weight stage, then waits for
    // this grid): after this block's loads, which its prefetch would otherwise delay.
    griddep_launch();
    mx = warp_max(mx);
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < (nth + 31) / 32; ++w) M = fmaxf(M, red[w]);
    float acc = 0.0f, L = 0.0f;
    for (int s0 = 0; s0 < n_split; s0 += ATT_CMB_TILE) {
        const int ns = min(ATT_CMB_TILE, n_split - s0);
        if (s0 > 0) {
            __syncthreads();  // the previous tile's weights are used
            for (int s = tid; s < ns; s += nth) {
                const long long pr = (long long)(s0 + s) * rows_total + row;
                w_s[s] = ws_ml[pr * 2];
                l_s[s] = ws_ml[pr * 2 + 1];
            }
        }
        __syncthreads();
        for (int s = tid; s < ns; s += nth) {  // (m, l) -> (w, l), 0 for a dead split
            const float m = w_s[s], l = l_s[s];
            const bool live = l > 0.0f;
            w_s[s] = live ? expf(m - M) : 0.0f;
            l_s[s] = live ? l : 0.0f;
        }
        __syncthreads();
        if (col) {
            int s = 0;
            if (s0 == 0) {
#pragma unroll
                for (int u = 0; u < ATT_CMB_PRE; ++u) {
                    if (u >= ns) break;
                    const float l = l_s[u], w = w_s[u];
                    const bool live = l > 0.0f;
                    acc = live ? fmaf(pre[u], w, acc) : acc;
                    L = live ? fmaf(l, w, L) : L;
                }
                s = min(ns, ATT_CMB_PRE);
            }
#pragma unroll 16
            for (; s < ns; ++s) {
                const float o = ws_o[((long long)(s0 + s) * rows_total + row) * D + tid];
                const float l = l_s[s], w = w_s[s];
                const bool live = l > 0.0f;
                acc = live ? fmaf(o, w, acc) : acc;
                L = live ? fmaf(l, w, L) : L;
            }
        }
    }
    const float y = L > 0.0f ? acc / L : 0.0f;
    if (col) out[row * D + tid] = y;
    if (hi != nullptr && col) {
        u32 h2, l2;
        split_bf16x2(y, 0.0f, h2, l2);
        hi[row * D + tid] = (u16)(h2 & 0xffffu);
        if (lo != nullptr) lo[row * D + tid] = (u16)(l2 & 0xffffu);
    }
    if (xq != nullptr) {
        const int i = (int)(row / H), h = (int)(row % H);
        a8_store_block(y, (h * D >> 5) + warp, i, NT, xq, xd);
        if (h == H - 1) a8_zero_pad(i, H * D / 32, KBp, NT, xq, xd);
    }
}
// attention_gemm's masked softmax of row (g, i) of g * r rows of nk scores (keys jlo ..),
// query row r0 + i of the call. Its visible keys [lo, hi) as the CPU backend's: causal, hi =
// min(qpos - kv_pos0 + 1, n_kv) (0 when qpos < kv_pos0); window w, lo = qpos + 1 - w - kv_pos0
// (at least 0, at most hi). Returns the block-relative range [a, b), the row's maximum m and
// 1 / sum (0 for a row that sees no key). blockDim 256.
__device__ __forceinline__ void softmax_row_stats(const float *x, int nk, int i, long long r0, long long jlo, long long q_pos0,
                                                  long long kv_pos0, long long n_kv, int causal, long long window, float *red,
                                                  int &a, int &b, float &m, float &inv) {
    const long long qpos = q_pos0 + r0 + i;
    long long hi = !causal ? n_kv : (qpos < kv_pos0 ? 0 : min(qpos - kv_pos0 + 1, n_kv));
    long long lo = 0;
    if (window > 0) lo = min(max(qpos + 1 - window - kv_pos0, 0LL), hi);
    a = (int)max(lo - jlo, 0LL);
    b = (int)max(min(hi - jlo, (long long)nk), 0LL);
    m = NEG_INF;
    for (int j = a + threadIdx.x; j < b; j += blockDim.x) m = fmaxf(m, x[j]);
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = NEG_INF;
#pragma unroll
    for (int w = 0; w < 8; ++w) m = fmaxf(m, red[w]);
    float l = 0.0f;
    for (int j = a + threadIdx.x; j < b; j += blockDim.x) l += expf(x[j] - m);
    l = block_sum(l, red);
    inv = l > 0.0f ? 1.0f / l : 0.0f;
}

// The softmax in place (f32 P): keys outside the row's range are 0; a row that sees none is
// all zeros.
extern "C" __global__ void __launch_bounds__(256) attn_softmax_rows(float *s, int nk, int r, long long r0, long long jlo,
                                                                  long long q_pos0, long long kv_pos0, long long n_kv,
                                                                  int causal, long long window) {
    __shared__ float red[32];
    const int row = blockIdx.x;
    float *x = s + (long long)row * nk;
    int a, b;
    float m, inv;
    softmax_row_stats(x, nk, row % r, r0, jlo, q_pos0, kv_pos0, n_kv, causal, window, red, a, b, m, inv);
    for (int j = threadIdx.x; j < nk; j += blockDim.x) x[j] = j >= a && j < b ? expf(x[j] - m) * inv : 0.0f;
}

// The softmax written as P's 16-bit operand of attention_gemm's second product: row R = (kv
// head hk, query head of the group, row i) of hq * r rows (gr = g * r per kv head); key j of
// the block in chunk c = j / kc at position jj = j % kc of row (hk, c, R % gr) of P (parts * kc
// values: f16, or the bf16 triple (hi, hi, lo) against V's (hi, lo, hi) of
// attn_gemm_operand: O = Vhi Phi + Vlo Phi + Vhi Plo over the chunk in one product). Keys
// outside the row's range and the chunks' padding past nk are 0.
extern "C" __global__ void __launch_bounds__(256) attn_softmax_rows_p16(const float *s, u16 *p, int nk, int r, int gr, int kc, int nc,
                                                                      long long r0, long long jlo, long long q_pos0,
                                                                      long long kv_pos0, long long n_kv, int causal,
                                                                      long long window, int f16) {
    __shared__ float red[32];
    const int row = blockIdx.x, hk = row / gr, col = row % gr;
    const float *x = s + (long long)row * nk;
    int a, b;
    float m, inv;
    softmax_row_stats(x, nk, row % r, r0, jlo, q_pos0, kv_pos0, n_kv, causal, window, red, a, b, m, inv);
    const int parts = f16 ? 1 : 3, ldk = parts * kc;
    for (int j = threadIdx.x; j < nc * kc; j += blockDim.x) {
        const float v = j >= a && j < b ? expf(x[j] - m) * inv : 0.0f;
        const int c = j / kc, jj = j - c * kc;
        u16 *y = p + (((long long)hk * nc + c) * gr + col) * ldk;
        if (f16) {
            y[jj] = h_pack(v);
        } else {
            u32 h, l;
            split_bf16x2(v, 0.0f, h, l);
            y[3 * jj] = (u16)(h & 0xffffu);
            y[3 * jj + 1] = (u16)(h & 0xffffu);
            y[3 * jj + 2] = (u16)(l & 0xffffu);
        }
    }
}

// attention_gemm's 16-bit operands: source row (a, b) of `heads` rows of w values per a (the
// layout of q / k / v: a the token, b the head) written as row b * rows_out + a (head-major),
// rows a >= valid as zeros. f16: one f16 value each; else three bf16 parts of w, part t the hi
// (bit t of `lo_parts` clear) or lo (set) half of split_bf16x2: Q [hi | hi | lo] (0b100)
// against K [hi | lo | hi] (0b010) gives S = Qhi Khi + Qhi Klo + Qlo Khi in one product over
// 3 w; V the same as K.
extern "C" __global__ void attn_gemm_operand(const float *__restrict__ x, u16 *__restrict__ y, long long valid, long long rows_out,
                                             int heads, int w, int lo_parts, int f16) {
    const long long hw = (long long)heads * w, n = rows_out * hw, step = (long long)gridDim.x * blockDim.x;
    const int parts = f16 ? 1 : 3;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += step) {
        const long long a = i / hw;
        const int rem = (int)(i - a * hw), b = rem / w, c = rem - b * w;
        const float v = a < valid ? x[i] : 0.0f;
        u16 *o = y + ((long long)b * rows_out + a) * parts * w + c;
        if (f16) {
            o[0] = h_pack(v);
            continue;
        }
        u32 h, l;
        split_bf16x2(v, 0.0f, h, l);
#pragma unroll
        for (int t = 0; t < 3; ++t) o[(long long)t * w] = (u16)(((lo_parts >> t) & 1 ? l : h) & 0xffffu);
    }
}

// attention_gemm's output: out row i, head h = hk g + gi (r rows of hq heads of d) = the sum
// in chunk order of the partials [hk][c][gi r + i][d] of its nc key chunks.
extern "C" __global__ void attn_gemm_reduce(const float *__restrict__ part, float *__restrict__ out, int r, int hq, int g, int d, int nc) {
    const long long n = (long long)r * hq * d, step = (long long)gridDim.x * blockDim.x;
    const long long gr = (long long)g * r;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n; idx += step) {
        const int i = (int)(idx / ((long long)hq * d)), rem = (int)(idx - (long long)i * hq * d);
        const int h = rem / d, dd = rem - h * d, hk = h / g, gi = h - hk * g;
        const long long col = (long long)gi * r + i;
        float acc = 0.0f;
        for (int c = 0; c < nc; ++c) acc += part[(((long long)hk * nc + c) * gr + col) * d + dd];
        out[idx] = acc;
    }
}

extern "C" __global__ void attn_combine(const float *ws_o, const float *ws_ml, int n_split, long long rows_total, int D, float *out,
                                        int H, int NT, int KBp, u32 *xq, float *xd, u16 *hi, u16 *lo) {
    attn_combine_impl<16>(ws_o, ws_ml, n_split, rows_total, D, out, H, NT, KBp, xq, xd, hi, lo);
}
extern "C" __global__ void attn_combine_wide(const float *ws_o, const float *ws_ml, int n_split, long long rows_total, int D,
                                             float *out, int H, int NT, int KBp, u32 *xq, float *xd, u16 *hi, u16 *lo) {
    attn_combine_impl<64>(ws_o, ws_ml, n_split, rows_total, D, out, H, NT, KBp, xq, xd, hi, lo);
}

// Generic fallback for head dims the tiled kernel does not take: one warp per (query, head),
// keys in order with an online softmax; lane owns d = lane + 32e. Per-row deterministic.
extern "C" __global__ void attn_generic(const float *q, const float *k, const float *v, float *out, int n_q, int n_kv, int H, int Hkv,
                                        int D, long long q_pos0, long long kv_pos0, int causal, long long window, float scale) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + warp;
    if (row >= (long long)n_q * H) return;
    const int i = (int)(row / H), h = (int)(row % H), hk = h / (H / Hkv);
    const long long qpos = q_pos0 + i;
    const float *qr = q + row * D;
    float acc[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) acc[e] = 0.0f;
    float M = NEG_INF, L = 0.0f;
    for (long long j = 0; j < n_kv; ++j) {
        const long long kpos = kv_pos0 + j;
        if (!att_visible(j, n_kv, kpos, qpos, causal, window)) continue;
        const float *kr = k + (j * Hkv + hk) * D;
        float s = 0.0f;
        for (int d = lane; d < D; d += 32) s = fmaf(qr[d], kr[d], s);
        s = warp_sum(s) * scale;
        const float Mn = fmaxf(M, s);
        const float a = M == NEG_INF ? 0.0f : expf(M - Mn);
        const float p = expf(s - Mn);
        L = L * a + p;
        M = Mn;
        const float *vr = v + (j * Hkv + hk) * D;
#pragma unroll
        for (int e = 0; e < 16; ++e) {
            const int d = lane + 32 * e;
            if (d < D) acc[e] = acc[e] * a + p * vr[d];
        }
    }
#pragma unroll
    for (int e = 0; e < 16; ++e) {
        const int d = lane + 32 * e;
        if (d < D) out[row * D + d] = L > 0.0f ? acc[e] / L : 0.0f;
    }
}

// ------------------------------------------------------------------------------------------------
// Tensor-core attention (3xTF32) for head dims 32 / 64 / 128.
//
// Grid (ceil(n_q * G / (16 RW)), splits, n_kv_heads), 32 * KW * RW threads: RW row warps (16 query
// rows each: row qr = query qr / G, head hk G + qr % G) times KW key warps. The block streams its
// split of `split_keys` keys as chunks of CK = 16 KW keys through a cp.async pipeline of nst (1, 2
// or 3, a launch argument: scheduling only) stages shared by all warps; key warp kw takes keys
// 16 kw .. 16 kw + 15 of every chunk. Each warp keeps its own
// online softmax (running max, sum, unnormalised output) for its 16 rows over its keys; at the
// end the KW states of a row group are merged in the fixed order kw = 0, 1, ..., and the split's
// partial (unnormalised output, max, sum) goes to the workspace for attn_combine.
// The grid's splits are split0 .. split0 + gridDim.y - 1 (the host leaves out the splits no
// query row can see: exact no-ops in the combine), and split split0 + y writes partial slot y.
//
// Products: S = Q K^T and O += P V with mma.m16n8k8 tf32, each operand split as x = hi + lo
// (hi = tf32(x), lo = x - hi) and hi*hi + hi*lo + lo*hi accumulated in f32 (the lo*lo term
// is below f32 rounding): about f32 accuracy.
//
// Per-row determinism: the chunk boundaries sit at fixed key indices (multiples of CK from the
// split start, split starts at multiples of split_keys), a row's scores depend only on its
// query and the keys (each mma output element is a dot product of its own A row and B column),
// masked keys give p = 0 and leave (max, sum, output) unchanged bit for bit, chunks no row of
// the block can see are skipped (the same no-op), and the merge orders are fixed. So a row gives
// the same bits for any n_q, n_kv >= its visible keys and any RW.
//
// Fragment layouts (m16n8k8 tf32; g = lane / 4, t = lane % 4): A a0 (g, t), a1 (g+8, t),
// a2 (g, t+4), a3 (g+8, t+4); B b0 (k t, n g), b1 (k t+4, n g); C c0 (g, 2t), c1 (g, 2t+1),
// c2 (g+8, 2t), c3 (g+8, 2t+1).
// * S: over a pair of k-steps lane t reads d = 16 kp + 4t .. +3 with one float4 (Q and K):
//   step 0 maps k t -> d 16kp+4t, k t+4 -> 16kp+4t+1, step 1 -> +2 / +3. Key n of n-tile nt is
//   key 8 nt + n of the warp's 16.
// * PV: the A operand (P) comes straight from the S accumulator: k t -> key 2t, k t+4 -> key
//   2t+1, so a0 = c0, a1 = c2, a2 = c1, a3 = c3, and V's B rows are read with the same map.
//   Output n-tile 4c + e, column n holds d = 32c + 4n + e, so lane g reads V[key][32c + 4g ..+3]
//   as one float4 for e = 0..3, and the accumulator of rows g / g+8 holds d = 32c + 8t .. +7.
// Shared pitches: Q and K rows D + 16 floats (float4 reads of 2 rows x 4 lanes conflict-free),
// V rows D + 4 (float4 reads of rows 2t / 2t+1 at column 4g conflict-free).

// hi = x rounded to tf32 (half-ulp up in magnitude, low 13 bits cleared), lo = x - hi (exact in
// f32; the tensor cores read its top 19 bits, ignoring the low 13 as for any tf32 operand).
__device__ __forceinline__ void tf32_split(float x, u32 &hi, u32 &lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
}
// x rounded to tf32 (the hi part of tf32_split): P in the 1xTF32 kernels.
__device__ __forceinline__ u32 tf32_rn(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }
// x as a tf32 operand as it is (the tensor cores read its top 19 bits: truncation): Q, K and V in
// the 1xTF32 kernels, which stream them with no instruction spent on rounding.
__device__ __forceinline__ u32 f2u(float x) { return __float_as_uint(x); }
__device__ __forceinline__ void mma_tf32(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// c += a b with a = ah + al, b = bh + bl (al bl dropped), small terms first.
__device__ __forceinline__ void mma_3xtf32(float c[4], const u32 ah[4], const u32 al[4], u32 bh0, u32 bh1, u32 bl0, u32 bl1) {
    mma_tf32(c, al[0], al[1], al[2], al[3], bh0, bh1);
    mma_tf32(c, ah[0], ah[1], ah[2], ah[3], bl0, bl1);
    mma_tf32(c, ah[0], ah[1], ah[2], ah[3], bh0, bh1);
}

// The chunks [c_begin, c_end) of a split (first key jbase) that some row qr0 .. of a block can
// see (the others are exact no-ops): the window's and the causal mask's bounds of the block's
// first and last real rows.
__device__ __forceinline__ void att_chunk_range(long long jbase, int split_keys, int n_kv, int qr0, int ROWS, int QR, const IDiv &G,
                                                long long q_pos0, long long kv_pos0, int causal, long long window, int CK,
                                                int &c_begin, int &c_end) {
    c_begin = 0;
    c_end = 0;
    const int last = min(qr0 + ROWS, QR) - 1;
    long long jlo = jbase, jhi = min((long long)n_kv, jbase + split_keys);  // [jlo, jhi)
    if (last >= qr0) {
        if (window >= 0) jlo = max(jlo, q_pos0 + G.div(qr0) - window + 1 - kv_pos0);
        if (causal) jhi = min(jhi, q_pos0 + G.div(last) - kv_pos0 + 1);
    } else {
        jhi = jlo;
    }
    if (jhi > jlo) {
        c_begin = (int)((jlo - jbase) / CK);
        c_end = (int)((jhi - jbase + CK - 1) / CK);
    }
}

// A tensor-core warp's scores of its 16 keys (key 8 nt + n of n-tile nt, from key jw; this
// lane's rows g / g+8: va / vb real, at query positions qpa / qpb): scaled, masked unless the
// whole chunk is visible (`full`), then one online-softmax step per row (quad shuffles: lanes 4g
// .. 4g+3 hold row g): s becomes p, (m, l) are updated, (ala, alb) rescale the running output.
// EX2 (the f16 kernels): scale carries log2(e), so s, m are in log2 units and the exponentials
// are ex2.approx (relative error ~2^-22, against the operands' f16 rounding of 2^-11); the caller
// turns m back into natural units before the merge (m ln 2).
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
template <bool EX2 = false>
__device__ __forceinline__ void att_softmax16(float (&s)[2][4], bool full, long long jw, int t, bool va, bool vb, long long qpa,
                                              long long qpb, int n_kv, long long kv_pos0, int causal, long long window, float scale,
                                              float &m_a, float &m_b, float &l_a, float &l_b, float &ala, float &alb) {
    if (full) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] *= scale;
    } else {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const long long j = jw + nt * 8 + 2 * t + e;
                const long long kpos = kv_pos0 + j;
                s[nt][e] = va && att_visible(j, n_kv, kpos, qpa, causal, window) ? s[nt][e] * scale : NEG_INF;
                s[nt][2 + e] = vb && att_visible(j, n_kv, kpos, qpb, causal, window) ? s[nt][2 + e] * scale : NEG_INF;
            }
    }
    float mxa = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
    float mxb = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
    mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
    mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
    mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
    mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
    const float mna = fmaxf(m_a, mxa), mnb = fmaxf(m_b, mxb);
    ala = m_a == NEG_INF ? 1.0f : EX2 ? ex2_approx(m_a - mna) : expf(m_a - mna);
    alb = m_b == NEG_INF ? 1.0f : EX2 ? ex2_approx(m_b - mnb) : expf(m_b - mnb);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            s[nt][e] = s[nt][e] == NEG_INF ? 0.0f : EX2 ? ex2_approx(s[nt][e] - mna) : expf(s[nt][e] - mna);
            s[nt][2 + e] = s[nt][2 + e] == NEG_INF ? 0.0f : EX2 ? ex2_approx(s[nt][2 + e] - mnb) : expf(s[nt][2 + e] - mnb);
        }
    l_a = __fmaf_rn(l_a, ala, (s[0][0] + s[0][1]) + (s[1][0] + s[1][1]));
    l_b = __fmaf_rn(l_b, alb, (s[0][2] + s[0][3]) + (s[1][2] + s[1][3]));
    m_a = mna;
    m_b = mnb;
}

// The running output of rows g / g+8 times (ala, alb), skipped when the whole warp's factors are
// 1 (x * 1 == x: exact).
template <int NO>
__device__ __forceinline__ void att_rescale(float (&o)[NO][4], float ala, float alb) {
    if (__any_sync(0xffffffffu, ala != 1.0f || alb != 1.0f)) {
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            o[n][0] *= ala;
            o[n][1] *= ala;
            o[n][2] *= alb;
            o[n][3] *= alb;
        }
    }
}

// The end of a tensor-core split kernel: merge the key warps' online-softmax states (o, m, l of
// this lane's rows g / g+8; l already summed over the quad) and write the split's partial into
// slot pslot of the workspace.
template <int D, int KW, bool PERM>
__device__ __forceinline__ void attn_tc_store(float (&o)[D / 8][4], float m_a, float m_b, float l_a, float l_b, float *sm, int rw,
                                              int kw, int lane, int t, int ra, int rb, bool va, bool vb, const IDiv &G, int hk, int H,
                                              int n_q, int pslot, float *__restrict__ ws_o, float *__restrict__ ws_ml) {
    constexpr int NO = D / 8, NC = D / 32;
    // Merge the key warps' states in order kw = 0, 1, ... (through shared memory): every key warp
    // saves its state, then key warp kw merges the output column groups c = kw, kw + KW, ... of
    // its row warp (each output value gets the same operations, in the same order, as one warp
    // merging all of them; the row maxima and sums are recomputed by each, identically) and
    // writes that part of the split's partial.
    constexpr int SW = NO * 4 + 4;  // floats per lane of one saved state
    if (KW > 1) {
        __syncthreads();  // every warp is done with the K / V stages
        float *dst = sm + (size_t)((rw * KW + kw) * SW) * 32 + lane;
#pragma unroll
        for (int n = 0; n < NO; ++n)
#pragma unroll
            for (int r = 0; r < 4; ++r) dst[(n * 4 + r) * 32] = o[n][r];
        dst[(NO * 4) * 32] = m_a;
        dst[(NO * 4 + 1) * 32] = m_b;
        dst[(NO * 4 + 2) * 32] = l_a;
        dst[(NO * 4 + 3) * 32] = l_b;
        __syncthreads();
        if (kw >= NC) return;
    }
    const long long rows_total = (long long)n_q * H;
    for (int c = kw; c < NC; c += KW) {
        float oc[4][4];  // n-tiles 4c .. 4c+3
        float ma = m_a, mb = m_b, la = l_a, lb = l_b;
        if constexpr (KW > 1) {
            const float *s0 = sm + (size_t)((rw * KW) * SW) * 32 + lane;
#pragma unroll
            for (int e = 0; e < 4; ++e)
#pragma unroll
                for (int r = 0; r < 4; ++r) oc[e][r] = s0[((4 * c + e) * 4 + r) * 32];
            ma = s0[(NO * 4) * 32];
            mb = s0[(NO * 4 + 1) * 32];
            la = s0[(NO * 4 + 2) * 32];
            lb = s0[(NO * 4 + 3) * 32];
            for (int w = 1; w < KW; ++w) {
                const float *src = sm + (size_t)((rw * KW + w) * SW) * 32 + lane;
                const float msa = src[(NO * 4) * 32], msb = src[(NO * 4 + 1) * 32];
                const float lsa = src[(NO * 4 + 2) * 32], lsb = src[(NO * 4 + 3) * 32];
                const float Ma = fmaxf(ma, msa), Mb = fmaxf(mb, msb);
                const float fa = ma == NEG_INF ? 0.0f : expf(ma - Ma), fsa = msa == NEG_INF ? 0.0f : expf(msa - Ma);
                const float fb = mb == NEG_INF ? 0.0f : expf(mb - Mb), fsb = msb == NEG_INF ? 0.0f : expf(msb - Mb);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int n = 4 * c + e;
                    oc[e][0] = __fmaf_rn(oc[e][0], fa, __fmul_rn(src[(n * 4) * 32], fsa));
                    oc[e][1] = __fmaf_rn(oc[e][1], fa, __fmul_rn(src[(n * 4 + 1) * 32], fsa));
                    oc[e][2] = __fmaf_rn(oc[e][2], fb, __fmul_rn(src[(n * 4 + 2) * 32], fsb));
                    oc[e][3] = __fmaf_rn(oc[e][3], fb, __fmul_rn(src[(n * 4 + 3) * 32], fsb));
                }
                la = __fmaf_rn(la, fa, __fmul_rn(lsa, fsa));
                lb = __fmaf_rn(lb, fb, __fmul_rn(lsb, fsb));
                ma = Ma;
                mb = Mb;
            }
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
#pragma unroll
                for (int r = 0; r < 4; ++r) oc[e][r] = o[4 * c + e][r];
        }
        // The split's partial. PERM (the tf32 kernels' P V layout): rows g / g+8 hold d = 32c +
        // 8t .. +7; else n-tile n holds d = 8n + 2t, 8n + 2t + 1.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int qr = half ? rb : ra;
            if (!(half ? vb : va)) continue;
            const int i = G.div(qr), h = hk * G.d + (qr - i * G.d);
            const long long row = (long long)pslot * rows_total + (long long)i * H + h;
            const int r0 = half * 2;
            if constexpr (PERM) {
                float *dst = ws_o + row * D + 8 * t + 32 * c;
                *(float4 *)dst = make_float4(oc[0][r0], oc[1][r0], oc[2][r0], oc[3][r0]);
                *(float4 *)(dst + 4) = make_float4(oc[0][r0 + 1], oc[1][r0 + 1], oc[2][r0 + 1], oc[3][r0 + 1]);
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    *(float2 *)(ws_o + row * D + 32 * c + 8 * e + 2 * t) = make_float2(oc[e][r0], oc[e][r0 + 1]);
            }
            if (t == 0 && c == 0) {
                ws_ml[row * 2] = half ? mb : ma;
                ws_ml[row * 2 + 1] = half ? lb : la;
            }
        }
    }
}

// FPV: P V on the CUDA cores instead (exact f32 FMA chains; each lane owns d = lane + 32c of all 16
// rows of its warp): the tensor cores then only run S = Q K^T, and the FMAs issue while they do.
// P and the rescale factors go through a per-warp shared tile (P transposed, pitch ATT_PTP).
#define ATT_PTP 20
// X1 (the reduced-precision kernels, `attention_fast`): one tf32 product per term, no lo terms:
// a third of the mma and none of the splits. Q, K and V enter truncated to tf32 (relative error
// below 2^-10 each), P rounded (below 2^-11); f32 accumulation. Everything else (chunks, masks, merges, per-row determinism)
// as above.
template <int D, int KW, bool FPV, bool X1>
__device__ __forceinline__ void attn_tc_impl(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                                             float *__restrict__ ws_o, float *__restrict__ ws_ml, int n_q, int n_kv, int H, int Hkv,
                                             long long q_pos0, long long kv_pos0, int causal, long long window, float scale,
                                             int split_keys, int nst, int split0) {
    constexpr int CK = 16 * KW;  // keys per chunk
    constexpr int PQ = D + 16, PK = D + 16, PV = D + 4;
    constexpr int NC = D / 32;  // 32-wide output column groups
    constexpr int NO = D / 8;   // output n-tiles
    constexpr int C4 = D / 4;
    constexpr int NDL = D / 32;  // FPV: output columns per lane (d = lane + 32c), 16 rows each
    griddep_launch();  // the combine may launch (it waits for this grid)
    griddep_wait();    // a programmatic dependent launch: q and the cache first
    extern __shared__ __align__(16) float sm[];
    const int nth = blockDim.x;
    const int RW = nth / (32 * KW);
    const int ROWS = 16 * RW;
    float *Qs = sm;                   // [ROWS][PQ]
    float *Ks = Qs + ROWS * PQ;       // [nst][CK][PK]
    float *Vs = Ks + nst * CK * PK;   // [nst][CK][PV]

    const IDiv G(H / Hkv);
    const int QR = n_q * G.d;
    // Grid (row groups, splits, kv heads): the row groups of one (split, kv head), which read
    // the same K / V chunks, are neighbours in launch order (L2 hits).
    const int hk = blockIdx.z;
    const int split = split0 + blockIdx.y;  // its partial goes to slot blockIdx.y
    const int qr0 = blockIdx.x * ROWS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int rw = warp / KW, kw = warp % KW;
    const int g = lane >> 2, t = lane & 3;
    // FPV: this warp's P^T [16 keys][ATT_PTP] and rescale factors [16].
    float *PT = Vs + nst * CK * PV + warp * (16 * ATT_PTP + 16);
    float *AL = PT + 16 * ATT_PTP;

    // This lane's two rows.
    const int ra = qr0 + rw * 16 + g, rb = ra + 8;
    const bool va = ra < QR, vb = rb < QR;
    const long long qpa = q_pos0 + (va ? G.div(ra) : 0), qpb = q_pos0 + (vb ? G.div(rb) : 0);

    // Chunks of this split that some row of the block can see (the others are exact no-ops).
    const long long jbase = (long long)split * split_keys;
    int c_begin, c_end;
    att_chunk_range(jbase, split_keys, n_kv, qr0, ROWS, QR, G, q_pos0, kv_pos0, causal, window, CK, c_begin, c_end);
    const int nch = c_end - c_begin;
    // Query positions of the block's first and last real rows.
    const long long qpos_lo = q_pos0 + G.div(qr0), qpos_hi = q_pos0 + G.div(max(min(qr0 + ROWS, QR) - 1, qr0));

    // A thread copies column d4 of the rows kk0, kk0 + RSTEP, ... of a chunk (nth is a multiple of
    // C4): the global addresses advance by a constant, and whole chunks skip the bounds check.
    const int RSTEP = nth / C4, kk0 = tid / C4, d4c = (tid % C4) * 4;
    const long long gstep = (long long)RSTEP * Hkv * D;
    auto load_chunk = [&](int c, int st) {
        const long long j0 = jbase + (long long)c * CK;
        float *kd = Ks + st * CK * PK + d4c, *vd = Vs + st * CK * PV + d4c;  // stage st
        const long long off0 = ((j0 + kk0) * Hkv + hk) * D + d4c;
        const float *ks = k + off0, *vs = v + off0;
        if (j0 + CK <= n_kv) {
            for (int kk = kk0; kk < CK; kk += RSTEP, ks += gstep, vs += gstep) {
                cp_async16(kd + kk * PK, ks);
                cp_async16(vd + kk * PV, vs);
            }
        } else {
            for (int kk = kk0; kk < CK; kk += RSTEP, ks += gstep, vs += gstep) {
                if (j0 + kk < n_kv) {
                    cp_async16(kd + kk * PK, ks);
                    cp_async16(vd + kk * PV, vs);
                } else {
                    *(float4 *)(kd + kk * PK) = make_float4(0.f, 0.f, 0.f, 0.f);
                    *(float4 *)(vd + kk * PV) = make_float4(0.f, 0.f, 0.f, 0.f);
                }
            }
        }
    };

    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;  // l: this lane's columns only

    // Pipeline of nst (2 or 3) stages: chunks 0 .. nst-2 (and Q, with chunk 0) in flight before the
    // loop; iteration ci waits for chunk ci, then refills the stage iteration ci-1 read.
    for (int c = tid; c < ROWS * C4; c += nth) {
        const int r = c / C4, d4 = (c % C4) * 4;
        const int qr = qr0 + r;
        if (qr < QR) {
            const int i = G.div(qr), h = hk * G.d + (qr - i * G.d);
            cp_async16(Qs + r * PQ + d4, q + ((long long)i * H + h) * D + d4);
        } else {
            *(float4 *)(Qs + r * PQ + d4) = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    for (int p = 0; p < nst - 1; ++p) {
        if (p < nch) load_chunk(c_begin + p, p);
        cp_async_commit();
    }
    // st = ci % nst and the refill's (ci + nst - 1) % nst, counted (no divisions).
    for (int ci = 0, st = 0, fill = nst - 1; ci < nch; ++ci, st = st + 1 == nst ? 0 : st + 1, fill = fill + 1 == nst ? 0 : fill + 1) {
        if (nst == 1) {
            // One stage (smaller blocks, more of them per multiprocessor): load, wait, compute.
            __syncthreads();  // every warp is done with the previous chunk
            load_chunk(c_begin + ci, 0);
            cp_async_commit();
            cp_async_wait_all();
            __syncthreads();
        } else {
            if (nst == 3) cp_async_wait1();
            else cp_async_wait_all();
            __syncthreads();
            if (ci + nst - 1 < nch) load_chunk(c_begin + ci + nst - 1, fill);
            cp_async_commit();
        }
        const float *Kc = Ks + st * CK * PK + kw * 16 * PK;
        const float *Vc = Vs + st * CK * PV + kw * 16 * PV;
        const float *Qw = Qs + rw * 16 * PQ;
        // S = Q K^T for the warp's 16 keys (2 n-tiles).
        float s[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int kp = 0; kp < D / 16; ++kp) {
            const float4 qa = *(const float4 *)(Qw + g * PQ + 16 * kp + 4 * t);
            const float4 qb = *(const float4 *)(Qw + (g + 8) * PQ + 16 * kp + 4 * t);
            if constexpr (X1) {
                const u32 a0[4] = {f2u(qa.x), f2u(qb.x), f2u(qa.y), f2u(qb.y)};
                const u32 a1[4] = {f2u(qa.z), f2u(qb.z), f2u(qa.w), f2u(qb.w)};
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const float4 kb = *(const float4 *)(Kc + (nt * 8 + g) * PK + 16 * kp + 4 * t);
                    mma_tf32(s[nt], a0[0], a0[1], a0[2], a0[3], f2u(kb.x), f2u(kb.y));
                    mma_tf32(s[nt], a1[0], a1[1], a1[2], a1[3], f2u(kb.z), f2u(kb.w));
                }
                continue;
            }
            u32 ah0[4], al0[4], ah1[4], al1[4];
            tf32_split(qa.x, ah0[0], al0[0]);
            tf32_split(qb.x, ah0[1], al0[1]);
            tf32_split(qa.y, ah0[2], al0[2]);
            tf32_split(qb.y, ah0[3], al0[3]);
            tf32_split(qa.z, ah1[0], al1[0]);
            tf32_split(qb.z, ah1[1], al1[1]);
            tf32_split(qa.w, ah1[2], al1[2]);
            tf32_split(qb.w, ah1[3], al1[3]);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const float4 kb = *(const float4 *)(Kc + (nt * 8 + g) * PK + 16 * kp + 4 * t);
                u32 h0, l0, h1, l1;
                tf32_split(kb.x, h0, l0);
                tf32_split(kb.y, h1, l1);
                mma_3xtf32(s[nt], ah0, al0, h0, h1, l0, l1);
                tf32_split(kb.z, h0, l0);
                tf32_split(kb.w, h1, l1);
                mma_3xtf32(s[nt], ah1, al1, h0, h1, l0, l1);
            }
        }
        // Scale and mask; online softmax per row (quad shuffles: lanes 4g .. 4g+3 hold row g).
        const long long j0 = jbase + (long long)(c_begin + ci) * CK;
        // Every key of the chunk visible to every real row of the block (padding rows are
        // never written, so they may keep their scores of a zero query).
        const bool full = j0 + CK <= n_kv && (!causal || kv_pos0 + j0 + CK - 1 <= qpos_lo) &&
                          (window < 0 || qpos_hi < kv_pos0 + j0 + window);
        float ala, alb;
        att_softmax16(s, full, j0 + kw * 16, t, va, vb, qpa, qpb, n_kv, kv_pos0, causal, window, scale, m_a, m_b, l_a, l_b, ala, alb);
        if constexpr (FPV) {
            __syncwarp();  // the previous chunk's reads of PT / AL are done
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    PT[(nt * 8 + 2 * t + e) * ATT_PTP + g] = s[nt][e];
                    PT[(nt * 8 + 2 * t + e) * ATT_PTP + g + 8] = s[nt][2 + e];
                }
            if (t == 0) {
                AL[g] = ala;
                AL[g + 8] = alb;
            }
            __syncwarp();
            float al[16];
#pragma unroll
            for (int r4 = 0; r4 < 4; ++r4) {
                const float4 a4 = *(const float4 *)(AL + 4 * r4);
                al[4 * r4] = a4.x; al[4 * r4 + 1] = a4.y; al[4 * r4 + 2] = a4.z; al[4 * r4 + 3] = a4.w;
            }
            bool any = false;
#pragma unroll
            for (int r = 0; r < 16; ++r) any |= al[r] != 1.0f;
            if (any) {  // warp-uniform (every lane read the same 16 factors); x * 1 == x
#pragma unroll
                for (int r = 0; r < 16; ++r)
#pragma unroll
                    for (int c = 0; c < NDL; ++c) o[(r * NDL + c) >> 2][(r * NDL + c) & 3] *= al[r];
            }
            // O[r][lane + 32c] += sum over the warp's 16 keys in order of P[r][j] V[j][lane + 32c].
#pragma unroll 2
            for (int j = 0; j < 16; ++j) {
                float vv[NDL];
#pragma unroll
                for (int c = 0; c < NDL; ++c) vv[c] = Vc[j * PV + lane + 32 * c];
                float pp[16];
#pragma unroll
                for (int r4 = 0; r4 < 4; ++r4) {
                    const float4 p4 = *(const float4 *)(PT + j * ATT_PTP + 4 * r4);
                    pp[4 * r4] = p4.x; pp[4 * r4 + 1] = p4.y; pp[4 * r4 + 2] = p4.z; pp[4 * r4 + 3] = p4.w;
                }
#pragma unroll
                for (int r = 0; r < 16; ++r)
#pragma unroll
                    for (int c = 0; c < NDL; ++c) {
                        float &acc = o[(r * NDL + c) >> 2][(r * NDL + c) & 3];
                        acc = __fmaf_rn(pp[r], vv[c], acc);
                    }
            }
            continue;
        }
        att_rescale(o, ala, alb);
        // O += P V.
#pragma unroll
        for (int kt = 0; kt < 2; ++kt) {
            if constexpr (X1) {
                const u32 pr[4] = {tf32_rn(s[kt][0]), tf32_rn(s[kt][2]), tf32_rn(s[kt][1]), tf32_rn(s[kt][3])};
                const float *v0 = Vc + (kt * 8 + 2 * t) * PV + 4 * g;
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    const float4 x0 = *(const float4 *)(v0 + 32 * c);
                    const float4 x1 = *(const float4 *)(v0 + PV + 32 * c);
                    mma_tf32(o[4 * c], pr[0], pr[1], pr[2], pr[3], f2u(x0.x), f2u(x1.x));
                    mma_tf32(o[4 * c + 1], pr[0], pr[1], pr[2], pr[3], f2u(x0.y), f2u(x1.y));
                    mma_tf32(o[4 * c + 2], pr[0], pr[1], pr[2], pr[3], f2u(x0.z), f2u(x1.z));
                    mma_tf32(o[4 * c + 3], pr[0], pr[1], pr[2], pr[3], f2u(x0.w), f2u(x1.w));
                }
                continue;
            }
            u32 ph[4], pl[4];
            tf32_split(s[kt][0], ph[0], pl[0]);
            tf32_split(s[kt][2], ph[1], pl[1]);
            tf32_split(s[kt][1], ph[2], pl[2]);
            tf32_split(s[kt][3], ph[3], pl[3]);
            const float *v0 = Vc + (kt * 8 + 2 * t) * PV + 4 * g;
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const float4 x0 = *(const float4 *)(v0 + 32 * c);
                const float4 x1 = *(const float4 *)(v0 + PV + 32 * c);
                const float f0[4] = {x0.x, x0.y, x0.z, x0.w};
                const float f1[4] = {x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    u32 h0, l0, h1, l1;
                    tf32_split(f0[e], h0, l0);
                    tf32_split(f1[e], h1, l1);
                    mma_3xtf32(o[4 * c + e], ph, pl, h0, h1, l0, l1);
                }
            }
        }
    }
    cp_async_wait_all();
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);

    if constexpr (FPV) {
        // States: o (D/2 floats per lane) of key warps 1.., and (m, l) of the 16 rows of every key warp.
        constexpr int SO = NO * 4;
        float *ml = sm + (size_t)RW * (KW - 1) * SO * 32 + (size_t)(rw * KW + kw) * 32;  // [m 16][l 16]
        __syncthreads();
        if (kw > 0) {
            float *dst = sm + (size_t)((rw * (KW - 1) + kw - 1) * SO) * 32 + lane;
#pragma unroll
            for (int n = 0; n < NO; ++n)
#pragma unroll
                for (int r = 0; r < 4; ++r) dst[(n * 4 + r) * 32] = o[n][r];
        }
        if (t == 0) {
            ml[g] = m_a;
            ml[g + 8] = m_b;
            ml[16 + g] = l_a;
            ml[16 + g + 8] = l_b;
        }
        __syncthreads();
        if (kw > 0) return;
        float Mr[16], Lr[16];
#pragma unroll
        for (int r = 0; r < 16; ++r) {
            Mr[r] = ml[r];
            Lr[r] = ml[16 + r];
        }
        for (int w = 1; w < KW; ++w) {
            const float *src = sm + (size_t)((rw * (KW - 1) + w - 1) * SO) * 32 + lane;
            const float *mlw = ml + w * 32;
#pragma unroll
            for (int r = 0; r < 16; ++r) {
                const float ms = mlw[r], ls = mlw[16 + r];
                const float Mn = fmaxf(Mr[r], ms);
                const float fa = Mr[r] == NEG_INF ? 0.0f : expf(Mr[r] - Mn), fs = ms == NEG_INF ? 0.0f : expf(ms - Mn);
#pragma unroll
                for (int c = 0; c < NDL; ++c) {
                    const int f = r * NDL + c;
                    o[f >> 2][f & 3] = __fmaf_rn(o[f >> 2][f & 3], fa, __fmul_rn(src[f * 32], fs));
                }
                Lr[r] = __fmaf_rn(Lr[r], fa, __fmul_rn(ls, fs));
                Mr[r] = Mn;
            }
        }
        const long long rows_total = (long long)n_q * H;
#pragma unroll
        for (int r = 0; r < 16; ++r) {
            const int qr = qr0 + rw * 16 + r;
            if (qr >= QR) continue;
            const int i = G.div(qr), h = hk * G.d + (qr - i * G.d);
            const long long row = (long long)blockIdx.y * rows_total + (long long)i * H + h;
#pragma unroll
            for (int c = 0; c < NDL; ++c) ws_o[row * D + lane + 32 * c] = o[(r * NDL + c) >> 2][(r * NDL + c) & 3];
            if (lane == 0) {
                ws_ml[row * 2] = Mr[r];
                ws_ml[row * 2 + 1] = Lr[r];
            }
        }
        return;
    }

    attn_tc_store<D, KW, true>(o, m_a, m_b, l_a, l_b, sm, rw, kw, lane, t, ra, rb, va, vb, G, hk, H, n_q, blockIdx.y, ws_o, ws_ml);
}

// ------------------------------------------------------------------------------------------------
// Tensor-core attention with f16 operands (the fast op, `attention_fast`, for head dims 32 / 64 /
// 128 with 4 key warps): the grid, the split, the chunks of CK = 64 keys, the masks, the online
// softmax, the merges and the partials of attn_tc_impl (so the same per-row determinism), with
// Q, K, V and P rounded to f16 (round to nearest, saturating at +-65504: relative error below
// 2^-11 each, against the 1xTF32 kernels' truncation below 2^-10) into mma.m16n8k16 f16 with f32
// accumulation. K / V chunks land as f32 in nst (1-3) staging slots through cp.async, are
// converted once per chunk into f16 tiles (every warp then reads half the bytes the f32 kernels
// read, with ldmatrix), and nst chunks stay in flight while one is computed (the f32 kernels: nst
// - 1 beside the 2-3 padded f32 stages that fill the shared memory at 64 query rows).
// Fragments (g = lane / 4, t = lane % 4): S = Q K^T, A = Q rows x 16 d, B = K rows (keys) x 16 d
// (ldmatrix, not transposed); P V, A = P straight from the S accumulator (k = the warp's 16
// keys), B = V rows x 8 d (ldmatrix.trans); output n-tile n holds d = 8n + 2t, +1.
__device__ __forceinline__ void ldsm_x4(u32 addr, u32 &r0, u32 &r1, u32 &r2, u32 &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32 &r0, u32 &r1, u32 &r2, u32 &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void mma_h16(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <int N>
__device__ __forceinline__ void cp_async_wait_n() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The f16-cache chunk copies (attn_h16_impl's KV16 path, attn_fa_impl): chunk c (CK keys from
// key jbase + c CK, kv head hk) into the tile pair `slot` of `tiles` (f16 rows of D + 8 halves:
// K at slot * 2 TILE_B bytes, V one tile after it); keys past n_kv become zeros. Thread tid
// copies the 8 halves d8c.. of rows kk8, kk8 + RS8, ... (nth % (D / 8) == 0): its global and
// shared addresses of chunk 0 / slot 0 once, constant steps after that, and whole chunks
// without the bounds check.
template <int D, int CK>
struct Kv16Copy {
    static constexpr int PH = D + 8, C8 = D / 8;
    static constexpr u32 TILE_B = CK * PH * 2;
    int RS8, kk8, n_kv;
    long long jbase, gstep8, cstep8;
    const u16 *kg8, *vg8;
    u32 ks8, sstep8;
    __device__ __forceinline__ Kv16Copy(const float *k, const float *v, u16 *tiles, int tid, int nth, long long jbase_, int hk, int Hkv,
                                        int n_kv_)
        : RS8(nth / C8), kk8(tid / C8), n_kv(n_kv_), jbase(jbase_) {
        const int d8c = (tid % C8) * 8;
        gstep8 = (long long)RS8 * Hkv * D;
        cstep8 = (long long)CK * Hkv * D;  // halves per chunk
        const long long goff8 = ((jbase + kk8) * Hkv + hk) * D + d8c;
        kg8 = (const u16 *)k + goff8;
        vg8 = (const u16 *)v + goff8;
        ks8 = (u32)__cvta_generic_to_shared(tiles + kk8 * PH + d8c);
        sstep8 = (u32)(RS8 * PH * 2);  // bytes between a thread's rows
    }
    __device__ __forceinline__ void operator()(int c, int slot) const {
        const long long j0 = jbase + (long long)c * CK;
        const u16 *ks = kg8 + c * cstep8, *vs = vg8 + c * cstep8;
        u32 kd = ks8 + (u32)slot * 2 * TILE_B;
        if (j0 + CK <= n_kv) {
            for (int kk = kk8; kk < CK; kk += RS8, ks += gstep8, vs += gstep8, kd += sstep8) {
                cp_async16s(kd, ks);
                cp_async16s(kd + TILE_B, vs);
            }
        } else {
            for (int kk = kk8; kk < CK; kk += RS8, ks += gstep8, vs += gstep8, kd += sstep8) {
                if (j0 + kk < n_kv) {
                    cp_async16s(kd, ks);
                    cp_async16s(kd + TILE_B, vs);
                } else {
                    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(kd), "r"(0u) : "memory");
                    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(kd + TILE_B), "r"(0u) : "memory");
                }
            }
        }
    }
};

// cp.async copies of chunk c of an f32 cache's K / V (CK keys of kv head hk from split start
// jbase) into staging slot `slot` of st ([slot][K, V][CK][D] floats; attn_h16_impl,
// attn_pf_impl): thread tid takes column d4c of rows kk0, kk0 + RSTEP, ... (nth % (D / 4) ==
// 0); keys past n_kv are zeros.
template <int D, int CK>
struct Kv32Stage {
    static constexpr int C4 = D / 4;
    int RSTEP, kk0, d4c, hk, Hkv, n_kv;
    long long jbase, gstep;
    const float *k, *v;
    float *st;
    __device__ __forceinline__ Kv32Stage(const float *k_, const float *v_, float *st_, int tid, int nth, long long jbase_, int hk_,
                                         int Hkv_, int n_kv_)
        : RSTEP(nth / C4), kk0(tid / C4), d4c((tid % C4) * 4), hk(hk_), Hkv(Hkv_), n_kv(n_kv_), jbase(jbase_),
          gstep((long long)(nth / C4) * Hkv_ * D), k(k_), v(v_), st(st_) {}
    __device__ __forceinline__ void operator()(int c, int slot) const {
        const long long j0 = jbase + (long long)c * CK;
        float *kd = st + (size_t)slot * 2 * CK * D + d4c, *vd = kd + CK * D;
        const long long off0 = ((j0 + kk0) * Hkv + hk) * D + d4c;
        const float *ks = k + off0, *vs = v + off0;
        for (int kk = kk0; kk < CK; kk += RSTEP, ks += gstep, vs += gstep) {
            if (j0 + kk < n_kv) {
                cp_async16(kd + kk * D, ks);
                cp_async16(vd + kk * D, vs);
            } else {
                *(float4 *)(kd + kk * D) = make_float4(0.f, 0.f, 0.f, 0.f);
                *(float4 *)(vd + kk * D) = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
    }
};

// KV16 (an f16 KV cache, `attention_fast_kv16`): k and v hold f16 (h2_pack of the f32 values,
// so the tiles, and every bit after them, equal the f32 cache's), copied by cp.async straight
// into nst stages of f16 tiles: no staging, no conversion, half the bytes, one block barrier per
// chunk, and nst - 1 chunks in flight while one is computed (as attn_tc_impl).
template <int D, int KW, bool KV16>
__device__ __forceinline__ void attn_h16_impl(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                                              float *__restrict__ ws_o, float *__restrict__ ws_ml, int n_q, int n_kv, int H, int Hkv,
                                              long long q_pos0, long long kv_pos0, int causal, long long window, float scale,
                                              int split_keys, int nst, int split0) {
    constexpr int CK = 16 * KW;  // keys per chunk
    constexpr int PH = D + 8;    // halves per row of the f16 tiles (ldmatrix rows conflict-free)
    constexpr int NO = D / 8;    // output n-tiles
    constexpr int C4 = D / 4;
    constexpr u32 TILE_B = CK * PH * 2;  // bytes of one f16 K (or V) tile
    griddep_launch();  // the combine may launch (it waits for this grid)
    griddep_wait();    // a programmatic dependent launch: q and the cache first
    extern __shared__ __align__(16) float sm[];
    const int nth = blockDim.x;
    const int RW = nth / (32 * KW);
    const int ROWS = 16 * RW;
    u16 *Qh = (u16 *)sm;         // [ROWS][PH]
    u16 *Kh = Qh + ROWS * PH;    // [CK][PH]; KV16: [nst][K, V][CK][PH]
    u16 *Vh = Kh + CK * PH;      // [CK][PH] (not KV16)
    float *St = (float *)(Vh + CK * PH);  // [nst][K, V][CK][D] f32 staging (not KV16)

    const IDiv G(H / Hkv);
    const int QR = n_q * G.d;
    const int hk = blockIdx.z;
    const int split = split0 + blockIdx.y;  // its partial goes to slot blockIdx.y
    const int qr0 = blockIdx.x * ROWS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int rw = warp / KW, kw = warp % KW;
    const int g = lane >> 2, t = lane & 3;
    const int ra = qr0 + rw * 16 + g, rb = ra + 8;
    const bool va = ra < QR, vb = rb < QR;
    const long long qpa = q_pos0 + (va ? G.div(ra) : 0), qpb = q_pos0 + (vb ? G.div(rb) : 0);

    // Chunks of this split that some row of the block can see (as attn_tc_impl).
    const long long jbase = (long long)split * split_keys;
    int c_begin, c_end;
    att_chunk_range(jbase, split_keys, n_kv, qr0, ROWS, QR, G, q_pos0, kv_pos0, causal, window, CK, c_begin, c_end);
    const int nch = c_end - c_begin;
    const long long qpos_lo = q_pos0 + G.div(qr0), qpos_hi = q_pos0 + G.div(max(min(qr0 + ROWS, QR) - 1, qr0));

    const Kv32Stage<D, CK> load_chunk(k, v, St, tid, nth, jbase, hk, Hkv, n_kv);
    const Kv16Copy<D, CK> load_chunk16(k, v, Kh, tid, nth, jbase, hk, Hkv, n_kv);  // KV16
    // The first chunks' copies first (in flight while Q loads).
    if constexpr (KV16) {
        for (int p = 0; p < nst - 1; ++p) {
            if (p < nch) load_chunk16(c_begin + p, p);
            cp_async_commit();
        }
    } else {
        for (int p = 0; p < nst; ++p) {
            if (p < nch) load_chunk(c_begin + p, p);
            cp_async_commit();
        }
    }
    // Q in f16, once (plain loads: q was written by the previous kernel). Every thread takes
    // QIT = ROWS * C4 / nth = D / (8 KW) float4 (nth = 32 KW RW): all loads issued, then the
    // conversions (one round trip instead of QIT).
    {
        constexpr int QIT = D / (8 * KW);
        static_assert(QIT >= 1 && D % (8 * KW) == 0, "head dim");
        float4 x[QIT];
#pragma unroll
        for (int u = 0; u < QIT; ++u) {
            const int c = tid + u * nth, r = c / C4, d4 = (c % C4) * 4, qr = qr0 + r;
            x[u] = qr < QR ? *(const float4 *)(q + ((long long)G.div(qr) * H + hk * G.d + G.mod(qr)) * D + d4)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < QIT; ++u) {
            const int c = tid + u * nth, r = c / C4, d4 = (c % C4) * 4;
            *(uint2 *)(Qh + r * PH + d4) = make_uint2(h2_pack(x[u].x, x[u].y), h2_pack(x[u].z, x[u].w));
        }
    }

    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;
    const float scale_l2 = scale * 1.4426950408889634f;  // scores in log2 units (att_softmax16<true>)
    const u32 q_addr = (u32)__cvta_generic_to_shared(Qh + (rw * 16 + (lane & 15)) * PH + (lane >> 4) * 8);
    const u32 k_addr = (u32)__cvta_generic_to_shared(Kh + (kw * 16 + (lane & 7) + ((lane >> 4) << 3)) * PH + ((lane >> 3) & 1) * 8);
    const u32 v_addr = (u32)__cvta_generic_to_shared(Vh + (kw * 16 + (lane & 15)) * PH + (lane >> 4) * 8);

    // slot = ci % nst and the refill's (ci + nst - 1) % nst, counted (no divisions).
    for (int ci = 0, slot = 0, fill = nst - 1; ci < nch; ++ci, slot = slot + 1 == nst ? 0 : slot + 1, fill = fill + 1 == nst ? 0 : fill + 1) {
        u32 kcur = k_addr, vcur = v_addr;  // this chunk's tiles
        if constexpr (KV16) {
            if (nst == 1) {
                __syncthreads();  // every warp is done with the previous chunk's tiles
                load_chunk16(c_begin + ci, 0);
                cp_async_commit();
                cp_async_wait_n<0>();
                __syncthreads();
            } else {
                if (nst == 3) cp_async_wait_n<1>();
                else cp_async_wait_n<0>();
                __syncthreads();  // chunk ci landed; every warp is done with chunk ci - 1's stage
                if (ci + nst - 1 < nch) load_chunk16(c_begin + ci + nst - 1, fill);
                cp_async_commit();
            }
            // Stage slot: K at slot * 2 tiles, V one tile after it (v_addr already is one tile
            // after k's base).
            kcur += (u32)slot * 2 * TILE_B;
            vcur += (u32)slot * 2 * TILE_B;
        } else {
            if (nst == 3) cp_async_wait_n<2>();
            else if (nst == 2) cp_async_wait_n<1>();
            else cp_async_wait_n<0>();
            __syncthreads();  // chunk ci staged; every warp is done with chunk ci - 1's f16 tiles
            {
                const float *ks = St + (size_t)slot * 2 * CK * D, *vs = ks + CK * D;
                for (int c = tid; c < CK * C4; c += nth) {
                    const int kk = c / C4, d4 = (c % C4) * 4;
                    const float4 a = *(const float4 *)(ks + kk * D + d4), b = *(const float4 *)(vs + kk * D + d4);
                    *(uint2 *)(Kh + kk * PH + d4) = make_uint2(h2_pack(a.x, a.y), h2_pack(a.z, a.w));
                    *(uint2 *)(Vh + kk * PH + d4) = make_uint2(h2_pack(b.x, b.y), h2_pack(b.z, b.w));
                }
            }
            __syncthreads();  // the f16 tiles are ready, the staging slot is free
            if (ci + nst < nch) load_chunk(c_begin + ci + nst, slot);
            cp_async_commit();
        }

        // S = Q K^T for the warp's 16 keys (2 n-tiles).
        float s[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            u32 a0, a1, a2, a3, b0, b1, b2, b3;
            ldsm_x4(q_addr + ks * 32, a0, a1, a2, a3);
            ldsm_x4(kcur + ks * 32, b0, b1, b2, b3);
            mma_h16(s[0], a0, a1, a2, a3, b0, b1);
            mma_h16(s[1], a0, a1, a2, a3, b2, b3);
        }
        // Scale and mask; online softmax per row (as attn_tc_impl).
        const long long j0 = jbase + (long long)(c_begin + ci) * CK;
        const bool full = j0 + CK <= n_kv && (!causal || kv_pos0 + j0 + CK - 1 <= qpos_lo) &&
                          (window < 0 || qpos_hi < kv_pos0 + j0 + window);
        float ala, alb;
        att_softmax16<true>(s, full, j0 + kw * 16, t, va, vb, qpa, qpb, n_kv, kv_pos0, causal, window, scale_l2, m_a, m_b, l_a, l_b, ala, alb);
        att_rescale(o, ala, alb);
        // O += P V: P (rows x the warp's 16 keys) from the S accumulator.
        const u32 p0 = h2_pack(s[0][0], s[0][1]), p1 = h2_pack(s[0][2], s[0][3]);
        const u32 p2 = h2_pack(s[1][0], s[1][1]), p3 = h2_pack(s[1][2], s[1][3]);
#pragma unroll
        for (int np = 0; np < NO / 2; ++np) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(vcur + np * 32, b0, b1, b2, b3);
            mma_h16(o[2 * np], p0, p1, p2, p3, b0, b1);
            mma_h16(o[2 * np + 1], p0, p1, p2, p3, b2, b3);
        }
    }
    cp_async_wait_all();
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    m_a *= 0.69314718055994531f;  // log2 units -> natural (the merge and the combine use expf)
    m_b *= 0.69314718055994531f;
    attn_tc_store<D, KW, false>(o, m_a, m_b, l_a, l_b, sm, rw, kw, lane, t, ra, rb, va, vb, G, hk, H, n_q, blockIdx.y, ws_o, ws_ml);
}

#define ATTN_H16(D)                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(512, 1) attn_h16_d##D##_kw4(                                                         \
        const float *q, const float *k, const float *v, float *ws_o, float *ws_ml, int n_q, int n_kv, int H, int Hkv,                    \
        long long q_pos0, long long kv_pos0, int causal, long long window, float scale, int split_keys, int nst, int split0) {                       \
        attn_h16_impl<D, 4, false>(q, k, v, ws_o, ws_ml, n_q, n_kv, H, Hkv, q_pos0, kv_pos0, causal, window, scale, split_keys, nst, split0);         \
    }
ATTN_H16(32)
ATTN_H16(64)
ATTN_H16(128)

// The f16-cache twin (`attention_fast_kv16`): k and v point at halves.
#define ATTN_H16KV(D)                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(512, 1) attn_h16kv_d##D##_kw4(                                                       \
        const float *q, const float *k, const float *v, float *ws_o, float *ws_ml, int n_q, int n_kv, int H, int Hkv,                    \
        long long q_pos0, long long kv_pos0, int causal, long long window, float scale, int split_keys, int nst, int split0) {                       \
        attn_h16_impl<D, 4, true>(q, k, v, ws_o, ws_ml, n_q, n_kv, H, Hkv, q_pos0, kv_pos0, causal, window, scale, split_keys, nst, split0);   \
    }
ATTN_H16KV(32)
ATTN_H16KV(64)
ATTN_H16KV(128)

// FA (`attention_fast_kv16` over long spans, the FlashAttention-2 division of the work): a warp
// owns 16 query rows and computes every key of every chunk (CK = 64 keys: one row-max update and
// one rescale of its output per 64 keys, where attn_h16_impl's 4 key warps pay them per 16 and
// merge their states at the end), with its Q A-fragments in registers for the whole split
// (loaded once from global memory, rounded to f16 as attn_h16_impl rounds them). The block's RW
// row warps share one cp.async pipeline of nst f16 K / V stages copied straight from the cache.
// Each warp writes its rows' partial; a row's partial depends only on its query and the split's
// keys (the chunk order and the per-chunk arithmetic are fixed), so rows stay deterministic
// across calls of any height. Grid and partials as attn_h16_impl.
template <int NT>
__device__ __forceinline__ void att_softmax_fa(float (&s)[NT][4], bool full, long long j0, int t, bool va, bool vb, long long qpa,
                                               long long qpb, int n_kv, long long kv_pos0, int causal, long long window, float scale_l2,
                                               float &m_a, float &m_b, float &l_a, float &l_b, float &ala, float &alb) {
    if (full) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] *= scale_l2;
    } else {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const long long j = j0 + nt * 8 + 2 * t + e;
                const long long kpos = kv_pos0 + j;
                s[nt][e] = va && att_visible(j, n_kv, kpos, qpa, causal, window) ? s[nt][e] * scale_l2 : NEG_INF;
                s[nt][2 + e] = vb && att_visible(j, n_kv, kpos, qpb, causal, window) ? s[nt][2 + e] * scale_l2 : NEG_INF;
            }
    }
    float mxa = fmaxf(s[0][0], s[0][1]), mxb = fmaxf(s[0][2], s[0][3]);
#pragma unroll
    for (int nt = 1; nt < NT; ++nt) {
        mxa = fmaxf(mxa, fmaxf(s[nt][0], s[nt][1]));
        mxb = fmaxf(mxb, fmaxf(s[nt][2], s[nt][3]));
    }
    mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
    mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
    mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
    mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
    const float mna = fmaxf(m_a, mxa), mnb = fmaxf(m_b, mxb);
    ala = m_a == NEG_INF ? 1.0f : ex2_approx(m_a - mna);
    alb = m_b == NEG_INF ? 1.0f : ex2_approx(m_b - mnb);
    // A row with no visible key yet keeps m = -inf: its exponentials are 0 (not ex2(-inf + inf)).
    const float sa = mna == NEG_INF ? 0.0f : mna, sb = mnb == NEG_INF ? 0.0f : mnb;
    float suma = 0.0f, sumb = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            s[nt][e] = ex2_approx(s[nt][e] - sa);
            s[nt][2 + e] = ex2_approx(s[nt][2 + e] - sb);
        }
        suma += s[nt][0] + s[nt][1];
        sumb += s[nt][2] + s[nt][3];
    }
    l_a = __fmaf_rn(l_a, ala, suma);
    l_b = __fmaf_rn(l_b, alb, sumb);
    m_a = mna;
    m_b = mnb;
}

// The f32 pairs of Q's A-fragments of this lane's rows ra / rb (real: va / vb; query ia / ib),
// d 16 ks + 2 t (+1, +8, +9), of the DW dims from col0: all loads issued before any is used.
template <int D, int DW = D>
__device__ __forceinline__ void att_q_pairs(const float *__restrict__ q, float2 (&x)[DW / 16][4], int ia, int ib, int ra, int rb, bool va,
                                            bool vb, int hk, int H, const IDiv &G, int t, int col0 = 0) {
    const float *qa = q + ((long long)ia * H + hk * G.d + (ra - ia * G.d)) * D + col0 + 2 * t;
    const float *qb = q + ((long long)ib * H + hk * G.d + (rb - ib * G.d)) * D + col0 + 2 * t;
#pragma unroll
    for (int ks = 0; ks < DW / 16; ++ks) {
        const float2 z = make_float2(0.f, 0.f);
        x[ks][0] = va ? *(const float2 *)(qa + 16 * ks) : z;
        x[ks][1] = vb ? *(const float2 *)(qb + 16 * ks) : z;
        x[ks][2] = va ? *(const float2 *)(qa + 16 * ks + 8) : z;
        x[ks][3] = vb ? *(const float2 *)(qb + 16 * ks + 8) : z;
    }
}

// Q's A-fragments (att_q_pairs) rounded to f16 (attn_fa_impl, attn_wg_impl, attn_pf_impl x1).
template <int D, int DW = D>
__device__ __forceinline__ void att_q_frags(const float *__restrict__ q, u32 (&qf)[DW / 16][4], int ia, int ib, int ra, int rb, bool va,
                                            bool vb, int hk, int H, const IDiv &G, int t, int col0 = 0) {
    float2 x[DW / 16][4];
    att_q_pairs<D, DW>(q, x, ia, ib, ra, rb, va, vb, hk, H, G, t, col0);
#pragma unroll
    for (int ks = 0; ks < DW / 16; ++ks)
#pragma unroll
        for (int e = 0; e < 4; ++e) qf[ks][e] = h2_pack(x[ks][e].x, x[ks][e].y);
}

// The end of a one-key-warp split (attn_fa_impl, attn_wg_impl): the row sums over the quad, m
// back to natural units (the combine uses expf), the split's partial.
template <int D>
__device__ __forceinline__ void att_fa_store(float (&o)[D / 8][4], float m_a, float m_b, float l_a, float l_b, float *sm, int rw, int lane,
                                             int t, int ra, int rb, bool va, bool vb, const IDiv &G, int hk, int H, int n_q,
                                             float *__restrict__ ws_o, float *__restrict__ ws_ml) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    m_a *= 0.69314718055994531f;
    m_b *= 0.69314718055994531f;
    attn_tc_store<D, 1, false>(o, m_a, m_b, l_a, l_b, sm, rw, 0, lane, t, ra, rb, va, vb, G, hk, H, n_q, blockIdx.y, ws_o, ws_ml);
}

template <int D>
__device__ __forceinline__ void attn_fa_impl(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                                             float *__restrict__ ws_o, float *__restrict__ ws_ml, int n_q, int n_kv, int H, int Hkv,
                                             long long q_pos0, long long kv_pos0, int causal, long long window, float scale,
                                             int split_keys, int nst, int split0) {
    constexpr int CK = 64;       // keys per chunk
    constexpr int NT = CK / 8;   // score n-tiles per chunk
    constexpr int PH = D + 8;    // halves per tile row (ldmatrix rows conflict-free)
    constexpr int NO = D / 8;    // output n-tiles
    constexpr int KS = D / 16;   // k-steps of S = Q K^T
    constexpr u32 TILE_B = CK * PH * 2;
    griddep_launch();  // the combine may launch (it waits for this grid)
    griddep_wait();    // q and the cache first
    extern __shared__ __align__(16) float sm[];
    u16 *Kh = (u16 *)sm;  // [nst][K, V][CK][PH]
    const int nth = blockDim.x;
    const int ROWS = nth / 2;  // 16 rows per warp
    const IDiv G(H / Hkv);
    const int QR = n_q * G.d;
    const int hk = blockIdx.z;
    const int split = split0 + blockIdx.y;
    const int qr0 = blockIdx.x * ROWS;
    const int tid = threadIdx.x, rw = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int ra = qr0 + rw * 16 + g, rb = ra + 8;
    const bool va = ra < QR, vb = rb < QR;
    const int ia = va ? G.div(ra) : 0, ib = vb ? G.div(rb) : 0;
    const long long qpa = q_pos0 + ia, qpb = q_pos0 + ib;

    const long long jbase = (long long)split * split_keys;
    int c_begin, c_end;
    att_chunk_range(jbase, split_keys, n_kv, qr0, ROWS, QR, G, q_pos0, kv_pos0, causal, window, CK, c_begin, c_end);
    const int nch = c_end - c_begin;
    const long long qpos_lo = q_pos0 + G.div(qr0), qpos_hi = q_pos0 + G.div(max(min(qr0 + ROWS, QR) - 1, qr0));

    const Kv16Copy<D, CK> load_chunk16(k, v, Kh, tid, nth, jbase, hk, Hkv, n_kv);
    for (int p = 0; p < nst - 1; ++p) {
        if (p < nch) load_chunk16(c_begin + p, p);
        cp_async_commit();
    }
    u32 qf[KS][4];
    att_q_frags<D>(q, qf, ia, ib, ra, rb, va, vb, hk, H, G, t);

    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;
    const float scale_l2 = scale * 1.4426950408889634f;  // scores in log2 units
    const u32 k_addr = (u32)__cvta_generic_to_shared(Kh + ((lane & 7) + ((lane >> 4) << 3)) * PH + ((lane >> 3) & 1) * 8);
    const u32 v_addr = (u32)__cvta_generic_to_shared(Kh + CK * PH + (lane & 15) * PH + (lane >> 4) * 8);

    for (int ci = 0, slot = 0, fill = nst - 1; ci < nch; ++ci, slot = slot + 1 == nst ? 0 : slot + 1, fill = fill + 1 == nst ? 0 : fill + 1) {
        if (nst == 1) {
            __syncthreads();  // every warp is done with the previous chunk's tiles
            load_chunk16(c_begin + ci, 0);
            cp_async_commit();
            cp_async_wait_n<0>();
            __syncthreads();
        } else {
            if (nst == 3) cp_async_wait_n<1>();
            else if (nst == 4) cp_async_wait_n<2>();
            else cp_async_wait_n<0>();
            __syncthreads();  // chunk ci landed; every warp is done with chunk ci - 1's stage
            if (ci + nst - 1 < nch) load_chunk16(c_begin + ci + nst - 1, fill);
            cp_async_commit();
        }
        const u32 kcur = k_addr + (u32)slot * 2 * TILE_B, vcur = v_addr + (u32)slot * 2 * TILE_B;

        // S = Q K^T, 16 rows x 64 keys (n-tile nt: keys 8 nt ..).
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                u32 b0, b1, b2, b3;
                ldsm_x4(kcur + np * 16 * PH * 2 + ks * 32, b0, b1, b2, b3);
                mma_h16(s[2 * np], qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], b0, b1);
                mma_h16(s[2 * np + 1], qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], b2, b3);
            }
        const long long j0 = jbase + (long long)(c_begin + ci) * CK;
        const bool full = j0 + CK <= n_kv && (!causal || kv_pos0 + j0 + CK - 1 <= qpos_lo) &&
                          (window < 0 || qpos_hi < kv_pos0 + j0 + window);
        float ala, alb;
        att_softmax_fa<NT>(s, full, j0, t, va, vb, qpa, qpb, n_kv, kv_pos0, causal, window, scale_l2, m_a, m_b, l_a, l_b, ala, alb);
        att_rescale(o, ala, alb);
        // O += P V over the chunk's 4 steps of 16 keys (P from the S accumulator).
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            const u32 p0 = h2_pack(s[2 * kk][0], s[2 * kk][1]), p1 = h2_pack(s[2 * kk][2], s[2 * kk][3]);
            const u32 p2 = h2_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]), p3 = h2_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int np = 0; np < NO / 2; ++np) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(vcur + kk * 16 * PH * 2 + np * 32, b0, b1, b2, b3);
                mma_h16(o[2 * np], p0, p1, p2, p3, b0, b1);
                mma_h16(o[2 * np + 1], p0, p1, p2, p3, b2, b3);
            }
        }
    }
    cp_async_wait_all();
    att_fa_store<D>(o, m_a, m_b, l_a, l_b, sm, rw, lane, t, ra, rb, va, vb, G, hk, H, n_q, ws_o, ws_ml);
}

#define ATTN_FA(D)                                                                                                                     \
    extern "C" __global__ void __launch_bounds__(128) attn_fa16kv_d##D(                                                                \
        const float *q, const float *k, const float *v, float *ws_o, float *ws_ml, int n_q, int n_kv, int H, int Hkv,                    \
        long long q_pos0, long long kv_pos0, int causal, long long window, float scale, int split_keys, int nst, int split0) {        \
        attn_fa_impl<D>(q, k, v, ws_o, ws_ml, n_q, n_kv, H, Hkv, q_pos0, kv_pos0, causal, window, scale, split_keys, nst, split0);     \
    }
ATTN_FA(32)
ATTN_FA(64)
ATTN_FA(128)

// ------------------------------------------------------------------------------------------------
// A prompt's prefill over an f32 cache (`attn_pf_d{D}_{x3,x1}`): causal calls of more than 16
// query rows, the FlashAttention-2 structure of attn_fa_impl for many rows. 8 warps, 128 rows
// (GQA-packed as every split kernel: row qr = query qr / G, head hk G + qr % G); a warp owns 16
// rows and computes all 64 keys of every chunk, its Q fragments in registers. Each chunk of f32
// K / V is staged by cp.async (nst = 1 or 2 stages), then converted once per block into 16-bit
// tiles that every warp reads through ldmatrix (the 3xTF32 kernel's warps each split every K / V
// element they read again, and merge 4 key warps' states; ncu: ~40 TFLOP/s on a prefill).
// X3 (the exact op): Q, K, V and P as bf16 hi + lo (x - hi rounded again: ~17 significant bits,
// the exact cuBLAS prefill's split of its operands), each product as hi*lo + lo*hi + hi*hi
// (lo*lo, ~2^-18 relative, dropped) on the bf16 tensor cores with f32 accumulation, bf16 for
// its range (an f32 cache's values need not fit f16). X1 (`PrefillPrecision::Fast`, and
// `attention_fast`): Q, K, V and P rounded to f16 (as attn_h16_impl), one product.
// Blocks run in reverse row order (the causal rows that see the most keys first: a shorter
// tail). Scores in log2 units (att_softmax_fa). A row's bits depend on its query, the keys and
// the chunk boundaries (fixed key indices), not on the block's other rows; such rows are never
// compared with a decode's (the prefill is the one start a speculative and a plain run share).
// Q's A-fragments (att_q_pairs) split into bf16 hi + lo (attn_pf_impl x3).
template <int D, int DW = D>
__device__ __forceinline__ void att_q_frags_x3(const float *__restrict__ q, u32 (&qh)[DW / 16][4], u32 (&ql)[DW / 16][4], int ia, int ib,
                                               int ra, int rb, bool va, bool vb, int hk, int H, const IDiv &G, int t, int col0 = 0) {
    float2 x[DW / 16][4];
    att_q_pairs<D, DW>(q, x, ia, ib, ra, rb, va, vb, hk, H, G, t, col0);
#pragma unroll
    for (int ks = 0; ks < DW / 16; ++ks)
#pragma unroll
        for (int e = 0; e < 4; ++e) split_bf16x2(x[ks][e].x, x[ks][e].y, qh[ks][e], ql[ks][e]);
}

// A call of one split (every key in split 0): attn_pf's rows written as attn_combine would
// write them from its partial, without the partial or the combine's launch. The combine's
// arithmetic for one live split: weight expf(m - m) = 1, acc = fmaf(o, 1, 0) = o + 0 (a -0
// becomes +0), L = l, y = acc / L (0 for a row that sees no key); with hi != null also the o
// projection's bf16 hi (/ lo: null for hi only) x, split_bf16x2 of y elementwise. Row i * H + h
// of out (D values), the layout of the combine's out / hi / lo; the warp's DW of them from
// column col0 (attn_pf2_impl: half a row per warp).
template <int D, int DW = D>
__device__ __forceinline__ void att_pf_store_out(float (&o)[DW / 8][4], float l_a, float l_b, int t, int ra, int rb, bool va, bool vb,
                                                 const IDiv &G, int hk, int H, float *__restrict__ out, u16 *__restrict__ hi,
                                                 u16 *__restrict__ lo, int col0 = 0) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int qr = half ? rb : ra;
        if (!(half ? vb : va)) continue;
        const int i = G.div(qr), h = hk * G.d + (qr - i * G.d);
        const long long row = (long long)i * H + h;
        const float L = half ? l_b : l_a;
        const int r0 = half * 2;
#pragma unroll
        for (int n = 0; n < DW / 8; ++n) {
            const float y0 = L > 0.0f ? __fadd_rn(o[n][r0], 0.0f) / L : 0.0f;
            const float y1 = L > 0.0f ? __fadd_rn(o[n][r0 + 1], 0.0f) / L : 0.0f;
            const long long e = row * D + col0 + 8 * n + 2 * t;
            *(float2 *)(out + e) = make_float2(y0, y1);
            if (hi != nullptr) {
                u32 h2, l2;
                split_bf16x2(y0, y1, h2, l2);
                *(u32 *)(hi + e) = h2;
                if (lo != nullptr) *(u32 *)(lo + e) = l2;
            }
        }
    }
}

// One k-step of S = Q K^T for a warp's 16 rows over NT n-tiles of 8 keys (attn_pf_impl,
// attn_pf2_impl): B-fragments by ldmatrix from ka (+ np * 16 tile rows; lo tiles lo_b bytes
// on); X3 the small terms first.
template <bool X3, int NT>
__device__ __forceinline__ void att_pf_s_kstep(float (&s)[NT][4], const u32 (&qh)[4], const u32 (&ql)[4], u32 ka, u32 row16_b,
                                               u32 lo_b) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
        u32 b0, b1, b2, b3;
        const u32 a = ka + np * row16_b;
        ldsm_x4(a, b0, b1, b2, b3);
        if constexpr (X3) {
            u32 c0, c1, c2, c3;
            ldsm_x4(a + lo_b, c0, c1, c2, c3);
            mma_bf16_16816(s[2 * np], ql[0], ql[1], ql[2], ql[3], b0, b1);
            mma_bf16_16816(s[2 * np + 1], ql[0], ql[1], ql[2], ql[3], b2, b3);
            mma_bf16_16816(s[2 * np], qh[0], qh[1], qh[2], qh[3], c0, c1);
            mma_bf16_16816(s[2 * np + 1], qh[0], qh[1], qh[2], qh[3], c2, c3);
            mma_bf16_16816(s[2 * np], qh[0], qh[1], qh[2], qh[3], b0, b1);
            mma_bf16_16816(s[2 * np + 1], qh[0], qh[1], qh[2], qh[3], b2, b3);
        } else {
            mma_h16(s[2 * np], qh[0], qh[1], qh[2], qh[3], b0, b1);
            mma_h16(s[2 * np + 1], qh[0], qh[1], qh[2], qh[3], b2, b3);
        }
    }
}

// O += P V for one step of 16 keys (P from the S accumulator's n-tiles s0 / s1) over NO output
// n-tiles: B-fragments by ldmatrix.trans from va (+ 32 bytes per pair; lo tiles lo_b bytes on).
template <bool X3, int NO>
__device__ __forceinline__ void att_pf_pv_step(float (&o)[NO][4], const float (&s0)[4], const float (&s1)[4], u32 va, u32 lo_b) {
    u32 p0, p1, p2, p3, r0 = 0, r1 = 0, r2 = 0, r3 = 0;
    if constexpr (X3) {
        split_bf16x2(s0[0], s0[1], p0, r0);
        split_bf16x2(s0[2], s0[3], p1, r1);
        split_bf16x2(s1[0], s1[1], p2, r2);
        split_bf16x2(s1[2], s1[3], p3, r3);
    } else {
        p0 = h2_pack(s0[0], s0[1]);
        p1 = h2_pack(s0[2], s0[3]);
        p2 = h2_pack(s1[0], s1[1]);
        p3 = h2_pack(s1[2], s1[3]);
    }
#pragma unroll
    for (int np = 0; np < NO / 2; ++np) {
        u32 b0, b1, b2, b3;
        const u32 a = va + np * 32;
        ldsm_x4_t(a, b0, b1, b2, b3);
        if constexpr (X3) {
            u32 c0, c1, c2, c3;
            ldsm_x4_t(a + lo_b, c0, c1, c2, c3);
            mma_bf16_16816(o[2 * np], r0, r1, r2, r3, b0, b1);
            mma_bf16_16816(o[2 * np + 1], r0, r1, r2, r3, b2, b3);
            mma_bf16_16816(o[2 * np], p0, p1, p2, p3, c0, c1);
            mma_bf16_16816(o[2 * np + 1], p0, p1, p2, p3, c2, c3);
            mma_bf16_16816(o[2 * np], p0, p1, p2, p3, b0, b1);
            mma_bf16_16816(o[2 * np + 1], p0, p1, p2, p3, b2, b3);
        } else {
            mma_h16(o[2 * np], p0, p1, p2, p3, b0, b1);
            mma_h16(o[2 * np + 1], p0, p1, p2, p3, b2, b3);
        }
    }
}

template <int D, bool X3>
__device__ __forceinline__ void attn_pf_impl(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                                             float *__restrict__ ws_o, float *__restrict__ ws_ml, int n_q, int n_kv, int H, int Hkv,
                                             long long q_pos0, long long kv_pos0, int causal, long long window, float scale,
                                             int split_keys, int nst, int split0, float *__restrict__ out, u16 *__restrict__ hi,
                                             u16 *__restrict__ lo) {
    constexpr int CK = 64;      // keys per chunk
    constexpr int NT = CK / 8;  // score n-tiles per chunk
    constexpr int PH = D + 8;   // halves per tile row (ldmatrix rows conflict-free)
    constexpr int NO = D / 8;   // output n-tiles
    constexpr int KS = D / 16;  // k-steps of S = Q K^T
    constexpr int C4 = D / 4;
    constexpr int NTL = X3 ? 4 : 2;  // tiles: K hi, V hi (, K lo, V lo)
    constexpr u32 TILE_B = CK * PH * 2;
    griddep_launch();  // the combine may launch (it waits for this grid)
    griddep_wait();    // q and the cache first
    extern __shared__ __align__(16) float sm[];
    u16 *T = (u16 *)sm;                       // [NTL][CK][PH]
    float *St = (float *)(T + NTL * CK * PH);  // [nst][K, V][CK][D] f32 staging
    const int nth = blockDim.x;
    const int ROWS = nth / 2;  // 16 rows per warp
    const IDiv G(H / Hkv);
    const int QR = n_q * G.d;
    const int hk = blockIdx.z;
    const int split = split0 + blockIdx.y;
    const int qr0 = (gridDim.x - 1 - blockIdx.x) * ROWS;
    const int tid = threadIdx.x, rw = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int ra = qr0 + rw * 16 + g, rb = ra + 8;
    const bool va = ra < QR, vb = rb < QR;
    const int ia = va ? G.div(ra) : 0, ib = vb ? G.div(rb) : 0;
    const long long qpa = q_pos0 + ia, qpb = q_pos0 + ib;

    const long long jbase = (long long)split * split_keys;
    int c_begin, c_end;
    att_chunk_range(jbase, split_keys, n_kv, qr0, ROWS, QR, G, q_pos0, kv_pos0, causal, window, CK, c_begin, c_end);
    const int nch = c_end - c_begin;
    const long long qpos_lo = q_pos0 + G.div(qr0), qpos_hi = q_pos0 + G.div(max(min(qr0 + ROWS, QR) - 1, qr0));

    const Kv32Stage<D, CK> load_chunk(k, v, St, tid, nth, jbase, hk, Hkv, n_kv);
    for (int p = 0; p < nst; ++p) {
        if (p < nch) load_chunk(c_begin + p, p);
        cp_async_commit();
    }
    u32 qh[KS][4], ql[KS][4];
    if constexpr (X3) att_q_frags_x3<D>(q, qh, ql, ia, ib, ra, rb, va, vb, hk, H, G, t);
    else att_q_frags<D>(q, qh, ia, ib, ra, rb, va, vb, hk, H, G, t);

    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;
    const float scale_l2 = scale * 1.4426950408889634f;  // scores in log2 units
    const u32 kcur = (u32)__cvta_generic_to_shared(T + ((lane & 7) + ((lane >> 4) << 3)) * PH + ((lane >> 3) & 1) * 8);
    const u32 vcur = (u32)__cvta_generic_to_shared(T + CK * PH + (lane & 15) * PH + (lane >> 4) * 8);
    constexpr u32 LO_B = 2 * TILE_B;  // the lo tiles after the hi ones

    for (int ci = 0, slot = 0; ci < nch; ++ci, slot = slot + 1 == nst ? 0 : slot + 1) {
        if (nst == 2) cp_async_wait1();
        else cp_async_wait_all();
        __syncthreads();  // chunk ci staged; every warp is done with chunk ci - 1's tiles
        {
            const float *ks = St + (size_t)slot * 2 * CK * D, *vs = ks + CK * D;
            for (int c = tid; c < CK * C4; c += nth) {
                const int kk = c / C4, d4 = (c % C4) * 4;
                const float4 a = *(const float4 *)(ks + kk * D + d4), b = *(const float4 *)(vs + kk * D + d4);
                u16 *kt = T + kk * PH + d4, *vt = kt + CK * PH;
                if constexpr (X3) {
                    u32 h0, l0, h1, l1, h2, l2, h3, l3;
                    split_bf16x2(a.x, a.y, h0, l0);
                    split_bf16x2(a.z, a.w, h1, l1);
                    split_bf16x2(b.x, b.y, h2, l2);
                    split_bf16x2(b.z, b.w, h3, l3);
                    *(uint2 *)kt = make_uint2(h0, h1);
                    *(uint2 *)vt = make_uint2(h2, h3);
                    *(uint2 *)(kt + 2 * CK * PH) = make_uint2(l0, l1);
                    *(uint2 *)(vt + 2 * CK * PH) = make_uint2(l2, l3);
                } else {
                    *(uint2 *)kt = make_uint2(h2_pack(a.x, a.y), h2_pack(a.z, a.w));
                    *(uint2 *)vt = make_uint2(h2_pack(b.x, b.y), h2_pack(b.z, b.w));
                }
            }
        }
        __syncthreads();  // the tiles are ready, the staging slot is free
        if (ci + nst < nch) load_chunk(c_begin + ci + nst, slot);
        cp_async_commit();

        // S = Q K^T, 16 rows x 64 keys (n-tile nt: keys 8 nt ..); X3: the small terms first.
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) att_pf_s_kstep<X3, NT>(s, qh[ks], ql[ks], kcur + ks * 32, 16 * PH * 2, LO_B);
        const long long j0 = jbase + (long long)(c_begin + ci) * CK;
        const bool full = j0 + CK <= n_kv && (!causal || kv_pos0 + j0 + CK - 1 <= qpos_lo) &&
                          (window < 0 || qpos_hi < kv_pos0 + j0 + window);
        float ala, alb;
        att_softmax_fa<NT>(s, full, j0, t, va, vb, qpa, qpb, n_kv, kv_pos0, causal, window, scale_l2, m_a, m_b, l_a, l_b, ala, alb);
        att_rescale(o, ala, alb);
        // O += P V over the chunk's 4 steps of 16 keys (P from the S accumulator).
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) att_pf_pv_step<X3, NO>(o, s[2 * kk], s[2 * kk + 1], vcur + kk * 16 * PH * 2, LO_B);
    }
    cp_async_wait_all();
    if (out != nullptr) att_pf_store_out<D>(o, l_a, l_b, t, ra, rb, va, vb, G, hk, H, out, hi, lo);
    else att_fa_store<D>(o, m_a, m_b, l_a, l_b, sm, rw, lane, t, ra, rb, va, vb, G, hk, H, n_q, ws_o, ws_ml);
}

// out != null: a call of one split, its rows written straight to out (/ hi / lo) as the combine
// would write them (att_pf_store_out); no partial.
#define ATTN_PF(D, X3, SUFFIX)                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 1) attn_pf_d##D##_##SUFFIX(                                                    \
        const float *q, const float *k, const float *v, float *ws_o, float *ws_ml, int n_q, int n_kv, int H, int Hkv,                  \
        long long q_pos0, long long kv_pos0, int causal, long long window, float scale, int split_keys, int nst, int split0,        \
        float *out, u16 *hi, u16 *lo) {                                                                                               \
        attn_pf_impl<D, X3>(q, k, v, ws_o, ws_ml, n_q, n_kv, H, Hkv, q_pos0, kv_pos0, causal, window, scale, split_keys, nst, split0, \
                            out, hi, lo);                                                                                             \
    }
ATTN_PF(32, true, x3)
ATTN_PF(32, false, x1)
ATTN_PF(64, true, x3)
ATTN_PF(64, false, x1)
ATTN_PF(128, true, x3)
ATTN_PF(128, false, x1)

// ------------------------------------------------------------------------------------------------
// A prompt's prefill at a head dim too wide for attn_pf's registers (`attn_pf2_d{D}_{x3,x1}`,
// D = 256: Q's hi + lo fragments and the output of 16 rows would take 256 registers a lane).
// attn_pf_impl's arithmetic with each 16 rows shared by two warps, each owning half the head
// dims (DW = D / 2): a warp's Q fragments and its output cover its half; its S is the sum of
// both halves' partial products, the partner's read through shared memory after a pair barrier
// (the two warps add the same two values: the same scores, softmax and P in both). RG groups
// of 16 rows, 2 RG warps, per block (GQA-packed as attn_pf), one split (every key; attention_gemm's callers:
// f32 cache, no combine), the rows written as att_pf_store_out writes them. K and V come as
// attention_gemm's operands, split once per call (attn_gemm_operand: [kv head][key (nkvp rows,
// zeros past n_kv)][bf16 hi | lo | hi], or f16 [kv head][key][D]), copied by cp.async straight
// into NST stages of 16-bit tiles (CK keys a chunk): no staging and no conversion per block.
// X3 / X1 as attn_pf_impl (three bf16 products / one f16 product). Blocks in reverse row order.
template <int D, bool X3, int CK, int NST, int RG>
__device__ __forceinline__ void attn_pf2_impl(const float *__restrict__ q, const u16 *__restrict__ kop, const u16 *__restrict__ vop,
                                              int nkvp, int n_q, int n_kv, int H, int Hkv, long long q_pos0, long long kv_pos0,
                                              int causal, long long window, float scale, float *__restrict__ out) {
    constexpr int NT = CK / 8;       // score n-tiles per chunk
    constexpr int DW = D / 2;        // a warp's head dims
    constexpr int PH = D + 8;        // halves per tile row
    constexpr int NO = DW / 8;       // a warp's output n-tiles
    constexpr int KS = DW / 16;      // a warp's k-steps of S
    constexpr int PARTS = X3 ? 3 : 1;  // operand values per source value
    constexpr int NTL = X3 ? 4 : 2;  // tiles per stage: K hi, V hi (, K lo, V lo)
    constexpr int STAGE = NTL * CK * PH;  // halves per stage
    constexpr u32 TILE_B = CK * PH * 2;
    constexpr int C8 = D / 8;        // 16-byte pieces per operand row
    constexpr int NTH = RG * 64;     // RG groups of 16 rows, two warps each
    constexpr int ROWS = RG * 16;
    griddep_launch();
    griddep_wait();
    extern __shared__ __align__(16) float sm[];
    u16 *T = (u16 *)sm;                        // [NST][NTL][CK][PH]
    float *X = (float *)(T + NST * STAGE);     // [2 RG warps][NT * 4][32] partial scores
    const IDiv G(H / Hkv);
    const int QR = n_q * G.d;
    const int hk = blockIdx.z;
    const int qr0 = (gridDim.x - 1 - blockIdx.x) * ROWS;
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    const int rg = w >> 1, dh = w & 1;
    const int g = lane >> 2, t = lane & 3;
    const int ra = qr0 + rg * 16 + g, rb = ra + 8;
    const bool va = ra < QR, vb = rb < QR;
    const int ia = va ? G.div(ra) : 0, ib = vb ? G.div(rb) : 0;
    const long long qpa = q_pos0 + ia, qpb = q_pos0 + ib;

    int c_begin, c_end;
    att_chunk_range(0, n_kv, n_kv, qr0, ROWS, QR, G, q_pos0, kv_pos0, causal, window, CK, c_begin, c_end);
    const int nch = c_end - c_begin;
    const long long qpos_lo = q_pos0 + G.div(qr0), qpos_hi = q_pos0 + G.div(max(min(qr0 + ROWS, QR) - 1, qr0));

    // Chunk c's keys into stage `slot`: piece (key kk, 8 dims c8) of K hi, V hi (, K lo, V lo).
    const u16 *kbase = kop + (long long)hk * nkvp * PARTS * D, *vbase = vop + (long long)hk * nkvp * PARTS * D;
    const u32 t_sa = (u32)__cvta_generic_to_shared(T);
    auto load_chunk = [&](int c, int slot) {
        const long long j0 = (long long)c * CK;
        for (int e = tid; e < CK * C8; e += NTH) {
            const int kk = e / C8, c8 = (e % C8) * 8;
            const long long src = (j0 + kk) * PARTS * D + c8;
            const u32 dst = t_sa + (u32)(slot * STAGE + kk * PH + c8) * 2;
            cp_async16s(dst, kbase + src);
            cp_async16s(dst + TILE_B, vbase + src);
            if constexpr (X3) {
                cp_async16s(dst + 2 * TILE_B, kbase + src + D);
                cp_async16s(dst + 3 * TILE_B, vbase + src + D);
            }
        }
    };
#pragma unroll
    for (int p = 0; p < NST - 1; ++p) {
        if (p < nch) load_chunk(c_begin + p, p);
        cp_async_commit();
    }
    u32 qh[KS][4], ql[KS][4];
    if constexpr (X3) att_q_frags_x3<D, DW>(q, qh, ql, ia, ib, ra, rb, va, vb, hk, H, G, t, dh * DW);
    else att_q_frags<D, DW>(q, qh, ia, ib, ra, rb, va, vb, hk, H, G, t, dh * DW);

    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;
    const float scale_l2 = scale * 1.4426950408889634f;
    // ldmatrix lanes (attn_pf_impl's), moved to this warp's half of the dims.
    const u32 kcur0 = t_sa + (u32)((((lane & 7) + ((lane >> 4) << 3)) * PH + ((lane >> 3) & 1) * 8 + dh * DW) * 2);
    const u32 vcur0 = t_sa + TILE_B + (u32)(((lane & 15) * PH + (lane >> 4) * 8 + dh * DW) * 2);
    constexpr u32 LO_B = 2 * TILE_B;
    float *xs_own = X + w * (NT * 4 * 32) + lane, *xs_par = X + (w ^ 1) * (NT * 4 * 32) + lane;

    for (int ci = 0, slot = 0; ci < nch; ++ci, slot = slot + 1 == NST ? 0 : slot + 1) {
        cp_async_wait_n<NST - 2>();
        __syncthreads();  // chunk ci's tiles are in; every warp is done with chunk ci - 1's
        if (ci + NST - 1 < nch) load_chunk(c_begin + ci + NST - 1, slot == 0 ? NST - 1 : slot - 1);
        cp_async_commit();
        const u32 kcur = kcur0 + slot * STAGE * 2, vcur = vcur0 + slot * STAGE * 2;

        // This warp's half of S = Q K^T, 16 rows x CK keys; X3: the small terms first.
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) att_pf_s_kstep<X3, NT>(s, qh[ks], ql[ks], kcur + ks * 32, 16 * PH * 2, LO_B);
        // The pair's halves summed: low dims first in both warps (the same bits in both).
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) xs_own[(nt * 4 + e) * 32] = s[nt][e];
        asm volatile("bar.sync %0, 64;" ::"r"(1 + rg) : "memory");
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float other = xs_par[(nt * 4 + e) * 32];
                s[nt][e] = dh == 0 ? s[nt][e] + other : other + s[nt][e];
            }
        const long long j0 = (long long)(c_begin + ci) * CK;
        const bool full = j0 + CK <= n_kv && (!causal || kv_pos0 + j0 + CK - 1 <= qpos_lo) &&
                          (window < 0 || qpos_hi < kv_pos0 + j0 + window);
        float ala, alb;
        att_softmax_fa<NT>(s, full, j0, t, va, vb, qpa, qpb, n_kv, kv_pos0, causal, window, scale_l2, m_a, m_b, l_a, l_b, ala, alb);
        att_rescale(o, ala, alb);
        // O += P V over the chunk's steps of 16 keys, this warp's dims.
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) att_pf_pv_step<X3, NO>(o, s[2 * kk], s[2 * kk + 1], vcur + kk * 16 * PH * 2, LO_B);
    }
    cp_async_wait_all();
    att_pf_store_out<D, DW>(o, l_a, l_b, t, ra, rb, va, vb, G, hk, H, out, nullptr, nullptr, dh * DW);
}

#define ATTN_PF2(D, X3, CK, NST, RG, SUFFIX)                                                                                        \
    extern "C" __global__ void __launch_bounds__(RG * 64, 1) attn_pf2_d##D##_##SUFFIX(                                              \
        const float *q, const u16 *kop, const u16 *vop, int nkvp, int n_q, int n_kv, int H, int Hkv, long long q_pos0,              \
        long long kv_pos0, int causal, long long window, float scale, float *out) {                                                 \
        attn_pf2_impl<D, X3, CK, NST, RG>(q, kop, vop, nkvp, n_q, n_kv, H, Hkv, q_pos0, kv_pos0, causal, window, scale, out);           \
    }
ATTN_PF2(256, true, 32, 2, 4, x3)
ATTN_PF2(256, true, 32, 3, 4, x3_s3)
ATTN_PF2(256, false, 32, 2, 4, x1)
ATTN_PF2(256, false, 64, 2, 4, x1_c64)
ATTN_PF2(256, false, 32, 2, 8, x1_r8)
ATTN_PF2(256, false, 32, 3, 4, x1_s3)

#define ATTN_TC(D, KW, FPV, X1, SUFFIX)                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128 * KW, D > 128 ? 1 : 4 / KW) attn_tc_d##D##_kw##KW##SUFFIX(                         \
        const float *q, const float *k, const float *v, float *ws_o, float *ws_ml, int n_q, int n_kv, int H, int Hkv,                    \
        long long q_pos0, long long kv_pos0, int causal, long long window, float scale, int split_keys, int nst, int split0) {                       \
        attn_tc_impl<D, KW, FPV, X1>(q, k, v, ws_o, ws_ml, n_q, n_kv, H, Hkv, q_pos0, kv_pos0, causal, window, scale, split_keys, nst, split0); \
    }
ATTN_TC(32, 2, false, false, )
ATTN_TC(64, 2, false, false, )
ATTN_TC(128, 2, false, false, )
ATTN_TC(32, 4, false, false, )
ATTN_TC(64, 4, false, false, )
ATTN_TC(128, 4, false, false, )
ATTN_TC(32, 2, true, false, _fpv)
ATTN_TC(64, 2, true, false, _fpv)
ATTN_TC(128, 2, true, false, _fpv)
ATTN_TC(32, 4, true, false, _fpv)
ATTN_TC(64, 4, true, false, _fpv)
ATTN_TC(128, 4, true, false, _fpv)
ATTN_TC(32, 2, false, true, _x1)
ATTN_TC(64, 2, false, true, _x1)
ATTN_TC(128, 2, false, true, _x1)
ATTN_TC(32, 4, false, true, _x1)
ATTN_TC(64, 4, false, true, _x1)
ATTN_TC(128, 4, false, true, _x1)
// Head dim 256 (the hybrid target's attention layers): 2 key warps (32-key chunks; 64 keys of
// padded f32 K and V would leave one stage), one block per multiprocessor, so up to 255
// registers for the 128 accumulators of a lane's two rows.
ATTN_TC(256, 2, false, false, )
ATTN_TC(256, 2, false, true, _x1)

// The Hopper warpgroup-MMA twin of attn_fa_impl (`attn_wg16kv_d128`; only in the module compiled
// for sm_90a, DFLASH_SM90A). One warpgroup (4 warps, 64 rows: the 16 queries x 4 heads of a kv
// head at the 8B / 27B shapes) per block; per 64-key chunk S = Q K^T is 8 wgmma.m64n64k16 and
// O += P V 4 wgmma.m64n128k16, both reading K / V straight from shared memory (no ldmatrix),
// with Q and P as register A operands in mma.sync's A-fragment order and the accumulators in
// its C-fragment order, so the softmax, rescale and store are attn_fa_impl's. The tiles are
// 128-byte swizzled (KvSwCopy), so each warp instruction of the copy reads two whole cache rows
// as attn_fa_impl's does: the same kernel over 8 x 16-byte core matrices (no swizzle, each warp
// instruction 8 rows x 64 bytes) ran 27.8 us against the FA kernel's 22.3 at ctx 8192 (H200),
// this one 19.6. Grid, chunks, masks, partials and per-row determinism as attn_fa_impl.
#if defined(DFLASH_SM90A)
__device__ __forceinline__ unsigned long long wg_desc(u32 saddr, u32 lbo, u32 sbo) {
    return (unsigned long long)((saddr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32);
}
// The same with the 128-byte swizzle (layout type 1, bits 62-63; the tile 1024-byte aligned).
__device__ __forceinline__ unsigned long long wg_desc_sw128(u32 saddr, u32 lbo, u32 sbo) { return wg_desc(saddr, lbo, sbo) | (1ull << 62); }
template <int N>
__device__ __forceinline__ void wg_keep(float (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(r[i][e])::"memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// s (+)= A B over one k16 step: s the m64n64 f32 accumulator (this warp's C fragments, n-tile
// nt = keys 8 nt ..), a this warp's A fragment, B (K-major) by descriptor; acc = 0 overwrites.
__device__ __forceinline__ void wg_m64n64k16(float (&s)[8][4], const u32 (&a)[4], unsigned long long bd, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "{%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(s[0][0]), "+f"(s[0][1]), "+f"(s[0][2]), "+f"(s[0][3]), "+f"(s[1][0]), "+f"(s[1][1]), "+f"(s[1][2]), "+f"(s[1][3]),
          "+f"(s[2][0]), "+f"(s[2][1]), "+f"(s[2][2]), "+f"(s[2][3]), "+f"(s[3][0]), "+f"(s[3][1]), "+f"(s[3][2]), "+f"(s[3][3]),
          "+f"(s[4][0]), "+f"(s[4][1]), "+f"(s[4][2]), "+f"(s[4][3]), "+f"(s[5][0]), "+f"(s[5][1]), "+f"(s[5][2]), "+f"(s[5][3]),
          "+f"(s[6][0]), "+f"(s[6][1]), "+f"(s[6][2]), "+f"(s[6][3]), "+f"(s[7][0]), "+f"(s[7][1]), "+f"(s[7][2]), "+f"(s[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bd), "r"(acc));
}
// o += A B over one k16 step: o the m64n128 f32 accumulator, B read MN-major (imm-trans-b 1).
__device__ __forceinline__ void wg_m64n128k16_t(float (&o)[16][4], const u32 (&a)[4], unsigned long long bd) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
        "{%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(o[0][0]), "+f"(o[0][1]), "+f"(o[0][2]), "+f"(o[0][3]), "+f"(o[1][0]), "+f"(o[1][1]), "+f"(o[1][2]), "+f"(o[1][3]),
          "+f"(o[2][0]), "+f"(o[2][1]), "+f"(o[2][2]), "+f"(o[2][3]), "+f"(o[3][0]), "+f"(o[3][1]), "+f"(o[3][2]), "+f"(o[3][3]),
          "+f"(o[4][0]), "+f"(o[4][1]), "+f"(o[4][2]), "+f"(o[4][3]), "+f"(o[5][0]), "+f"(o[5][1]), "+f"(o[5][2]), "+f"(o[5][3]),
          "+f"(o[6][0]), "+f"(o[6][1]), "+f"(o[6][2]), "+f"(o[6][3]), "+f"(o[7][0]), "+f"(o[7][1]), "+f"(o[7][2]), "+f"(o[7][3]),
          "+f"(o[8][0]), "+f"(o[8][1]), "+f"(o[8][2]), "+f"(o[8][3]), "+f"(o[9][0]), "+f"(o[9][1]), "+f"(o[9][2]), "+f"(o[9][3]),
          "+f"(o[10][0]), "+f"(o[10][1]), "+f"(o[10][2]), "+f"(o[10][3]), "+f"(o[11][0]), "+f"(o[11][1]), "+f"(o[11][2]), "+f"(o[11][3]),
          "+f"(o[12][0]), "+f"(o[12][1]), "+f"(o[12][2]), "+f"(o[12][3]), "+f"(o[13][0]), "+f"(o[13][1]), "+f"(o[13][2]), "+f"(o[13][3]),
          "+f"(o[14][0]), "+f"(o[14][1]), "+f"(o[14][2]), "+f"(o[14][3]), "+f"(o[15][0]), "+f"(o[15][1]), "+f"(o[15][2]), "+f"(o[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bd));
}

// Chunk c (64 keys from key jbase + 64 c, kv head hk) into the K / V tiles of stage `slot` (K at
// slot * 2 TILE_B bytes, V TILE_B after it; tiles 1024-byte aligned), 128-byte swizzled: key row
// j's d half h (64 values) at h * 8192 + j * 128 bytes, its 16-byte d block c (0..7) at
// ((c ^ (j % 8)) * 16) (tools/bench/wgmma_layout.cu checked the descriptors on the H200). Thread
// tid copies the 16-byte piece tid % 16 of rows tid / 16 + 8 i (as Kv16Copy: a warp instruction
// reads two whole cache rows); its row's swizzle is the same for all i. Keys past n_kv become
// zeros. 128 threads.
template <int D>
struct KvSwCopy {
    static constexpr u32 TILE_B = 64 * D * 2;
    int n_kv, r0;
    long long jbase, cstep, rstep;  // halves: per chunk, per 8 key rows
    const u16 *kg, *vg;
    u32 sa;
    __device__ __forceinline__ KvSwCopy(const float *k, const float *v, u32 tiles, int tid, long long jbase_, int hk, int Hkv, int n_kv_)
        : n_kv(n_kv_), r0(tid / 16), jbase(jbase_) {
        static_assert(D == 128, "two 64-value halves per key row");
        const int p = tid % 16;
        cstep = 64LL * Hkv * D;
        rstep = 8LL * Hkv * D;
        const long long goff = ((jbase + r0) * Hkv + hk) * D + 8 * p;
        kg = (const u16 *)k + goff;
        vg = (const u16 *)v + goff;
        sa = tiles + (u32)((p / 8) * 8192 + r0 * 128 + (((p % 8) ^ r0) * 16));
    }
    __device__ __forceinline__ void operator()(int c, int slot) const {
        const long long j0 = jbase + (long long)c * 64;
        const u16 *ks = kg + c * cstep, *vs = vg + c * cstep;
        const u32 kd = sa + (u32)slot * 2 * TILE_B;
        const bool whole = j0 + 64 <= n_kv;
#pragma unroll
        for (int i = 0; i < 8; ++i, ks += rstep, vs += rstep) {
            const u32 so = kd + (u32)i * 1024;
            if (whole || j0 + r0 + 8 * i < n_kv) {
                cp_async16s(so, ks);
                cp_async16s(so + TILE_B, vs);
            } else {
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(so), "r"(0u) : "memory");
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(so + TILE_B), "r"(0u) : "memory");
            }
        }
    }
};

template <int D>
__device__ __forceinline__ void attn_wg_impl(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                                             float *__restrict__ ws_o, float *__restrict__ ws_ml, int n_q, int n_kv, int H, int Hkv,
                                             long long q_pos0, long long kv_pos0, int causal, long long window, float scale,
                                             int split_keys, int nst, int split0) {
    constexpr int CK = 64;      // keys per chunk
    constexpr int NT = CK / 8;  // score n-tiles per chunk
    constexpr int NO = D / 8;   // output n-tiles
    constexpr int KS = D / 16;  // k-steps of S = Q K^T
    constexpr u32 TILE_B = KvSwCopy<D>::TILE_B;
    griddep_launch();  // the combine may launch (it waits for this grid)
    griddep_wait();    // q and the cache first
    extern __shared__ __align__(128) float sm[];
    // [nst][K, V][64 keys x D], 128-byte swizzled (KvSwCopy), from the first 1024-byte boundary
    const u32 tiles = ((u32)__cvta_generic_to_shared(sm) + 1023u) & ~1023u;
    constexpr int ROWS = 64;
    const IDiv G(H / Hkv);
    const int QR = n_q * G.d;
    const int hk = blockIdx.z;
    const int split = split0 + blockIdx.y;
    const int qr0 = blockIdx.x * ROWS;
    const int tid = threadIdx.x, rw = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int ra = qr0 + rw * 16 + g, rb = ra + 8;
    const bool va = ra < QR, vb = rb < QR;
    const int ia = va ? G.div(ra) : 0, ib = vb ? G.div(rb) : 0;
    const long long qpa = q_pos0 + ia, qpb = q_pos0 + ib;

    const long long jbase = (long long)split * split_keys;
    int c_begin, c_end;
    att_chunk_range(jbase, split_keys, n_kv, qr0, ROWS, QR, G, q_pos0, kv_pos0, causal, window, CK, c_begin, c_end);
    const int nch = c_end - c_begin;
    const long long qpos_lo = q_pos0 + G.div(qr0), qpos_hi = q_pos0 + G.div(max(min(qr0 + ROWS, QR) - 1, qr0));

    const KvSwCopy<D> load_chunk(k, v, tiles, tid, jbase, hk, Hkv, n_kv);
    // 3 <= nst <= 5 (the host's choice): chunks ci and ci + 1 are read while ci + 2 .. land.
    for (int p = 0; p < nst - 1; ++p) {
        if (p < nch) load_chunk(c_begin + p, p);
        cp_async_commit();
    }
    u32 qf[KS][4];
    att_q_frags<D>(q, qf, ia, ib, ra, rb, va, vb, hk, H, G, t);

    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;
    const float scale_l2 = scale * 1.4426950408889634f;  // scores in log2 units
    const auto tile_k = [&](int ci) { return tiles + (u32)(ci % nst) * 2 * TILE_B; };
    // S = Q K^T of chunk ci (64 rows x 64 keys; this warp: its 16 rows, n-tile nt = keys 8 nt ..).
    const auto issue_s = [&](float (&s)[NT][4], int ci) {
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) wg_m64n64k16(s, qf[ks], wg_desc_sw128(tile_k(ci) + (ks / 4) * 8192 + (ks % 4) * 32, 16, 1024), ks);
    };
    // Software pipeline (one warpgroup: its phases would otherwise not overlap): S of the next
    // chunk runs on the tensor cores while this chunk's softmax runs, and this chunk's P V while
    // the next chunk's copy is awaited, its S issued and its softmax runs.
    float s[NT][4], sn[NT][4];
    u32 pf[NT / 2][4];  // P's A fragments: live until the P V group completes
    if (nch > 0) {
        cp_async_wait_n<0>();  // (the prologue's chunks; only the first is needed)
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        issue_s(sn, 0);
        wg_commit();
        wg_wait0();
        wg_keep(sn);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = sn[nt][e];
    }
    for (int ci = 0; ci < nch; ++ci) {
        const bool more = ci + 1 < nch;
        if (more) {
            // Chunk ci + 1 landed (3 <= nst <= 5: the prologue issued it, or iteration ci + 2 - nst).
            if (nst == 5) cp_async_wait_n<2>();
            else if (nst == 4) cp_async_wait_n<1>();
            else cp_async_wait_n<0>();
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncthreads();
            issue_s(sn, ci + 1);
        }
        wg_commit();  // (empty after the last chunk: the group count stays the same)
        const long long j0 = jbase + (long long)(c_begin + ci) * CK;
        const bool full = j0 + CK <= n_kv && (!causal || kv_pos0 + j0 + CK - 1 <= qpos_lo) &&
                          (window < 0 || qpos_hi < kv_pos0 + j0 + window);
        float ala, alb;
        att_softmax_fa<NT>(s, full, j0, t, va, vb, qpa, qpb, n_kv, kv_pos0, causal, window, scale_l2, m_a, m_b, l_a, l_b, ala, alb);
        // P V of chunk ci - 1 done (its stage and P free; o settled), and S of ci + 1. (Waiting
        // for the older group alone, wait_group 1, makes ptxas serialize every wgmma: it cannot
        // tell that the o it reads next is no longer in flight.)
        wg_wait0();
        wg_keep(o);
        wg_keep(sn);
        // Refill the stage of chunk ci - 1 with chunk ci + nst - 1 (every warp is past its P V:
        // a warpgroup MMA completes for all four warps at once).
        if (ci + nst - 1 < nch) load_chunk(c_begin + ci + nst - 1, (ci + nst - 1) % nst);
        cp_async_commit();
        att_rescale(o, ala, alb);
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            pf[kk][0] = h2_pack(s[2 * kk][0], s[2 * kk][1]);
            pf[kk][1] = h2_pack(s[2 * kk][2], s[2 * kk][3]);
            pf[kk][2] = h2_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pf[kk][3] = h2_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
        wg_keep(o);
        wg_fence();
        const u32 vcur = tile_k(ci) + TILE_B;
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) wg_m64n128k16_t(o, pf[kk], wg_desc_sw128(vcur + kk * 2048, 8192, 1024));
        wg_commit();
        if (more) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] = sn[nt][e];
        }
    }
    wg_wait0();
    wg_keep(o);
    cp_async_wait_all();
    att_fa_store<D>(o, m_a, m_b, l_a, l_b, sm, rw, lane, t, ra, rb, va, vb, G, hk, H, n_q, ws_o, ws_ml);
}

extern "C" __global__ void __launch_bounds__(128) attn_wg16kv_d128(const float *q, const float *k, const float *v, float *ws_o,
                                                                    float *ws_ml, int n_q, int n_kv, int H, int Hkv, long long q_pos0,
                                                                    long long kv_pos0, int causal, long long window, float scale,
                                                                    int split_keys, int nst, int split0) {
    attn_wg_impl<128>(q, k, v, ws_o, ws_ml, n_q, n_kv, H, Hkv, q_pos0, kv_pos0, causal, window, scale, split_keys, nst, split0);
}
#endif
