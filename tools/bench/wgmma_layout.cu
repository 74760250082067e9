// Which shared-memory descriptor layout does the Hopper warpgroup MMA (wgmma) read, for the
// two products of the drafter's attention, before a kernel is built on it?
//
// The FA kernel (attn_fa16kv_*) is bound by its per-SM mma.sync + ldmatrix work per chunk
// (docs/bench-gpu-log.md, twentieth session: the split ~17-19 us at ctx 8192 where its K / V reads
// alone take 9.7 us). wgmma.m64nNk16 reads B straight from shared memory at twice mma.sync's
// rate, and its 64-row tile is the 16 queries x 4 heads of a kv head. This program checks,
// on one warpgroup, the layouts such a kernel would use:
//   S = Q K^T  (64 x 64 over d = 128): A = Q from registers (per warp the m16n8k16 A fragment
//              of rows 16 w ..), B = the K tile, "K-major" (d contiguous), 8 k-steps of
//              m64n64k16
//   O = P V    (64 x 128 over 64 keys): A = P from registers, B = the V tile read as "MN-major"
//              (d contiguous, imm-trans-b = 1), 4 k-steps of m64n128k16
// Both tiles are stored as 8 x 16-byte core matrices: key block j / 8, d block c at
// ((j / 8) * 16 + c) * 128 bytes, row j % 8 at 16 (j % 8). For each product the descriptor's
// leading / stride byte offsets (LBO / SBO) are tried both ways round (the no-swizzle canonical
// layouts name them per operand major-ness), and the accumulators are read back in the
// mma.sync C-fragment order per warp (rows 16 w + g, + 8; columns 8 n + 2 t, + 1). Each variant
// prints its max |error| against a plain f32 reference; the right one prints ~1e-6 (f16
// operands, f32 sums), then the time of 256 chunks' products per block on 132 blocks.
//
// H200, twenty-first session: no swizzle: S with LBO = next d block, SBO = next key block, O
// with LBO = next key block, SBO = next d block: 3.8e-6 / 1.9e-6 (LBO / SBO the other way round:
// an illegal address); 128-byte swizzle (both tiles: key row j's d half h at h 8192 + 128 j, its
// 16-byte block c at (c ^ j % 8) 16): S with SBO = 1024, O with LBO = 8192 (next d half), SBO =
// 1024 (next 8 keys): 3.8e-6 / 1.9e-6 (O with LBO / SBO swapped: wrong values). Chained products
// of one warpgroup per SM: 736 ns per chunk (no swizzle), 762 (swizzled): ~90 cycles per
// m64n64k16 in a chain, a third of the tensor cores' peak; the layouts read alike. What made
// the attention kernel over the no-swizzle tiles slow was its copy (8 rows x 64 bytes per warp
// instruction), not the tensor cores' reads (cuda-kernels/kernels/attention.cu, attn_wg_impl).
//
// Build and run on the GPU machine: nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o
// wgmma_layout wgmma_layout.cu && ./wgmma_layout [variant 0 | 2 | 3]
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ck.cuh"

typedef unsigned int u32;
typedef unsigned long long u64;

constexpr int M = 64, D = 128, NK = 64;  // rows, head dim, keys (M: the warpgroup's 4 x 16 rows)

// Descriptor: start >> 4 (bits 0-13), LBO >> 4 (16-29), SBO >> 4 (32-45), no swizzle (62-63 = 0).
__device__ __forceinline__ u64 desc(u32 saddr, u32 lbo, u32 sbo) {
    return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

__device__ __forceinline__ u32 pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *(u32 *)&h;
}

// S += Q K^T over one k16 step: d[32] (m64n64 f32), a[4] (A from registers), B by descriptor.
__device__ __forceinline__ void wgmma_n64(float (&d)[32], const u32 (&a)[4], u64 bd, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "{%32,%33,%34,%35}, %36, p, 1, 1, %37;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]),
          "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
          "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bd), "n"(0), "r"(accumulate));
}

// O += P V over one k16 step: d[64] (m64n128 f32), B transposed (MN-major).
__device__ __forceinline__ void wgmma_n128_t(float (&d)[64], const u32 (&a)[4], u64 bd, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
        "{%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]),
          "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
          "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
          "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]),
          "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),
          "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bd), "r"(accumulate));
}

// One warpgroup. q [M][D], k [NK][D], v [NK][D], p [M][NK] (f32, rounded to f16 here);
// s_out [M][NK], o_out [M][D]. swap_s / swap_o: LBO and SBO exchanged for that product.
__global__ void __launch_bounds__(128) wgmma_check(const float *q, const float *k, const float *v, const float *p, float *s_out,
                                                   float *o_out, int swap_s, int swap_o, int reps = 1) {
    __shared__ __align__(128) __half Kt[NK * D], Vt[NK * D];
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    // Tiles in core matrices: key block j / 8, d block c: ((j / 8) * 16 + c) * 64 halves, row j % 8.
    for (int i = tid; i < NK * D; i += 128) {
        const int j = i / D, dd = i % D, c = dd / 8;
        const int at = ((j / 8) * (D / 8) + c) * 64 + (j % 8) * 8 + dd % 8;
        Kt[at] = __float2half_rn(k[i]);
        Vt[at] = __float2half_rn(v[i]);
    }
    // The tiles, written through the generic proxy, made visible to wgmma's async proxy.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const u32 kbase = (u32)__cvta_generic_to_shared(Kt), vbase = (u32)__cvta_generic_to_shared(Vt);
    const u32 core = 128, row_of_cores = (D / 8) * 128;  // bytes: next d block, next key block

    // S = Q K^T. A fragment of k-step ks: rows 16 w + g (+8), d 16 ks + 2 t (+1, +8, +9).
    float s[32];
    for (int i = 0; i < 32; ++i) s[i] = 0.0f;
    const float *qa = q + (16 * w + g) * D, *qb = qa + 8 * D;
    u32 qf[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const int d0 = 16 * ks + 2 * t;
        qf[ks][0] = pack(qa[d0], qa[d0 + 1]);
        qf[ks][1] = pack(qb[d0], qb[d0 + 1]);
        qf[ks][2] = pack(qa[d0 + 8], qa[d0 + 9]);
        qf[ks][3] = pack(qb[d0 + 8], qb[d0 + 9]);
    }
    // The A registers are written before the fence (wgmma reads them asynchronously).
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    for (int r = 0; r < reps; ++r)
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        // K-major B: the k-step's first core matrix is d block 2 ks of key block 0; the next
        // along K (d) is one core on, the next along N (keys) one row of cores on.
        const u32 lbo = swap_s ? row_of_cores : core, sbo = swap_s ? core : row_of_cores;
        wgmma_n64(s, qf[ks], desc(kbase + 2 * ks * core, lbo, sbo), ks > 0 || r > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    for (int n = 0; n < NK / 8; ++n) {
        s_out[(16 * w + g) * NK + 8 * n + 2 * t] = s[4 * n];
        s_out[(16 * w + g) * NK + 8 * n + 2 * t + 1] = s[4 * n + 1];
        s_out[(16 * w + g + 8) * NK + 8 * n + 2 * t] = s[4 * n + 2];
        s_out[(16 * w + g + 8) * NK + 8 * n + 2 * t + 1] = s[4 * n + 3];
    }

    // O = P V. A fragment of k-step kk: rows 16 w + g (+8), keys 16 kk + 2 t (+1, +8, +9).
    float o[64];
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    const float *pa = p + (16 * w + g) * NK, *pb = pa + 8 * NK;
    u32 pf[NK / 16][4];
#pragma unroll
    for (int kk = 0; kk < NK / 16; ++kk) {
        const int j0 = 16 * kk + 2 * t;
        pf[kk][0] = pack(pa[j0], pa[j0 + 1]);
        pf[kk][1] = pack(pb[j0], pb[j0 + 1]);
        pf[kk][2] = pack(pa[j0 + 8], pa[j0 + 9]);
        pf[kk][3] = pack(pb[j0 + 8], pb[j0 + 9]);
    }
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    for (int r = 0; r < reps; ++r)
#pragma unroll
    for (int kk = 0; kk < NK / 16; ++kk) {
        // MN-major B (d contiguous): the k-step's first core matrix is key block 2 kk, d block 0;
        // the next along K (keys) is one row of cores on, the next along N (d) one core on.
        const u32 lbo = swap_o ? core : row_of_cores, sbo = swap_o ? row_of_cores : core;
        wgmma_n128_t(o, pf[kk], desc(vbase + 2 * kk * row_of_cores, lbo, sbo), kk > 0 || r > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    for (int n = 0; n < D / 8; ++n) {
        o_out[(16 * w + g) * D + 8 * n + 2 * t] = o[4 * n];
        o_out[(16 * w + g) * D + 8 * n + 2 * t + 1] = o[4 * n + 1];
        o_out[(16 * w + g + 8) * D + 8 * n + 2 * t] = o[4 * n + 2];
        o_out[(16 * w + g + 8) * D + 8 * n + 2 * t + 1] = o[4 * n + 3];
    }
}

// The same two products over 128-byte-swizzled tiles (both tiles alike: key row j of d half h at
// h * 8192 + j * 128 bytes, its 16-byte d block c (0..7 within the half) at ((c ^ (j % 8)) * 16);
// tiles 1024-byte aligned). S reads K "K-major" (SBO = 1024: the next 8 keys; LBO unused), k-step
// ks at half ks / 4, + 32 (ks % 4) bytes; O reads V "MN-major" (trans-b), k-step kk at + 2048 kk,
// with (LBO, SBO) = (8192, 1024) (swap_o = 0: LBO = next d half) or (1024, 8192) (swap_o = 1).
__device__ __forceinline__ u64 desc_sw128(u32 saddr, u32 lbo, u32 sbo) {
    return desc(saddr, lbo, sbo) | (1ull << 62);
}
__global__ void __launch_bounds__(128) wgmma_sw128_check(const float *q, const float *k, const float *v, const float *p, float *s_out,
                                                         float *o_out, int swap_o, int reps = 1) {
    __shared__ __align__(1024) __half Kt[NK * D], Vt[NK * D];
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    for (int i = tid; i < NK * D; i += 128) {
        const int j = i / D, dd = i % D, hh = dd / 64, c = (dd % 64) / 8;
        const int at = hh * 4096 + j * 64 + ((c ^ (j % 8)) * 8) + dd % 8;  // halves
        Kt[at] = __float2half_rn(k[i]);
        Vt[at] = __float2half_rn(v[i]);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const u32 kbase = (u32)__cvta_generic_to_shared(Kt), vbase = (u32)__cvta_generic_to_shared(Vt);
    float s[32];
    for (int i = 0; i < 32; ++i) s[i] = 0.0f;
    const float *qa = q + (16 * w + g) * D, *qb = qa + 8 * D;
    u32 qf[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const int d0 = 16 * ks + 2 * t;
        qf[ks][0] = pack(qa[d0], qa[d0 + 1]);
        qf[ks][1] = pack(qb[d0], qb[d0 + 1]);
        qf[ks][2] = pack(qa[d0 + 8], qa[d0 + 9]);
        qf[ks][3] = pack(qb[d0 + 8], qb[d0 + 9]);
    }
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    for (int r = 0; r < reps; ++r)
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
        wgmma_n64(s, qf[ks], desc_sw128(kbase + (ks / 4) * 8192 + (ks % 4) * 32, 16, 1024), ks > 0 || r > 0);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    for (int n = 0; n < NK / 8; ++n) {
        s_out[(16 * w + g) * NK + 8 * n + 2 * t] = s[4 * n];
        s_out[(16 * w + g) * NK + 8 * n + 2 * t + 1] = s[4 * n + 1];
        s_out[(16 * w + g + 8) * NK + 8 * n + 2 * t] = s[4 * n + 2];
        s_out[(16 * w + g + 8) * NK + 8 * n + 2 * t + 1] = s[4 * n + 3];
    }
    float o[64];
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    const float *pa = p + (16 * w + g) * NK, *pb = pa + 8 * NK;
    u32 pf[NK / 16][4];
#pragma unroll
    for (int kk = 0; kk < NK / 16; ++kk) {
        const int j0 = 16 * kk + 2 * t;
        pf[kk][0] = pack(pa[j0], pa[j0 + 1]);
        pf[kk][1] = pack(pb[j0], pb[j0 + 1]);
        pf[kk][2] = pack(pa[j0 + 8], pa[j0 + 9]);
        pf[kk][3] = pack(pb[j0 + 8], pb[j0 + 9]);
    }
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    for (int r = 0; r < reps; ++r)
#pragma unroll
    for (int kk = 0; kk < NK / 16; ++kk)
        wgmma_n128_t(o, pf[kk], desc_sw128(vbase + kk * 2048, swap_o ? 1024 : 8192, swap_o ? 8192 : 1024), kk > 0 || r > 0);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    for (int n = 0; n < D / 8; ++n) {
        o_out[(16 * w + g) * D + 8 * n + 2 * t] = o[4 * n];
        o_out[(16 * w + g) * D + 8 * n + 2 * t + 1] = o[4 * n + 1];
        o_out[(16 * w + g + 8) * D + 8 * n + 2 * t] = o[4 * n + 2];
        o_out[(16 * w + g + 8) * D + 8 * n + 2 * t + 1] = o[4 * n + 3];
    }
}

static float h(float x) { return __half2float(__float2half_rn(x)); }

int main(int argc, char **argv) {
    const int only = argc > 1 ? atoi(argv[1]) : -1;
    std::vector<float> q(M * D), k(NK * D), v(NK * D), p(M * NK);
    srand(7);
    auto rnd = [] { return (float)rand() / RAND_MAX * 2.0f - 1.0f; };
    for (auto &x : q) x = rnd();
    for (auto &x : k) x = rnd();
    for (auto &x : v) x = rnd();
    for (auto &x : p) x = (float)rand() / RAND_MAX;
    // References over the f16-rounded operands, f32 (double) sums.
    std::vector<float> sr(M * NK), orf(M * D);
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < NK; ++j) {
            double a = 0;
            for (int d = 0; d < D; ++d) a += (double)h(q[i * D + d]) * h(k[j * D + d]);
            sr[i * NK + j] = (float)a;
        }
    for (int i = 0; i < M; ++i)
        for (int d = 0; d < D; ++d) {
            double a = 0;
            for (int j = 0; j < NK; ++j) a += (double)h(p[i * NK + j]) * h(v[j * D + d]);
            orf[i * D + d] = (float)a;
        }
    float *dq, *dk, *dv, *dp, *ds, *dout;
    CK(cudaMalloc(&dq, q.size() * 4));
    CK(cudaMalloc(&dk, k.size() * 4));
    CK(cudaMalloc(&dv, v.size() * 4));
    CK(cudaMalloc(&dp, p.size() * 4));
    CK(cudaMalloc(&ds, sr.size() * 4));
    CK(cudaMalloc(&dout, orf.size() * 4));
    CK(cudaMemcpy(dq, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dk, k.data(), k.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dp, p.data(), p.size() * 4, cudaMemcpyHostToDevice));
    std::printf("| LBO / SBO | S = Q K^T max |err| | O = P V max |err| |\n|---|---:|---:|\n");
    for (int swap = 0; swap < 4; ++swap) {
        if (swap == 1 || (only >= 0 && swap != only)) continue;  // 1: an illegal address
        CK(cudaMemset(ds, 0xff, sr.size() * 4));
        CK(cudaMemset(dout, 0xff, orf.size() * 4));
        if (swap < 2) wgmma_check<<<1, 128>>>(dq, dk, dv, dp, ds, dout, swap, swap);
        else wgmma_sw128_check<<<1, 128>>>(dq, dk, dv, dp, ds, dout, swap - 2);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        std::vector<float> sg(sr.size()), og(orf.size());
        CK(cudaMemcpy(sg.data(), ds, sg.size() * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(og.data(), dout, og.size() * 4, cudaMemcpyDeviceToHost));
        // Max |error|, and for a wrong layout where the first wrong value belongs (a permuted
        // read shows as a value of the reference at another index).
        auto check = [](const std::vector<float> &got, const std::vector<float> &want, int cols, const char *what) {
            double e = 0;
            long first = -1;
            for (size_t i = 0; i < want.size(); ++i) {
                const double d = std::isnan(got[i]) ? 1e30 : std::fabs(got[i] - want[i]);
                if (d > 1e-3 && first < 0) first = (long)i;
                e = std::fmax(e, d);
            }
            if (first >= 0) {
                long at = -1;
                for (size_t i = 0; i < want.size(); ++i)
                    if (std::fabs(want[i] - got[first]) < 1e-4) at = (long)i;
                std::printf("  %s: first wrong [%ld][%ld] = %g (want %g); that value is the reference's [%ld][%ld]\n", what, first / cols,
                            first % cols, got[first], want[first], at < 0 ? -1 : at / cols, at < 0 ? -1 : at % cols);
            }
            return e;
        };
        const double es = check(sg, sr, NK, "S"), eo = check(og, orf, D, "O");
        std::printf("| %s | %.3g | %.3g |\n",
                    swap == 3   ? "128B swizzle: S: SBO = 1024; O: LBO = 1024 (next 8 keys), SBO = 8192 (next d half)"
                    : swap == 2 ? "128B swizzle: S: SBO = 1024; O: LBO = 8192 (next d half), SBO = 1024 (next 8 keys)"
                                : "no swizzle: S: LBO = next d block, SBO = next key block; O: LBO = next key block, SBO = next d block",
                    es, eo);
        // Throughput: 132 blocks, each 256 rounds of the chunk's 8 + 4 wgmma.
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        for (int it = 0; it < 2; ++it) {
            CK(cudaEventRecord(e0));
            if (swap < 2) wgmma_check<<<132, 128>>>(dq, dk, dv, dp, ds, dout, swap, swap, 256);
            else wgmma_sw128_check<<<132, 128>>>(dq, dk, dv, dp, ds, dout, swap - 2, 256);
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
        }
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        std::printf("  256 chunks of S + O per block, 132 blocks: %.1f us (%.0f ns per chunk)\n", ms * 1e3, ms * 1e6 / 256);
    }
    return 0;
}
