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

__device__ __forceinline__ bool att_visible(long long j, int n_kv, long long kpos, long long qpos, int causal, long long window) {
    return j < n_kv && (!causal || kpos <= qpos) && (window < 0 || qpos < kpos + window);
}

template <int D>
__device__ __forceinline__ void attn_split_impl(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                                                float *__restrict__ ws_o, float *__restrict__ ws_ml, int n_q, int n_kv, int H, int Hkv,
                                                long long q_pos0, long long kv_pos0, int causal, long long window, float scale,
                                                int split_keys) {
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

// Merge the splits in order. One block per (query, head), threads over d.
extern "C" __global__ void attn_combine(const float *ws_o, const float *ws_ml, int n_split, long long rows_total, int D, float *out) {
    const long long row = blockIdx.x;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float M = NEG_INF, L = 0.0f, acc = 0.0f;
        for (int s = 0; s < n_split; ++s) {
            const long long pr = (long long)s * rows_total + row;
            const float m = ws_ml[pr * 2], l = ws_ml[pr * 2 + 1];
            if (!(l > 0.0f)) continue;
            const float Mn = fmaxf(M, m);
            const float a = M == NEG_INF ? 0.0f : expf(M - Mn);
            const float b = expf(m - Mn);
            acc = acc * a + ws_o[pr * D + d] * b;
            L = L * a + l * b;
            M = Mn;
        }
        out[row * D + d] = L > 0.0f ? acc / L : 0.0f;
    }
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
