// Row-wise normalisation, RoPE, elementwise ops, copies, gathers.

extern "C" __global__ void fill_f32(float *x, long long n, float v) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) x[i] = v;
}

// One block per row of width dim. out = w * x / sqrt(mean(x^2) + eps). The row is read once
// into registers (dim <= 32 * blockDim), else twice. The block size is chosen from dim only.
#define RMS_MAXV 32
// 1 / sqrt(mean(v^2) + eps) of a row already in registers (zeros past dim): the arithmetic of
// rms_norm, shared with the fused kernels below so that they give the same bits.
// Only the first nv = rms_slots(dim) register slots hold values: the loops below stop there
// (a block-uniform branch) instead of running all RMS_MAXV slots predicated off (a head-dim
// row in one slot executed the code of 32); the dead slots added exact zeros before (fma(0, 0,
// ss) == ss for ss >= 0), so the bits are unchanged.
__device__ __forceinline__ int rms_slots(int dim) { return min(RMS_MAXV, (dim + (int)blockDim.x - 1) / (int)blockDim.x); }
__device__ __forceinline__ float rms_inv_of(const float (&v)[RMS_MAXV], int dim, float eps, float *red) {
    const int nv = rms_slots(dim);
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < RMS_MAXV; ++u) {
        if (u >= nv) break;
        ss = fmaf(v[u], v[u], ss);
    }
    ss = block_sum(ss, red);
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

// Every load of a row is issued before any store: with stores in between, the compiler must
// assume a store may alias the next load and waits for each load in turn (16 dependent
// round trips per row at dim 4096: measured 10-15 us per launch instead of a few).
// The value v of element i of a normalised row goes to out[i] (f32) or, for the skinny
// matmuls' x, to hi[i] / lo[i]: split_bf16's bf16 pair of v (the bits split_bf16 writes from
// the f32 output, without that output or its launch; a null lo: hi only, for the fast
// prefill's one product).
template <bool SPLIT>
__device__ __forceinline__ void put_row(float *__restrict__ out, u16 *__restrict__ hi, u16 *__restrict__ lo, long long i, float v) {
    if (SPLIT) {
        u32 h, l;
        split_bf16x2(v, 0.0f, h, l);
        hi[i] = (u16)(h & 0xffffu);
        if (lo != nullptr) lo[i] = (u16)(l & 0xffffu);
    } else {
        out[i] = v;
    }
}

template <bool SPLIT>
__device__ __forceinline__ void rms_norm_impl(const float *__restrict__ x, const float *__restrict__ w, float *__restrict__ out,
                                              u16 *__restrict__ hi, u16 *__restrict__ lo, int dim, float eps) {
    // rms_norm triggers its dependents first thing; the split variant after its row's loads
    // (the next kernel, a skinny matmul, loads a weight tile before it waits: issued
    // earlier, those loads delayed this kernel's: the dense 8B target's verify16 +5.5%).
    // Launched programmatically (the split variant), the norm's weights load before the wait
    // for the kernel before (none writes them), x after it.
    if (!SPLIT) griddep_launch();
    __shared__ float red[32];
    const long long row = blockIdx.x;
    const float *xr = x + row * dim;
    if (dim <= RMS_MAXV * (int)blockDim.x) {
        const int nv = rms_slots(dim);
        float v[RMS_MAXV], wv[RMS_MAXV];
#pragma unroll
        for (int u = 0; u < RMS_MAXV; ++u) {
            if (u >= nv) break;
            const int i = threadIdx.x + u * blockDim.x;
            wv[u] = i < dim ? w[i] : 0.0f;
        }
        griddep_wait();
#pragma unroll
        for (int u = 0; u < RMS_MAXV; ++u) {
            if (u >= nv) break;
            const int i = threadIdx.x + u * blockDim.x;
            v[u] = i < dim ? xr[i] : 0.0f;
        }
        const float inv = rms_inv_of(v, dim, eps, red);
        if (SPLIT) griddep_launch();
#pragma unroll
        for (int u = 0; u < RMS_MAXV; ++u) {
            if (u >= nv) break;
            const int i = threadIdx.x + u * blockDim.x;
            if (i < dim) put_row<SPLIT>(out, hi, lo, row * dim + i, wv[u] * (v[u] * inv));
        }
        return;
    }
    griddep_wait();
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss, red);
    if (SPLIT) griddep_launch();
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) put_row<SPLIT>(out, hi, lo, row * dim + i, w[i] * (xr[i] * inv));
}

extern "C" __global__ void rms_norm(const float *__restrict__ x, const float *__restrict__ w, float *__restrict__ out, int dim,
                                    float eps) {
    rms_norm_impl<false>(x, w, out, nullptr, nullptr, dim, eps);
}
// rms_norm written as the skinny matmuls' bf16 hi / lo x (the bits of rms_norm + split_bf16).
extern "C" __global__ void rms_norm_split(const float *__restrict__ x, const float *__restrict__ w, u16 *__restrict__ hi,
                                          u16 *__restrict__ lo, int dim, float eps) {
    rms_norm_impl<true>(x, w, nullptr, hi, lo, dim, eps);
}

// Fused residual add + RMSNorm (dim <= RMS_MAXV * blockDim): h += o, then out = rms_norm(h)
// with rms_norm's arithmetic and block size: the bits of add_assign followed by rms_norm.
template <bool SPLIT>
__device__ __forceinline__ void add_rms_norm_impl(float *__restrict__ h, const float *__restrict__ o, const float *__restrict__ w,
                                                  float *__restrict__ out, u16 *__restrict__ hi, u16 *__restrict__ lo, int dim,
                                                  float eps) {
    if (!SPLIT) griddep_launch();  // the split variant: after its loads (as rms_norm_split)
    griddep_wait();  // a programmatic dependent launch: the previous kernel's output first
    __shared__ float red[32];
    const long long row = blockIdx.x;
    float *hr = h + row * dim;
    const float *orow = o + row * dim;
    const int nv = rms_slots(dim);
    float v[RMS_MAXV], ov[RMS_MAXV], wv[RMS_MAXV];
    // Loads only in this loop (an add here would wait for each slot's loads in turn: with the
    // slot branches the compiler no longer moves the adds after all the loads).
#pragma unroll
    for (int u = 0; u < RMS_MAXV; ++u) {
        if (u >= nv) break;
        const int i = threadIdx.x + u * blockDim.x;
        v[u] = i < dim ? hr[i] : 0.0f;
        ov[u] = i < dim ? orow[i] : 0.0f;
        wv[u] = i < dim ? w[i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < RMS_MAXV; ++u) {
        if (u >= nv) break;
        v[u] = v[u] + ov[u];
    }
    if (SPLIT) griddep_launch();
#pragma unroll
    for (int u = 0; u < RMS_MAXV; ++u) {
        if (u >= nv) break;
        const int i = threadIdx.x + u * blockDim.x;
        if (i < dim) hr[i] = v[u];
    }
    const float inv = rms_inv_of(v, dim, eps, red);
#pragma unroll
    for (int u = 0; u < RMS_MAXV; ++u) {
        if (u >= nv) break;
        const int i = threadIdx.x + u * blockDim.x;
        if (i < dim) put_row<SPLIT>(out, hi, lo, row * dim + i, wv[u] * (v[u] * inv));
    }
}

extern "C" __global__ void add_rms_norm(float *__restrict__ h, const float *__restrict__ o, const float *__restrict__ w,
                                        float *__restrict__ out, int dim, float eps) {
    add_rms_norm_impl<false>(h, o, w, out, nullptr, nullptr, dim, eps);
}
// add_rms_norm with the normed rows written as the skinny matmuls' bf16 hi / lo x (the bits of
// add_rms_norm + split_bf16).
extern "C" __global__ void add_rms_norm_split(float *__restrict__ h, const float *__restrict__ o, const float *__restrict__ w,
                                              u16 *__restrict__ hi, u16 *__restrict__ lo, int dim, float eps) {
    add_rms_norm_impl<true>(h, o, w, nullptr, hi, lo, dim, eps);
}

// rms_norm of rows row0 .. row0 + T - 1 of x [*, dim] written straight as the Q8_0A8
// activation of T tokens (a8_store_block's layout and arithmetic): the bytes a8_quant_x
// writes from rms_norm's output, without that output or the quantizer's launch. A row is
// spread over C blocks: every block loads the whole row and sums its squares exactly as
// rms_norm does (same block size, same order: the same inv in every block), then quantizes
// its share of the row's q8 blocks: register slots u = c, c + C, ... (slot u of warp w is
// block (u * blockDim + 32 w) / 32). Grid NT*8*C blocks: tokens T .. NT*8-1 are padding
// (zeros, nothing read); block c == C - 1 of each token also zeroes the padding blocks
// dim/32 .. KBp-1. dim % 32 == 0, dim <= RMS_MAXV * blockDim.
extern "C" __global__ void rms_norm_q8(const float *__restrict__ x, const float *__restrict__ w, int T, long long row0, int dim,
                                       float eps, int C, int NT, int KBp, u32 *__restrict__ xq, float *__restrict__ xd) {
    __shared__ float red[32];
    const int c = blockIdx.x % C, tok = blockIdx.x / C, nth = blockDim.x, warp = threadIdx.x >> 5;
    const bool live = tok < T;
    const float *xr = x + (row0 + tok) * (long long)dim;
    const int nv = rms_slots(dim);
    float v[RMS_MAXV], wv[RMS_MAXV];
    // The norm weight before the wait (like a matmul's weights: no kernel of the chain writes
    // it), so its load, often from HBM, overlaps the kernel before.
#pragma unroll
    for (int u = 0; u < RMS_MAXV; ++u) {
        if (u >= nv) break;
        const int i = threadIdx.x + u * nth;
        wv[u] = i < dim ? w[i] : 0.0f;
    }
    griddep_wait();  // a programmatic dependent launch: x first
#pragma unroll
    for (int u = 0; u < RMS_MAXV; ++u) {
        if (u >= nv) break;
        const int i = threadIdx.x + u * nth;
        v[u] = live && i < dim ? xr[i] : 0.0f;
    }
    const float inv = live ? rms_inv_of(v, dim, eps, red) : 0.0f;
    // The matmul may launch now (it prefetches its first weight stage, then waits for this
    // grid): after this block's loads, which its prefetch would otherwise delay.
    griddep_launch();
    // One copy of the quantization code (a loop that is not unrolled; the slot's values
    // picked out of the registers by selects): unrolled per slot, the kernel's code was
    // ~20 times larger and it ran at twice rms_norm's time.
#pragma unroll 1
    for (int uu = c; uu * nth + 32 * warp < dim; uu += C) {  // uniform over a warp
        float xv = 0.0f, wq = 0.0f;
#pragma unroll
        for (int u = 0; u < RMS_MAXV; ++u) {
            if (u >= nv) break;
            xv = u == uu ? v[u] : xv;
            wq = u == uu ? wv[u] : wq;
        }
        a8_store_block(live ? wq * (xv * inv) : 0.0f, (uu * nth >> 5) + warp, tok, NT, xq, xd);
    }
    if (c == C - 1) a8_zero_pad(tok, dim / 32, KBp, NT, xq, xd);
}

// NeoX rotation of one pair by (c, s) = (cos, sin)(pos * f) * sc (the arithmetic of rope,
// shared with qk_norm_rope_kv and qk_norm_rope_kv_rows).
__device__ __forceinline__ void rope_cs(float pos, float f, float sc, float &c, float &s) {
    const float ang = pos * f;
    c = cosf(ang) * sc;
    s = sinf(ang) * sc;
}
__device__ __forceinline__ void rope_rot(float x1, float x2, float c, float s, float &o1, float &o2) {
    o1 = x1 * c - x2 * s;
    o2 = x2 * c + x1 * s;
}
__device__ __forceinline__ void rope_pair(float x1, float x2, float pos, float f, float sc, float &o1, float &o2) {
    float c, s;
    rope_cs(pos, f, sc, c, s);
    rope_rot(x1, x2, c, s, o1, o2);
}

// Fused per-head q/k RMSNorm + NeoX RoPE + K/V cache write, one block per (row, head) of
// q (n_heads) then k (n_kv heads); block size = rms_norm's for head_dim, head_dim <=
// min(1024, RMS_MAXV * blockDim). q -> q_out (rows < q_rows only); k -> kc (already offset to
// the first cache row); the k blocks also copy v's head row into vc. Same bits as rms_norm +
// rope + copy. kv16: the caches hold f16 (kc / vc point at halves; h_pack of the same f32
// values: the bits of rms_norm + rope + copy + f16_pack).
extern "C" __global__ void qk_norm_rope_kv(const float *__restrict__ q0, const float *__restrict__ k0, const float *__restrict__ v,
                                           const float *__restrict__ qn, const float *__restrict__ kn, float *__restrict__ q_out,
                                           float *__restrict__ kc, float *__restrict__ vc, int n_heads, int n_kv, int hd, int half_rot,
                                           long long pos0, const float *__restrict__ inv_freq, float attn_scale, float eps,
                                           int q_rows, int kv16) {
    __shared__ float red[32];
    __shared__ float ys[1024];
    const int nh = n_heads + n_kv;
    const long long r = blockIdx.x / nh;
    const int hh = blockIdx.x % nh;
    const bool isq = hh < n_heads;
    const float *w = isq ? qn : kn;
    const int nv = rms_slots(hd);
    // The norm weights and this thread's first RoPE frequency before the wait (no kernel of
    // the chain writes them), so their loads overlap the kernel before.
    float wv[RMS_MAXV];
#pragma unroll
    for (int u = 0; u < RMS_MAXV; ++u) {
        if (u >= nv) break;
        const int i = threadIdx.x + u * blockDim.x;
        wv[u] = i < hd ? w[i] : 0.0f;
    }
    const float f0 = (int)threadIdx.x < half_rot ? inv_freq[threadIdx.x] : 0.0f;
    griddep_wait();  // a programmatic dependent launch: q0 / k0 / v first
    if (isq && r >= q_rows) return;  // q rows past q_rows are not wanted (block-uniform)
    const long long off = isq ? (r * n_heads + hh) * hd : (r * n_kv + (hh - n_heads)) * hd;
    const float *src = (isq ? q0 : k0) + off;
    const bool h16 = kv16 && !isq;
    float *dst = (isq ? q_out : kc) + (h16 ? 0 : off);
    u16 *dsth = (u16 *)kc + off;
    // The V copy first: no load of the row waits behind a store.
    if (!isq) {
        if (h16)
            for (int i = threadIdx.x; i < hd; i += blockDim.x) ((u16 *)vc)[off + i] = h_pack(v[off + i]);
        else
            for (int i = threadIdx.x; i < hd; i += blockDim.x) vc[off + i] = v[off + i];
    }
    float vv[RMS_MAXV];
#pragma unroll
    for (int u = 0; u < RMS_MAXV; ++u) {
        if (u >= nv) break;
        const int i = threadIdx.x + u * blockDim.x;
        vv[u] = i < hd ? src[i] : 0.0f;
    }
    const float inv = rms_inv_of(vv, hd, eps, red);
    // The attention may launch now (it waits for this grid): after this block's loads, so
    // that the launches it cascades into (the combine, the o projection's weight prefetch)
    // do not delay them.
    griddep_launch();
#pragma unroll
    for (int u = 0; u < RMS_MAXV; ++u) {
        if (u >= nv) break;
        const int i = threadIdx.x + u * blockDim.x;
        if (i < hd) ys[i] = wv[u] * (vv[u] * inv);
    }
    __syncthreads();
    const float pos = (float)(pos0 + r);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        if (i < half_rot) {
            float o1, o2;
            rope_pair(ys[i], ys[i + half_rot], pos, i == (int)threadIdx.x ? f0 : inv_freq[i], attn_scale, o1, o2);
            if (h16) {
                dsth[i] = h_pack(o1);
                dsth[i + half_rot] = h_pack(o2);
            } else {
                dst[i] = o1;
                dst[i + half_rot] = o2;
            }
        } else if (i >= 2 * half_rot) {
            if (h16) dsth[i] = h_pack(ys[i]);
            else dst[i] = ys[i];
        }
    }
}

// qk_norm_rope_kv for a prefill's rows (its parameters; the same bits): one block of
// QKR_WARPS warps per row, a warp per head (q heads, then k heads; a row past q_rows has k
// heads only), the row's RoPE (cos, sin) pairs computed once into shared memory for all of
// its heads (qk_norm_rope_kv: once per head). Lane l holds elements l + 32 m of the head: the
// elements thread 32 w + l of rms_norm's 128-thread block holds for w = m % 4 (its slot u =
// m / 4), so the four per-w sums of squares, each summed over the warp in warp_sum's order
// and then combined as block_sum combines its four warps, are rms_norm's sum bit for bit.
// hd <= 1024 (rms_norm's block of 128 threads: norm_threads); dynamic shared memory: 2 *
// half_rot + QKR_WARPS * hd floats.
#define QKR_WARPS 4
extern "C" __global__ void __launch_bounds__(32 * QKR_WARPS)
    qk_norm_rope_kv_rows(const float *__restrict__ q0, const float *__restrict__ k0, const float *__restrict__ v,
                         const float *__restrict__ qn, const float *__restrict__ kn, float *__restrict__ q_out,
                         float *__restrict__ kc, float *__restrict__ vc, int n_heads, int n_kv, int hd, int half_rot,
                         long long pos0, const float *__restrict__ inv_freq, float attn_scale, float eps, int q_rows,
                         int kv16) {
    extern __shared__ float qkr_sm[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float *cs = qkr_sm, *ys = qkr_sm + 2 * half_rot + warp * hd;
    const long long r = blockIdx.x;
    const float pos = (float)(pos0 + r);
    // The rotation before the wait (nothing of the chain writes inv_freq).
    for (int i = threadIdx.x; i < half_rot; i += blockDim.x) rope_cs(pos, inv_freq[i], attn_scale, cs[2 * i], cs[2 * i + 1]);
    griddep_wait();  // a programmatic dependent launch: q0 / k0 / v first
    __syncthreads();
    const int nm = (hd + 31) >> 5;
    for (int hh = (r < q_rows ? 0 : n_heads) + warp; hh < n_heads + n_kv; hh += QKR_WARPS) {
        const bool isq = hh < n_heads;
        const float *w = isq ? qn : kn;
        const long long off = isq ? (r * n_heads + hh) * hd : (r * n_kv + (hh - n_heads)) * hd;
        const float *src = (isq ? q0 : k0) + off;
        const bool h16 = kv16 && !isq;
        float *dst = (isq ? q_out : kc) + (h16 ? 0 : off);
        u16 *dsth = (u16 *)kc + off;
        float vv[32];
#pragma unroll
        for (int m = 0; m < 32; ++m) {
            if (m >= nm) break;
            const int e = lane + 32 * m;
            vv[m] = e < hd ? src[e] : 0.0f;
        }
        if (!isq) {
            if (h16)
                for (int i = lane; i < hd; i += 32) ((u16 *)vc)[off + i] = h_pack(v[off + i]);
            else
                for (int i = lane; i < hd; i += 32) vc[off + i] = v[off + i];
        }
        float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int m = 0; m < 32; ++m) {
            if (m >= nm) break;
            s4[m & 3] = fmaf(vv[m], vv[m], s4[m & 3]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) s4[j] = warp_sum(s4[j]);
        const float ss = (s4[0] + s4[2]) + (s4[1] + s4[3]);
        const float inv = 1.0f / sqrtf(ss / (float)hd + eps);
#pragma unroll
        for (int m = 0; m < 32; ++m) {
            if (m >= nm) break;
            const int e = lane + 32 * m;
            if (e < hd) ys[e] = w[e] * (vv[m] * inv);
        }
        __syncwarp();
        for (int i = lane; i < hd; i += 32) {
            if (i < half_rot) {
                float o1, o2;
                rope_rot(ys[i], ys[i + half_rot], cs[2 * i], cs[2 * i + 1], o1, o2);
                if (h16) {
                    dsth[i] = h_pack(o1);
                    dsth[i + half_rot] = h_pack(o2);
                } else {
                    dst[i] = o1;
                    dst[i + half_rot] = o2;
                }
            } else if (i >= 2 * half_rot) {
                if (h16) dsth[i] = h_pack(ys[i]);
                else dst[i] = ys[i];
            }
        }
        __syncwarp();
    }
}

// f32 -> f16 pairs (h2_pack: round to nearest even, saturating): dst[i] = halves of src[2i],
// src[2i + 1] (the lower one in the low bits). The f16 KV cache's layout.
extern "C" __global__ void f16_pack(const float *__restrict__ src, u32 *__restrict__ dst, long long npairs) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < npairs; i += (long long)gridDim.x * blockDim.x) {
        const float2 x = ((const float2 *)src)[i];
        dst[i] = h2_pack(x.x, x.y);
    }
}

// f16 pairs -> f32 (exact): f16_pack's inverse up to the rounding.
extern "C" __global__ void f16_unpack(const u32 *__restrict__ src, float *__restrict__ dst, long long npairs) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < npairs; i += (long long)gridDim.x * blockDim.x) {
        const u32 h = src[i];
        ((float2 *)dst)[i] = make_float2(f16_to_f32((u16)(h & 0xffffu)), f16_to_f32((u16)(h >> 16)));
    }
}

// out = (w * rmsnorm(x)) * silu(z); with SPLIT also as the skinny matmuls' bf16 hi / lo x (the
// bits of rms_norm_gated + split_bf16): the rows [rows, n_heads * dim] of the o projection's x.
template <bool SPLIT>
__device__ __forceinline__ void rms_norm_gated_impl(const float *x, const float *z, const float *w, float *out, u16 *hi,
                                                    u16 *lo, int dim, float eps) {
    if (SPLIT) griddep_launch();  // the o projection (launched programmatically) may start
    __shared__ float red[32];
    const long long row = blockIdx.x;
    const float *xr = x + row * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float zz = z[row * dim + i];
        const float v = (w[i] * (xr[i] * inv)) * silu_f(zz);
        out[row * dim + i] = v;
        if (SPLIT) put_row<true>(nullptr, hi, lo, row * dim + i, v);
    }
}
extern "C" __global__ void rms_norm_gated(const float *x, const float *z, const float *w, float *out, int dim, float eps) {
    rms_norm_gated_impl<false>(x, z, w, out, nullptr, nullptr, dim, eps);
}
extern "C" __global__ void rms_norm_gated_split(const float *x, const float *z, const float *w, float *out, u16 *hi, u16 *lo,
                                                int dim, float eps) {
    rms_norm_gated_impl<true>(x, z, w, out, hi, lo, dim, eps);
}

// NeoX rotate-half on x = [rows, n_heads, head_dim]; one thread per (row, head, pair).
extern "C" __global__ void rope(float *x, int rows, int n_heads, int head_dim, int half_rot, long long pos0,
                                const float *inv_freq, float attn_scale) {
    const long long n = (long long)rows * n_heads * half_rot;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n; idx += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(idx % half_rot);
        const long long rh = idx / half_rot;
        const long long r = rh / n_heads;
        const float pos = (float)(pos0 + r);
        float *h = x + rh * head_dim;
        float o1, o2;
        rope_pair(h[i], h[i + half_rot], pos, inv_freq[i], attn_scale, o1, o2);
        h[i] = o1;
        h[i + half_rot] = o2;
    }
}

extern "C" __global__ void silu_mul(const float *gate, const float *up, float *out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = silu_f(gate[i]) * up[i];
}
// silu_mul written as the skinny matmuls' bf16 hi / lo x (the bits of silu_mul + split_bf16).
extern "C" __global__ void silu_mul_split(const float *gate, const float *up, u16 *hi, u16 *lo, long long n) {
    griddep_launch();  // the down projection (launched programmatically) may start
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        put_row<true>(nullptr, hi, lo, i, silu_f(gate[i]) * up[i]);
}

extern "C" __global__ void add_assign(float *dst, const float *src, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] += src[i];
}

extern "C" __global__ void scale(float *x, long long n, float s) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= s;
}

extern "C" __global__ void mul_sigmoid(float *x, const float *gate, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= sigmoid_f(gate[i]);
}
// mul_sigmoid also written as the skinny matmuls' bf16 hi / lo x (the bits of mul_sigmoid +
// split_bf16): a gated attention's output for its o projection.
extern "C" __global__ void mul_sigmoid_split(float *x, const float *gate, u16 *hi, u16 *lo, long long n) {
    griddep_launch();  // the o projection (launched programmatically) may start
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float v = x[i] * sigmoid_f(gate[i]);
        x[i] = v;
        put_row<true>(nullptr, hi, lo, i, v);
    }
}

extern "C" __global__ void copy2d(const float *src, long long src_stride, float *dst, long long dst_stride, int rows, int cols) {
    griddep_launch();
    const long long n = (long long)rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / cols, c = i % cols;
        dst[r * dst_stride + c] = src[r * src_stride + c];
    }
}

// out[i, :] = W[ids[i], :] in f32, any format. Grid (ids, column pieces of GATHER_COLS):
// every thread issues its GATHER_PER loads before any store (see rms_norm), one round trip
// per block (one block per id looping over the row took ~10 us at 16 ids x 4096 columns).
#define GATHER_PER 4
#define GATHER_COLS (GATHER_PER * 256)
extern "C" __global__ void gather_rows(int fmt, const void *__restrict__ wq, const u16 *__restrict__ wd, const u32 *__restrict__ ids,
                                       int cols, float *__restrict__ out) {
    const long long row = ids[blockIdx.x];
    float *o = out + (long long)blockIdx.x * cols;
    const int c0 = blockIdx.y * GATHER_COLS + threadIdx.x;
    float t[GATHER_PER];
#pragma unroll
    for (int u = 0; u < GATHER_PER; ++u) {
        const int c = c0 + u * blockDim.x;
        t[u] = c < cols ? load_w<true, true>(fmt, wq, wd, row, c, cols) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < GATHER_PER; ++u) {
        const int c = c0 + u * blockDim.x;
        if (c < cols) o[c] = t[u];
    }
}

// A Gated DeltaNet log decay from its gate input a (before dt_bias) and ea = exp(a_log[h]):
// -ea * softplus(a + dt_bias). gdn_gates and the register delta rule (which computes its gates
// where it uses them) share it, so both give the same bits.
__device__ __forceinline__ float gdn_g(float a, float dt_bias, float ea) {
    // Rounded adds and products: never contracted into whatever uses them.
    const float xa = __fadd_rn(a, dt_bias);
    const float sp = xa > 20.0f ? xa : log1pf(expf(xa));
    return __fmul_rn(-ea, sp);
}

// g = -exp(a_log[h]) * softplus(a + dt_bias[h]); beta = sigmoid(b)
extern "C" __global__ void gdn_gates(const float *a, const float *b, const float *a_log, const float *dt_bias, int n_heads,
                                     long long n, float *g, float *beta) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const int h = (int)(i % n_heads);
        g[i] = gdn_g(a[i], dt_bias[h], expf(a_log[h]));
        beta[i] = sigmoid_f(b[i]);
    }
}

// Short causal depthwise conv1d with state, then SiLU. One thread per (channel, chunk of
// `chunk` tokens): an output reads only the inputs of its window, never an earlier output,
// so the chunks run side by side; each output is the same sum in the same order whatever the
// chunk. The window of a chunk's first token comes from x or, before token 0, from the state.
// Only chunk 0's threads read the state (the host keeps chunk >= kernel - 1), and they write
// the new state (the last kernel - 1 inputs) after their reads (from the window itself when
// the call is one chunk).
extern "C" __global__ void causal_conv1d(const float *x, int t_len, int channels, int kernel, int chunk, const float *w,
                                         float *state, float *out, float *stash) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    float win[16];
    const int km1 = kernel - 1;
    const int t0 = blockIdx.y * chunk;
    const int t1 = min(t0 + chunk, t_len);
    for (int j = 0; j < km1; ++j) {
        const int s = t0 - km1 + j;
        win[j] = s >= 0 ? x[(long long)s * channels + c] : state[(long long)(s + km1) * channels + c];
    }
    for (int t = t0; t < t1; ++t) {
        win[km1] = x[(long long)t * channels + c];
        float acc = 0.0f;
        for (int j = 0; j < kernel; ++j) acc = fmaf(w[(long long)c * kernel + j], win[j], acc);
        out[(long long)t * channels + c] = silu_f(acc);
        for (int j = 0; j < km1; ++j) win[j] = win[j + 1];
        if (stash)
            for (int j = 0; j < km1; ++j) stash[((long long)t * km1 + j) * channels + c] = win[j];
    }
    if (gridDim.y == 1) {
        // One chunk (a decode or a verify): the window holds the last kernel - 1 inputs.
        for (int j = 0; j < km1; ++j) state[(long long)j * channels + c] = win[j];
    } else if (blockIdx.y == 0) {
        // Ascending j reads index t_len + j > j of the old state before anything writes it.
        for (int j = 0; j < km1; ++j) {
            const int s = t_len - km1 + j;
            state[(long long)j * channels + c] =
                s >= 0 ? x[(long long)s * channels + c] : state[(long long)(s + km1) * channels + c];
        }
    }
}

// Gated delta rule, recurrent form. One block per value head, one thread per value column.
// Dynamic shared memory: S [dk][dv] + q [dk] + k [dk] + 32 floats.
extern "C" __global__ void gated_delta_rule(const float *q, const float *k, const float *v, const float *g, const float *beta,
                                            int t_len, int n_k_heads, int n_v_heads, int dk, int dv, int l2norm, float q_scale,
                                            float *state, float *out, float *stash) {
    extern __shared__ float sm[];
    float *S = sm;
    float *qs = S + dk * dv;
    float *ks = qs + dk;
    float *red = ks + dk;
    const int h = blockIdx.x;
    const int hk = h / (n_v_heads / n_k_heads);
    const int j = threadIdx.x;
    float *st = state + (long long)h * dk * dv;
    for (int i = threadIdx.x; i < dk * dv; i += blockDim.x) S[i] = st[i];
    for (int t = 0; t < t_len; ++t) {
        __syncthreads();
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = q[((long long)t * n_k_heads + hk) * dk + i];
            ks[i] = k[((long long)t * n_k_heads + hk) * dk + i];
        }
        __syncthreads();
        float qn = 1.0f, kn = 1.0f;
        if (l2norm) {
            float sq = 0.0f, sk = 0.0f;
            for (int i = threadIdx.x; i < dk; i += blockDim.x) { sq = fmaf(qs[i], qs[i], sq); sk = fmaf(ks[i], ks[i], sk); }
            sq = block_sum(sq, red);
            sk = block_sum(sk, red);
            qn = 1.0f / sqrtf(sq + 1e-6f);
            kn = 1.0f / sqrtf(sk + 1e-6f);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < dk; i += blockDim.x) { qs[i] = qs[i] * qn * q_scale; ks[i] = ks[i] * kn; }
        __syncthreads();
        if (j < dv) {
            const float decay = expf(g[(long long)t * n_v_heads + h]);
            const float b = beta[(long long)t * n_v_heads + h];
            float kv = 0.0f;
            for (int i = 0; i < dk; ++i) {
                float s = S[i * dv + j] * decay;
                S[i * dv + j] = s;
                kv = fmaf(s, ks[i], kv);
            }
            const float u = (v[((long long)t * n_v_heads + h) * dv + j] - kv) * b;
            float o = 0.0f;
            for (int i = 0; i < dk; ++i) {
                float s = fmaf(ks[i], u, S[i * dv + j]);
                S[i * dv + j] = s;
                o = fmaf(s, qs[i], o);
            }
            out[((long long)t * n_v_heads + h) * dv + j] = o;
            if (stash)
                for (int i = 0; i < dk; ++i) stash[(((long long)t * n_v_heads + h) * dk + i) * dv + j] = S[i * dv + j];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < dk * dv; i += blockDim.x) st[i] = S[i];
}

// Gated delta rule, recurrent form, the state in registers. Column j of a head's state
// evolves on its own (its k product, delta and output read only column j), so a block of
// GDN_WARPS warps takes 32 columns of one value head: lane = column, warp w = rows
// w, w + GDN_WARPS, ... (R rows per thread, dk <= GDN_WARPS * R). Per token every warp
// computes the q / k norms itself (a warp sum each: no barrier); the decayed column's k
// product and the output are summed over the warps through shared memory (two barriers;
// double-buffered by token parity). The next token's inputs are loaded before this token's
// arithmetic. Grid (ceil(dv / 32), n_v_heads).
#define GDN_WARPS 8
struct GdnIn {
    float qa[8], ka[8]; // q, k at lane + 32 m (the norms)
    float qr, kr;       // q, k at row w + GDN_WARPS * lane (this warp's rows)
    float v, g, b;
};
template <int R>
__device__ __forceinline__ void gdn_load(GdnIn &in, const float *q, const float *k, const float *v, const float *g,
                                         const float *beta, int t, long long qk_rs, long long v_rs, int nv, int hk,
                                         int h, int dk, int dv, int j, int lane, int w, int l2norm) {
    const float *qt = q + (long long)t * qk_rs + (long long)hk * dk;
    const float *kt = k + (long long)t * qk_rs + (long long)hk * dk;
    if (l2norm) {
#pragma unroll
        for (int m = 0; m < (R * GDN_WARPS + 31) / 32; ++m) {
            const int i = lane + 32 * m;
            in.qa[m] = i < dk ? qt[i] : 0.0f;
            in.ka[m] = i < dk ? kt[i] : 0.0f;
        }
    }
    const int ir = w + GDN_WARPS * lane;
    in.qr = lane < R && ir < dk ? qt[ir] : 0.0f;
    in.kr = lane < R && ir < dk ? kt[ir] : 0.0f;
    in.v = j < dv ? v[(long long)t * v_rs + (long long)h * dv + j] : 0.0f;
    in.g = g[(long long)t * nv + h];
    in.b = beta[(long long)t * nv + h];
}
template <int R>
__device__ __forceinline__ void gated_delta_rule_regs(const float *q, const float *k, const float *v, const float *g,
                                                      const float *beta, int t_len, int nk, int nv, int dk, int dv,
                                                      int l2norm, float q_scale, float *state, float *out,
                                                      float *stash, long long qk_rs, long long v_rs,
                                                      const float *a_log, const float *dt_bias) {
    __shared__ float kvp[2][GDN_WARPS][32];
    __shared__ float opp[2][GDN_WARPS][32];
    const int h = blockIdx.y;
    const int hk = h / (nv / nk);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int j = blockIdx.x * 32 + lane;
    const bool jok = j < dv;
    float S[R];
    float *st = state + (long long)h * dk * dv;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = w + GDN_WARPS * r;
        S[r] = jok && i < dk ? st[(long long)i * dv + j] : 0.0f;
    }
    // With a_log, g and beta hold the gate inputs a and b: the gates are computed here, where a
    // token is used.
    const bool gates = a_log != nullptr;
    const float ea = gates ? expf(a_log[h]) : 0.0f, dtb = gates ? dt_bias[h] : 0.0f;
    GdnIn cur = {}, nxt = {};
    if (t_len > 0) gdn_load<R>(cur, q, k, v, g, beta, 0, qk_rs, v_rs, nv, hk, h, dk, dv, j, lane, w, l2norm);
    for (int t = 0; t < t_len; ++t) {
        // This token's gates before the next token's loads are issued, so that their
        // temporaries are dead while those loads are in flight (ptxas 13.0, sm_90: r16 80
        // registers, r32 181; computed after the loads, 127 and 211; without gates 80, 177).
        const float decay = expf(gates ? gdn_g(cur.g, dtb, ea) : cur.g);
        const float bt = gates ? sigmoid_f(cur.b) : cur.b;
        if (t + 1 < t_len)
            gdn_load<R>(nxt, q, k, v, g, beta, t + 1, qk_rs, v_rs, nv, hk, h, dk, dv, j, lane, w, l2norm);
        float qn = 1.0f, kn = 1.0f;
        if (l2norm) {
            float sq = 0.0f, sk = 0.0f;
#pragma unroll
            for (int m = 0; m < (R * GDN_WARPS + 31) / 32; ++m) {
                sq = fmaf(cur.qa[m], cur.qa[m], sq);
                sk = fmaf(cur.ka[m], cur.ka[m], sk);
            }
            qn = 1.0f / sqrtf(warp_sum(sq) + 1e-6f);
            kn = 1.0f / sqrtf(warp_sum(sk) + 1e-6f);
        }
        const float kr = cur.kr * kn, qr = cur.qr * qn * q_scale;
        float kk[R], qq[R];
        float kv = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            kk[r] = __shfl_sync(0xffffffffu, kr, r);
            qq[r] = __shfl_sync(0xffffffffu, qr, r);
            S[r] *= decay;
            kv = fmaf(S[r], kk[r], kv);
        }
        const int par = t & 1;
        kvp[par][w][lane] = kv;
        __syncthreads();
        float kvs = 0.0f;
#pragma unroll
        for (int u = 0; u < GDN_WARPS; ++u) kvs += kvp[par][u][lane];
        const float d = (cur.v - kvs) * bt;
        float o = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            S[r] = fmaf(kk[r], d, S[r]);
            o = fmaf(S[r], qq[r], o);
        }
        opp[par][w][lane] = o;
        if (stash && jok) {
            float *sp = stash + (((long long)t * nv + h) * dk) * dv + j;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int i = w + GDN_WARPS * r;
                if (i < dk) sp[(long long)i * dv] = S[r];
            }
        }
        __syncthreads();
        if (w == 0 && jok) {
            float os = 0.0f;
#pragma unroll
            for (int u = 0; u < GDN_WARPS; ++u) os += opp[par][u][lane];
            out[((long long)t * nv + h) * dv + j] = os;
        }
        cur = nxt;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = w + GDN_WARPS * r;
        if (jok && i < dk) st[(long long)i * dv + j] = S[r];
    }
}
// dk <= 128 and dk <= 256. q / k rows of qk_rs floats, v rows of v_rs (n_k_heads * dk and
// n_v_heads * dv for packed buffers; the conv's channels when q / k / v are views of its rows).
// a_log null: g / beta are the gates; otherwise the gate inputs a / b, with a_log and dt_bias.
extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32)
    gated_delta_rule_r16(const float *q, const float *k, const float *v, const float *g, const float *beta, int t_len,
                         int nk, int nv, int dk, int dv, int l2norm, float q_scale, float *state, float *out,
                         float *stash, long long qk_rs, long long v_rs, const float *a_log, const float *dt_bias) {
    gated_delta_rule_regs<16>(q, k, v, g, beta, t_len, nk, nv, dk, dv, l2norm, q_scale, state, out, stash, qk_rs,
                              v_rs, a_log, dt_bias);
}
extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32)
    gated_delta_rule_r32(const float *q, const float *k, const float *v, const float *g, const float *beta, int t_len,
                         int nk, int nv, int dk, int dv, int l2norm, float q_scale, float *state, float *out,
                         float *stash, long long qk_rs, long long v_rs, const float *a_log, const float *dt_bias) {
    gated_delta_rule_regs<32>(q, k, v, g, beta, t_len, nk, nv, dk, dv, l2norm, q_scale, state, out, stash, qk_rs,
                              v_rs, a_log, dt_bias);
}

// Gated delta rule, chunked form (a prompt's long calls; no stash; q / k L2-normalized,
// dk <= GDC_DK). Per chunk of GDC tokens with G the cumulative log decay inside it,
// M[i][j] = b_i e^(G_i - G_j) k_i.k_j (j < i) and X = (I + M)^-1 [b e^G k | b v] = [W | U], the
// chunk's deltas are U - W S0 (S0: the state before the chunk), its outputs
// e^(G_i) q_i S0 + sum_{j <= i} e^(G_i - G_j) (q_i.k_j) delta_j, and the state after it
// e^(G_last) S0 + sum_j e^(G_last - G_j) k_j delta_j^T: the recurrence's algebra, summed in
// another order. Three kernels over a span of chunks: gdn_chunk_prep (every chunk side by side:
// W, U, k decayed to the chunk's end, the normalized q, the decayed q.k and G into scratch),
// gdn_chunk_state (per value head and 32 state columns, the chunks in order over the state in
// shared memory: each chunk's deltas, and the state before it into scratch) and gdn_chunk_out
// (every chunk side by side: the outputs from the state before the chunk and its deltas).
// Padding rows past the call's tokens have g = 0, b = 0, q = k = v = 0: no delta, no decay, no
// output. Rows of W, the decayed k and the normalized q are GDC_DK values, zeros past dk.
#define GDC 64
#define GDC_DK 128
// Row i's q / k at lanes lane + 32 p, L2-normalized (times scale) into dst (GDC_DK per row,
// zeros past dk and for rows past n).
__device__ __forceinline__ void gdc_norm_row(const float *src, int dk, bool ok, float scale, float *dst, int lane) {
    float x[GDC_DK / 32];
    float ss = 0.0f;
#pragma unroll
    for (int p = 0; p < GDC_DK / 32; ++p) {
        const int r = lane + 32 * p;
        x[p] = ok && r < dk ? src[r] : 0.0f;
        ss = fmaf(x[p], x[p], ss);
    }
    const float inv = 1.0f / sqrtf(warp_sum(ss) + 1e-6f) * scale;
#pragma unroll
    for (int p = 0; p < GDC_DK / 32; ++p) dst[lane + 32 * p] = x[p] * inv;
}
// Grid (chunks of the span, n_k_heads), 256 threads. Dynamic shared memory: kn, qn
// [GDC][GDC_DK + 1] (M [GDC][GDC] over qn once k.k and q.k are in registers), G, b [GDC].
// Scratch (span-local chunk c, value head h, key head hk): wk, kd [c][h][GDC][GDC_DK],
// uu [c][h][GDC][dv], qk [c][h][GDC][GDC], gc [c][h][GDC], qs [c][hk][GDC][GDC_DK].
extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_prep(const float *q, const float *k, const float *v, const float *g, const float *beta, int t0,
                   int t_len, int nk, int nv, int dk, int dv, float q_scale, float *wk, float *kd, float *uu,
                   float *qk, float *gc, float *qs) {
    extern __shared__ float sm[];
    constexpr int LD = GDC_DK + 1;
    float *kn = sm;
    float *qn = kn + GDC * LD;
    float *Ms = qn;
    float *Gs = qn + GDC * LD;
    float *Bs = Gs + GDC;
    const int c = blockIdx.x, hk = blockIdx.y, grp = nv / nk;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int tb = t0 + c * GDC;
    const int n = min(GDC, t_len - tb);
    for (int i = w; i < GDC; i += 8) {
        const long long row = ((long long)(tb + i) * nk + hk) * dk;
        gdc_norm_row(k + row, dk, i < n, 1.0f, kn + i * LD, lane);
        gdc_norm_row(q + row, dk, i < n, q_scale, qn + i * LD, lane);
    }
    __syncthreads();
    {
        float *dst = qs + ((long long)c * nk + hk) * GDC * GDC_DK;
        for (int e = tid; e < GDC * GDC_DK; e += 256) dst[e] = qn[(e / GDC_DK) * LD + e % GDC_DK];
    }
    // k.k and q.k: rows ti + 16 a, columns tj + 16 b.
    const int ti = tid >> 4, tj = tid & 15;
    float akk[4][4] = {}, aqk[4][4] = {};
    for (int r = 0; r < dk; ++r) {
        float ka[4], qa[4], kb[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            ka[a] = kn[(ti + 16 * a) * LD + r];
            qa[a] = qn[(ti + 16 * a) * LD + r];
            kb[a] = kn[(tj + 16 * a) * LD + r];
        }
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                akk[a][b] = fmaf(ka[a], kb[b], akk[a][b]);
                aqk[a][b] = fmaf(qa[a], kb[b], aqk[a][b]);
            }
    }
    __syncthreads(); // qn is M from here on
    for (int hh = 0; hh < grp; ++hh) {
        const int h = hk * grp + hh;
        const long long ch = (long long)c * nv + h;
        if (w == 0) {
            // Inclusive cumulative sum of g over the chunk (padding: 0).
            float g0 = lane < n ? g[(long long)(tb + lane) * nv + h] : 0.0f;
            float g1 = lane + 32 < n ? g[(long long)(tb + lane + 32) * nv + h] : 0.0f;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float a0 = __shfl_up_sync(0xffffffffu, g0, o);
                const float a1 = __shfl_up_sync(0xffffffffu, g1, o);
                if (lane >= o) { g0 += a0; g1 += a1; }
            }
            g1 += __shfl_sync(0xffffffffu, g0, 31);
            Gs[lane] = g0;
            Gs[lane + 32] = g1;
            gc[ch * GDC + lane] = g0;
            gc[ch * GDC + lane + 32] = g1;
            Bs[lane] = lane < n ? beta[(long long)(tb + lane) * nv + h] : 0.0f;
            Bs[lane + 32] = lane + 32 < n ? beta[(long long)(tb + lane + 32) * nv + h] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int i = ti + 16 * a, j = tj + 16 * b;
                const float e = expf(Gs[i] - Gs[j]);
                Ms[i * GDC + j] = j < i ? Bs[i] * e * akk[a][b] : 0.0f;
                qk[(ch * GDC + i) * GDC + j] = j <= i ? e * aqk[a][b] : 0.0f;
            }
        {
            // k's rows decayed to the chunk's end.
            float *dst = kd + ch * GDC * GDC_DK;
            const float glast = Gs[GDC - 1];
            for (int e = tid; e < GDC * GDC_DK; e += 256) {
                const int i = e / GDC_DK;
                dst[e] = kn[i * LD + e % GDC_DK] * expf(glast - Gs[i]);
            }
        }
        __syncthreads();
        // Forward substitution, one column of [W | U] per thread: X_i = rhs_i - sum_{j<i} M_ij X_j.
        for (int col = tid; col < dk + dv; col += 256) {
            float X[GDC];
            const bool isk = col < dk;
            const float *vc = v + (long long)h * dv + (isk ? 0 : col - dk);
#pragma unroll
            for (int i = 0; i < GDC; ++i) {
                float x = isk ? Bs[i] * expf(Gs[i]) * kn[i * LD + col]
                              : (i < n ? Bs[i] * vc[(long long)(tb + i) * nv * dv] : 0.0f);
#pragma unroll
                for (int j = 0; j < (i & ~3); j += 4) {
                    const float4 m4 = *reinterpret_cast<const float4 *>(Ms + i * GDC + j);
                    x = fmaf(-m4.x, X[j], x);
                    x = fmaf(-m4.y, X[j + 1], x);
                    x = fmaf(-m4.z, X[j + 2], x);
                    x = fmaf(-m4.w, X[j + 3], x);
                }
#pragma unroll
                for (int j = i & ~3; j < i; ++j) x = fmaf(-Ms[i * GDC + j], X[j], x);
                X[i] = x;
            }
            if (isk) {
                float *dst = wk + ch * GDC * GDC_DK + col;
#pragma unroll
                for (int i = 0; i < GDC; ++i) dst[(long long)i * GDC_DK] = X[i];
            } else {
                float *dst = uu + ch * GDC * dv + (col - dk);
#pragma unroll
                for (int i = 0; i < GDC; ++i) dst[(long long)i * dv] = X[i];
            }
        }
        // W's columns past dk: zeros.
        for (int e = tid; e < GDC * (GDC_DK - dk); e += 256)
            wk[(ch * GDC + e / (GDC_DK - dk)) * GDC_DK + dk + e % (GDC_DK - dk)] = 0.0f;
        __syncthreads();
    }
}
// 16-byte asynchronous copies from global into shared memory (sm_80+; both addresses 16-byte
// aligned), their groups and waits.
__device__ __forceinline__ void gdc_cp16(float *smem, const float *gmem) {
    const u32 sa = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(gmem) : "memory");
}
__device__ __forceinline__ void gdc_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void gdc_wait1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void gdc_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// A chunk's GDC x GDC_DK scratch values into shared memory, 16 bytes per copy (one group).
__device__ __forceinline__ void gdc_load_rows(float *dst, const float *src, int tid) {
    for (int e = tid; e < GDC * GDC_DK / 4; e += 256) gdc_cp16(dst + 4 * e, src + 4 * e);
    gdc_commit();
}
// o[m] += sum over r < N of A[(w + 8 m) * LDA + r] B[r * 32 + lane], m < 8: eight rows of A (shared
// memory, 16-byte aligned rows) times the 32 columns of B (shared memory), four values of r per
// step in one fma chain per row.
template <int LDA, int N>
__device__ __forceinline__ void gdc_rows_times(const float *A, const float *B, int w, int lane, float o[8]) {
    for (int r = 0; r < N; r += 4) {
        const float b0 = B[r * 32 + lane], b1 = B[(r + 1) * 32 + lane], b2 = B[(r + 2) * 32 + lane],
                    b3 = B[(r + 3) * 32 + lane];
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const float4 a4 = *reinterpret_cast<const float4 *>(A + (w + 8 * m) * LDA + r);
            o[m] = fmaf(a4.x, b0, fmaf(a4.y, b1, fmaf(a4.z, b2, fmaf(a4.w, b3, o[m]))));
        }
    }
}
// Grid (ceil(dv / 32), n_v_heads), 256 threads: the state's 32 columns j0 + lane of value head h,
// the span's chunks in order. Dynamic shared memory (88 KB: two blocks per SM): S [GDC_DK][32],
// Ws and Kd [GDC][GDC_DK], Vn [GDC][32]. Each chunk's W arrives while the previous chunk's state
// is updated, its decayed k while its deltas are summed (cp.async). uu: U in, the deltas out
// (each thread rewrites the values it read); hs [c][h][dk][dv]: the state before chunk c.
extern "C" __global__ void __launch_bounds__(256, 2)
    gdn_chunk_state(const float *wk, const float *kd, const float *gc, int n_chunks, int nv, int dk, int dv,
                    float *uu, float *state, float *hs) {
    extern __shared__ __align__(16) float sm[];
    float *S = sm;
    float *Ws = S + GDC_DK * 32;
    float *Kd = Ws + GDC * GDC_DK;
    float *Vn = Kd + GDC * GDC_DK;
    const int h = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int j = blockIdx.x * 32 + lane;
    const bool jok = j < dv;
    float *st = state + (long long)h * dk * dv;
    for (int r = w; r < GDC_DK; r += 8) S[r * 32 + lane] = jok && r < dk ? st[(long long)r * dv + j] : 0.0f;
    gdc_load_rows(Ws, wk + (long long)h * GDC * GDC_DK, tid);
    for (int c = 0; c < n_chunks; ++c) {
        const long long ch = (long long)c * nv + h;
        gdc_load_rows(Kd, kd + ch * GDC * GDC_DK, tid);
        float u[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) u[m] = jok ? uu[(ch * GDC + w + 8 * m) * dv + j] : 0.0f;
        const float glast = gc[ch * GDC + GDC - 1];
        gdc_wait1(); // this thread's copies of W
        __syncthreads();
        if (jok)
            for (int r = w; r < dk; r += 8) hs[(ch * dk + r) * dv + j] = S[r * 32 + lane];
        // Rows i = w + 8 m: the deltas U - W S.
        float dl[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) dl[m] = 0.0f;
        gdc_rows_times<GDC_DK, GDC_DK>(Ws, S, w, lane, dl);
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const float d = u[m] - dl[m];
            Vn[(w + 8 * m) * 32 + lane] = d;
            if (jok) uu[(ch * GDC + w + 8 * m) * dv + j] = d;
        }
        __syncthreads(); // every warp is done with Ws; Vn is whole
        if (c + 1 < n_chunks) gdc_load_rows(Ws, wk + (ch + nv) * GDC * GDC_DK, tid);
        else gdc_commit();
        gdc_wait1(); // this thread's copies of Kd
        __syncthreads();
        // The state: rows r = 16 w + m, S = e^(G_last) S + Kd^T Vn.
        const float dec = expf(glast);
        float acc[16];
#pragma unroll
        for (int m = 0; m < 16; ++m) acc[m] = S[(16 * w + m) * 32 + lane] * dec;
        for (int i = 0; i < GDC; ++i) {
            const float vn = Vn[i * 32 + lane];
#pragma unroll
            for (int m = 0; m < 16; m += 4) {
                const float4 k4 = *reinterpret_cast<const float4 *>(Kd + i * GDC_DK + 16 * w + m);
                acc[m] = fmaf(k4.x, vn, acc[m]);
                acc[m + 1] = fmaf(k4.y, vn, acc[m + 1]);
                acc[m + 2] = fmaf(k4.z, vn, acc[m + 2]);
                acc[m + 3] = fmaf(k4.w, vn, acc[m + 3]);
            }
        }
#pragma unroll
        for (int m = 0; m < 16; ++m) S[(16 * w + m) * 32 + lane] = acc[m];
        __syncthreads();
    }
    for (int r = w; r < dk; r += 8)
        if (jok) st[(long long)r * dv + j] = S[r * 32 + lane];
}
// Grid (ceil(dv / 32), n_v_heads, chunks of the span), 256 threads: chunk c's outputs at value
// head h, columns j0 + lane, rows w + 8 m: (e^(G_i) q_i) S0 summed over the state's rows, then
// the decayed q.k times the deltas. Dynamic shared memory (72 KB): S0 [GDC_DK][32], Qg
// [GDC][GDC_DK], QK [GDC][GDC], Vn [GDC][32], G [GDC].
extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_out(const float *qs, const float *hs, const float *uu, const float *qk, const float *gc, int t0,
                  int t_len, int nk, int nv, int dk, int dv, float *out) {
    extern __shared__ __align__(16) float sm[];
    float *S = sm;
    float *Qg = S + GDC_DK * 32;
    float *QKs = Qg + GDC * GDC_DK;
    float *Vn = QKs + GDC * GDC;
    float *Gs = Vn + GDC * 32;
    const int c = blockIdx.z, h = blockIdx.y, hk = h / (nv / nk);
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int j = blockIdx.x * 32 + lane;
    const bool jok = j < dv;
    const int tb = t0 + c * GDC;
    const int n = min(GDC, t_len - tb);
    const long long ch = (long long)c * nv + h;
    gdc_load_rows(Qg, qs + ((long long)c * nk + hk) * GDC * GDC_DK, tid);
    for (int e = tid; e < GDC * GDC / 4; e += 256) gdc_cp16(QKs + 4 * e, qk + ch * GDC * GDC + 4 * e);
    gdc_commit();
    if (tid < GDC) Gs[tid] = gc[ch * GDC + tid];
    for (int r = w; r < GDC_DK; r += 8) S[r * 32 + lane] = jok && r < dk ? hs[(ch * dk + r) * dv + j] : 0.0f;
#pragma unroll
    for (int m = 0; m < 8; ++m) Vn[(w + 8 * m) * 32 + lane] = jok ? uu[(ch * GDC + w + 8 * m) * dv + j] : 0.0f;
    gdc_wait_all();
    __syncthreads();
    for (int e = tid; e < GDC * GDC_DK; e += 256) Qg[e] *= expf(Gs[e / GDC_DK]);
    __syncthreads();
    float o[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) o[m] = 0.0f;
    gdc_rows_times<GDC_DK, GDC_DK>(Qg, S, w, lane, o);
    // Sum over l <= i of QK[i][l] Vn[l] (QK is zero past the diagonal).
    gdc_rows_times<GDC, GDC>(QKs, Vn, w, lane, o);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        const int i = w + 8 * m;
        if (jok && i < n) out[((long long)(tb + i) * nv + h) * dv + j] = o[m];
    }
}

// A hint to the L2: bring up to 6 byte ranges in (the weights the next kernels will stream,
// issued while latency-bound kernels leave the memory idle). No results; nothing reads them
// through this kernel. Starts are 16-byte aligned (device allocations are); a tail of the range
// under 16 bytes is left out. sm_90: bulk prefetches of up to 32 KiB pieces through the copy
// engine, round-robin over the threads; older devices: one line prefetch per 128 bytes.
// Launched on a stream of its own, beside the ops (one multiprocessor issues bulk prefetches
// at only a few hundred GB/s: the launch spreads them over one warp per MiB).
#define L2PF_PIECE 32768
extern "C" __global__ void l2_prefetch(const char *p0, long long n0, const char *p1, long long n1, const char *p2, long long n2,
                                       const char *p3, long long n3, const char *p4, long long n4, const char *p5, long long n5) {
    const char *ps[6] = {p0, p1, p2, p3, p4, p5};
    const long long ns[6] = {n0, n1, n2, n3, n4, n5};
    const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x, nth = (long long)gridDim.x * blockDim.x;
#pragma unroll
    for (int r = 0; r < 6; ++r) {
        const long long n = ns[r] & ~15LL;
        if (ps[r] == nullptr || n <= 0) continue;
#if __CUDA_ARCH__ >= 900
        for (long long off = tid * L2PF_PIECE; off < n; off += nth * L2PF_PIECE) {
            const unsigned sz = (unsigned)min((long long)L2PF_PIECE, n - off);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ps[r] + off), "r"(sz) : "memory");
        }
#else
        for (long long off = tid * 128; off < n; off += nth * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(ps[r] + off));
#endif
    }
}

// Deterministic pseudo-random fills (benchmarks build large random weights on the device).
__device__ __forceinline__ u32 hash_u32(u64 x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return (u32)x;
}
__device__ __forceinline__ float hash_unit(u64 seed, long long i) {  // uniform in [-1, 1)
    return (float)(hash_u32(seed * 0x9e3779b97f4a7c15ULL + (u64)i) >> 8) * (2.0f / 16777216.0f) - 1.0f;
}
extern "C" __global__ void fill_random_u32(u32 *p, long long n, unsigned long long seed) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        p[i] = hash_u32(seed * 0x9e3779b97f4a7c15ULL + (u64)i);
}
// bf16 (f16 = 0) or f16 (f16 = 1) bit patterns of uniform(-amp, amp).
extern "C" __global__ void fill_random_half(u16 *p, long long n, unsigned long long seed, float amp, int f16) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float v = hash_unit(seed, i) * amp;
        if (f16) {
            unsigned short h;
            asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
            p[i] = h;
        } else {
            p[i] = (u16)(pack_bf16x2(v, 0.0f) & 0xffffu);
        }
    }
}
extern "C" __global__ void fill_random_f32(float *p, long long n, unsigned long long seed, float amp) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        p[i] = hash_unit(seed, i) * amp;
}
