// Can part of a weight stream stay in L2 from one draft step to the next, and does it pay?
// The draft step reads ~1.7 GB of weights per call (8B shape, q8_0), far past the 50 MB L2, so
// every byte comes from HBM. A persisting L2 set-aside (cudaLimitPersistingL2CacheSize) with an
// access policy window over part of one matrix keeps up to that many bytes resident across
// calls; the question is what that saves on a stream at the copy bandwidth (the lm_head, 661 MB
// at the 8B shape: the one matmul of the step that streams at its bytes) and whether the lines
// survive a verify of the target in between (modelled by streaming a 4 GiB buffer, no window).
//
// Modes (each: warm-up passes, then the median of 15 timed passes of the W stream alone):
//   none          no set-aside, no window
//   win=F         set-aside = the device maximum, window over the first F bytes of W,
//                 hitRatio = min(1, set-aside / F), hitProp persisting, missProp streaming
//   +target       between W passes a 4 GiB read (another stream of the same kernel, no window)
//                 and a 1 GiB device-to-device copy: what a verify of an 8B target streams
//
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o l2_persist l2_persist.cu && ./l2_persist
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "ck.cuh"

typedef unsigned long long u64;

// Each block streams one contiguous range (as a matmul block streams its tiles), 16-byte
// non-coherent loads, 4 in flight per thread; the xor keeps the loads.
__global__ void __launch_bounds__(256) stream_read(const uint4 *__restrict__ p, u64 n16, u64 per_block, unsigned *sink) {
    const u64 b0 = (u64)blockIdx.x * per_block, b1 = min(n16, b0 + per_block);
    unsigned acc = 0;
    for (u64 i = b0 + threadIdx.x; i < b1; i += 4 * 256) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const u64 j = i + (u64)u * 256;
            v[u] = j < b1 ? __ldg(p + j) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

__global__ void fill(uint4 *p, u64 n16, unsigned seed) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n16; i += (u64)gridDim.x * blockDim.x) {
        unsigned x = (unsigned)i * 2654435761u ^ seed;
        p[i] = make_uint4(x, x * 3u, x * 5u, x * 7u);
    }
}

static int g_sms = 132;

static void launch_read(cudaStream_t s, const void *p, u64 bytes, unsigned *sink) {
    const u64 n16 = bytes / 16;
    const int blocks = g_sms * 8;
    const u64 per = (n16 + blocks - 1) / blocks;
    stream_read<<<blocks, 256, 0, s>>>((const uint4 *)p, n16, per, sink);
}

static void set_window(cudaStream_t s, void *base, size_t bytes, float hit) {
    cudaStreamAttrValue a = {};
    a.accessPolicyWindow.base_ptr = base;
    a.accessPolicyWindow.num_bytes = bytes;
    a.accessPolicyWindow.hitRatio = hit;
    a.accessPolicyWindow.hitProp = bytes ? cudaAccessPropertyPersisting : cudaAccessPropertyNormal;
    a.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
    CK(cudaStreamSetAttribute(s, cudaStreamAttributeAccessPolicyWindow, &a));
}

int main() {
    int dev = 0, l2 = 0, max_persist = 0, max_win = 0;
    CK(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    g_sms = prop.multiProcessorCount;
    CK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
    CK(cudaDeviceGetAttribute(&max_persist, cudaDevAttrMaxPersistingL2CacheSize, dev));
    CK(cudaDeviceGetAttribute(&max_win, cudaDevAttrMaxAccessPolicyWindowSize, dev));
    printf("%s: %d SMs, L2 %.1f MB, max persisting %.1f MB, max window %.1f MB\n", prop.name, g_sms, l2 / 1e6,
           max_persist / 1e6, max_win / 1e6);

    const u64 wbytes = 661ull << 20, tbytes = 4ull << 30, cbytes = 1ull << 30;
    void *w, *t, *c0, *c1;
    unsigned *sink;
    CK(cudaMalloc(&w, wbytes));
    CK(cudaMalloc(&t, tbytes));
    CK(cudaMalloc(&c0, cbytes));
    CK(cudaMalloc(&c1, cbytes));
    CK(cudaMalloc(&sink, 4));
    fill<<<1024, 256>>>((uint4 *)w, wbytes / 16, 1u);
    fill<<<1024, 256>>>((uint4 *)t, tbytes / 16, 2u);
    fill<<<1024, 256>>>((uint4 *)c0, cbytes / 16, 3u);
    CK(cudaDeviceSynchronize());

    cudaStream_t s, so;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&so, cudaStreamNonBlocking));

    // Copy bandwidth (read + write), as the bench's floor measures it.
    const float copy_ms = median_ms(s, 9, [&] { CK(cudaMemcpyAsync(c1, c0, cbytes, cudaMemcpyDeviceToDevice, s)); });
    const double copy_bw = 2.0 * cbytes / (copy_ms * 1e-3) / 1e9;
    printf("copy bandwidth %.0f GB/s (read + write, 1 GiB, median of 9); W = %.0f MB: %.1f us at it\n", copy_bw,
           wbytes / 1e6, wbytes / (copy_bw * 1e9) * 1e6);

    struct Mode {
        const char *name;
        size_t win;
        bool target;
    };
    const size_t mw = (size_t)max_win, mp = (size_t)max_persist;
    std::vector<Mode> modes = {
        {"none", 0, false},
        {"win=set-aside", mp, false},
        {"win=max", std::min(mw, (size_t)wbytes), false},
        {"none +target", 0, true},
        {"win=set-aside +target", mp, true},
        {"win=max +target", std::min(mw, (size_t)wbytes), true},
    };
    printf("| mode | window MB | hitRatio | W pass us (median of 15) | vs none | W read GB/s |\n|---|---:|---:|---:|---:|---:|\n");
    double base[2] = {0, 0};
    for (int round = 0; round < 2; ++round) {
        for (const Mode &m : modes) {
            CK(cudaDeviceSynchronize());
            CK(cudaCtxResetPersistingL2Cache());
            CK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, m.win ? mp : 0));
            const float hit = m.win ? std::min(1.0f, (float)mp / (float)m.win) : 0.0f;
            set_window(s, w, m.win, hit);
            // The target's verify stand-in, on the other stream (no window), then W.
            const double us = median_us_after(
                s, 15, 5,
                [&] {
                    if (m.target) {
                        launch_read(so, t, tbytes, sink);
                        CK(cudaMemcpyAsync(c1, c0, cbytes, cudaMemcpyDeviceToDevice, so));
                        CK(cudaStreamSynchronize(so));
                    }
                },
                [&] { launch_read(s, w, wbytes, sink); });
            const int bi = m.target ? 1 : 0;
            if (m.win == 0) base[bi] = us;
            printf("| %s (round %d) | %.1f | %.3f | %.1f | %+.1f us | %.0f |\n", m.name, round + 1, m.win / 1e6, hit, us,
                   us - base[bi], wbytes / (us * 1e-6) / 1e9);
        }
    }
    set_window(s, w, 0, 0.0f);
    CK(cudaCtxResetPersistingL2Cache());
    CK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 0));
    return 0;
}
