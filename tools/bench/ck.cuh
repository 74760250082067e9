// Shared by the microbenchmarks in this folder (each is one nvcc translation unit): CK(x) aborts
// with the file, line, call and CUDA error string when a runtime call fails; fill_random and
// median_ms are the streaming benchmarks' (read_bw, l2_mix) buffer fill and timer; copy_gbs and
// graph_us_per_launch the skinny benchmarks' copy bandwidth and per-launch time.
#pragma once
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#define CK(x)                                                                                     \
    do {                                                                                          \
        cudaError_t e_ = (x);                                                                     \
        if (e_ != cudaSuccess) {                                                                  \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            std::exit(1);                                                                         \
        }                                                                                         \
    } while (0)

// n 16-byte words of SplitMix64 bytes (so no compression or zero page helps a read).
__global__ void fill_random(uint4 *p, size_t n, unsigned long long seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned long long z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        p[i] = make_uint4((unsigned)z, (unsigned)(z >> 32), (unsigned)(z * 3), (unsigned)(z >> 17));
    }
}

// Median ms of `reps` runs of f() on stream st, each between two events, after one warm-up run.
template <typename F>
static float median_ms(cudaStream_t st, int reps, F f) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    f();
    CK(cudaStreamSynchronize(st));
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(a, st));
        f();
        CK(cudaEventRecord(b, st));
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return t[t.size() / 2];
}

// Median us of `reps` runs of timed() on stream st between two events, each after setup()
// (untimed: flushes, warm-ups, concurrent work on other streams), the device synchronized
// after each run; the first `warm` runs are dropped.
template <typename S, typename F>
static float median_us_after(cudaStream_t st, int reps, int warm, S setup, F timed) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int r = 0; r < warm + reps; ++r) {
        setup();
        CK(cudaEventRecord(a, st));
        timed();
        CK(cudaEventRecord(b, st));
        CK(cudaDeviceSynchronize());
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (r >= warm) t.push_back(ms * 1e3f);
    }
    std::sort(t.begin(), t.end());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return t[t.size() / 2];
}

// cp.async helpers and the streaming loop of `confined` and `l2_warm`: a ring of NS stages of
// ST16 16-byte words in shared memory, `issue(st)` copying stage st into slot st % NS; each
// thread consumes one word per stage (the xor keeps the copies).
__device__ __forceinline__ void ck_cp16(unsigned s, const void *g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
}
__device__ __forceinline__ void ck_cp16_hint(unsigned s, const void *g, unsigned long long pol) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(s), "l"(g), "l"(pol) : "memory");
}
__device__ __forceinline__ void ck_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void ck_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
template <int NS, int ST16, class Issue>
__device__ __forceinline__ void ck_ring_stream(int nst, const uint4 *ring, Issue issue, unsigned *sink) {
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
        if (s < nst) issue(s);
        ck_commit();
    }
    unsigned acc = 0;
    for (int st = 0; st < nst; ++st) {
        ck_wait<NS - 2>();
        __syncthreads();
        if (st + NS - 1 < nst) issue(st + NS - 1);
        ck_commit();
        const uint4 v = ring[(st % NS) * ST16 + threadIdx.x];
        acc ^= v.x ^ v.w;
    }
    ck_wait<0>();
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Device-to-device copy bandwidth in GB/s, bytes read + written: the median of 12 copies of nb
// bytes from the start of buf (2 nb bytes) to its second half.
inline double copy_gbs(void *buf, size_t nb, cudaStream_t st) {
    const float ms = median_ms(st, 12, [&] { CK(cudaMemcpyAsync((char *)buf + nb, buf, nb, cudaMemcpyDeviceToDevice, st)); });
    return 2.0 * nb / (ms * 1e-3) / 1e9;
}

// Microseconds per launch: launch(l) for l = 0 .. launches - 1 captured as one CUDA graph on st,
// replayed `reps` times after one warm-up replay (median replay / launches).
template <typename F>
static double graph_us_per_launch(cudaStream_t st, int launches, int reps, F launch) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int l = 0; l < launches; ++l) launch(l);
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const float ms = median_ms(st, reps, [&] { CK(cudaGraphLaunch(exec, st)); });
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    return ms * 1e3 / launches;
}

