// What does a kernel's code size cost on the draft step's dependency chain? Each of the step's
// ~50 launches starts its blocks on code that the kernels before it may have pushed out of the
// multiprocessors' instruction caches; the seventh session's ncu saw 10-25% instruction-fetch
// stalls in the small kernels. This times a chain of programmatically dependent launches (what
// the step's kernels do: griddepcontrol.launch_dependents first, griddepcontrol.wait before the
// read) whose kernels run N straight-line FMA instructions after the wait:
//   same    the same kernel on every link (its code warm after the first)
//   cycleK  K distinct kernels of the same size in turn (K x the code between two runs of one)
// with the FMAs' constants from the constant bank (`straight`) or registers only (`regs`),
// and two remedies: the body run once before the wait as a dry run (its code fetched while the
// kernel before runs), and the same FMAs as a loop (its code one 64-FMA body).
// 132 blocks x 128 threads (one per multiprocessor, as a latency-bound kernel), 8 independent
// FMA chains per thread. us per link = replay time of a graph of 240 links / 240; the difference
// between `same` and `cycleK` at one N is what cold code costs per launch (the `straight` rows
// add the constant cache's misses to the instruction fetch's; `regs` has only the latter).
//
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o icache icache.cu && ./icache
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "ck.cuh"

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// The 8 chains' start values (values another block of the link before wrote) and their sum.
__device__ __forceinline__ void load8(const float *in, int i, float (&x)[8]) {
#pragma unroll
    for (int c = 0; c < 8; ++c) x[c] = __ldcg(in + ((i * 7 + c * 131) % (gridDim.x * blockDim.x)));
}
__device__ __forceinline__ float sum8(const float (&x)[8]) {
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < 8; ++c) s += x[c];
    return s;
}

// N FMAs over 8 chains, constants distinct per kernel id (ID) so the K kernels are distinct code.
template <int N, int ID>
__global__ void __launch_bounds__(128) straight(const float *in, float *out) {
    pdl_launch();
    pdl_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float x[8];
    load8(in, i, x);
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const float a = 1.0f + (float)((k * 37 + ID * 11) % 997) * 1e-7f;
        x[k % 8] = fmaf(x[k % 8], a, (float)(k % 13) * 1e-9f);
    }
    out[i] = sum8(x);
}

// The same straight-line code with register operands only (no per-instruction constant: the
// constants of `straight` live in the constant bank, whose cache can miss as well).
template <int N, int ID>
__global__ void __launch_bounds__(128) regs(const float *in, float *out) {
    pdl_launch();
    pdl_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float x[8];
    load8(in, i, x);
    const float a0 = x[0] * 1e-30f + 1.0f, a1 = x[1] * 1e-30f + (1.0f + ID * 1e-7f), b = x[2] * 1e-30f;
#pragma unroll
    for (int k = 0; k < N; ++k) x[k % 8] = fmaf(x[k % 8], (k / 8) % 2 ? a1 : a0, b);
    out[i] = sum8(x);
}

// The same body run twice through one copy of its code: once before the wait on whatever `in`
// holds then (a dry run whose result is dropped: it only brings the code into the instruction
// caches while the kernel before runs), then after the wait for real.
template <int N, int ID>
__global__ void __launch_bounds__(128) warmed(const float *in, float *out) {
    pdl_launch();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float s = 0.0f;
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
        if (pass == 1) pdl_wait();
        float x[8];
        load8(in, i, x);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const float a = 1.0f + (float)((k * 37 + ID * 11) % 997) * 1e-7f;
            x[k % 8] = fmaf(x[k % 8], a, (float)(k % 13) * 1e-9f);
        }
        s = sum8(x);
    }
    out[i] = s;
}

// The same instruction count as a loop of 64-FMA bodies (the code: one body).
template <int N, int ID>
__global__ void __launch_bounds__(128) rolled(const float *in, float *out) {
    pdl_launch();
    pdl_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float x[8];
    load8(in, i, x);
    float a = 1.0f + (float)ID * 1e-7f;
#pragma unroll 1
    for (int r = 0; r < N / 64; ++r) {
#pragma unroll
        for (int k = 0; k < 64; ++k) x[k % 8] = fmaf(x[k % 8], a, (float)(k % 13) * 1e-9f);
        a += 1e-8f;
    }
    out[i] = sum8(x);
}

using Fn = void (*)(const float *, float *);
#define SET(KER)                                                                                    \
    template <int N>                                                                                \
    void fns_##KER(std::vector<Fn> &v) {                                                            \
        v = {KER<N, 0>, KER<N, 1>, KER<N, 2>, KER<N, 3>, KER<N, 4>, KER<N, 5>, KER<N, 6>, KER<N, 7>}; \
    }
SET(straight)
SET(regs)
SET(warmed)
SET(rolled)

static void launch(cudaStream_t st, Fn fn, const float *in, float *out) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(132);
    cfg.blockDim = dim3(128);
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    void *args[] = {(void *)&in, (void *)&out};
    CK(cudaLaunchKernelExC(&cfg, (const void *)fn, args));
}

// us per link of a graph of `links` launches cycling through the first k kernels of v.
static float chain(cudaStream_t st, const std::vector<Fn> &v, int k, float *a, float *b) {
    const int links = 240;
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int l = 0; l < links; ++l) launch(st, v[l % k], (l & 1) ? b : a, (l & 1) ? a : b);
    CK(cudaStreamEndCapture(st, &g));
    cudaGraphExec_t ge;
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 5; ++i) CK(cudaGraphLaunch(ge, st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int r = 0; r < 15; ++r) {
        CK(cudaEventRecord(e0, st));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1000.0f / links);
    }
    std::sort(t.begin(), t.end());
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return t[t.size() / 2];
}

static void row(const char *what, int n, const std::vector<Fn> &v, cudaStream_t st, float *a, float *b) {
    std::printf("| %s | %d | %.1f", what, n, n * 16 / 1024.0);
    for (int k : {1, 2, 4, 8}) std::printf(" | %.2f", chain(st, v, k, a, b));
    std::printf(" |\n");
}
template <int N>
static void rows(cudaStream_t st, float *a, float *b) {
    std::vector<Fn> v;
    fns_straight<N>(v);
    row("straight", N, v, st, a, b);
    fns_regs<N>(v);
    row("straight, register operands", N, v, st, a, b);
    fns_warmed<N>(v);
    row("dry run before the wait", N, v, st, a, b);
    fns_rolled<N>(v);
    row("rolled (64 per iteration)", N, v, st, a, b);
}

int main() {
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    float *a, *b;
    CK(cudaMalloc(&a, 132 * 128 * 4));
    CK(cudaMalloc(&b, 132 * 128 * 4));
    CK(cudaMemset(a, 0, 132 * 128 * 4));
    CK(cudaMemset(b, 0, 132 * 128 * 4));
    std::printf("| kernel | FMAs after the wait | straight code KB (approx.) | same kernel us/link | 2 in turn | 4 in turn | 8 in turn |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
    for (int round = 0; round < 2; ++round) {
        rows<64>(st, a, b);
        rows<256>(st, a, b);
        rows<512>(st, a, b);
        rows<1024>(st, a, b);
        rows<2048>(st, a, b);
        rows<4096>(st, a, b);
    }
    return 0;
}
