// A persistent, warp-specialized DFlash draft step at the Qwen3-8B-DFlash-b16 shape (q8_0
// weights on the int8 tensor cores, f16 draft K / V cache), to measure whether keeping the
// weight stream running through the step's latency-bound phases reaches the 1.3x-floor goal
// that the launch-per-op step (xtask bench gpu) misses (bench-gpu.md, "What a persistent layer
// kernel could reach").
//
// One block per SM for the whole step. Warp 8 of each block is a producer: it walks a host-built
// list of the block's weight chunks (every matmul of every layer, then the lm_head) and its lane
// 0 streams them with TMA bulk copies into a ring of shared-memory slots, held back only by free
// slots, never by the data dependencies. Warps 0-7 are the consumers: they run the step's phases
// (embedding + norm, q/k/v, attention, o + residual + norm, gate / up + SiLU, down + residual +
// norm, ..., lm_head + argmax) separated by grid barriers, taking the weight chunks from the ring
// in the same order (each warp a slice of every chunk; PAIR: two chunks per wait). So while the
// consumers sit in a barrier, a norm or the attention, the ring fills with the next projection's
// weights.
//
// The activations reach each matmul as q8_0 codes in mma fragment order: an RMSNorm is factored
// (codes of x * w per 32-block, the row's 1 / rms applied to the matmul's result), so the
// producer of x (the o / down epilogue, 32 columns per block) writes the codes and a sum of
// squares per row and column group, and the consumer sums those partials. The attention is one
// item per (q head, key split) on the f16 tensor cores; the last split of a head to finish
// merges the four and writes the o projection's codes.
//
// Checked against a naive reference (one kernel per op, plain loops, the same quantization
// rules) on the same random weights: final residual stream, logits, argmax and the block's K / V
// rows in the cache. Timed beside the copy bandwidth measured in the same run (the floor =
// weight + K / V bytes over it).
//
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90a -o persistent_step persistent_step.cu
// && ./persistent_step [ctx [iters [layers]]] (layers < 5: the check over the first layers only).
//
// Measured (docs/bench-gpu-log.md, thirty-seventh to thirty-ninth sessions, H100 80GB HBM3):
// the check passes (x 4.3e-3 after one layer, 2.0e-2 after five, each within the network's own
// sensitivity to a 1e-4 input noise, 4.9e-3 / 2.0e-2; argmax 16/16). The step: 0.839-0.874 ms
// with the first producer (a descriptor walk with integer divisions per chunk: the producer
// thread bound the stream), 0.784 ms with the host-built chunk list, 0.768 with PAIR, 0.741 with
// the merge's loads in one round trip and each unit's descriptor loaded a unit ahead, against
// the library's launch-per-op step's 0.704 ms on the same lease (floor 0.558-0.560 ms). The
// ablations printed after the check (this build): no mma 0.717, no weight copies 0.683, no
// attention 0.690, the consumers' ring protocol, epilogues, attention and barriers alone (no
// bytes, no mmas) 0.493 ms. CHKB=64 (17 KB bulk copies) takes the last to 0.379 ms but the step
// to 0.759 (PAIR) / 0.752 (PAIR=0): its consumers cheaper, its stream no better covered. An
// owner-warp-per-chunk version (git 15c24dc: per-warp sub-rings) measured 1.141 ms with 4.3 KB
// chunks and 0.762 ms with 8.7 KB ones (-DCHKB=32 -DSUBSLOTS=2, whose check fails: not chased).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ck.cuh"

// ---------------------------------------------------------------------------------------------
// Shape (Qwen3-8B-DFlash-b16 drafter) and kernel geometry.
constexpr int H = 4096, NH = 32, NKV = 8, HD = 128, INTER = 12288, NL = 5, VOCAB = 151936;
constexpr int R = 16;                         // block rows
constexpr int QKV_N = H + 2 * NKV * HD;       // 6144
constexpr int KB_BYTES = 272;                 // one q8_0 k-block of an 8-column tile: 256 B codes + 8 f16 scales
#ifndef CHKB
#define CHKB 32
#endif
constexpr int CH_KB = CHKB;                   // k-blocks per ring chunk (one TMA bulk copy; 32 or 64)
constexpr int CH_BYTES = CH_KB * KB_BYTES;    // 8704 (32)
constexpr int NSLOT = 130560 / CH_BYTES;      // ring slots (~130 KB of ring at either size)
constexpr int NCW = 8;                        // consumer warps
constexpr int NTHR = (NCW + 1) * 32;          // + the producer warp
constexpr int GROUPS = H / 32;                // 128 column groups of the residual stream
constexpr float EPS = 1e-6f;
constexpr float THETA = 1000000.0f;
constexpr int SPL = 144;                      // keys per attention split (<= 576 keys in 4 splits)
#ifndef PAIR
#define PAIR 1                                // consumers take two ring chunks per wait (K = 4096 tiles)
#endif

// Shared memory: the ring, then a work area used by the matmul phases (resident A codes +
// scales, the cross-warp reduction scratch, a group buffer) or by the attention (K, V, q, S, P).
constexpr int A_CODES = (H / 32) * 512;       // 65536
constexpr int A_SCALES = (H / 32) * R * 4;    // 8192
constexpr int SCRATCH = 16384;
constexpr int GBUF = 8 * R * 8 * 4;           // 4096
constexpr int KROW = 272;                     // padded f16 row of 128 (bank-conflict free B loads)
constexpr int PROW = SPL + 8;                 // P row (halves)
constexpr int ATT_BYTES = 2 * SPL * KROW + R * KROW + R * SPL * 4 + R * PROW * 2;
constexpr int MM_BYTES = A_CODES + A_SCALES + SCRATCH + GBUF + 64;
constexpr int WORK = ATT_BYTES > MM_BYTES ? ATT_BYTES : MM_BYTES;
constexpr int RING = NSLOT * CH_BYTES;
constexpr int SMEM = RING + ((WORK + 15) / 16) * 16 + 2 * NSLOT * 8 + 16;

// Phases: 0 = embedding; per layer l: 1+5l qkv, 2+5l attention, 3+5l o, 4+5l gate/up,
// 5+5l down; 26 = lm_head.
enum Kind { K_EMB, K_QKV, K_ATT, K_O, K_GU, K_DOWN, K_LM };
constexpr int NPH = 2 + 5 * NL;
__host__ __device__ inline int phase_kind(int p) {
    if (p == 0) return K_EMB;
    if (p == NPH - 1) return K_LM;
    return K_QKV + (p - 1) % 5;
}

// Matrices: per layer qkv, o, gate, up, down; then the lm_head.
enum { M_QKV, M_O, M_G, M_U, M_D, M_PER };
constexpr int NMAT = NL * M_PER + 1;
struct Mat {
    const uint8_t *w;
    int K, N;
};
// One unit of a matmul phase: ntiles 8-column tiles from `mat` (and as many from mat2, the up
// projection of a gate / up group), starting at tile `tile`; kc-major = all tiles advance
// through K together (the down projection, whose A does not fit the work area).
struct Desc {
    uint16_t mat, mat2;
    uint16_t ntiles, kcmajor;
    uint32_t tile, grp;
};

struct Params {
    Mat mats[NMAT];
    const Desc *descs;
    const int *dstart;           // [nblk][NPH + 1]
    const uint8_t *const *csrc;  // every block's chunk sources in stream order (host-built)
    const int *cstart;           // [nblk][NPH + 1]: each phase's first chunk in csrc
    const __nv_bfloat16 *emb;    // [vocab_rows][H]
    const int *ids;              // [R]
    const float *norm_in;        // [NL + 1][H]: input norms of the layers, then the final norm
    const float *norm_post;      // [NL][H]
    const float *qn, *kn;        // [NL][HD]
    __half *kc, *vc;             // [NL][NKV][cap][HD]
    int cap, ctx;
    float *x;                    // [R][H] residual stream
    float *qkv;                  // [R][QKV_N]
    uint8_t *nA;                 // norm codes [H/32][512]
    float *nS;                   // [H/32][R]
    float *sumsq;                // [GROUPS][R]
    uint8_t *aA;                 // attention output codes [H/32][512]
    float *aS;
    uint8_t *mA;                 // SiLU product codes [INTER/32][512]
    float *mS;
    float *opart;                // [NH][nspl][R][HD]
    float *mlpart;               // [NH][nspl][R][2]
    float *argpart;              // [nblk][R][2] (value, index as float bits)
    unsigned *ctrl;              // [0] grid barrier, [1] argmax counter, [2..2+NH) attention counters
    int *out_ids;                // [R]
    float *logits;               // [R][VOCAB] or null
    unsigned long long *trace;   // or null: [nblk][NPH + 1] barrier release times (ns), then
                                 // [nblk][NPH] cycles the producer waited for a free slot
    int nl_run;                  // layers run (the rest skipped; a correctness knob)
    int mode;                    // ablation (timing only): 0 full, 1 consumers skip the mmas, 2 the
                                 // producer copies nothing (arrives only), 3 no attention, 4 barriers only,
                                 // 5 = 1 and 2 (the ring protocol and the epilogues)
    unsigned epoch;
};

// ---------------------------------------------------------------------------------------------
// PTX helpers.
__device__ __forceinline__ unsigned smem_u32(const void *p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t *b, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t *b, unsigned tx) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(tx) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *b, unsigned parity) {
    unsigned ok = 0;
    while (!ok) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(ok)
            : "r"(smem_u32(b)), "r"(parity)
            : "memory");
    }
}
__device__ __forceinline__ void bulk_g2s(void *dst, const void *src, unsigned bytes, uint64_t *bar, uint64_t policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
            smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
        : "memory");
}
__device__ __forceinline__ void cp16(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void cp_wait_dyn(int n) {
    if (n <= 0) cp_wait<0>();
    else if (n == 1) cp_wait<1>();
    else if (n == 2) cp_wait<2>();
    else cp_wait<3>();
}
__device__ __forceinline__ void cbar() { asm volatile("bar.sync 1, 256;" ::: "memory"); }
__device__ __forceinline__ unsigned long long gtime() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void mma_s8(int c[4], const uint4 a, const uint2 b) {
    asm(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y), "r"(0), "r"(0), "r"(0), "r"(0));
}
__device__ __forceinline__ void mma_f16(float d[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of activation code (row r, column c of its 32-block) inside the block's 512 bytes
// (m16n8k32 A fragment order: lane (r & 7) * 4 + (c & 15) / 4 holds 16 bytes: rows r, r + 8 for
// columns 0-15, then the same rows for 16-31).
__host__ __device__ inline int a_off(int r, int c) {
    const int lane = (r & 7) * 4 + ((c & 15) >> 2);
    const int reg = (r >> 3) + 2 * (c >> 4);
    return lane * 16 + reg * 4 + (c & 3);
}
// Byte offset of weight code (column n of the 8-column tile, k of its 32-block) inside the
// k-block's 256 code bytes (m16n8k32 B fragment: lane n * 4 + (k & 15) / 4 holds k and k + 16).
__host__ __device__ inline int w_off(int n, int k) { return (n * 4 + ((k & 15) >> 2)) * 8 + (k >> 4) * 4 + (k & 3); }

// q8_0 rule shared by both paths: d = amax / 127, code = round-to-nearest-even(v / d).
__device__ __forceinline__ int q8_code(float v, float d) { return d > 0.f ? __float2int_rn(v / d) : 0; }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---------------------------------------------------------------------------------------------
// The consumers' pieces.
// Grid barrier over the consumers of every block (the producers never wait on it).
__device__ __forceinline__ void grid_sync(unsigned *bar, unsigned target) {
    cbar();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(bar, 1u);
        while (ld_acquire(bar) < target) __nanosleep(20);
        __threadfence();
    }
    cbar();
}

// 1 / rms of each row from the residual producers' partial sums of squares (fixed order, so
// every block gets the same bits). rinv[16] in shared memory.
__device__ void compute_rinv(const float *sumsq, float *rinv) {
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = w * 2; r < w * 2 + 2; ++r) {
        float s = 0.f;
        for (int g = lane; g < GROUPS; g += 32) s += __ldcg(sumsq + g * R + r);
        s = warp_sum(s);
        if (lane == 0) rinv[r] = rsqrtf(s / (float)H + EPS);
    }
}

// Copy nkb k-blocks of A codes and scales from global into the work area.
__device__ void load_a(uint8_t *codes, float *scales, const uint8_t *gA, const float *gS, int kb0, int nkb) {
    const int tid = threadIdx.x;
    const uint8_t *src = gA + (size_t)kb0 * 512;
    for (int i = tid; i < nkb * 32; i += 256) cp16(codes + i * 16, src + (size_t)i * 16);
    const uint8_t *ss = (const uint8_t *)(gS + (size_t)kb0 * R);
    for (int i = tid; i < nkb * 4; i += 256) cp16((uint8_t *)scales + i * 16, ss + (size_t)i * 16);
    cp_commit();
}

// The q8 rule over one row of 32 columns held by a warp (lane = column): codes into the
// fragment layout of k-block kb, the scale into S[kb][r].
__device__ __forceinline__ void quant_row32(float v, int r, int kb, uint8_t *gA, float *gS) {
    const int lane = threadIdx.x & 31;
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.f;
    gA[(size_t)kb * 512 + a_off(r, lane)] = (uint8_t)(int8_t)q8_code(v, d);
    if (lane == 0) gS[(size_t)kb * R + r] = d;
}

// Residual epilogue of a 32-column group: x += y (y null: x = the embedding rows), then the
// factored norm's codes of x * w and the rows' sums of squares.
__device__ void resid_norm(const Params &P, const float *y /*smem [16][32] or null*/, int grp, const float *wn,
                           const __nv_bfloat16 *emb_rows) {
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = grp * 32 + lane;
    for (int r = w * 2; r < w * 2 + 2; ++r) {
        float xn;
        if (emb_rows) {
            const int id = P.ids[r];
            xn = __bfloat162float(P.emb[(size_t)id * H + c]);
        } else {
            xn = __ldcg(P.x + r * H + c) + y[r * 32 + lane];
        }
        __stcg(P.x + r * H + c, xn);
        quant_row32(xn * wn[c], r, grp, P.nA, P.nS);
        const float ss = warp_sum(xn * xn);
        if (lane == 0) P.sumsq[grp * R + r] = ss;
    }
}

// One 8-column tile's k-blocks [kc * 32, kc * 32 + 32) from ring chunk `chunk`: warp w takes
// 4 of them. Ascale / Acodes index k-blocks relative to `a_kb0`.
__device__ __forceinline__ void mma_chunk(float acc[4], const uint8_t *chunk, const uint8_t *Acodes,
                                          const float *Ascale, int kb_rel0) {
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < CH_KB / NCW; ++j) {
        const int kbl = w * (CH_KB / NCW) + j;
        const int kb = kb_rel0 + kbl;
        const uint4 a = *(const uint4 *)(Acodes + kb * 512 + lane * 16);
        const uint8_t *blk = chunk + kbl * KB_BYTES;
        const uint2 b = *(const uint2 *)(blk + lane * 8);
        const __half2 sw = *(const __half2 *)(blk + 256 + t * 4);
        const float sw0 = __low2float(sw), sw1 = __high2float(sw);
        const float sa0 = Ascale[kb * R + g], sa1 = Ascale[kb * R + g + 8];
        int c[4];
        mma_s8(c, a, b);
        acc[0] = fmaf((float)c[0], sa0 * sw0, acc[0]);
        acc[1] = fmaf((float)c[1], sa0 * sw1, acc[1]);
        acc[2] = fmaf((float)c[2], sa1 * sw0, acc[2]);
        acc[3] = fmaf((float)c[3], sa1 * sw1, acc[3]);
    }
}

// Fragment position of (row, col) of a 16 x 8 C tile: lane * 4 + register.
__device__ __forceinline__ int c_pos(int row, int col) {
    return ((row & 7) * 4 + (col >> 1)) * 4 + (row >> 3) * 2 + (col & 1);
}

// Sum the 8 warps' fragments of one tile (scratch[w][128]); threads 0..127 get (row i >> 3,
// col i & 7). Caller: cbar() between the writes and this read.
__device__ __forceinline__ float reduce_tile(const float *scratch) {
    const int i = threadIdx.x;
    const int p = c_pos(i >> 3, i & 7);
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < NCW; ++w) s += scratch[w * 128 + p];
    return s;
}

struct Ring {
    uint8_t *base;
    uint64_t *full, *empty;
    unsigned idx;
    __device__ __forceinline__ const uint8_t *wait(unsigned ahead = 0) {
        const unsigned i = idx + ahead, slot = i % NSLOT;
        mbar_wait(full + slot, (i / NSLOT) & 1);
        return base + slot * CH_BYTES;
    }
    __device__ __forceinline__ void release() {
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbar_arrive(empty + idx % NSLOT);
        ++idx;
    }
};

// ---------------------------------------------------------------------------------------------
// The context K / V rows of a (q head, key split) item into the work area (cp.async, one
// commit group; they do not depend on this step, so a block issues them before the barrier
// that opens the attention phase), and zeros in the V rows past the split's end (P is 0 there,
// but 0 * NaN is not).
__device__ void attention_load(const Params &P, int layer, int h, int s, uint8_t *work) {
    const int kvh = h / (NH / NKV);
    const int nkeys = P.ctx + R;
    const int k0 = s * SPL, k1 = min(nkeys, k0 + SPL);
    const int nk = k1 - k0;
    uint8_t *Ks = work, *Vs = work + SPL * KROW;
    const size_t cbase = ((size_t)layer * NKV + kvh) * P.cap;
    const int kc_end = min(k1, P.ctx);
    for (int i = threadIdx.x; i < (kc_end - k0) * 16; i += 256) {
        const int key = i >> 4, piece = i & 15;
        cp16(Ks + key * KROW + piece * 16, P.kc + (cbase + k0 + key) * HD + piece * 8);
        cp16(Vs + key * KROW + piece * 16, P.vc + (cbase + k0 + key) * HD + piece * 8);
    }
    cp_commit();
    for (int i = threadIdx.x; i < (SPL - nk) * 64; i += 256) {
        const int key = nk + (i >> 6), word = i & 63;
        ((unsigned *)(Vs + key * KROW))[word] = 0u;
    }
}

// Attention trace marks (block 0's first item of each layer): P.trace + atrace_off, 8 per layer.
#define ATS(k)                                                                                  \
    do {                                                                                        \
        if (P.trace && blockIdx.x == 0 && h == 0 && s == 0 && threadIdx.x == 0)                 \
            P.trace[(size_t)gridDim.x * (2 * NPH + 1) + layer * 8 + (k)] = gtime();             \
    } while (0)
// The attention of one (q head, key split) item, its K / V loads issued (attention_load).
__device__ void attention_item(const Params &P, int layer, int h, int s, int nspl, uint8_t *work) {
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int kvh = h / (NH / NKV);
    const int nkeys = P.ctx + R;
    const int k0 = s * SPL, k1 = min(nkeys, k0 + SPL);
    const int nk = k1 - k0;
    uint8_t *Ks = work, *Vs = work + SPL * KROW, *Qs = work + 2 * SPL * KROW;
    float *S = (float *)(Qs + R * KROW);
    __half *Ps = (__half *)(S + R * SPL);
    const size_t cbase = ((size_t)layer * NKV + kvh) * P.cap;
    // q of this head and, where the split holds block keys, the block's k / v: RMSNorm per
    // head, NeoX RoPE at position ctx + r; q also scaled by log2(e) / sqrt(HD).
    const float qscale = 1.4426950408889634f / sqrtf((float)HD);
    // Every value this warp needs first (one L2 round trip), then the arithmetic.
    float vv[2][3][4];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int r = w * 2 + rr, pos = P.ctx + r;
        const bool blk_in = pos >= k0 && pos < k1;
#pragma unroll
        for (int which = 0; which < 3; ++which) {
            const int col0 = which == 0 ? h * HD : (which == 1 ? H + kvh * HD : H + NKV * HD + kvh * HD);
#pragma unroll
            for (int j = 0; j < 4; ++j)
                vv[rr][which][j] = which == 0 || blk_in ? __ldcg(P.qkv + r * QKV_N + col0 + lane + 32 * j) : 0.f;
        }
    }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int r = w * 2 + rr, pos = P.ctx + r;
        const bool blk_in = pos >= k0 && pos < k1;
#pragma unroll
        for (int which = 0; which < 3; ++which) {
            if (which > 0 && !blk_in) continue;
            float *v = vv[rr][which];
            if (which < 2) {
                const float *nw = (which == 0 ? P.qn : P.kn) + layer * HD;
                const float ss = warp_sum(v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3]);
                const float ri = rsqrtf(ss / (float)HD + EPS);
#pragma unroll
                for (int j = 0; j < 4; ++j) v[j] = v[j] * ri * nw[lane + 32 * j];
                float o[4];
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int i = lane + 32 * j;  // pair (i, i + 64)
                    const float f = powf(THETA, -2.0f * (float)i / (float)HD);
                    float sn, cs;
                    sincosf((float)pos * f, &sn, &cs);
                    o[j] = v[j] * cs - v[j + 2] * sn;
                    o[j + 2] = v[j + 2] * cs + v[j] * sn;
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) v[j] = o[j];
            }
            if (which == 0) {
#pragma unroll
                for (int j = 0; j < 4; ++j) ((__half *)(Qs + r * KROW))[lane + 32 * j] = __float2half_rn(v[j] * qscale);
            } else {
                uint8_t *dst = (which == 1 ? Ks : Vs) + (pos - k0) * KROW;
                __half *cache = (which == 1 ? P.kc : P.vc) + (cbase + pos) * HD;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const __half hv = __float2half_rn(v[j]);
                    ((__half *)dst)[lane + 32 * j] = hv;
                    if (h % (NH / NKV) == 0) cache[lane + 32 * j] = hv;
                }
            }
        }
    }
    ATS(0);
    cp_wait<0>();
    cbar();
    ATS(1);
    // S = q K^T over the split's keys: warp w takes 8-key tiles w, w + 8, ...
    unsigned qa[8][4];
    for (int ks = 0; ks < 8; ++ks) {
        const __half *q0 = (const __half *)(Qs + g * KROW) + ks * 16 + 2 * t;
        const __half *q1 = (const __half *)(Qs + (g + 8) * KROW) + ks * 16 + 2 * t;
        qa[ks][0] = *(const unsigned *)q0;
        qa[ks][1] = *(const unsigned *)q1;
        qa[ks][2] = *(const unsigned *)(q0 + 8);
        qa[ks][3] = *(const unsigned *)(q1 + 8);
    }
    for (int kt = w; kt * 8 < nk; kt += NCW) {
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        const __half *krow = (const __half *)(Ks + (kt * 8 + g) * KROW);
        for (int ks = 0; ks < 8; ++ks) {
            const unsigned b0 = *(const unsigned *)(krow + ks * 16 + 2 * t);
            const unsigned b1 = *(const unsigned *)(krow + ks * 16 + 8 + 2 * t);
            mma_f16(d, qa[ks], b0, b1);
        }
        for (int j = 0; j < 4; ++j) {
            const int row = g + 8 * (j >> 1), key = kt * 8 + 2 * t + (j & 1);
            S[row * SPL + key] = key < nk ? d[j] : -INFINITY;
        }
    }
    cbar();
    ATS(2);
    // Softmax pieces per row (warp w: rows 2w, 2w + 1); P in f16, l summed from the f16 P.
    float mrow[2], lrow[2];
    for (int rr = 0; rr < 2; ++rr) {
        const int r = w * 2 + rr;
        const int nt = ((nk + 15) / 16) * 16;
        float m = -INFINITY;
        for (int k = lane; k < nk; k += 32) m = fmaxf(m, S[r * SPL + k]);
        m = warp_max(m);
        float l = 0.f;
        for (int k = lane; k < nt; k += 32) {
            const __half p = __float2half_rn(k < nk ? exp2f(S[r * SPL + k] - m) : 0.f);
            Ps[r * PROW + k] = p;
            l += __half2float(p);
        }
        mrow[rr] = m;
        lrow[rr] = warp_sum(l);
    }
    cbar();
    ATS(3);
    // O = P V: warp w takes output dims 16w .. 16w + 15 (two 8-wide n tiles).
    float o[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    const int nks = (nk + 15) / 16;
    for (int ks = 0; ks < nks; ++ks) {
        unsigned pa[4];
        const __half *p0 = Ps + g * PROW + ks * 16 + 2 * t;
        const __half *p1 = Ps + (g + 8) * PROW + ks * 16 + 2 * t;
        pa[0] = *(const unsigned *)p0;
        pa[1] = *(const unsigned *)p1;
        pa[2] = *(const unsigned *)(p0 + 8);
        pa[3] = *(const unsigned *)(p1 + 8);
        for (int nt = 0; nt < 2; ++nt) {
            const int dim = w * 16 + nt * 8 + g;
            const __half *v0 = (const __half *)(Vs + (ks * 16 + 2 * t) * KROW) + dim;
            __half2 b0h = __halves2half2(v0[0], *(v0 + KROW / 2));
            __half2 b1h = __halves2half2(*(v0 + 8 * KROW / 2), *(v0 + 9 * KROW / 2));
            mma_f16(o[nt], pa, *(unsigned *)&b0h, *(unsigned *)&b1h);
        }
    }
    // Partial out.
    const size_t pb = ((size_t)h * nspl + s) * R;
    for (int nt = 0; nt < 2; ++nt)
        for (int j = 0; j < 4; ++j) {
            const int row = g + 8 * (j >> 1), dim = w * 16 + nt * 8 + 2 * t + (j & 1);
            P.opart[(pb + row) * HD + dim] = o[nt][j];
        }
    if (lane == 0)
        for (int rr = 0; rr < 2; ++rr) {
            P.mlpart[(pb + w * 2 + rr) * 2 + 0] = mrow[rr];
            P.mlpart[(pb + w * 2 + rr) * 2 + 1] = lrow[rr];
        }
    // The last split of this head merges all of them and writes the o projection's codes.
    __shared__ unsigned last;
    ATS(4);
    cbar();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned target = (P.epoch * NL + layer + 1) * (unsigned)nspl;
        last = atomicAdd(P.ctrl + 2 + h, 1u) == target - 1;
        __threadfence();
    }
    cbar();
    ATS(5);
    if (!last) return;
    // Merge (nspl <= 4 splits at the contexts this prototype runs): every load of the warp's
    // 8 (row, quarter) pieces first (one L2 round trip), then the arithmetic.
    constexpr int NPI = R * 4 / NCW;
    float mm[NPI][4], ll[NPI][4], oo[NPI][4];
#pragma unroll
    for (int q = 0; q < NPI; ++q) {
        const int pi = w + q * NCW, r = pi >> 2, dim = (pi & 3) * 32 + lane;
#pragma unroll
        for (int ss = 0; ss < 4; ++ss) {
            const size_t b = ((size_t)h * nspl + ss) * R + r;
            const bool on = ss < nspl;
            mm[q][ss] = on ? __ldcg(P.mlpart + b * 2) : -INFINITY;
            ll[q][ss] = on ? __ldcg(P.mlpart + b * 2 + 1) : 0.f;
            oo[q][ss] = on ? __ldcg(P.opart + b * HD + dim) : 0.f;
        }
    }
#pragma unroll
    for (int q = 0; q < NPI; ++q) {
        const int pi = w + q * NCW, r = pi >> 2, kq = pi & 3;
        float M = -INFINITY;
#pragma unroll
        for (int ss = 0; ss < 4; ++ss) M = fmaxf(M, mm[q][ss]);
        float num = 0.f, den = 0.f;
#pragma unroll
        for (int ss = 0; ss < 4; ++ss) {
            const float sc = ss < nspl ? exp2f(mm[q][ss] - M) : 0.f;
            num += sc * oo[q][ss];
            den += sc * ll[q][ss];
        }
        quant_row32(num / den, r, h * 4 + kq, P.aA, P.aS);
    }
    ATS(6);
}

// ---------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(NTHR, 1) step_kernel(const Params P) {
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t *ring = smem;
    uint8_t *work = smem + RING;
    uint64_t *full = (uint64_t *)(work + ((WORK + 15) / 16) * 16);
    uint64_t *empty = full + NSLOT;
    const int nblk = gridDim.x, b = blockIdx.x;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int *ds = P.dstart + b * (NPH + 1);
    if (threadIdx.x == 0) {
        for (int i = 0; i < NSLOT; ++i) {
            mbar_init(full + i, 1);
            mbar_init(empty + i, NCW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (w == NCW) {
        // Producer: every chunk of this block's schedule, in the consumers' order. The warp
        // reads 32 chunk sources at a time, lane 0 issues them.
        if (P.mode == 4) return;
        uint64_t policy;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        const int *cs = P.cstart + b * (NPH + 1);
        const int c0 = cs[0], c1 = cs[NPH];
        int ph = 0, next_ph = cs[1];
        unsigned long long stall = 0;
        for (int base = c0; base < c1; base += 32) {
            const uint8_t *mine = base + lane < c1 ? P.csrc[base + lane] : nullptr;
            const int n = min(32, c1 - base);
            for (int j = 0; j < n; ++j) {
                const uint8_t *src = (const uint8_t *)__shfl_sync(0xffffffffu, (unsigned long long)mine, j);
                if (lane == 0) {
                    const int ci = base + j;
                    while (ci >= next_ph) {
                        if (P.trace) P.trace[(size_t)nblk * (NPH + 1) + b * NPH + ph] = stall;
                        stall = 0;
                        ++ph;
                        next_ph = cs[ph + 1];
                    }
                    const unsigned idx = (unsigned)(ci - c0);
                    const unsigned slot = idx % NSLOT;
                    if (idx >= NSLOT) {
                        if (P.trace) {
                            const long long t0 = clock64();
                            mbar_wait(empty + slot, ((idx / NSLOT) - 1) & 1);
                            stall += clock64() - t0;
                        } else {
                            mbar_wait(empty + slot, ((idx / NSLOT) - 1) & 1);
                        }
                    }
                    if (P.mode == 2 || P.mode == 5) {
                        mbar_arrive(full + slot);
                    } else {
                        mbar_expect_tx(full + slot, CH_BYTES);
                        bulk_g2s(ring + slot * CH_BYTES, src, CH_BYTES, full + slot, policy);
                    }
                }
                __syncwarp();
            }
        }
        if (lane == 0)
            for (; ph < NPH; ++ph) {
                if (P.trace) P.trace[(size_t)nblk * (NPH + 1) + b * NPH + ph] = stall;
                stall = 0;
            }
        return;
    }

    // Consumers.
    const bool do_mma = P.mode != 1 && P.mode != 5;  // the ablations without the mmas skip them
    Ring rg{ring, full, empty, 0};
    uint8_t *Acodes = work;
    float *Ascale = (float *)(work + A_CODES);
    float *scratch = (float *)(work + A_CODES + A_SCALES);
    float *gbuf = scratch + SCRATCH / 4;
    float *rinv = gbuf + GBUF / 4;
    const int nkeys = P.ctx + R;
    const int nspl = (nkeys + SPL - 1) / SPL;
    float best = -INFINITY;
    int besti = 0;

    for (int p = 0; p < NPH; ++p) {
        if (p > 0 && p < NPH - 1 && (p - 1) / 5 >= P.nl_run) {
            grid_sync(P.ctrl, (P.epoch * (NPH - 1) + p) * (unsigned)nblk);
            continue;
        }
        if (P.mode == 4 || (P.mode == 3 && phase_kind(p) == K_ATT)) {
            if (p > 0) grid_sync(P.ctrl, (P.epoch * (NPH - 1) + p) * (unsigned)nblk);
            if (P.trace && threadIdx.x == 0) P.trace[b * (NPH + 1) + p] = gtime();
            continue;
        }
        if (p > 0 && phase_kind(p) == K_ATT && b < NH * nspl) {
            // This block's first attention item: its context K / V before the barrier.
            cbar();
            attention_load(P, (p - 1) / 5, b / nspl, b % nspl, work);
        }
        if (p > 0) grid_sync(P.ctrl, (P.epoch * (NPH - 1) + p) * (unsigned)nblk);
        if (P.trace && threadIdx.x == 0) P.trace[b * (NPH + 1) + p] = gtime();
        const int kind = phase_kind(p);
        const int layer = p == 0 ? 0 : (p - 1) / 5;
        if (kind == K_EMB) {
            for (int grp = b; grp < GROUPS; grp += nblk) resid_norm(P, nullptr, grp, P.norm_in, P.emb);
            continue;
        }
        if (kind == K_ATT) {
            for (int it = b; it < NH * nspl; it += nblk) {
                if (it != b) attention_load(P, layer, it / nspl, it % nspl, work);
                attention_item(P, layer, it / nspl, it % nspl, nspl, work);
                cbar();
            }
            continue;
        }
        if (ds[p] == ds[p + 1]) continue;
        // A matmul phase.
        const bool normed = kind == K_QKV || kind == K_GU || kind == K_LM;
        // A in 4 commit groups of 32 k-blocks (one ring chunk's k range each): the first tile
        // waits for each as it reaches it (a_left = groups not yet waited for).
        int a_left = 0;
        if (kind != K_DOWN) {
            const uint8_t *gA = kind == K_O ? P.aA : P.nA;
            const float *gS = kind == K_O ? P.aS : P.nS;
            for (int pc = 0; pc < 4; ++pc)
                load_a(Acodes + pc * 32 * 512, Ascale + pc * 32 * R, gA, gS, pc * 32, 32);
            a_left = 4;
        }
        if (normed) compute_rinv(P.sumsq, rinv);
        if (kind == K_DOWN) cbar();
        // Wait (block-wide) for A's k range of chunk kc.
        auto a_need = [&](int kc) {
            const int pc = (kc + 1) * CH_KB / 32 - 1;  // the last 32-block group chunk kc needs
            if (a_left > 3 - pc) {
                cp_wait_dyn(3 - pc);
                cbar();
                a_left = 3 - pc;
            }
        };
        int sb = 0;  // scratch double buffer
        // Each unit's descriptor loaded one unit ahead (off the tile's critical path).
        Desc dnext = P.descs[ds[p]];
        for (int di = ds[p]; di < ds[p + 1]; ++di) {
            const Desc d = dnext;
            if (di + 1 < ds[p + 1]) dnext = P.descs[di + 1];
            const Mat m = P.mats[d.mat];
            const int nkc = m.K / (32 * CH_KB);
            const int ntr = d.ntiles * (d.mat2 != 0xFFFF ? 2 : 1);
            if (!d.kcmajor) {
                for (int tr = 0; tr < ntr; ++tr) {
                    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#if PAIR
                    // Two chunks per wait: 8 independent mmas per warp in flight.
                    for (int kc = 0; kc < nkc; kc += 2) {
                        a_need(kc + 1);
                        const uint8_t *ch = rg.wait(), *ch2 = rg.wait(1);
                        if (do_mma) {
                            mma_chunk(acc, ch, Acodes, Ascale, kc * CH_KB);
                            mma_chunk(acc, ch2, Acodes, Ascale, (kc + 1) * CH_KB);
                        }
                        rg.release();
                        rg.release();
                    }
#else
                    for (int kc = 0; kc < nkc; ++kc) {
                        a_need(kc);
                        const uint8_t *ch = rg.wait();
                        if (do_mma) mma_chunk(acc, ch, Acodes, Ascale, kc * CH_KB);
                        rg.release();
                    }
#endif
                    float *sc = scratch + sb * (NCW * 128);
                    *(float4 *)(sc + w * 128 + lane * 4) = make_float4(acc[0], acc[1], acc[2], acc[3]);
                    cbar();
                    if (threadIdx.x < 128) {
                        const float v = reduce_tile(sc);
                        const int row = threadIdx.x >> 3, col = threadIdx.x & 7;
                        const int n = (d.tile + tr) * 8 + col;
                        if (kind == K_QKV) {
                            P.qkv[row * QKV_N + n] = v * rinv[row];
                        } else if (kind == K_LM) {
                            const float lg = v * rinv[row];
                            if (P.logits) P.logits[(size_t)row * VOCAB + n] = lg;
                            if (lg > best) {
                                best = lg;
                                besti = n;
                            }
                        } else {
                            gbuf[tr * 128 + row * 8 + col] = v;
                        }
                    }
                    sb ^= 1;
                }
            } else {
                // Down: all tiles through K together, A in 32-k-block chunks double-buffered.
                float acc[4][4] = {};
                const int kbc = CH_KB;
                load_a(Acodes, Ascale, P.mA, P.mS, 0, kbc);
                for (int kc = 0; kc < nkc; ++kc) {
                    const int cur = kc & 1;
                    if (kc + 1 < nkc) {
                        load_a(Acodes + (cur ^ 1) * (kbc * 512), Ascale + (cur ^ 1) * (kbc * R), P.mA, P.mS,
                               (kc + 1) * kbc, kbc);
                        cp_wait<1>();
                    } else {
                        cp_wait<0>();
                    }
                    cbar();
#pragma unroll
                    for (int tr = 0; tr < 4; ++tr) {
                        if (tr < ntr) {
                            const uint8_t *ch = rg.wait();
                            if (do_mma)
                                mma_chunk(acc[tr], ch, Acodes + cur * (kbc * 512), Ascale + cur * (kbc * R), 0);
                            rg.release();
                        }
                    }
                    cbar();
                }
#pragma unroll
                for (int tr = 0; tr < 4; ++tr)
                    if (tr < ntr)
                        *(float4 *)(scratch + tr * (NCW * 128) + w * 128 + lane * 4) =
                            make_float4(acc[tr][0], acc[tr][1], acc[tr][2], acc[tr][3]);
                cbar();
                if (threadIdx.x < 128)
                    for (int tr = 0; tr < ntr; ++tr) {
                        const int row = threadIdx.x >> 3, col = threadIdx.x & 7;
                        gbuf[tr * 128 + row * 8 + col] = reduce_tile(scratch + tr * (NCW * 128));
                    }
            }
            if (kind == K_QKV || kind == K_LM) continue;
            cbar();
            // Group epilogues over 32 columns (gbuf[tile][row][col]).
            if (kind == K_O || kind == K_DOWN) {
                float *y = scratch + (NCW * 128) * 2;  // [16][32] past the two tile buffers
                for (int i = threadIdx.x; i < R * 32; i += 256) {
                    const int r = i >> 5, c = i & 31;
                    y[i] = gbuf[(c >> 3) * 128 + r * 8 + (c & 7)];
                }
                cbar();
                const float *wn = kind == K_O ? P.norm_post + layer * H : P.norm_in + (layer + 1) * H;
                resid_norm(P, y, d.grp, wn, nullptr);
            } else {  // K_GU: m = silu(g) * u, quantized for the down projection
                for (int r = w * 2; r < w * 2 + 2; ++r) {
                    const int c = lane;
                    const float gv = gbuf[(c >> 3) * 128 + r * 8 + (c & 7)] * rinv[r];
                    const float uv = gbuf[(4 + (c >> 3)) * 128 + r * 8 + (c & 7)] * rinv[r];
                    const float mv = gv / (1.f + __expf(-gv)) * uv;
                    quant_row32(mv, r, d.grp, P.mA, P.mS);
                }
            }
            cbar();
        }
    }

    // Argmax over the vocabulary: rows' bests over this block's tiles, then across blocks by the
    // last block to finish.
    __shared__ unsigned lastb;
    if (threadIdx.x < 128) {
        for (int o = 1; o < 8; o <<= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, besti, o);
            if (ov > best || (ov == best && oi < besti)) {
                best = ov;
                besti = oi;
            }
        }
        if ((threadIdx.x & 7) == 0) {
            const int row = threadIdx.x >> 3;
            P.argpart[(b * R + row) * 2] = best;
            P.argpart[(b * R + row) * 2 + 1] = __int_as_float(besti);
        }
    }
    cbar();
    if (threadIdx.x == 0) {
        __threadfence();
        lastb = atomicAdd(P.ctrl + 1, 1u) == (P.epoch + 1) * (unsigned)nblk - 1;
        __threadfence();
    }
    cbar();
    if (P.trace && threadIdx.x == 0) P.trace[b * (NPH + 1) + NPH] = gtime();
    if (lastb && threadIdx.x < R) {
        const int row = threadIdx.x;
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int k = 0; k < nblk; ++k) {
            const float v = __ldcg(P.argpart + (k * R + row) * 2);
            const int i = __float_as_int(__ldcg(P.argpart + (k * R + row) * 2 + 1));
            if (v > bv || (v == bv && i < bi)) {
                bv = v;
                bi = i;
            }
        }
        P.out_ids[row] = bi;
    }
}

// ---------------------------------------------------------------------------------------------
// Random fills.
__device__ inline uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
__device__ inline float unif(uint64_t i, uint64_t seed) {  // [-1, 1)
    return (float)(mix((i + 1) * 0x9E3779B97F4A7C15ull ^ seed) >> 40) / 8388608.0f - 1.0f;
}
// A weight matrix in the stream layout: codes uniform in [-127, 127], scales sqrt(3 / K) / 127
// * (0.5 .. 1.5), so W has variance ~1 / K.
// ---------------------------------------------------------------------------------------------
// The naive reference: one kernel per op, row-major activations, the same quantization rules.
__device__ inline float w_at(const Mat &m, int n, int k) {
    const size_t tb = (size_t)(m.K / 32) * KB_BYTES;
    const uint8_t *blk = m.w + (size_t)(n / 8) * tb + (size_t)(k / 32) * KB_BYTES;
    return (float)(int8_t)blk[w_off(n % 8, k % 32)];
}
__device__ inline float ws_at(const Mat &m, int n, int kb) {
    const size_t tb = (size_t)(m.K / 32) * KB_BYTES;
    const uint8_t *blk = m.w + (size_t)(n / 8) * tb + (size_t)kb * KB_BYTES;
    return __half2float(((const __half *)(blk + 256))[n % 8]);
}
// codes[r][K], scales[r][K/32] row-major.
__global__ void ref_quant(const float *x, const float *wn, int K, int8_t *codes, float *scales) {
    const int r = blockIdx.y, kb = blockIdx.x, lane = threadIdx.x;
    const float v = x[r * K + kb * 32 + lane] * (wn ? wn[kb * 32 + lane] : 1.f);
    const float d = warp_max(fabsf(v)) / 127.f;
    codes[r * K + kb * 32 + lane] = (int8_t)q8_code(v, d);
    if (lane == 0) scales[r * (K / 32) + kb] = d;
}
__global__ void ref_rinv(const float *x, float *rinv) {
    const int r = blockIdx.x, lane = threadIdx.x;
    float s = 0.f;
    for (int g = 0; g < GROUPS; ++g) {
        const float v = x[r * H + g * 32 + lane];
        float ss = warp_sum(v * v);
        s += ss;  // the same per-group partials, summed in group order
    }
    if (lane == 0) rinv[r] = rsqrtf(s / (float)H + EPS);
}
// out[r][n] (+)= rinv[r] * sum_kb isum * (sa * sw)
__global__ void ref_matmul(const int8_t *codes, const float *scales, const float *rinv, Mat m, float *out, int ldo,
                           int add) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
    if (n >= m.N) return;
    float acc = 0.f;
    for (int kb = 0; kb < m.K / 32; ++kb) {
        int is = 0;
        for (int k = 0; k < 32; ++k) is += (int)codes[r * m.K + kb * 32 + k] * (int)w_at(m, n, kb * 32 + k);
        acc += (float)is * (scales[r * (m.K / 32) + kb] * ws_at(m, n, kb));
    }
    acc *= rinv ? rinv[r] : 1.f;
    if (add)
        out[r * ldo + n] += acc;
    else
        out[r * ldo + n] = acc;
}
__global__ void ref_embed(const __nv_bfloat16 *emb, const int *ids, float *x) {
    const int r = blockIdx.x;
    for (int c = threadIdx.x; c < H; c += blockDim.x) x[r * H + c] = __bfloat162float(emb[(size_t)ids[r] * H + c]);
}
// q / k norm + RoPE (f32), block K / V rows into the cache (f16).
__global__ void ref_qk(const float *qkv, const float *qn, const float *kn, int ctx, int cap, int layer, float *q,
                       __half *kc, __half *vc) {
    const int r = blockIdx.x, hh = blockIdx.y, lane = threadIdx.x;  // hh < NH: q head; else kv head hh - NH
    const bool isq = hh < NH;
    const int col0 = isq ? hh * HD : H + (hh - NH) * HD;
    float v[4];
    for (int j = 0; j < 4; ++j) v[j] = qkv[r * QKV_N + col0 + lane + 32 * j];
    const float *nw = isq ? qn : kn;
    const float ri = rsqrtf(warp_sum(v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3]) / (float)HD + EPS);
    for (int j = 0; j < 4; ++j) v[j] = v[j] * ri * nw[lane + 32 * j];
    const int pos = ctx + r;
    float o[4];
    for (int j = 0; j < 2; ++j) {
        const int i = lane + 32 * j;
        const float f = powf(THETA, -2.0f * (float)i / (float)HD);
        float sn, cs;
        sincosf((float)pos * f, &sn, &cs);
        o[j] = v[j] * cs - v[j + 2] * sn;
        o[j + 2] = v[j + 2] * cs + v[j] * sn;
    }
    if (isq) {
        for (int j = 0; j < 4; ++j) q[(r * NH + hh) * HD + lane + 32 * j] = o[j];
    } else {
        const int kvh = hh - NH;
        const size_t base = (((size_t)layer * NKV + kvh) * cap + pos) * HD;
        for (int j = 0; j < 4; ++j) {
            kc[base + lane + 32 * j] = __float2half_rn(o[j]);
            vc[base + lane + 32 * j] = __float2half_rn(qkv[r * QKV_N + H + NKV * HD + kvh * HD + lane + 32 * j]);
        }
    }
}
// Attention in f32 over the f16 cache (keys 0 .. ctx + 15, non-causal); one block per (row, head).
__global__ void ref_attn(const float *q, const __half *kc, const __half *vc, int ctx, int cap, int layer, float *out) {
    extern __shared__ float sc[];
    const int r = blockIdx.x, h = blockIdx.y, kvh = h / (NH / NKV);
    const int nk = ctx + R;
    const __half *K = kc + ((size_t)layer * NKV + kvh) * cap * HD;
    const __half *V = vc + ((size_t)layer * NKV + kvh) * cap * HD;
    const float *qq = q + (r * NH + h) * HD;
    for (int k = threadIdx.x; k < nk; k += blockDim.x) {
        float s = 0.f;
        for (int d = 0; d < HD; ++d) s += qq[d] * __half2float(K[(size_t)k * HD + d]);
        sc[k] = s / sqrtf((float)HD);
    }
    __syncthreads();
    __shared__ float mx, sum;
    if (threadIdx.x == 0) {
        float m = -INFINITY;
        for (int k = 0; k < nk; ++k) m = fmaxf(m, sc[k]);
        float l = 0.f;
        for (int k = 0; k < nk; ++k) l += expf(sc[k] - m);
        mx = m;
        sum = l;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float o = 0.f;
        for (int k = 0; k < nk; ++k) o += expf(sc[k] - mx) * __half2float(V[(size_t)k * HD + d]);
        out[r * H + h * HD + d] = o / sum;
    }
}
__global__ void perturb_x(float *x, float rel) {
    const int r = blockIdx.x;
    for (int c = threadIdx.x; c < H; c += blockDim.x) x[r * H + c] *= 1.f + rel * unif((uint64_t)r * H + c, 4242);
}
__global__ void ref_silu(const float *gu, float *m) {  // gu[r][2 * INTER]: gate then up
    const int r = blockIdx.y;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < INTER; c += gridDim.x * blockDim.x) {
        const float g = gu[r * 2 * INTER + c], u = gu[r * 2 * INTER + INTER + c];
        m[r * INTER + c] = g / (1.f + __expf(-g)) * u;
    }
}
__global__ void ref_argmax(const float *lg, int *ids) {
    const int r = blockIdx.x;
    __shared__ float bv[256];
    __shared__ int bi[256];
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int n = threadIdx.x; n < VOCAB; n += 256) {
        const float x = lg[(size_t)r * VOCAB + n];
        if (x > v) {
            v = x;
            idx = n;
        }
    }
    bv[threadIdx.x] = v;
    bi[threadIdx.x] = idx;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < 256; ++i)
            if (bv[i] > v || (bv[i] == v && bi[i] < idx)) {
                v = bv[i];
                idx = bi[i];
            }
        ids[r] = idx;
    }
}

// ---------------------------------------------------------------------------------------------
__global__ void fill_weight(uint8_t *w, size_t nkb_total, int K, uint64_t seed) {
    const float base = sqrtf(3.0f / (float)K) / 127.0f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nkb_total * (KB_BYTES / 16);
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t kb = i / (KB_BYTES / 16), piece = i % (KB_BYTES / 16);
        uint8_t *blk = w + kb * KB_BYTES + piece * 16;
        if (piece < 16) {
            for (int j = 0; j < 16; ++j) blk[j] = (uint8_t)(int8_t)(int)(unif(i * 16 + j, seed) * 127.5f);
        } else {
            for (int j = 0; j < 8; ++j)
                ((__half *)blk)[j] = __float2half_rn(base * (1.0f + 0.5f * unif(i * 16 + j, seed ^ 0x55)));
        }
    }
}
__global__ void fill_f32(float *p, size_t n, float lo, float hi, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = lo + (hi - lo) * 0.5f * (unif(i, seed) + 1.0f);
}
__global__ void fill_f16(__half *p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2half_rn(unif(i, seed));
}
__global__ void fill_bf16(__nv_bfloat16 *p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(unif(i, seed));
}

// ---------------------------------------------------------------------------------------------
template <typename T>
static T *dmalloc(size_t n) {
    T *p;
    CK(cudaMalloc(&p, n * sizeof(T)));
    return p;
}

static double rel_err(const std::vector<float> &a, const std::vector<float> &b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        const double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
        if (!std::isfinite(a[i])) return INFINITY;
    }
    return std::sqrt(num / den);
}

int main(int argc, char **argv) {
    const int ctx = argc > 1 ? std::atoi(argv[1]) : 512;
    const int iters = argc > 2 ? std::atoi(argv[2]) : 30;
    const int nl_run = argc > 3 ? std::atoi(argv[3]) : NL;
    const int nkeys = ctx + R;
    const int nspl = (nkeys + SPL - 1) / SPL;
    if (nspl > 4) {
        std::fprintf(stderr, "ctx %d needs %d attention splits; this prototype merges at most 4 (ctx <= %d)\n", ctx, nspl, 4 * SPL - R);
        return 1;
    }
    const int cap = nkeys;
    int dev = 0, nsm = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    std::printf("device %s, %d SMs, smem per block %d B (kernel %d B), ctx %d, %d attention splits\n", prop.name, nsm,
                (int)prop.sharedMemPerBlockOptin, SMEM, ctx, nspl);
    const int nblk = nsm;

    // Weights in the stream layout.
    Params P{};
    std::vector<uint8_t *> wbufs;
    size_t wbytes = 0;
    auto make_mat = [&](int N, int K, uint64_t seed) {
        const size_t nkb = (size_t)(N / 8) * (K / 32);
        uint8_t *w = dmalloc<uint8_t>(nkb * KB_BYTES);
        fill_weight<<<4096, 256>>>(w, nkb, K, seed);
        CK(cudaGetLastError());
        wbufs.push_back(w);
        wbytes += nkb * KB_BYTES;
        return Mat{w, K, N};
    };
    for (int l = 0; l < NL; ++l) {
        P.mats[l * M_PER + M_QKV] = make_mat(QKV_N, H, 100 + l * 10);
        P.mats[l * M_PER + M_O] = make_mat(H, H, 101 + l * 10);
        P.mats[l * M_PER + M_G] = make_mat(INTER, H, 102 + l * 10);
        P.mats[l * M_PER + M_U] = make_mat(INTER, H, 103 + l * 10);
        P.mats[l * M_PER + M_D] = make_mat(H, INTER, 104 + l * 10);
    }
    P.mats[NL * M_PER] = make_mat(VOCAB, H, 999);
    const int EMB_ROWS = 4096;
    __nv_bfloat16 *emb = dmalloc<__nv_bfloat16>((size_t)EMB_ROWS * H);
    fill_bf16<<<1024, 256>>>(emb, (size_t)EMB_ROWS * H, 7);
    float *norm_in = dmalloc<float>((NL + 1) * H), *norm_post = dmalloc<float>(NL * H);
    float *qn = dmalloc<float>(NL * HD), *kn = dmalloc<float>(NL * HD);
    fill_f32<<<64, 256>>>(norm_in, (NL + 1) * H, 0.8f, 1.2f, 11);
    fill_f32<<<64, 256>>>(norm_post, NL * H, 0.8f, 1.2f, 12);
    fill_f32<<<8, 256>>>(qn, NL * HD, 0.8f, 1.2f, 13);
    fill_f32<<<8, 256>>>(kn, NL * HD, 0.8f, 1.2f, 14);
    const size_t kvn = (size_t)NL * NKV * cap * HD;
    __half *kc = dmalloc<__half>(kvn), *vc = dmalloc<__half>(kvn), *kc_ref = dmalloc<__half>(kvn),
           *vc_ref = dmalloc<__half>(kvn);
    fill_f16<<<1024, 256>>>(kc, kvn, 21);
    fill_f16<<<1024, 256>>>(vc, kvn, 22);
    CK(cudaMemcpy(kc_ref, kc, kvn * 2, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(vc_ref, vc, kvn * 2, cudaMemcpyDeviceToDevice));
    std::vector<int> ids_h(R);
    for (int r = 0; r < R; ++r) ids_h[r] = (r * 977 + 13) % EMB_ROWS;
    int *ids = dmalloc<int>(R);
    CK(cudaMemcpy(ids, ids_h.data(), R * 4, cudaMemcpyHostToDevice));

    // The schedule: each phase's units dealt round robin, the start rotating so that the blocks
    // that took one more unit in a phase take the first units of the next.
    std::vector<std::vector<Desc>> per(nblk);
    std::vector<int> dstart_h((size_t)nblk * (NPH + 1));
    int off = 0;
    for (int p = 0; p < NPH; ++p) {
        for (int b = 0; b < nblk; ++b) dstart_h[b * (NPH + 1) + p] = (int)per[b].size();
        const int kind = phase_kind(p), layer = p == 0 ? 0 : (p - 1) / 5;
        std::vector<Desc> units;
        if (kind != K_LM && kind != K_EMB && layer >= nl_run) continue;
        if (kind == K_QKV)
            for (int t = 0; t < QKV_N / 8; ++t) units.push_back({(uint16_t)(layer * M_PER + M_QKV), 0xFFFF, 1, 0, (uint32_t)t, 0});
        if (kind == K_O)
            for (int g = 0; g < GROUPS; ++g) units.push_back({(uint16_t)(layer * M_PER + M_O), 0xFFFF, 4, 0, (uint32_t)g * 4, (uint32_t)g});
        if (kind == K_GU)
            for (int g = 0; g < INTER / 32; ++g)
                units.push_back({(uint16_t)(layer * M_PER + M_G), (uint16_t)(layer * M_PER + M_U), 4, 0, (uint32_t)g * 4, (uint32_t)g});
        if (kind == K_DOWN)
            for (int g = 0; g < GROUPS; ++g) units.push_back({(uint16_t)(layer * M_PER + M_D), 0xFFFF, 4, 1, (uint32_t)g * 4, (uint32_t)g});
        if (kind == K_LM)
            for (int t = 0; t < VOCAB / 8; ++t) units.push_back({(uint16_t)(NL * M_PER), 0xFFFF, 1, 0, (uint32_t)t, 0});
        if (units.empty()) continue;
        // Contiguous runs per block for the one-tile phases (tile order rising per block).
        const int n = (int)units.size();
        for (int u = 0; u < n; ++u) per[(off + u) % nblk].push_back(units[u]);
        off = (off + n) % nblk;
    }
    std::vector<Desc> descs_h;
    for (int b = 0; b < nblk; ++b) {
        const int base = (int)descs_h.size();
        for (int p = 0; p <= NPH; ++p) {
            int &v = dstart_h[b * (NPH + 1) + p];
            v = p == NPH ? base + (int)per[b].size() : base + v;
        }
        descs_h.insert(descs_h.end(), per[b].begin(), per[b].end());
    }
    // Every block's chunk sources in the consumers' order (the producer's walk, precomputed).
    std::vector<const uint8_t *> csrc_h;
    std::vector<int> cstart_h((size_t)nblk * (NPH + 1));
    for (int b = 0; b < nblk; ++b) {
        for (int p = 0; p <= NPH; ++p) {
            cstart_h[b * (NPH + 1) + p] = (int)csrc_h.size();
            if (p == NPH) break;
            for (int di = dstart_h[b * (NPH + 1) + p]; di < dstart_h[b * (NPH + 1) + p + 1]; ++di) {
                const Desc &d = descs_h[di];
                const Mat &m = P.mats[d.mat];
                const int nkc = m.K / (32 * CH_KB);
                const size_t tb = (size_t)(m.K / 32) * KB_BYTES;
                const int ntr = d.ntiles * (d.mat2 != 0xFFFF ? 2 : 1);
                for (int o = 0; o < ntr * nkc; ++o) {
                    const int tr = d.kcmajor ? o % ntr : o / nkc;
                    const int kc = d.kcmajor ? o / ntr : o % nkc;
                    const Mat &mm = tr < d.ntiles ? m : P.mats[d.mat2];
                    csrc_h.push_back(mm.w + (size_t)(d.tile + tr % d.ntiles) * tb + (size_t)kc * CH_BYTES);
                }
            }
        }
    }
    const uint8_t **csrc = dmalloc<const uint8_t *>(csrc_h.size());
    CK(cudaMemcpy(csrc, csrc_h.data(), csrc_h.size() * sizeof(void *), cudaMemcpyHostToDevice));
    int *cstart = dmalloc<int>(cstart_h.size());
    CK(cudaMemcpy(cstart, cstart_h.data(), cstart_h.size() * 4, cudaMemcpyHostToDevice));
    P.csrc = csrc;
    P.cstart = cstart;
    Desc *descs = dmalloc<Desc>(descs_h.size());
    CK(cudaMemcpy(descs, descs_h.data(), descs_h.size() * sizeof(Desc), cudaMemcpyHostToDevice));
    int *dstart = dmalloc<int>(dstart_h.size());
    CK(cudaMemcpy(dstart, dstart_h.data(), dstart_h.size() * 4, cudaMemcpyHostToDevice));
    {
        size_t mx = 0, mn = SIZE_MAX;
        for (int b = 0; b < nblk; ++b) {
            size_t by = 0;
            for (auto &d : per[b]) {
                const Mat &m = P.mats[d.mat];
                by += (size_t)d.ntiles * (d.mat2 != 0xFFFF ? 2 : 1) * (m.K / 32) * KB_BYTES;
            }
            mx = std::max(mx, by);
            mn = std::min(mn, by);
        }
        std::printf("weight bytes per block: min %.2f MB, max %.2f MB (%zu descs)\n", mn / 1e6, mx / 1e6, descs_h.size());
    }

    P.descs = descs;
    P.dstart = dstart;
    P.emb = emb;
    P.ids = ids;
    P.norm_in = norm_in;
    P.norm_post = norm_post;
    P.qn = qn;
    P.kn = kn;
    P.kc = kc;
    P.vc = vc;
    P.cap = cap;
    P.ctx = ctx;
    P.nl_run = nl_run;
    P.x = dmalloc<float>(R * H);
    P.qkv = dmalloc<float>(R * QKV_N);
    P.nA = dmalloc<uint8_t>(H / 32 * 512);
    P.nS = dmalloc<float>(H / 32 * R);
    P.sumsq = dmalloc<float>(GROUPS * R);
    P.aA = dmalloc<uint8_t>(H / 32 * 512);
    P.aS = dmalloc<float>(H / 32 * R);
    P.mA = dmalloc<uint8_t>(INTER / 32 * 512);
    P.mS = dmalloc<float>(INTER / 32 * R);
    P.opart = dmalloc<float>((size_t)NH * nspl * R * HD);
    P.mlpart = dmalloc<float>((size_t)NH * nspl * R * 2);
    P.argpart = dmalloc<float>((size_t)nblk * R * 2);
    P.ctrl = dmalloc<unsigned>(2 + NH);
    CK(cudaMemset(P.ctrl, 0, (2 + NH) * 4));
    P.out_ids = dmalloc<int>(R);
    float *logits = dmalloc<float>((size_t)R * VOCAB);
    CK(cudaFuncSetAttribute(step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, step_kernel, NTHR, SMEM));
    if (occ < 1) {
        std::fprintf(stderr, "kernel does not fit one SM\n");
        return 1;
    }
    unsigned epoch = 0;
    auto launch = [&](float *lg) {
        P.logits = lg;
        P.epoch = epoch++;
        void *args[] = {&P};
        CK(cudaLaunchCooperativeKernel((void *)step_kernel, dim3(nblk), dim3(NTHR), args, SMEM, 0));
    };

    // ---- Correctness: one step with logits against the reference.
    launch(logits);
    CK(cudaDeviceSynchronize());
    std::vector<float> x_p(R * H), lg_p((size_t)R * VOCAB);
    std::vector<int> ids_p(R);
    CK(cudaMemcpy(x_p.data(), P.x, R * H * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lg_p.data(), logits, lg_p.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ids_p.data(), P.out_ids, R * 4, cudaMemcpyDeviceToHost));

    {
        float *x = dmalloc<float>(R * H), *qkv = dmalloc<float>(R * QKV_N), *q = dmalloc<float>(R * H),
              *att = dmalloc<float>(R * H), *gu = dmalloc<float>(R * 2 * INTER), *m = dmalloc<float>(R * INTER),
              *rinv = dmalloc<float>(R), *lg = dmalloc<float>((size_t)R * VOCAB), *sc = dmalloc<float>(R * INTER / 32);
        int8_t *codes = dmalloc<int8_t>(R * INTER);
        int *rid = dmalloc<int>(R);
        auto run_ref = [&](float perturb) {
        ref_embed<<<R, 256>>>(emb, ids, x);
        if (perturb > 0.f) perturb_x<<<R, 256>>>(x, perturb);
        auto mm = [&](const float *in, const float *wn, bool use_rinv, const Mat &mat, float *out, int ldo, int add) {
            if (use_rinv) ref_rinv<<<R, 32>>>(in, rinv);
            ref_quant<<<dim3(mat.K / 32, R), 32>>>(in, wn, mat.K, codes, sc);
            ref_matmul<<<dim3((mat.N + 127) / 128, R), 128>>>(codes, sc, use_rinv ? rinv : nullptr, mat, out, ldo, add);
        };
        for (int l = 0; l < nl_run; ++l) {
            mm(x, norm_in + l * H, true, P.mats[l * M_PER + M_QKV], qkv, QKV_N, 0);
            ref_qk<<<dim3(R, NH + NKV), 32>>>(qkv, qn + l * HD, kn + l * HD, ctx, cap, l, q, kc_ref, vc_ref);
            ref_attn<<<dim3(R, NH), 128, nkeys * 4>>>(q, kc_ref, vc_ref, ctx, cap, l, att);
            mm(att, nullptr, false, P.mats[l * M_PER + M_O], x, H, 1);
            mm(x, norm_post + l * H, true, P.mats[l * M_PER + M_G], gu, 2 * INTER, 0);
            mm(x, norm_post + l * H, true, P.mats[l * M_PER + M_U], gu + INTER, 2 * INTER, 0);
            ref_silu<<<dim3(48, R), 256>>>(gu, m);
            mm(m, nullptr, false, P.mats[l * M_PER + M_D], x, H, 1);
        }
        mm(x, norm_in + nl_run * H, true, P.mats[NL * M_PER], lg, VOCAB, 0);
        ref_argmax<<<R, 256>>>(lg, rid);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        };
        // The network's own sensitivity: the reference with its embedding rows perturbed by a
        // relative 1e-4 (about what one q8 code step in one element of a block does).
        run_ref(1e-4f);
        std::vector<float> x_q(R * H), lg_q((size_t)R * VOCAB);
        CK(cudaMemcpy(x_q.data(), x, R * H * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(lg_q.data(), lg, lg_q.size() * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(kc_ref, kc, kvn * 2, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(vc_ref, vc, kvn * 2, cudaMemcpyDeviceToDevice));
        run_ref(0.f);
        std::vector<float> x_r(R * H), lg_r((size_t)R * VOCAB);
        std::vector<int> ids_r(R);
        CK(cudaMemcpy(x_r.data(), x, R * H * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(lg_r.data(), lg, lg_r.size() * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(ids_r.data(), rid, R * 4, cudaMemcpyDeviceToHost));
        // The block's K / V rows of the last layer in both caches.
        std::vector<__half> k_p(NKV * R * HD), k_r(NKV * R * HD), v_p(NKV * R * HD), v_r(NKV * R * HD);
        for (int g = 0; g < NKV; ++g) {
            const size_t o = (((size_t)(nl_run - 1) * NKV + g) * cap + ctx) * HD;
            CK(cudaMemcpy(k_p.data() + g * R * HD, kc + o, R * HD * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(k_r.data() + g * R * HD, kc_ref + o, R * HD * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(v_p.data() + g * R * HD, vc + o, R * HD * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(v_r.data() + g * R * HD, vc_ref + o, R * HD * 2, cudaMemcpyDeviceToHost));
        }
        std::vector<float> kpf, krf, vpf, vrf;
        for (size_t i = 0; i < k_p.size(); ++i) {
            kpf.push_back(__half2float(k_p[i]));
            krf.push_back(__half2float(k_r[i]));
            vpf.push_back(__half2float(v_p[i]));
            vrf.push_back(__half2float(v_r[i]));
        }
        int agree = 0;
        for (int r = 0; r < R; ++r) agree += ids_p[r] == ids_r[r];
        double xn = 0;
        for (float v : x_r) xn += (double)v * v;
        const double ex = rel_err(x_p, x_r), el = rel_err(lg_p, lg_r), ek = rel_err(kpf, krf), ev = rel_err(vpf, vrf);
        std::printf("check vs reference (%d layers): x rel %.3e (|x| rms %.3f), logits rel %.3e, K rows rel %.3e, V rows rel %.3e, argmax %d/%d\n",
                    nl_run, ex, std::sqrt(xn / x_r.size()), el, ek, ev, agree, R);
        const double sx = rel_err(x_q, x_r), sl = rel_err(lg_q, lg_r);
        std::printf("reference vs itself with 1e-4 relative noise on the embedding: x rel %.3e, logits rel %.3e\n", sx, sl);
        // Pass: within 3x of what the network makes of a 1e-4 input perturbation, or 5e-3.
        const bool ok = ex < std::max(5e-3, 3 * sx) && el < std::max(5e-3, 3 * sl) && agree >= R - 2;
        std::printf("CHECK %s\n", ok ? "PASS" : "FAIL");
    }

    // ---- Timing: the copy bandwidth, then the step.
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    const size_t cbytes = (size_t)2 << 30;
    uint8_t *ca = dmalloc<uint8_t>(cbytes), *cb = dmalloc<uint8_t>(cbytes);
    CK(cudaMemset(ca, 1, cbytes));
    const float cms = median_ms(st, 10, [&] { CK(cudaMemcpyAsync(cb, ca, cbytes, cudaMemcpyDeviceToDevice, st)); });
    const double bw = 2.0 * cbytes / (cms * 1e-3);  // bytes read + written per second
    CK(cudaFree(ca));
    CK(cudaFree(cb));
    // Floor bytes: the q8_0 weights (34 B per 32, what the stream layout holds), 16 embedding
    // rows, the visible K / V in f16.
    const double kvbytes = (double)NL * 2 * nkeys * NKV * HD * 2;
    const double fbytes = (double)wbytes + (double)R * H * 2 + kvbytes;
    const double floor_ms = fbytes / bw * 1e3;
    auto launch_st = [&] {
        P.logits = nullptr;
        P.epoch = epoch++;
        void *args[] = {&P};
        CK(cudaLaunchCooperativeKernel((void *)step_kernel, dim3(nblk), dim3(NTHR), args, SMEM, st));
    };
    // Each ablation mode from fresh counters: timed, then one traced launch (each phase from its
    // barrier's release on block 0's clock to the next; the producers' stalls on a full ring, mean
    // over blocks, us at the SM clock).
    const char *mode_names[] = {"full", "no mma", "no copy", "no attention", "barriers only", "no mma, no copy"};
    const int NMODE = 6;
    float one_ms[NMODE], b2b_ms[NMODE];
    double sum_t[NMODE][7] = {}, sum_s[NMODE][7] = {};
    std::vector<int> ids_t(R);
    for (int mode = NMODE - 1; mode >= 0; --mode) {
        CK(cudaMemset(P.ctrl, 0, (2 + NH) * 4));
        epoch = 0;
        P.mode = mode;
        for (int i = 0; i < 3; ++i) launch_st();
        CK(cudaStreamSynchronize(st));
        one_ms[mode] = median_ms(st, iters, launch_st);
        const int nb2b = 20;
        b2b_ms[mode] = median_ms(st, 5, [&] {
                           for (int i = 0; i < nb2b; ++i) launch_st();
                       }) /
                       nb2b;
        const size_t nt = (size_t)nblk * (NPH + 1) + (size_t)nblk * NPH + NL * 8;
        unsigned long long *tr = dmalloc<unsigned long long>(nt);
        CK(cudaMemset(tr, 0, nt * 8));
        P.trace = tr;
        launch_st();
        CK(cudaStreamSynchronize(st));
        P.trace = nullptr;
        std::vector<unsigned long long> th(nt);
        CK(cudaMemcpy(th.data(), tr, nt * 8, cudaMemcpyDeviceToHost));
        int clk_khz = 0;
        CK(cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, dev));
        for (int p = 0; p < NPH; ++p) {
            unsigned long long t1 = 0;
            for (int b = 0; b < nblk; ++b) t1 = std::max(t1, th[b * (NPH + 1) + p + 1]);
            const double us = (p + 1 < NPH ? (double)(th[p + 1] - th[p]) : (double)(t1 - th[p])) / 1e3;
            double st_us = 0;
            for (int b = 0; b < nblk; ++b) st_us += (double)th[(size_t)nblk * (NPH + 1) + b * NPH + p];
            st_us = st_us / nblk / (clk_khz / 1e3);
            sum_t[mode][phase_kind(p)] += us;
            sum_s[mode][phase_kind(p)] += st_us;
        }
        if (mode == 0) {
            std::printf("attention, block 0 item 0, us from the phase's release: prep, K/V landed, S, softmax, PV + partials, counter, merge\n");
            for (int l = 0; l < NL; ++l) {
                const unsigned long long t0 = th[1 + 5 * l + 1];
                std::printf("  layer %d:", l);
                for (int k = 0; k < 7; ++k) {
                    const unsigned long long t = th[(size_t)nblk * (2 * NPH + 1) + l * 8 + k];
                    std::printf(" %.2f", t ? (double)(t - t0) / 1e3 : -1.0);
                }
                std::printf(" | phase %.2f\n", (double)(th[1 + 5 * l + 2] - t0) / 1e3);
            }
        }
        CK(cudaFree(tr));
        if (mode == 0) CK(cudaMemcpy(ids_t.data(), P.out_ids, R * 4, cudaMemcpyDeviceToHost));
    }
    const char *names[] = {"embedding", "q/k/v", "attention", "o", "gate/up", "down", "lm_head+argmax"};
    std::printf("traced launches: phase (summed over layers): us from its barrier to the next / producer stall us\n");
    std::printf("| phase |");
    for (int m = 0; m < NMODE; ++m) std::printf(" %s |", mode_names[m]);
    std::printf("\n|---|");
    for (int m = 0; m < NMODE; ++m) std::printf("---:|");
    std::printf("\n");
    for (int k = 0; k < 7; ++k) {
        std::printf("| %s |", names[k]);
        for (int m = 0; m < NMODE; ++m) std::printf(" %.1f / %.1f |", sum_t[m][k], sum_s[m][k]);
        std::printf("\n");
    }
    std::printf("| step ms (one launch, back to back) |");
    for (int m = 0; m < NMODE; ++m) std::printf(" %.3f, %.3f |", one_ms[m], b2b_ms[m]);
    std::printf("\n");
    const float one = one_ms[0], b2b = b2b_ms[0];
    // The ids must not change from launch to launch (the step rewrites the same K / V rows).
    int same = 0;
    for (int r = 0; r < R; ++r) same += ids_t[r] == ids_p[r];
    std::printf("copy bandwidth %.0f GB/s; floor %.3f ms (%.3f GB)\n", bw / 1e9, floor_ms, fbytes / 1e9);
    std::printf("ids after %u launches equal to the first: %d/%d\n", epoch, same, R);
    std::printf("| shape | ctx | persistent ms (one launch) | back to back ms | floor ms | one / floor | b2b / floor |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
    std::printf("| Qwen3-8B-DFlash-b16 | %d | %.3f | %.3f | %.3f | %.2fx | %.2fx |\n", ctx, one, b2b, floor_ms, one / floor_ms,
                b2b / floor_ms);
    return 0;
}
