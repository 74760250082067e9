// How long does one dependency between two ops of a CUDA graph take on this GPU, and what would
// a grid-wide barrier inside one persistent kernel take instead? The draft step is a chain of
// ~50 dependent launches whose latency-bound links (norms, q/k norm, attention, argmax) stop
// the weight stream; this measures the price of each way to chain them.
//
// A chain of N links; link l: every block reads one value that another block of link l - 1
// wrote, then writes its own (no other work: the time per link is the dependency's latency).
//   plain    one kernel per link, stream order
//   pdl      one kernel per link, programmatic dependent launch: griddepcontrol.launch_dependents
//            first thing, griddepcontrol.wait before the read (what the draft step's kernels do)
//   flag     PDL launch, but no griddepcontrol.wait: thread 0 spins (ld.acquire, nanosleep) on a
//            counter that every block of the previous link increments after a fence (counters
//            zeroed by a memset node at the graph's start)
//   barrier  one kernel, the links separated by a grid barrier (the same counter protocol; all
//            blocks resident)
//   flags    as flag, but each block of the previous link sets a flag of its own (fence, then a
//            release store; no atomics) and warp 0 of each block polls all of them
//   fbarrier one kernel, grid barriers of per-block flags (as flags)
// All four captured in a CUDA graph of N links, replayed; us per link = replay time / N.
//
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o sync_latency sync_latency.cu &&
// ./sync_latency
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ck.cuh"

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void spin_until(const unsigned *cnt, unsigned target) {
    while (ld_acquire(cnt) < target) __nanosleep(20);
}
// The one value of the previous link this block depends on (written by another block).
__device__ __forceinline__ int src_of(int b, int nb) { return (b * 7 + 3) % nb; }

__global__ void link_plain(const float *in, float *out) {
    const float v = __ldcg(in + src_of(blockIdx.x, gridDim.x));
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = v + 1.0f;
}

__global__ void link_pdl(const float *in, float *out) {
    pdl_launch();
    pdl_wait();
    const float v = __ldcg(in + src_of(blockIdx.x, gridDim.x));
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = v + 1.0f;
}

__global__ void link_flag(const float *in, float *out, const unsigned *wait_cnt, unsigned *sig_cnt) {
    pdl_launch();
    if (threadIdx.x == 0 && wait_cnt != nullptr) spin_until(wait_cnt, gridDim.x);
    __syncthreads();
    const float v = __ldcg(in + src_of(blockIdx.x, gridDim.x));
    __syncthreads();
    if (threadIdx.x == 0) {
        out[blockIdx.x] = v + 1.0f;
        __threadfence();
        atomicAdd(sig_cnt, 1u);
    }
}

// Warp 0 of the calling block waits until all n flags are set (ld.acquire), then the block.
__device__ __forceinline__ void wait_flags(const unsigned *f, int n) {
    if (threadIdx.x < 32) {
        for (int i = threadIdx.x; i < n; i += 32)
            while (ld_acquire(f + i) == 0u) __nanosleep(20);
    }
    __syncthreads();
}
__device__ __forceinline__ void set_flag(unsigned *f) {
    __threadfence();
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(f), "r"(1u) : "memory");
}

__global__ void link_flags(const float *in, float *out, const unsigned *wait_f, unsigned *sig_f) {
    pdl_launch();
    if (wait_f != nullptr) wait_flags(wait_f, gridDim.x);
    const float v = __ldcg(in + src_of(blockIdx.x, gridDim.x));
    __syncthreads();
    if (threadIdx.x == 0) {
        out[blockIdx.x] = v + 1.0f;
        set_flag(sig_f + blockIdx.x);
    }
}

__global__ void persistent_flags(float *bufs, int links, unsigned *flags) {
    const int nb = gridDim.x, b = blockIdx.x;
    for (int l = 0; l < links; ++l) {
        const float v = __ldcg(bufs + (long long)l * nb + src_of(b, nb));
        __syncthreads();
        if (threadIdx.x == 0) {
            bufs[(long long)(l + 1) * nb + b] = v + 1.0f;
            set_flag(flags + (long long)l * nb + b);
        }
        wait_flags(flags + (long long)l * nb, nb);
    }
}

__global__ void persistent(float *bufs, int links, unsigned *bar) {
    const int nb = gridDim.x, b = blockIdx.x;
    for (int l = 0; l < links; ++l) {
        const float v = __ldcg(bufs + (long long)l * nb + src_of(b, nb));
        __syncthreads();
        if (threadIdx.x == 0) {
            bufs[(long long)(l + 1) * nb + b] = v + 1.0f;
            __threadfence();
            atomicAdd(bar, 1u);
            spin_until(bar, (unsigned)((l + 1) * nb));
        }
        __syncthreads();
    }
}

static void launch(cudaStream_t st, const void *fn, int nb, int threads, bool pdl, void **args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(nb);
    cfg.blockDim = dim3(threads);
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelExC(&cfg, fn, args));
}

// us per link of `variant` for a chain of `links` links of `nb` blocks.
static double run(const char *variant, int nb, int links, int threads) {
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    float *bufs;
    unsigned *cnt;
    CK(cudaMalloc(&bufs, sizeof(float) * (size_t)nb * (links + 1)));
    CK(cudaMemset(bufs, 0, sizeof(float) * (size_t)nb * (links + 1)));
    const size_t ncnt = (size_t)nb * (links + 1);  // flags: one per (link, block)
    CK(cudaMalloc(&cnt, sizeof(unsigned) * ncnt));
    const std::string v(variant);
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    CK(cudaMemsetAsync(cnt, 0, sizeof(unsigned) * ncnt, st));
    if (v == "barrier") {
        void *args[] = {&bufs, &links, &cnt};
        launch(st, (const void *)persistent, nb, threads, false, args);
    } else if (v == "fbarrier") {
        void *args[] = {&bufs, &links, &cnt};
        launch(st, (const void *)persistent_flags, nb, threads, false, args);
    } else {
        for (int l = 0; l < links; ++l) {
            float *in = bufs + (size_t)l * nb, *out = bufs + (size_t)(l + 1) * nb;
            if (v == "plain") {
                void *args[] = {&in, &out};
                launch(st, (const void *)link_plain, nb, threads, false, args);
            } else if (v == "pdl") {
                void *args[] = {&in, &out};
                launch(st, (const void *)link_pdl, nb, threads, l > 0, args);
            } else if (v == "flags") {
                const unsigned *w = l > 0 ? cnt + (size_t)(l - 1) * nb : nullptr;
                unsigned *s = cnt + (size_t)l * nb;
                void *args[] = {&in, &out, &w, &s};
                launch(st, (const void *)link_flags, nb, threads, l > 0, args);
            } else {
                const unsigned *w = l > 0 ? cnt + l - 1 : nullptr;
                unsigned *s = cnt + l;
                void *args[] = {&in, &out, &w, &s};
                launch(st, (const void *)link_flag, nb, threads, l > 0, args);
            }
        }
    }
    CK(cudaStreamEndCapture(st, &g));
    cudaGraphExec_t ge;
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 5; ++i) CK(cudaGraphLaunch(ge, st));
    CK(cudaStreamSynchronize(st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int r = 0; r < 21; ++r) {
        CK(cudaEventRecord(e0, st));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    // Check: the last link's values are all `links`.
    std::vector<float> last(nb);
    CK(cudaMemcpy(last.data(), bufs + (size_t)links * nb, sizeof(float) * nb, cudaMemcpyDeviceToHost));
    for (int b = 0; b < nb; ++b)
        if (last[b] != (float)links) {
            std::fprintf(stderr, "%s nb=%d: block %d holds %g, expected %d\n", variant, nb, b, last[b], links);
            std::exit(1);
        }
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    CK(cudaFree(bufs));
    CK(cudaFree(cnt));
    CK(cudaStreamDestroy(st));
    return ms[ms.size() / 2] * 1e3 / links;
}

int main() {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    const int links = 200, threads = 128;
    std::printf("%s, %d SMs; a chain of %d links of %d-thread blocks, CUDA graph replay, median of 21\n\n", p.name,
                p.multiProcessorCount, links, threads);
    std::printf("| blocks per link | plain | pdl | flag (one counter) | flags (per block) | barrier (one counter) | "
                "fbarrier (per-block flags) |\n|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int nb : {16, 132, 264, 396}) {
        std::printf("| %d", nb);
        for (const char *v : {"plain", "pdl", "flag", "flags", "barrier", "fbarrier"}) std::printf(" | %.2f", run(v, nb, links, threads));
        std::printf(" |\n");
    }
    std::printf("\n(us per link)\n");
    return 0;
}
