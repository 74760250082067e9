// Shared helpers, prepended to every module by the Rust side (NVRTC needs no #include).
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned long long u64;

#define FMT_F32 0
#define FMT_BF16 1
#define FMT_F16 2
#define FMT_Q8_0 3
#define FMT_Q4_0 4
#define FMT_Q8A8 5
// bf16 in the skinny matmuls' fragment order (CudaWeightBuf::Bf16P): tiles of 16 rows (padded
// with zeros); per (tile, 32-wide k tile) two halves (rows g, g + 8) of 32 lanes x 8 values:
// lane 4 g + t holds row 16 tile + 8 half + g, k = 32 kt + 8 t .. + 7. A warp's 16-byte loads
// of one half are 512 contiguous bytes; row-major bf16 reads 8 rows x 64 bytes.
#define FMT_BF16P 6
// q4_0 codes in the Q8_0A8 tiles and blocks (CudaWeightBuf::Q4A8): per (tile, block) 32 lanes
// x 8 bytes, lane g * 4 + t holding rows g and g + 8's q4_0 bytes 4t .. 4t + 3 (low nibble k,
// high nibble k + 16); the scales as FMT_Q8A8's.
#define FMT_Q4A8 7
__device__ __forceinline__ long long bf16p_index(long long row, int col, int cols) {
    const long long kt = col >> 5;
    const int r = (int)(row & 15), kk = col & 31;
    return ((((row >> 4) * (cols >> 5) + kt) * 2 + (r >> 3)) * 32 + (r & 7) * 4 + (kk >> 3)) * 8 + (kk & 7);
}

// Q8_0A8 weight layout: 32-value blocks per stage of the int8-mma kernel (rows padded to
// whole stages of blocks).
#define A8_KC 8

#define NEG_INF (__int_as_float(0xff800000))
#define ARGMAX_NONE 0xffffffffu

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}

// Two f32 -> packed f16x2 (round to nearest even, saturating at +-65504, NaN stays NaN); `lo`
// lands in the low half: the f16 of the fast attention's operands and of an f16 KV cache.
__device__ __forceinline__ u32 h2_pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// One f32 -> f16 bits, as h2_pack.
__device__ __forceinline__ u16 h_pack(float x) { return (u16)(h2_pack(x, 0.0f) & 0xffffu); }

// Two f32 -> packed bf16x2 (round to nearest even); `lo` lands in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Split a pair of f32 into bf16 hi and lo parts: x ~= hi + lo with ~16 significant bits.
__device__ __forceinline__ void split_bf16x2(float x0, float x1, u32 &hi, u32 &lo) {
    hi = pack_bf16x2(x0, x1);
    float h0 = __uint_as_float(hi << 16);
    float h1 = __uint_as_float(hi & 0xffff0000u);
    lo = pack_bf16x2(x0 - h0, x1 - h1);
}

__device__ __forceinline__ void mma_bf16_16816(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum with a fixed reduction tree (deterministic). `red` holds >= 32 floats.
__device__ __forceinline__ float block_sum(float v, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = 0.0f;
    if (warp == 0) {
        r = lane < nw ? red[lane] : 0.0f;
        r = warp_sum(r);
        if (lane == 0) red[0] = r;
    }
    __syncthreads();
    return red[0];
}

// Argmax candidate order: NaN never wins, larger value wins, first index wins ties.
__device__ __forceinline__ bool am_better(float v, u32 i, float bv, u32 bi) {
    if (v != v) return false;
    if (bi == ARGMAX_NONE) return true;
    return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ void warp_argmax(float &v, u32 &i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        u32 oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (am_better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

// Block argmax; returns the winner in thread 0 (and all threads via shared memory).
__device__ __forceinline__ void block_argmax(float &v, u32 &i, float *rv, u32 *ri) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    warp_argmax(v, i);
    __syncthreads();
    if (lane == 0) { rv[warp] = v; ri[warp] = i; }
    __syncthreads();
    if (warp == 0) {
        v = lane < nw ? rv[lane] : 0.0f;
        i = lane < nw ? ri[lane] : ARGMAX_NONE;
        warp_argmax(v, i);
        if (lane == 0) { rv[0] = v; ri[0] = i; }
    }
    __syncthreads();
    v = rv[0];
    i = ri[0];
}

// Scalar weight access in any storage format. Block formats use the backend's repacked
// layout: q8_0 = int8 values [rows, cols] + f16 scales [rows, cols/32]; q4_0 = one u32 per
// (row, block, quarter) holding the 8 nibbles of values 8q..8q+7 (value 8q+i at bit 2i for
// even i, at bit 16 + 2(i-1) for odd i) + f16 scales.
// BF16P = false: a kernel that never sees FMT_BF16P (skinny_simt: its case cost 16 registers).
// Q4A8 = true: one that may see FMT_Q4A8 (gather_rows; the matmuls and the Markov chain take
// Q4_0A8 weights through their own kernels or refuse them).
template <bool BF16P = true, bool Q4A8 = false>
__device__ __forceinline__ float load_w(int fmt, const void *wq, const u16 *wd, long long row, int col, int cols) {
    if (BF16P && fmt == FMT_BF16P) return bf16_to_f32(((const u16 *)wq)[bf16p_index(row, col, cols)]);
    if (Q4A8 && fmt == FMT_Q4A8) {
        const long long kbp = (long long)((cols / 32 + A8_KC - 1) / A8_KC) * A8_KC;
        const long long pb = (row >> 4) * kbp + (col >> 5);
        const int r = (int)(row & 15), g = r & 7, hi = r >> 3, kk = col & 31, j = kk & 15;
        const float d = f16_to_f32(wd[(pb * 8 + g) * 2 + hi]);
        const u32 byte = ((const u8 *)wq)[(pb * 32 + g * 4 + (j >> 2)) * 8 + hi * 4 + (j & 3)];
        return (float)((int)((kk >= 16 ? byte >> 4 : byte) & 0xfu) - 8) * d;
    }
    switch (fmt) {
    case FMT_F32: return ((const float *)wq)[row * cols + col];
    case FMT_BF16: return bf16_to_f32(((const u16 *)wq)[row * cols + col]);
    case FMT_F16: return f16_to_f32(((const u16 *)wq)[row * cols + col]);
    case FMT_Q8_0: {
        float d = f16_to_f32(wd[row * (cols / 32) + col / 32]);
        return (float)((const i8 *)wq)[row * cols + col] * d;
    }
    case FMT_Q8A8: {
        // Tiles of 16 rows; per (tile, block) 32 lanes x 16 bytes = the m16n8k32 A fragments
        // (reg = (k >= 16) * 2 + (row >= 8), lane = (row % 8) * 4 + (k % 16) / 4), then the
        // f16 scales as pairs (row g, row g + 8) per (tile, block, g).
        const long long kbp = (long long)((cols / 32 + A8_KC - 1) / A8_KC) * A8_KC;
        const long long pb = (row >> 4) * kbp + (col >> 5);
        const int r = (int)(row & 15), g = r & 7, hi = r >> 3, kk = col & 31;
        const int lane = g * 4 + ((kk & 15) >> 2), reg = ((kk >> 4) << 1) | hi;
        const float d = f16_to_f32(wd[(pb * 8 + g) * 2 + hi]);
        return (float)((const i8 *)wq)[(pb * 32 + lane) * 16 + reg * 4 + (kk & 3)] * d;
    }
    default: {
        const int b = col >> 5, e = col & 31;
        float d = f16_to_f32(wd[row * (cols / 32) + b]);
        u32 w = ((const u32 *)wq)[(row * (cols / 32) + b) * 4 + (e >> 3)];
        const int i = e & 7;
        const int shift = (i & 1) ? 16 + 2 * (i - 1) : 2 * i;
        int nib = (int)((w >> shift) & 0xfu);
        return (float)(nib - 8) * d;
    }
    }
}

// ---------------------------------------------------------------------------------------
// Q8_0A8 activations (x quantized to q8_0 in the int8 mma B-fragment layout), written by the
// quantizer a8_quant_x and by rms_norm_q8 (one implementation of the arithmetic, so the bytes
// are the same whichever kernel writes them). Layout (NT token groups of 8, KBp blocks, zeros
// in the padding: tokens T .. NT*8-1, blocks K/32 .. KBp-1):
//   xq[((b * NT + tok / 8) * 32 + (tok % 8) * 4 + t) * 2 + h] = codes k = 16h + 4t .. +3 of block b
//   xd[b * NT * 8 + tok] = the f16 scale of block b, as f32

// f32 -> f16 bits, round to nearest even (ggml's GGML_FP32_TO_FP16 on F16C machines).
__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
    u16 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
    return h;
}

// One warp quantizes block b of token tok (lane = position in the block, v = its value; all
// 32 lanes call it). Byte-exact with dflash_quant::quantize_q8_0 (ggml
// quantize_row_q8_0_ref) for finite v: d = amax / 127, id = d != 0 ? 1 / d : 0 (an infinite
// id gives the codes of id = 0, as on x86), q = roundf(v * id), stored d = f16(d).
__device__ __forceinline__ void a8_store_block(float v, int b, int tok, int NT, u32 *__restrict__ xq, float *__restrict__ xd) {
    const int lane = threadIdx.x & 31;
    const float amax = warp_max(fabsf(v));  // finite v: the max is order-independent
    const float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    if (fabsf(id) == __int_as_float(0x7f800000)) id = 0.0f;
    const u32 q = (u32)((int)roundf(__fmul_rn(v, id))) & 0xffu;
    const u32 w = q | (__shfl_down_sync(0xffffffffu, q, 1) << 8) | (__shfl_down_sync(0xffffffffu, q, 2) << 16) |
                  (__shfl_down_sync(0xffffffffu, q, 3) << 24);
    if ((lane & 3) == 0) {
        const int t = (lane & 15) >> 2, h = lane >> 4;
        xq[((long long)(b * NT + tok / 8) * 32 + (tok % 8) * 4 + t) * 2 + h] = w;
    }
    if (lane == 0) xd[(long long)b * NT * 8 + tok] = f16_to_f32(f32_to_f16_bits(d));
}

// Zero codes and scales of the padding blocks KB .. KBp-1 of token tok (by the block's threads).
__device__ __forceinline__ void a8_zero_pad(int tok, int KB, int KBp, int NT, u32 *__restrict__ xq, float *__restrict__ xd) {
    for (int e = threadIdx.x; e < (KBp - KB) * 9; e += blockDim.x) {
        const int b = KB + e / 9, j = e % 9;
        if (j < 8) xq[((long long)(b * NT + tok / 8) * 32 + (tok % 8) * 4 + (j >> 1)) * 2 + (j & 1)] = 0u;
        else xd[(long long)b * NT * 8 + tok] = 0.0f;
    }
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// Programmatic dependent launch (sm_90): the Q8_0A8 kernels, the skinny matmuls, add_rms_norm,
// qk_norm_rope_kv, the attention split kernels and the combine, the Markov steps,
// argmax_partial and argmax_final may be launched while the previous kernel on
// the stream still runs; griddep_wait() blocks until that kernel has finished and its writes
// are visible (a no-op for a normal launch; every such kernel calls it before reading
// anything, in every block, so none completes before its predecessor), griddep_launch() lets
// the next PDL-launched kernel start early (its blocks become resident and wait in
// griddep_wait; a no-op when the next kernel is launched normally). The kernels that precede
// one of those in a step call griddep_launch() first thing (the attention split kernels,
// copy2d, the matmuls, add_rms_norm, the other producers of the skinny matmuls' x:
// silu_mul_split, mul_sigmoid_split, rms_norm_gated_split, split_bf16), or right after their
// own loads (rms_norm_q8, rms_norm_split, add_rms_norm_split, qk_norm_rope_kv, the combine:
// the next kernel's weight prefetch, directly or through the launches it cascades into, would
// delay those loads), so the next launch overlaps them.
//
// Block trace (compiled with -DDFLASH_BLOCK_TRACE: CudaOptions::block_trace, a profiling aid):
// thread 0 of every block that calls griddep_wait() appends one record to this module's
// bt_buf: (source line of the call | SM << 32, global time entering the wait, global time
// leaving it, linear block index | blocks << 32); block_trace_end() appends (line + 100000 |
// SM << 32, time, 0, block | blocks << 32). Slots are taken by an atomic counter (bt_n, reset
// by the host); records past the buffer are dropped (bt_n still counts them).
#ifdef DFLASH_BLOCK_TRACE
#define BT_CAP 65536u
__device__ unsigned long long bt_buf[4 * BT_CAP];  // 2 MiB per module, only when traced
__device__ unsigned int bt_n;
__device__ __forceinline__ unsigned long long bt_time() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void bt_record(unsigned tag, unsigned long long t0, unsigned long long t1) {
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
        const unsigned slot = atomicAdd(&bt_n, 1u);
        if (slot < BT_CAP) {
            unsigned sm;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
            const unsigned long long blk = blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
            const unsigned long long nb = (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
            bt_buf[slot * 4] = tag | ((unsigned long long)sm << 32);
            bt_buf[slot * 4 + 1] = t0;
            bt_buf[slot * 4 + 2] = t1;
            bt_buf[slot * 4 + 3] = blk | (nb << 32);
        }
    }
}
__device__ __forceinline__ void griddep_wait_traced(unsigned line) {
    const unsigned long long t0 = bt_time();
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    bt_record(line, t0, bt_time());
}
#define griddep_wait() griddep_wait_traced(__LINE__)
#define block_trace_end() bt_record(__LINE__ + 100000u, bt_time(), 0ull)
#else
__device__ __forceinline__ void griddep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
#define block_trace_end()
#endif
__device__ __forceinline__ void griddep_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The Markov embedding W1[*prev, :] into shared memory (every block of a step loads it).
__device__ __forceinline__ void markov_load_emb(int fmt1, const void *__restrict__ w1q, const u16 *__restrict__ w1d,
                                                const u32 *__restrict__ prev, int rank, float *emb) {
    griddep_launch();  // the step's final may launch (it waits for this grid)
    griddep_wait();    // a programmatic dependent launch: the previous step's token first
    const u32 p = *prev;
    for (int i = threadIdx.x; i < rank; i += blockDim.x) emb[i] = load_w(fmt1, w1q, w1d, p, i, rank);
    __syncthreads();
}
