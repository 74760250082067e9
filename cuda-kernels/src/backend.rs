//! `Cuda: Backend` over cudarc: one context, one stream, kernels from the registry.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::{sys as cublas_sys, CudaBlas};
use cudarc::driver::{
    result as drv_result, sys as drv_sys, CudaContext, CudaFunction, CudaSlice, CudaStream,
    CudaView, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use dflash_backend::{
    attention_fast_kv16_ops, attention_layer_tail_ops, check_f16_range, check_f16_rows,
    layer_tail_ops, mlp_residual_ops, norm_rows_matmul_ops, qk_norm_rope_kv_ops, AttnOp,
    AttnParams, Backend, BackendError, DeltaParams, GatedNorm, HostData, HostWeight, KvCacheRows,
    KvStorage, LayerTail, QkNormRope, RopeSpec, TailScratch, Weight, WeightFormat,
};

use crate::error::{dev, CudaError};
use crate::registry::{arch_for, Kernel, Registry};

mod attention;
mod markov;
mod skinny;
use attention::{AttnAct, AttnExtra};
pub use attention::{AttnFa, AttnKernel};

type Result<T> = std::result::Result<T, BackendError>;

/// Largest row count served by the per-row-deterministic skinny matmul in one launch.
pub const SKINNY_ROWS: usize = 16;

/// Tokens per thread of `causal_conv1d` (its chunks run side by side; at least kernel - 1,
/// and few enough chunks for the grid's y dimension).
const CONV_CHUNK: usize = 16;

/// Rows from which q8_0 / q4_0 matmuls take cuBLAS by default
/// ([`Cuda::set_quant_prefill_rows`]): the dense 8B target's q8_0 prefill crossed over
/// between 64 and 128 tokens (H100, 2026-12-06: 128 tokens 47.2 ms through the skinny
/// kernels, 41.8 through cuBLAS).
pub const QUANT_PREFILL_ROWS: usize = 128;

/// Rows from which Q8_0A8 / Q4_0A8 matmuls take cuBLAS by default
/// ([`Cuda::set_quant_prefill_rows`]): their skinny kernels run on the int8 tensor cores, so
/// the dense 8B target's Q8_0A8 prefill crossed over later, at ~300 tokens (H100,
/// 2026-12-06: 256 tokens 53.6 ms skinny against 59.5 on cuBLAS, 384 tokens 80.4 against
/// 69.5).
pub const A8_PREFILL_ROWS: usize = 320;

/// The arithmetic of a prompt's prefill on CUDA ([`Cuda::set_prefill_precision`]): the
/// matmuls of more than [`SKINNY_ROWS`] rows on cuBLAS and the causal attention of more than
/// [`SKINNY_ROWS`] query rows. A prefill is the one start a speculative and a plain run share,
/// so either choice keeps the speculative stream equal to the plain one; what changes is how
/// close the prompt's K / V and last logits stay to the CPU's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefillPrecision {
    /// x (and a block format's dequantized W) split into bf16 hi + lo, two or three bf16
    /// products (~16 significant bits of each side); the attention over an f32 cache with Q,
    /// K, V and P split the same way, three bf16 products each (hi lo + lo hi + hi hi;
    /// [`Cuda::set_attn_prefill_fa`]; off: 3xTF32). Within 1e-3 of the CPU's logits (bf16 / q8_0
    /// weights).
    #[default]
    Exact,
    /// One bf16 product per matmul of bf16 or block-format weights (x, and a block format's
    /// W, rounded to bf16, f32 accumulation: a bf16 inference engine's prefill; f32 weights
    /// keep their f32 GEMM) and the attention over an f32 cache with Q, K, V and P rounded to f16
    /// (one product; [`Cuda::set_attn_prefill_fa`]); an f16 cache's attention is the same
    /// either way.
    Fast,
}

/// How a prompt's attention (64 query rows or more, f32 cache) runs at a head dim without a
/// tensor-core prefill kernel ([`Cuda::set_attn_gemm`]): per block of query rows, S = scale Q
/// K^T over the keys the block sees (one cuBLAS product), a masked softmax kernel, O = P V (a
/// second product). Under [`PrefillPrecision::Fast`], [`AttnGemm::Bf16x3`]'s products take
/// f16 operands (Q, K, V and P rounded to f16, one product each, as the prefill kernels' fast
/// arithmetic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttnGemm {
    /// The split kernel of the decode and verify rows instead (at head dim 256 the 3xTF32
    /// tensor-core one with 2 key warps; [`AttnKernel`]).
    Off,
    /// f32 products (CUBLAS_COMPUTE_32F: CUDA cores, no TF32), one kv head at a time, under
    /// either precision.
    F32,
    /// Q, K, V and P split into bf16 hi + lo, each product as one bf16 tensor-core product
    /// over three times its inner dimension (hi hi + hi lo + lo hi, f32 accumulation): the
    /// arithmetic of the FlashAttention-2-style prefill kernels at head dims 32 / 64 / 128.
    /// Every head in one product; the second product's long inner dimension (three values a
    /// key) in chunks of keys whose partial outputs a kernel sums, so that it fills the GPU.
    Bf16x3,
    /// [`AttnGemm::Bf16x3`]'s arithmetic (f16 under [`PrefillPrecision::Fast`]) in one
    /// FlashAttention-2-style kernel at head dim 256 (`attn_pf2_d256_*`: two warps per 16 rows,
    /// half the head dims each; K and V split into their operands once per call): no scores
    /// or probabilities through memory. Other head dims take [`AttnGemm::Bf16x3`]'s products.
    #[default]
    Fused,
}

/// Keys per split of a prefill's causal attention by default ([`Cuda::set_attn_prefill_split`]):
/// one split for any span up to 2^20 keys.
pub const ATTN_PREFILL_SPLIT: usize = 1 << 20;
const ARGMAX_CHUNK: usize = 4096;
/// A null device pointer kernel argument (an optional output left out).
const NULL_PTR: u64 = 0;
/// Q8_0A8: 32-value blocks per pipeline stage (`A8_KC` in prelude.cuh); rows of the
/// repacked weight are padded to a whole number of stages.
const A8_KC: usize = 8;
/// Q8_0A8: cp.async pipeline depth for `w` warps per block (the `A8(...)` instances in
/// matmul.cu).
fn a8_stages(w: usize) -> usize {
    match w {
        1 => 12,
        2 => 8,
        _ => 4,
    }
}

/// Shared memory limits of a device: the most one thread block may take (opt-in) and one
/// multiprocessor's total. Kernel choices respect them (H100 / H200: 227 / 228 KiB; sm_86 /
/// sm_89: 99 / 100 KiB; A100: 163 / 164 KiB).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SmemLimits {
    pub(crate) block: usize,
    pub(crate) sm: usize,
}

impl SmemLimits {
    /// The H100 / H200 (sm_90) limits.
    #[cfg(test)]
    pub(crate) const SM90: SmemLimits = SmemLimits {
        block: 227 * 1024,
        sm: 228 * 1024,
    };
}

/// Blocks of the Q8_0A8 contract's f32 chunk ([`dflash_backend::A8_CHUNK_BLOCKS`], `A8_CB` in
/// matmul.cu).
const A8_CB: usize = dflash_backend::A8_CHUNK_BLOCKS;

/// Which Q8_0A8 matmul kernel runs (the results are bit-identical either way; this only
/// picks the launch shape, for benchmarks and tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum A8Kernel {
    /// The default: a split kernel chosen from the tile count and K (whole-K for K <= 2048);
    /// the rule and its measurements are in `Cuda::matmul_a8`.
    Auto,
    /// One warp per (tile, token group) over all of K (chunk after chunk).
    WholeK,
    /// Whole-K with K split over the warps of a block: `(w, ks, s)` = `w` tiles x `ks`
    /// slices, slice `i` running chunks `i, i + ks, ...`, the chunk sums added in order in
    /// shared memory, an `s`-stage pipeline. One of (1, 4, 3), (1, 2, 3),
    /// (2, 2, 4), (2, 4, 3), (2, 4, 2), (4, 1, 3), (4, 2, 3), (4, 2, 2), (4, 4, 2); any other
    /// runs whole-K.
    Split(u8, u8, u8),
    /// As [`A8Kernel::Split`], with K also split across thread blocks: a block runs one
    /// round (`ks` chunks) of one tile group and writes its chunk sums to a workspace; a second
    /// kernel (`a8_sum`) adds them in chunk order. More, shorter blocks for few tall tiles over
    /// a long K (the automatic choice for the 27B down projection, 320 tiles of 17 chunks,
    /// until 1 x 2 x 3 measured faster; now only chosen explicitly).
    SplitApart(u8, u8, u8),
}

/// Q8_0A8 split kernels (`A8K(...)` in matmul.cu) for `nt` token groups, `w` tiles, `ks`
/// k-slices and an `s`-stage pipeline.
fn a8k_kernel(nt: usize, w: usize, ks: usize, s: usize) -> Option<Kernel> {
    Some(match (nt, w, ks, s) {
        (1, 1, 4, 3) => Kernel::A8KN1W1K4S3,
        (1, 1, 2, 3) => Kernel::A8KN1W1K2S3,
        (1, 2, 2, 4) => Kernel::A8KN1W2K2S4,
        (1, 2, 4, 3) => Kernel::A8KN1W2K4S3,
        (1, 2, 4, 2) => Kernel::A8KN1W2K4S2,
        (1, 4, 1, 3) => Kernel::A8KN1W4K1S3,
        (1, 4, 2, 3) => Kernel::A8KN1W4K2S3,
        (1, 4, 2, 2) => Kernel::A8KN1W4K2S2,
        (1, 4, 4, 2) => Kernel::A8KN1W4K4S2,
        (2, 1, 4, 3) => Kernel::A8KN2W1K4S3,
        (2, 1, 2, 3) => Kernel::A8KN2W1K2S3,
        (2, 2, 2, 4) => Kernel::A8KN2W2K2S4,
        (2, 2, 4, 3) => Kernel::A8KN2W2K4S3,
        (2, 2, 4, 2) => Kernel::A8KN2W2K4S2,
        (2, 4, 1, 3) => Kernel::A8KN2W4K1S3,
        (2, 4, 2, 3) => Kernel::A8KN2W4K2S3,
        (2, 4, 2, 2) => Kernel::A8KN2W4K2S2,
        (2, 4, 4, 2) => Kernel::A8KN2W4K4S2,
        _ => return None,
    })
}

/// The paired gate / up kernels (`A8KP(...)` in matmul.cu: 2 gate + 2 up tiles per block) for
/// `nt` token groups, `ks` k-slices and an `s`-stage pipeline.
fn a8kp_kernel(nt: usize, ks: usize, s: usize) -> Option<Kernel> {
    Some(match (nt, ks, s) {
        (1, 2, 2) => Kernel::A8KPN1W4K2S2,
        (2, 2, 2) => Kernel::A8KPN2W4K2S2,
        (1, 1, 3) => Kernel::A8KPN1W4K1S3,
        (2, 1, 3) => Kernel::A8KPN2W4K1S3,
        (1, 1, 2) => Kernel::A8KPN1W4K1S2,
        (2, 1, 2) => Kernel::A8KPN2W4K1S2,
        _ => return None,
    })
}

/// The paired gate / up kernel for `grid` blocks (see [`Cuda::set_a8_pair_kernel`]): (1, 3)
/// while the blocks fit one wave of as many per SM as the shared memory allows, else (1, 2)
/// while those do, else (1, 3). The Q4_0A8 twins for 16 rows (one warp per tile for both
/// token groups): (2, 2), whose 2 k-slices give a block the warps of a Q8_0A8 block (H200,
/// q4_0a8 step, graph ms, ctx 512, two rounds: 8B (1, 3) 0.560 / 0.562 -> 0.509 / 0.510;
/// 27B, which takes the queue launch (0.872 / 0.877), without it 0.953 / 0.956 -> 0.910 /
/// 0.909).
fn a8_pair_auto(grid: usize, nt: usize, sms: usize, lim: SmemLimits, q4: bool) -> (u8, u8) {
    if q4 && a8_wpt(nt, q4) < nt {
        return (2, 2);
    }
    // Per block the driver also reserves 1 KiB of shared memory.
    let per_sm = |st: usize| lim.sm / (a8k_smem_bytes(nt, 4, 1, st, q4) + 1024);
    if grid <= per_sm(3) * sms || grid > per_sm(2) * sms {
        (1, 3)
    } else {
        (1, 2)
    }
}

/// The paired gate / up launch with a queue for the groups left over (`A8KPQ` in matmul.cu,
/// [`Cuda::set_a8_pair_queue`]) for `grid` groups of `nch` chunks on `sms` SMs: where the
/// groups spread unevenly over one wave (the fullest SM's groups over the mean >= 1.1: the 27B
/// shape's 544 groups on 132 SMs, 5 on some SMs for a mean of 4.12), `bps` = grid / sms
/// blocks per SM (held there by their shared memory) run one group each and the rest runs as
/// pieces of one tile x one chunk (4 tiles per group). Some(plan), or None for the plain
/// launch. At most 4 per SM (the launch bound's registers for 16 rows).
fn a8_pair_queue(
    grid: usize,
    nch: usize,
    nt: usize,
    sms: usize,
    lim: SmemLimits,
    q4: bool,
) -> Option<A8Queue> {
    let bps = grid / sms.max(1);
    if bps == 0 || bps > 4 || grid.div_ceil(sms) * sms * 10 < grid * 11 {
        return None;
    }
    let smem = a8_pair_queue_smem(nt, bps, lim.sm, q4);
    if (smem + 1024) * bps > lim.sm || smem > lim.block {
        return None;
    }
    let whole = bps * sms;
    Some(A8Queue {
        bps,
        whole,
        pieces: (grid - whole) * 4 * nch,
        smem,
    })
}

/// The queue launch's shared memory per block for `bps` blocks per SM of `sm` bytes: the
/// 2-stage pipeline or a piece (one tile's chunk of weights and x: `A8_CB` blocks), whichever
/// is larger, + 16 bytes, padded so that bps + 1 blocks (+ the driver's 1 KiB each) do not
/// fit.
fn a8_pair_queue_smem(nt: usize, bps: usize, sm: usize, q4: bool) -> usize {
    let piece = A8_CB * (nt * 288 + a8_wb(q4) + 32);
    let need = a8k_smem_bytes(nt, 4, 1, 2, q4).max(piece) + 16;
    need.max((sm / (bps + 1)).saturating_sub(1024).next_multiple_of(16) + 16)
}

/// A queue launch's plan ([`a8_pair_queue`]): `whole` = `bps` x SMs blocks of `smem` bytes of
/// shared memory, each running one group, then `pieces` from the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct A8Queue {
    bps: usize,
    whole: usize,
    pieces: usize,
    smem: usize,
}

/// Shared memory of one split Q8_0A8 block: the pipeline (`stages` x `ks` slices) and, with
/// more than one slice, two rounds of chunk sums (`ks` slices x `w` tiles x `nt` token groups
/// x 32 lanes x float4; one slice adds its chunk sums in registers).
fn a8k_smem_bytes(nt: usize, w: usize, ks: usize, stages: usize, q4: bool) -> usize {
    let part = if ks > 1 { 2 * ks * w * nt * 512 } else { 0 };
    stages * ks * (A8_KC * nt * 288 + w * A8_KC * (a8_wb(q4) + 32)) + part
}

/// Warps per tile (and k-slice) of a Q8_0A8 / Q4_0A8 kernel for `nt` token groups of 8: one
/// per group for Q8_0A8, one for all of them for Q4_0A8 (`A8_WPT` in matmul.cu).
fn a8_wpt(nt: usize, q4: bool) -> usize {
    if q4 {
        1
    } else {
        nt
    }
}

/// Weight bytes per (16-row tile, 32-value block): Q8_0A8's int8 fragments, or Q4_0A8's nibbles
/// (`A8_WB` in matmul.cu).
fn a8_wb(q4: bool) -> usize {
    if q4 {
        256
    } else {
        512
    }
}

/// Every split Q8_0A8 kernel (`A8K` and the paired `A8KP` in matmul.cu) with its threads per
/// block and the shared memory per block the host launches it with: what the kernels' launch
/// bounds are derived from (`A8K_MINB`, checked against this in `tests/nvrtc_compile.rs`).
#[doc(hidden)]
pub fn a8_split_kernel_shapes() -> Vec<(Kernel, usize, usize)> {
    let mut v = Vec::new();
    for nt in [1, 2] {
        for q4 in [false, true] {
            let twin = |k: Kernel| if q4 { k.q4_twin() } else { Some(k) };
            for w in [1, 2, 4] {
                for ks in [1, 2, 4] {
                    for st in [2, 3, 4] {
                        let shape = (
                            32 * w * a8_wpt(nt, q4) * ks,
                            a8k_smem_bytes(nt, w, ks, st, q4),
                        );
                        if let Some(k) = a8k_kernel(nt, w, ks, st).and_then(twin) {
                            v.push((k, shape.0, shape.1));
                        }
                        if let Some(k) = a8kp_kernel(nt, ks, st).filter(|_| w == 4).and_then(twin) {
                            v.push((k, shape.0, shape.1));
                        }
                    }
                }
            }
            // The queue launch at 4 blocks per SM of 228 KiB (the 27B gate / up on the H200).
            let k = if nt == 1 {
                Kernel::A8KPQN1W4K1S2
            } else {
                Kernel::A8KPQN2W4K1S2
            };
            if let Some(k) = twin(k) {
                v.push((
                    k,
                    128 * a8_wpt(nt, q4),
                    a8_pair_queue_smem(nt, 4, 228 * 1024, q4),
                ));
            }
        }
    }
    v
}

/// A Q8_0A8 kernel choice that fits `limit` bytes of shared memory per block: `mode` itself
/// (whole-K with `whole_w` tiles per block), else 4 tiles x 2 slices x 2 stages, else whole-K
/// with 4 tiles per block (the smallest pipelines); `None` if not even that fits. The same
/// bits whichever runs.
fn a8_fit(
    mode: A8Kernel,
    nt: usize,
    whole_w: usize,
    limit: usize,
    q4: bool,
) -> Option<(A8Kernel, usize)> {
    let smem = |m: A8Kernel, ww: usize| match m {
        A8Kernel::Split(w, ks, st) | A8Kernel::SplitApart(w, ks, st) => {
            a8k_smem_bytes(nt, w as usize, ks as usize, st as usize, q4)
        }
        _ => a8_smem_bytes(nt, ww, q4),
    };
    let small = match mode {
        A8Kernel::SplitApart(..) => A8Kernel::SplitApart(4, 2, 2),
        _ => A8Kernel::Split(4, 2, 2),
    };
    [(mode, whole_w), (small, whole_w), (A8Kernel::WholeK, 4)]
        .into_iter()
        .find(|&(m, ww)| smem(m, ww) <= limit)
}

/// Blocks per row of a repacked Q8_0A8 weight (K / 32 rounded up to whole stages).
fn a8_kbp(cols: usize) -> usize {
    (cols / 32).div_ceil(A8_KC) * A8_KC
}

/// Shared memory of one Q8_0A8 matmul block: `nt` token groups of 8, `w` warps.
fn a8_smem_bytes(nt: usize, w: usize, q4: bool) -> usize {
    a8_stages(w) * (A8_KC * nt * 288 + w * A8_KC * (a8_wb(q4) + 32))
}

/// An f32 activation buffer on the device.
pub struct CudaBuf {
    pub(crate) data: CudaSlice<f32>,
    len: usize,
}

impl CudaBuf {
    /// The underlying device slice (at least `len` values; one spare value for empty buffers).
    pub fn slice(&self) -> &CudaSlice<f32> {
        &self.data
    }
    pub fn slice_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.data
    }
}

/// A weight matrix in device memory, in its format. Block formats are repacked for aligned
/// loads: q8_0 as int8 codes `[rows, cols]` + f16 scales `[rows, cols/32]`; q4_0 as one u32
/// per (row, block, quarter q) holding the nibbles of values `8q..8q+7` (even ones in the low
/// half-word, odd ones in the high half-word) + f16 scales.
pub enum CudaWeightBuf {
    F32(CudaSlice<f32>),
    /// bf16, row-major (matrices whose K is not a multiple of 32).
    Bf16(CudaSlice<u16>),
    /// bf16 in the skinny matmuls' mma-fragment order (`repack_bf16p`; `FMT_BF16P` in
    /// prelude.cuh): tiles of 16 rows (padded with zeros), per (tile, 32-wide k tile) two
    /// halves (rows g, g + 8) of 32 lanes x 8 values, lane `4 g + t` holding k `8 t .. 8 t + 7`.
    /// Every bf16 matrix with K % 32 == 0 is stored so: a warp's weight loads are 512
    /// contiguous bytes (row-major: 8 rows x 64 bytes), 6-10% faster at 1 row and 10% at 16
    /// (`tools/bench/skinny_layout.cu`); the same values, so the same bits.
    Bf16P(CudaSlice<u16>),
    F16(CudaSlice<u16>),
    Q8_0 {
        qs: CudaSlice<i8>,
        d: CudaSlice<u16>,
    },
    Q4_0 {
        qs: CudaSlice<u32>,
        d: CudaSlice<u16>,
    },
    /// [`WeightFormat::Q8_0A8`]: q8_0 codes repacked into int8 mma A fragments. Tiles of 16
    /// rows (padded); per (tile, block) 32 lanes x 16 bytes (lane `(r % 8) * 4 + (k % 16) / 4`,
    /// register `(k >= 16) * 2 + (r >= 8)`, byte `k % 4`), blocks padded to whole stages
    /// (`a8_kbp`); scales as f16 pairs `(row g, row g + 8)` per (tile, block, g).
    Q8A8 {
        qs: CudaSlice<u8>,
        d: CudaSlice<u16>,
    },
    /// [`WeightFormat::Q4_0A8`]: q4_0 codes in the tiles and blocks of [`CudaWeightBuf::Q8A8`],
    /// 8 bytes per lane: rows `g` and `g + 8`'s q4_0 bytes `4t .. 4t + 3` of the block (lane
    /// `g * 4 + t`; low nibbles `k = 4t ..`, high nibbles `k = 16 + 4t ..`), which the Q4_0A8
    /// kernels widen into Q8A8's fragments; the scales as Q8A8's.
    Q4A8 {
        qs: CudaSlice<u8>,
        d: CudaSlice<u16>,
    },
}

/// An A8 weight's device parts: codes, scales, and whether the codes are Q4_0A8 nibbles.
pub(crate) struct A8Parts<'a> {
    pub qs: &'a CudaSlice<u8>,
    pub d: &'a CudaSlice<u16>,
    pub q4: bool,
}

impl CudaWeightBuf {
    /// Bytes of device memory that a full pass over the matrix reads.
    pub fn device_bytes(&self) -> usize {
        match self {
            CudaWeightBuf::F32(s) => s.num_bytes(),
            CudaWeightBuf::Bf16(s) | CudaWeightBuf::Bf16P(s) | CudaWeightBuf::F16(s) => {
                s.num_bytes()
            }
            CudaWeightBuf::Q8_0 { qs, d } => qs.num_bytes() + d.num_bytes(),
            CudaWeightBuf::Q4_0 { qs, d } => qs.num_bytes() + d.num_bytes(),
            CudaWeightBuf::Q8A8 { qs, d } | CudaWeightBuf::Q4A8 { qs, d } => {
                qs.num_bytes() + d.num_bytes()
            }
        }
    }

    /// The parts of a [`WeightFormat::Q8_0A8`] or [`WeightFormat::Q4_0A8`] weight (the
    /// formats the A8 kernels take); None for the others.
    pub(crate) fn a8(&self) -> Option<A8Parts<'_>> {
        match self {
            CudaWeightBuf::Q8A8 { qs, d } => Some(A8Parts { qs, d, q4: false }),
            CudaWeightBuf::Q4A8 { qs, d } => Some(A8Parts { qs, d, q4: true }),
            _ => None,
        }
    }
    fn fmt_code(&self) -> i32 {
        match self {
            CudaWeightBuf::F32(_) => 0,
            CudaWeightBuf::Bf16(_) => 1,
            CudaWeightBuf::F16(_) => 2,
            CudaWeightBuf::Q8_0 { .. } => 3,
            CudaWeightBuf::Q4_0 { .. } => 4,
            CudaWeightBuf::Q8A8 { .. } => 5,
            CudaWeightBuf::Q4A8 { .. } => 7,
            CudaWeightBuf::Bf16P(_) => 6,
        }
    }
}

/// Options of the CUDA backend.
#[derive(Clone, Copy, Debug)]
pub struct CudaOptions {
    /// Use cuBLAS for bf16 / f32 matmuls of more than [`SKINNY_ROWS`] rows (prompt prefill).
    /// cuBLAS picks algorithms by shape, so such rows may differ in the last bits from the
    /// same rows computed alone; turn this off to make every matmul per-row deterministic.
    pub cublas_prefill: bool,
    /// Compile the kernels with per-block trace records (a profiling aid, off by default):
    /// every block of a kernel that waits for the kernel before it records its SM and when it
    /// reached and left the wait; the Q8_0A8 matmul blocks also record the end of their main
    /// loop. Read with [`Cuda::block_trace`] after [`Cuda::block_trace_reset`] and one replay
    /// of the step; it costs ~4% of the drafter step (H200, 8B shape). `xtask bench gpu
    /// --trace FILE` writes them as CSV, `tools/bench/block_trace.py` reads that.
    pub block_trace: bool,
    /// Bytes of freed memory the backend's memory pool keeps for later buffers at a
    /// synchronization (its release threshold; [`Cuda::set_pool_keep`], [`Cuda::trim_pool`]).
    /// Default `u64::MAX`: every freed byte, as a caching allocator does (a prefill frees and
    /// allocates gigabytes of activations per call; CUDA's default pool, which returns them
    /// to the driver at each synchronization, made the 27B-shape hybrid target's prefill of
    /// 8192 tokens 3-5 ms slower on an H100). 0: CUDA's default behaviour.
    pub pool_keep: u64,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            cublas_prefill: true,
            block_trace: false,
            pool_keep: u64::MAX,
        }
    }
}

/// The backend's own stream-ordered memory pool on its device (`cuMemPoolCreate`): the
/// buffers of `Backend::zeros`, `Backend::scratch`, `Backend::upload` and
/// [`Cuda::upload_ids`] come from it (outside a graph capture of the op stream), with the
/// release threshold of [`CudaOptions::pool_keep`]. The backend's long-lived buffers (weights,
/// its growable scratch) come from the device's pool as before. Its own pool, not
/// the device's current one, so that the threshold changes nothing for other users of the
/// device in the process. Destroyed with the backend; the driver frees it once its last
/// buffer is freed.
struct MemPool(drv_sys::CUmemoryPool);

// SAFETY: a driver handle; the driver's pool calls are thread-safe.
unsafe impl Send for MemPool {}
// SAFETY: as above.
unsafe impl Sync for MemPool {}

impl MemPool {
    fn new(ordinal: usize, keep: u64) -> std::result::Result<Self, CudaError> {
        use drv_sys::{CUmemAllocationType, CUmemLocationType};
        // SAFETY: zeroed pool properties are valid (no handle types, no flags) once the
        // allocation type and location are set; the pool is destroyed by Drop.
        let pool = unsafe {
            let mut props: drv_sys::CUmemPoolProps = std::mem::zeroed();
            props.allocType = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            props.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            props.location.id = ordinal as i32;
            drv_result::mem_pool::create(&props)?
        };
        let p = MemPool(pool);
        p.set_keep(keep)?;
        Ok(p)
    }

    fn set_keep(&self, bytes: u64) -> std::result::Result<(), CudaError> {
        let mut v = bytes;
        // SAFETY: a live pool; the release threshold attribute is a u64.
        unsafe {
            drv_result::mem_pool::set_attribute(
                self.0,
                drv_sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut v as *mut u64 as *mut _,
            )?
        };
        Ok(())
    }

    fn attr(&self, a: drv_sys::CUmemPool_attribute) -> std::result::Result<u64, CudaError> {
        let mut v = 0u64;
        // SAFETY: a live pool; the reserved / used memory attributes are u64s.
        unsafe { drv_result::mem_pool::get_attribute(self.0, a, &mut v as *mut u64 as *mut _)? };
        Ok(v)
    }
}

impl Drop for MemPool {
    fn drop(&mut self) {
        // SAFETY: created by MemPool::new, destroyed once; buffers still allocated from it
        // keep it alive in the driver until they are freed.
        let _ = unsafe { drv_result::mem_pool::destroy(self.0) };
    }
}

/// Growable device scratch, reused across launches on the one stream.
struct Scratch {
    mm_ws: Option<CudaSlice<f32>>,
    mm_counters: Option<CudaSlice<u32>>,
    att_o: Option<CudaSlice<f32>>,
    att_ml: Option<CudaSlice<f32>>,
    /// [`Cuda::attention_gemm`]'s scores of one kv head's block of rows.
    att_s: Option<CudaSlice<f32>>,
    /// Its bf16 operands under [`AttnGemm::Bf16x3`]: the block's Q, the keys' K and V (three
    /// parts each), and P (three values a score).
    att_q3: Option<CudaSlice<u16>>,
    att_k3: Option<CudaSlice<u16>>,
    att_v3: Option<CudaSlice<u16>>,
    att_p3: Option<CudaSlice<u16>>,
    am_v: Option<CudaSlice<f32>>,
    am_i: Option<CudaSlice<u32>>,
    /// The persistent Markov chain's grid barrier: [arrivals, generation], zero at rest.
    mk_bar: Option<CudaSlice<u32>>,
    ids: Option<CudaSlice<u32>>,
    toks: Option<CudaSlice<u32>>,
    x_hi: Option<CudaSlice<u16>>,
    x_lo: Option<CudaSlice<u16>>,
    /// Row blocks of a fragment-order bf16 matrix, unpacked for cuBLAS (prefills).
    w_unpack: Option<CudaSlice<u16>>,
    /// The chunked delta rule's W, U, decayed q.k and G per chunk of a span.
    gdn: Option<CudaSlice<f32>>,
    /// A counter bumped by every launch that writes x_hi / x_lo, and the (K, rows) they hold;
    /// a [`SplitAct`] names the generation it was written as.
    x_gen: u64,
    x_shape: Option<(usize, usize)>,
    /// The second pair: the down projection's x, written by the gate / up launch
    /// ([`Cuda::matmul_glu_split`]) while it reads the first; its own counter and shape.
    y_hi: Option<CudaSlice<u16>>,
    y_lo: Option<CudaSlice<u16>>,
    y_gen: u64,
    y_shape: Option<(usize, usize)>,
    a8_q: Option<CudaSlice<u32>>,
    a8_d: Option<CudaSlice<f32>>,
    a8_ws: Option<CudaSlice<f32>>,
    /// The paired queue launch's counters ([`Cuda::set_a8_pair_queue`]), zero at rest.
    a8_qctr: Option<CudaSlice<u32>>,
    /// The second activation slot: the down projection's, written by the paired gate / up
    /// launch while it reads the first.
    a8_q2: Option<CudaSlice<u32>>,
    a8_d2: Option<CudaSlice<f32>>,
    /// Per activation slot: a counter bumped by every launch that writes it, and the (K,
    /// rows) it holds; an [`A8Act`] names the generation it was written as.
    a8_gen: [u64; 2],
    a8_shape: [Option<(usize, usize)>; 2],
}

/// A Q8_0A8 activation written on the device by a producer ([`Cuda::rms_norm_q8`],
/// [`Cuda::attention_q8`], [`Cuda::matmul_gate_up_q8`]) for the projections that read it
/// ([`Cuda::matmul_many_q8`]). It stays valid until the next launch that writes its scratch
/// slot (any Q8_0A8 quantizer or producer on this backend); a projection of a stale one is an
/// error, never a read of other data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct A8Act {
    k: usize,
    rows: usize,
    slot: usize,
    generation: u64,
}

impl A8Act {
    /// Row length (K of the projections that read it).
    pub fn k(&self) -> usize {
        self.k
    }
    /// Rows (tokens).
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// The bf16 hi / lo pair of an activation (`split_bf16`'s bits) written by a producer
/// ([`Cuda::rms_norm_split`], [`Cuda::add_rms_norm_split`], [`Cuda::silu_mul_split`]) for the
/// matmuls of bf16 / q8_0 / q4_0 weights that read it ([`Cuda::matmul_many_split`]: the skinny
/// kernels for 1-16 rows, cuBLAS for a prefill's). It stays valid until the next launch that
/// writes the pair (any skinny or cuBLAS matmul of an f32 x or producer on this backend); a
/// matmul of a stale one launches nothing. A prefill's under [`PrefillPrecision::Fast`] has
/// its hi halves only (the one product reads no lo).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitAct {
    k: usize,
    rows: usize,
    generation: u64,
    hi_only: bool,
    /// In the second pair ([`Cuda::matmul_glu_split`]'s output).
    second: bool,
}

/// A cuBLAS matmul's buffers: the weight scratch (a block of W unpacked to bf16) and x's
/// bf16 hi / lo pair.
struct SplitBuffers<'a> {
    w: &'a mut CudaSlice<u16>,
    hi: &'a CudaSlice<u16>,
    lo: &'a CudaSlice<u16>,
}

impl Scratch {
    /// Record a write of the bf16 hi / lo pair holding (k, rows) (grown first if smaller);
    /// its token and the two buffers.
    fn split_written(
        &mut self,
        stream: &Arc<CudaStream>,
        k: usize,
        rows: usize,
        hi_only: bool,
    ) -> Result<(SplitAct, &mut CudaSlice<u16>, &mut CudaSlice<u16>)> {
        ensure(stream, &mut self.x_hi, rows * k).map_err(dev)?;
        ensure(stream, &mut self.x_lo, rows * k).map_err(dev)?;
        self.x_gen += 1;
        self.x_shape = Some((k, rows));
        let act = SplitAct {
            k,
            rows,
            generation: self.x_gen,
            hi_only,
            second: false,
        };
        Ok((
            act,
            self.x_hi.as_mut().ok_or_else(internal)?,
            self.x_lo.as_mut().ok_or_else(internal)?,
        ))
    }

    /// The cuBLAS prefill's buffers, grown first: `w` values of weight scratch and the x hi /
    /// lo pair for `len` values, recorded as holding no producer's activation (a later
    /// `matmul_many_split` of an older token finds it stale).
    fn prefill_buffers(
        &mut self,
        stream: &Arc<CudaStream>,
        w: usize,
        len: usize,
    ) -> Result<(
        &mut CudaSlice<u16>,
        &mut CudaSlice<u16>,
        &mut CudaSlice<u16>,
    )> {
        ensure(stream, &mut self.w_unpack, w).map_err(dev)?;
        ensure(stream, &mut self.x_hi, len).map_err(dev)?;
        ensure(stream, &mut self.x_lo, len).map_err(dev)?;
        self.x_gen += 1;
        self.x_shape = None;
        Ok((
            self.w_unpack.as_mut().ok_or_else(internal)?,
            self.x_hi.as_mut().ok_or_else(internal)?,
            self.x_lo.as_mut().ok_or_else(internal)?,
        ))
    }

    /// The pair `act` holds, if it is still current (no launch has written the pair since),
    /// with the weight scratch grown to `w` values first (the pair's token kept).
    fn split_current(
        &mut self,
        stream: &Arc<CudaStream>,
        act: &SplitAct,
        w: usize,
    ) -> Result<Option<SplitBuffers<'_>>> {
        if act.second || self.x_gen != act.generation || self.x_shape != Some((act.k, act.rows)) {
            return Ok(None);
        }
        ensure(stream, &mut self.w_unpack, w).map_err(dev)?;
        Ok(Some(SplitBuffers {
            w: self.w_unpack.as_mut().ok_or_else(internal)?,
            hi: self.x_hi.as_ref().ok_or_else(internal)?,
            lo: self.x_lo.as_ref().ok_or_else(internal)?,
        }))
    }

    /// Record a write of activation slot `slot` holding (k, rows); its token.
    fn a8_written(&mut self, slot: usize, k: usize, rows: usize) -> A8Act {
        self.a8_gen[slot] += 1;
        self.a8_shape[slot] = Some((k, rows));
        A8Act {
            k,
            rows,
            slot,
            generation: self.a8_gen[slot],
        }
    }
    /// The first activation slot, grown to `kbp` blocks of `nt` token groups if smaller.
    fn a8_first(
        &mut self,
        stream: &Arc<CudaStream>,
        kbp: usize,
        nt: usize,
    ) -> Result<(&mut CudaSlice<u32>, &mut CudaSlice<f32>)> {
        ensure(stream, &mut self.a8_q, kbp * nt * 64).map_err(dev)?;
        ensure(stream, &mut self.a8_d, kbp * nt * 8).map_err(dev)?;
        Ok((
            self.a8_q.as_mut().ok_or_else(internal)?,
            self.a8_d.as_mut().ok_or_else(internal)?,
        ))
    }

    /// Whether `act` is still what its slot holds.
    fn a8_current(&self, act: &A8Act) -> bool {
        self.a8_gen.get(act.slot) == Some(&act.generation)
            && self.a8_shape[act.slot] == Some((act.k, act.rows))
    }
}

fn stale(op: &'static str, act: &A8Act) -> BackendError {
    BackendError::Invalid {
        op,
        msg: format!(
            "the Q8_0A8 activation ({} rows x {}) was overwritten by a later launch on this backend",
            act.rows, act.k
        ),
    }
}

/// Threads of an `argmax_final` block over `n` partials: each loads up to 4 of them in one
/// batch of round trips (a warp looping over 594 Markov partials, 19 dependent round trips,
/// took 16 us in ncu), a multiple of 32, at most 1024.
fn am_final_threads(n: usize) -> u32 {
    (n.div_ceil(4).next_multiple_of(32)).clamp(32, 1024) as u32
}

fn ensure<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<CudaSlice<T>>,
    len: usize,
) -> std::result::Result<(), CudaError> {
    let len = len.max(1);
    if slot.as_ref().is_none_or(|s| s.len() < len) {
        *slot = Some(stream.alloc_zeros::<T>(len)?);
    }
    Ok(())
}

/// The CUDA backend.
pub struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// A second stream for [`Cuda::l2_prefetch`] hints only (they run beside the ops).
    pf_stream: Arc<CudaStream>,
    /// A third stream for [`Cuda::timeline_mark`] marks only.
    tl_stream: Arc<CudaStream>,
    reg: Registry,
    num_sms: usize,
    smem: SmemLimits,
    opts: CudaOptions,
    scratch: Mutex<Scratch>,
    rope_cache: Mutex<HashMap<Vec<u32>, CudaSlice<f32>>>,
    blas: Mutex<Option<CudaBlas>>,
    smem_set: Mutex<HashMap<Kernel, usize>>,
    /// Blocks per SM of the skinny kernels as the driver compiled them
    /// ([`Cuda::skinny_occupancy`]).
    occupancy: Mutex<HashMap<Kernel, usize>>,
    a8_kernel: Mutex<A8Kernel>,
    /// The paired gate / up kernel (k-slices, stages); None: chosen per launch.
    a8_pair: Mutex<Option<(u8, u8)>>,
    /// The paired gate / up launch's even blocks per SM with a queue of one-tile x one-chunk
    /// pieces where its groups spread unevenly (default on).
    a8_pair_queue: Mutex<bool>,
    a8_pdl: Mutex<bool>,
    /// Whether the tensor-core skinny matmuls are launched programmatically
    /// ([`Cuda::set_skinny_pdl`]).
    skinny_pdl: Mutex<bool>,
    /// Whether gate and up run as one launch writing the down projection's x
    /// ([`Cuda::set_skinny_glu`]).
    skinny_glu: Mutex<bool>,
    /// Whether norms and SiLU products write the bf16 / q8_0 / q4_0 skinny matmuls' x
    /// ([`Cuda::set_skinny_producers`]).
    skinny_producers: Mutex<bool>,
    /// [`Cuda::set_prefill_producers`].
    prefill_producers: Mutex<bool>,
    /// Matmuls of a prefill producer's x, and q / k norms one block per row, so far
    /// ([`Cuda::prefill_producer_uses`]).
    prefill_producer_uses: [AtomicU64; 2],
    /// From how many rows the block formats' matmuls take cuBLAS
    /// ([`Cuda::set_quant_prefill_rows`]).
    quant_prefill_rows: Mutex<Option<usize>>,
    a8_evict_first: Mutex<bool>,
    a8_prewait: Mutex<Option<bool>>,
    attn_split: Mutex<Option<usize>>,
    /// Causal rows' splits by the keys they see ([`Cuda::set_attn_causal_splits`]); `None`:
    /// the default table of the call's head dim.
    attn_causal_splits: Mutex<Option<Vec<(usize, usize)>>>,
    /// Keys per split of causal calls of more than [`SKINNY_ROWS`] rows (a prefill;
    /// [`Cuda::set_attn_prefill_split`]); 0 = the splits of the keys each row sees.
    attn_prefill_split: Mutex<usize>,
    /// [`Cuda::set_attn_prefill_fa`].
    attn_prefill_fa: Mutex<bool>,
    /// [`Cuda::set_prefill_precision`].
    prefill_precision: Mutex<PrefillPrecision>,
    attn_kernel: Mutex<AttnKernel>,
    attn_fast_f16: Mutex<bool>,
    attn_fa: Mutex<AttnFa>,
    markov_persistent: Mutex<bool>,
    /// Whether a bf16 / q8_0 / q4_0 W2 takes the tensor-core Markov step
    /// ([`Cuda::set_markov_mma`]).
    markov_mma: Mutex<bool>,
    /// [`Cuda::set_recurrent_parallel`].
    recurrent_parallel: Mutex<bool>,
    /// [`Cuda::set_delta_chunk_min`].
    delta_chunk_min: AtomicUsize,
    /// [`Cuda::set_delta_skip`].
    delta_skip: AtomicUsize,
    /// [`Cuda::set_zero_fill`].
    zero_fill: AtomicBool,
    /// [`Cuda::set_poison_scratch`].
    poison_scratch: AtomicBool,
    /// [`Cuda::set_attn_gemm`].
    attn_gemm: Mutex<AttnGemm>,
    /// [`Cuda::set_attn_pf2_shape`].
    attn_pf2_shape: Mutex<(usize, usize, usize)>,
    /// [`Cuda::set_attn_gemm_scores`].
    attn_gemm_scores: AtomicUsize,
    /// [`Cuda::set_attn_gemm_chunks`].
    attn_gemm_chunks: AtomicUsize,
    /// [`Cuda::set_unpack_block`].
    unpack_values: AtomicUsize,
    /// [`Cuda::markov_persistent_tiles`] per (vocabulary, rank): computed once.
    markov_fit: Mutex<HashMap<(usize, usize), Option<usize>>>,
    /// Resident 256-thread blocks per multiprocessor of the bf16 / q8_0 / q4_0 Markov step
    /// kernels, per (kernel, dynamic shared memory): computed once.
    markov_occ: Mutex<HashMap<(Kernel, usize), usize>>,
    /// [`MemPool`] (last: dropped after every buffer the backend holds).
    pool: MemPool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A token-by-token delta rule's inputs: q / k / v as views with their row strides (packed
/// buffers, or the conv's rows), and either the gates (`gates: None`) or the gate inputs a / b
/// in `g` / `beta` with `(a_log, dt_bias)`.
struct DeltaSrc<'a> {
    q: CudaView<'a, f32>,
    k: CudaView<'a, f32>,
    v: CudaView<'a, f32>,
    g: CudaView<'a, f32>,
    beta: CudaView<'a, f32>,
    qk_rs: usize,
    v_rs: usize,
    gates: Option<(&'a CudaBuf, &'a CudaBuf)>,
}

fn check(op: &'static str, operand: &'static str, expected: usize, found: usize) -> Result<()> {
    if found < expected {
        return Err(BackendError::shape(op, operand, expected, found));
    }
    Ok(())
}

fn i32_of(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| BackendError::Invalid {
        op,
        msg: format!("{what} = {v} does not fit the kernels' 32-bit sizes"),
    })
}

fn grid_1d(n: usize, block: u32) -> LaunchConfig {
    let blocks = n.div_ceil(block as usize).clamp(1, 65535 * 8) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One 128-thread block per row of a weight's row block (`unpack_bf16p`,
/// `unpack_quant_hilo`; [`Cuda::set_unpack_block`]).
fn row_blocks(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The device copy of `spec`'s RoPE frequencies, uploaded once per distinct table.
fn rope_freqs<'a>(
    stream: &Arc<CudaStream>,
    cache: &'a mut HashMap<Vec<u32>, CudaSlice<f32>>,
    spec: &RopeSpec,
) -> Result<&'a CudaSlice<f32>> {
    let key: Vec<u32> = spec.inv_freq.iter().map(|f| f.to_bits()).collect();
    Ok(match cache.entry(key) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => e.insert(stream.clone_htod(&spec.inv_freq).map_err(dev)?),
    })
}

fn cfg(grid: (u32, u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// Threads per row of the row-wise norms, from the row width only (per-row determinism).
/// Warps per block of `qk_norm_rope_kv_rows` (`QKR_WARPS` in elementwise.cu).
const QKR_WARPS: usize = 4;

fn norm_threads(dim: usize) -> u32 {
    if dim > 2048 {
        256
    } else {
        128
    }
}

impl Cuda {
    /// Open device `ordinal` with default options. Fails with an error (never a panic) where
    /// the CUDA driver or NVRTC libraries are missing or no such device exists.
    pub fn new(ordinal: usize) -> std::result::Result<Self, CudaError> {
        Self::with_options(ordinal, CudaOptions::default())
    }

    pub fn with_options(ordinal: usize, opts: CudaOptions) -> std::result::Result<Self, CudaError> {
        // SAFETY: these only probe dlopen on the candidate library names.
        if !unsafe { drv_sys::is_culib_present() } {
            return Err(CudaError::LibraryMissing {
                lib: "libcuda (the CUDA driver)",
            });
        }
        if !crate::registry::nvrtc_available() {
            return Err(CudaError::LibraryMissing { lib: "libnvrtc" });
        }
        let count = CudaContext::device_count()?;
        if ordinal as i64 >= count as i64 {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        // One stream only: no cross-stream event tracking (it would also get in the way of
        // graph capture).
        // SAFETY: every slice of this backend is used on `stream` alone.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let pf_stream = ctx.new_stream()?;
        let tl_stream = ctx.new_stream()?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = arch_for(major, minor)?;
        let num_sms = ctx
            .attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            as usize;
        let smem = SmemLimits {
            block: ctx.attribute(
                drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )? as usize,
            sm: ctx.attribute(
                drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            )? as usize,
        };
        let pool = MemPool::new(ordinal, opts.pool_keep)?;
        Ok(Cuda {
            reg: Registry::new(ctx.clone(), arch, opts.block_trace),
            ctx,
            stream,
            pf_stream,
            tl_stream,
            num_sms,
            smem,
            opts,
            scratch: Mutex::new(Scratch {
                mm_ws: None,
                mm_counters: None,
                att_o: None,
                att_ml: None,
                att_s: None,
                att_q3: None,
                att_k3: None,
                att_v3: None,
                att_p3: None,
                am_v: None,
                am_i: None,
                mk_bar: None,
                ids: None,
                toks: None,
                x_hi: None,
                x_lo: None,
                w_unpack: None,
                gdn: None,
                x_gen: 0,
                x_shape: None,
                y_hi: None,
                y_lo: None,
                y_gen: 0,
                y_shape: None,
                a8_q: None,
                a8_d: None,
                a8_ws: None,
                a8_qctr: None,
                a8_q2: None,
                a8_d2: None,
                a8_gen: [0; 2],
                a8_shape: [None; 2],
            }),
            rope_cache: Mutex::new(HashMap::new()),
            blas: Mutex::new(None),
            smem_set: Mutex::new(HashMap::new()),
            occupancy: Mutex::new(HashMap::new()),
            a8_kernel: Mutex::new(A8Kernel::Auto),
            a8_pair: Mutex::new(None),
            a8_pair_queue: Mutex::new(true),
            a8_pdl: Mutex::new(true),
            skinny_pdl: Mutex::new(true),
            skinny_glu: Mutex::new(true),
            skinny_producers: Mutex::new(true),
            prefill_producers: Mutex::new(true),
            prefill_producer_uses: [AtomicU64::new(0), AtomicU64::new(0)],
            quant_prefill_rows: Mutex::new(None),
            a8_evict_first: Mutex::new(true),
            a8_prewait: Mutex::new(None),
            attn_split: Mutex::new(None),
            attn_causal_splits: Mutex::new(None),
            attn_prefill_split: Mutex::new(ATTN_PREFILL_SPLIT),
            attn_prefill_fa: Mutex::new(true),
            prefill_precision: Mutex::new(PrefillPrecision::Exact),
            attn_kernel: Mutex::new(AttnKernel::Auto),
            attn_fast_f16: Mutex::new(true),
            attn_fa: Mutex::new(AttnFa::default()),
            markov_persistent: Mutex::new(true),
            markov_mma: Mutex::new(true),
            recurrent_parallel: Mutex::new(true),
            delta_chunk_min: AtomicUsize::new(DELTA_CHUNK_MIN),
            delta_skip: AtomicUsize::new(0),
            zero_fill: AtomicBool::new(true),
            poison_scratch: AtomicBool::new(false),
            attn_gemm: Mutex::new(AttnGemm::default()),
            attn_pf2_shape: Mutex::new((0, 0, 0)),
            attn_gemm_scores: AtomicUsize::new(attention::ATTN_GEMM_SCORES),
            attn_gemm_chunks: AtomicUsize::new(0),
            unpack_values: AtomicUsize::new(UNPACK_VALUES),
            markov_fit: Mutex::new(HashMap::new()),
            markov_occ: Mutex::new(HashMap::new()),
            pool,
        })
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream every op is queued on (capture it to build a CUDA graph).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    pub fn arch(&self) -> &'static str {
        self.reg.arch()
    }
    pub fn num_sms(&self) -> usize {
        self.num_sms
    }
    /// Pick the Q8_0A8 matmul kernel (default [`A8Kernel::Auto`]). Every choice gives the
    /// same bits (each output is one thread's block-ordered f32 sum of exact int32 dots);
    /// this is for benchmarks and tests.
    pub fn set_a8_kernel(&self, k: A8Kernel) {
        *lock(&self.a8_kernel) = k;
    }
    /// Pick the paired gate / up kernel of [`Cuda::matmul_gate_up_q8`]: `(ks, stages)`, k-slices
    /// per block and pipeline stages: (1, 3), (1, 2) or (2, 2); [`Cuda::set_a8_pair_kernel_auto`]
    /// (the default) chooses per launch. The same bits whichever runs; for benchmarks and
    /// tests. An unknown pair is an error.
    ///
    /// (1, 3): 8-warp blocks, 3 per SM, so the 8B shape's 384 blocks run in one wave (2 x 2
    /// gave 16-warp blocks, 2 per SM: 1.45 waves). The q8_0a8 step (graph ms, 8B ctx 512 /
    /// 8192, 27B 512 / 8192, H200, ninth session, two rounds), (2, 2) -> (1, 3): 0.655 / 0.813 /
    /// 1.102 / 1.219 -> 0.645 / 0.800 / 1.087 / 1.201. (1, 2): the same blocks with 2 stages and
    /// the chunk sums added in registers (no shared-memory slots for them), 5 per SM: the 27B
    /// shape's 544 blocks in one wave where (1, 3) runs 1.37 (thirteenth session, two rounds
    /// each, q8_0a8 + fast attention over f16 caches): 27B 1.032-1.037 -> 1.012-1.013 ms at ctx
    /// 512, 1.134-1.143 -> 1.107-1.110 at 8192; the 8B shape 0.606-0.617 -> 0.668-0.676 (its
    /// 384 blocks fill 3 per SM exactly).
    /// The default paired gate / up kernel: (1, 3) while its blocks fit one wave at 3 per SM,
    /// else (1, 2) (5 per SM) while those do (see [`Cuda::set_a8_pair_kernel`]).
    pub fn set_a8_pair_kernel_auto(&self) {
        *lock(&self.a8_pair) = None;
    }
    /// Where the paired gate / up launch's groups of 2 + 2 tiles spread unevenly over one wave
    /// (the fullest SM's over the mean >= 1.1), launch as many blocks per SM as the mean allows,
    /// one group each, and run the groups left over as pieces of one tile x one chunk from a
    /// queue, taken by the blocks as they finish (`A8KPQ` in matmul.cu; on by default; H200,
    /// 27B shape: the step -0.8% with 4-tile pieces, another -0.5% at ctx 512 with 1-tile
    /// pieces loaded in one go). The same bits either way; a benchmark knob. Only with the
    /// automatic paired kernel ([`Cuda::set_a8_pair_kernel_auto`]).
    pub fn set_a8_pair_queue(&self, on: bool) {
        *lock(&self.a8_pair_queue) = on;
    }
    /// The queue launch's plan for a paired gate / up launch of `n` features, `k` inputs and
    /// `rows` rows (1-16) on this device, as the launch would take it now: Some((blocks per
    /// SM, pieces)), or None for the plain launch.
    #[doc(hidden)]
    pub fn a8_pair_queue_plan(
        &self,
        n: usize,
        k: usize,
        rows: usize,
        format: WeightFormat,
    ) -> Option<(usize, usize)> {
        let q4 = format == WeightFormat::Q4_0A8;
        self.pair_queue(n, k, if rows > 8 { 2 } else { 1 }, q4)
            .map(|q| (q.bps, q.pieces))
    }
    /// The queue launch for a paired launch of `n` features, `k` inputs and `nt` token groups
    /// (Q4_0A8 weights with `q4`), if the knobs and the shape take it.
    fn pair_queue(&self, n: usize, k: usize, nt: usize, q4: bool) -> Option<A8Queue> {
        if lock(&self.a8_pair).is_some() || !*lock(&self.a8_pair_queue) {
            return None;
        }
        let nch = (k / 32).div_ceil(A8_CB).max(1);
        a8_pair_queue(n.div_ceil(32), nch, nt, self.num_sms, self.smem, q4)
    }
    pub fn set_a8_pair_kernel(&self, ks: u8, stages: u8) -> Result<()> {
        if a8kp_kernel(1, ks.into(), stages.into()).is_none() {
            return Err(BackendError::Invalid {
                op: "set_a8_pair_kernel",
                msg: format!("no paired kernel with {ks} k-slices and {stages} stages"),
            });
        }
        *lock(&self.a8_pair) = Some((ks, stages));
        Ok(())
    }
    /// Launch the Q8_0A8 quantizer and matmul kernels, `add_rms_norm`, `qk_norm_rope_kv` and
    /// the attention split and combine kernels with programmatic dependent launch (default
    /// on): each launch overlaps the kernel before it (which triggers its dependents first
    /// thing), and the matmul prefetches its first weight stages while the quantizer runs.
    /// The same bits either way (the kernels wait for their inputs); a benchmark knob. On the H200, draft step (graph replays, one lease) off -> on: 8B 0.779
    /// -> 0.750 ms (ctx 512), 1.066 -> 1.036 (8192); 27B 1.198 -> 1.170, 1.384 -> 1.355.
    pub fn set_a8_pdl(&self, on: bool) {
        *lock(&self.a8_pdl) = on;
    }

    /// Launch the tensor-core skinny matmuls (bf16 / q8_0 / q4_0 weights, 1-16 rows: a dense or
    /// hybrid target's decode and verify, a drafter in those formats) with programmatic
    /// dependent launch (default on): each block loads its first weight tile while the kernel
    /// before finishes (the producers of its x trigger it: the norms after their own loads,
    /// the others first thing), then waits for it. The same bits either way; a benchmark knob.
    /// H100, off -> on: the dense Qwen3-8B-shape target's decode1 -1.9% / -2.1% and verify16
    /// 0% / -1.2% at ctx 512 / 8192, the hybrid's decode -1.8% / -1.4% (fifty-seventh session).
    pub fn set_skinny_pdl(&self, on: bool) {
        *lock(&self.skinny_pdl) = on;
    }

    /// With bf16 / q8_0 / q4_0 MLP weights and 1-16 rows, run the gate and up projections as
    /// one launch whose blocks each hold a gate and the same up rows and write the SiLU
    /// product as the down projection's x ([`Cuda::matmul_glu_split`]; default on), instead
    /// of a gate / up launch and a `silu_mul_split` launch. The same bits either way; a
    /// benchmark knob. H100, off -> on (fifty-eighth session, two rounds, graph replays): the
    /// dense Qwen3-8B-shape target's decode1 6.83 -> 6.36 ms (-6.8%) at ctx 512 and 7.97 ->
    /// 7.50 (-5.9%) at 8192, verify16 7.35 -> 7.18 (-2.2%) and 8.88 -> 8.80 (-0.9%); with an
    /// f16 K / V cache decode1 -7.0% / -6.5%, verify16 -2.5% / -2.0%; the 4-layer hybrid's
    /// decode -0.5% / -0.3% and verify16 -0.9% / -1.7%; the bf16 drafter's step -1.7% / -0.5%.
    /// Most of the decode1 gain is a wave: in that build the two-matrix kernel took 96
    /// registers (5 blocks per SM: the 8B gate / up's 768 blocks in 1.16 waves, 75 us; the
    /// code of a pre-wait knob since removed) and this one 78 (6 per SM: one wave, 65 us).
    /// Without that code the driver gave this launch's one-row kernels more than 80 (5 per
    /// SM: decode1 +3.9% against the fifty-seventh session's main, fifty-ninth session, H100;
    /// held to 6 per SM by `__launch_bounds__` they spilled: +17.7%), so a launch whose
    /// 32-row blocks overflow a wave at the kernel's real occupancy runs the 64-row twin
    /// where that fits one (`skinny::wave_r4`). The SiLU launch itself
    /// (not programmatic: it starts once gate / up has finished) cost ~2.4 us per layer in
    /// the per-block trace.
    pub fn set_skinny_glu(&self, on: bool) {
        *lock(&self.skinny_glu) = on;
    }

    /// With bf16 / q8_0 / q4_0 weights and 1-16 rows, `norm_matmul_many` and `layer_tail`
    /// let the norms and the SiLU product write the skinny matmuls' bf16 hi / lo x themselves
    /// ([`Cuda::rms_norm_split`], [`Cuda::add_rms_norm_split`], [`Cuda::silu_mul_split`]) and
    /// the down projection add into the residual stream: 4 launches fewer per layer (default
    /// on). The same bits either way; a benchmark knob.
    pub fn set_skinny_producers(&self, on: bool) {
        *lock(&self.skinny_producers) = on;
    }

    /// A prompt's prefill (more than [`SKINNY_ROWS`] rows): the norms, the SiLU product and
    /// the attention write the bf16 hi / lo x of the cuBLAS matmuls that read it (bf16
    /// weights, and q8_0 / q4_0 weights where cuBLAS takes them; one split per x instead of
    /// one per matrix, and no f32 copy of it); the prefill's attention kernel over an f32
    /// cache, in a call of one split, writes its rows itself (no partial, no combine launch);
    /// and the per-head q / k norm + RoPE runs one block per row (`qk_norm_rope_kv_rows`: the
    /// row's rotation computed once for all of its heads). Default on; the same bits either
    /// way (a benchmark knob).
    pub fn set_prefill_producers(&self, on: bool) {
        *lock(&self.prefill_producers) = on;
    }

    /// How many matmuls read a prefill producer's x, and how many q / k norms ran one block
    /// per row, on this backend so far (a test's evidence that the path ran).
    #[doc(hidden)]
    pub fn prefill_producer_uses(&self) -> (u64, u64) {
        let [m, q] = &self.prefill_producer_uses;
        (m.load(Ordering::Relaxed), q.load(Ordering::Relaxed))
    }

    /// From how many rows a matmul of q8_0 / q4_0 / Q8_0A8 / Q4_0A8 weights (a prompt's
    /// prefill) runs on cuBLAS (`matmul_cublas_quant`: three bf16 products of the weights and
    /// x split into hi + lo, one under [`PrefillPrecision::Fast`]) instead of the skinny
    /// kernels 16 rows at a time: `Some(rows)` for every block format (`usize::MAX`: never),
    /// `None` (the default) for [`QUANT_PREFILL_ROWS`] (q8_0 / q4_0) and [`A8_PREFILL_ROWS`]
    /// (Q8_0A8 / Q4_0A8), the crossovers measured on the dense 8B target's prefill (H100;
    /// q4_0 takes q8_0's, not measured apart). Through cuBLAS the Q8_0A8 8B target's prompt
    /// of 8192 tokens took 794 ms against 1812 through the skinny kernels. Only with
    /// [`CudaOptions::cublas_prefill`]; such rows differ in their last bits from the skinny
    /// kernels' (as cuBLAS rows do, see there), and a prefill is the one start both a
    /// speculative and a plain run share.
    pub fn set_quant_prefill_rows(&self, rows: Option<usize>) {
        *lock(&self.quant_prefill_rows) = rows.map(|r| r.max(SKINNY_ROWS + 1));
    }

    /// The arithmetic of a prompt's prefill (default [`PrefillPrecision::Exact`]; see there):
    /// the cuBLAS matmuls of more than [`SKINNY_ROWS`] rows and the causal attention of more
    /// than [`SKINNY_ROWS`] query rows. Decodes and verifies (at most [`SKINNY_ROWS`] rows)
    /// never change. Only with [`CudaOptions::cublas_prefill`] for the matmuls.
    pub fn set_prefill_precision(&self, p: PrefillPrecision) {
        *lock(&self.prefill_precision) = p;
    }

    /// Whether the prefill runs [`PrefillPrecision::Fast`].
    fn prefill_fast(&self) -> bool {
        *lock(&self.prefill_precision) == PrefillPrecision::Fast
    }

    /// Whether the whole-K and split Q8_0A8 kernels stream their weights (read once per call)
    /// with the L2 evict-first priority, so they do not push the activations, the KV cache
    /// and the quantized x out of L2. On by default (H200, 16 rows: the 8B draft step 0.832
    /// -> 0.811 ms at ctx 512, 1.089 -> 1.073 ms at 8192, 27B 1.404 -> 1.390 ms); changes no
    /// result (a benchmark knob).
    /// The hybrid targets' recurrent ops (default on): `gated_delta_rule` keeps each state
    /// column in the registers of a warp's lanes, 32 columns of a head per block (heads with
    /// dk <= 256), instead of one block per head over the state in shared memory; and
    /// `causal_conv1d` runs its tokens in chunks side by side instead of one after another;
    /// a long call of the delta rule without a stash runs in chunks of 64 tokens
    /// ([`Cuda::set_delta_chunk_min`]; off with this knob). The convolution's bits are the
    /// same either way; the delta rule's sums run in another order (within f32 rounding of
    /// each other), and in the recurrent kernels a token's arithmetic does not depend on how
    /// many tokens the call holds (a benchmark knob).
    pub fn set_recurrent_parallel(&self, on: bool) {
        *lock(&self.recurrent_parallel) = on;
    }

    /// The fewest tokens a `gated_delta_rule` call without a stash takes through the chunked
    /// kernels (q / k L2-normalized, dk <= 128, [`Cuda::set_recurrent_parallel`] on);
    /// `usize::MAX`: never. Default [`DELTA_CHUNK_MIN`]. The chunked form sums in another order
    /// than the recurrent kernels (within f32 rounding of them), and its rounding depends on
    /// where the call's chunks of 64 tokens begin: a prompt split into other calls gives other
    /// low bits (a benchmark knob).
    pub fn set_delta_chunk_min(&self, tokens: usize) {
        self.delta_chunk_min.store(tokens, Ordering::Relaxed);
    }

    /// Timing ablations of the chunked delta rule: its `gdn_chunk_prep` (bit 0),
    /// `gdn_chunk_state` (bit 1) and `gdn_chunk_out` (bit 2) launches left out. Its results
    /// are then wrong: a benchmark knob, 0 (the default) for the op.
    #[doc(hidden)]
    pub fn set_delta_skip(&self, mask: usize) {
        self.delta_skip.store(mask, Ordering::Relaxed);
    }

    /// Timing ablation: `Backend::zeros` allocates without its memset when off (the buffer's
    /// values are then whatever the pool held: results of ops that read before they write are
    /// wrong). A benchmark knob; on (the default) for the op.
    #[doc(hidden)]
    pub fn set_zero_fill(&self, on: bool) {
        self.zero_fill.store(on, Ordering::Relaxed);
    }

    /// `Backend::scratch` buffers filled with NaN (off by default: their values are then
    /// whatever the pool held). A test knob: an op that reads a scratch value it did not
    /// write first makes NaN of its result.
    pub fn set_poison_scratch(&self, on: bool) {
        self.poison_scratch.store(on, Ordering::Relaxed);
    }

    /// The bytes of freed memory the backend's memory pool keeps at a synchronization (see
    /// [`CudaOptions::pool_keep`]; from now on).
    pub fn set_pool_keep(&self, bytes: u64) -> std::result::Result<(), CudaError> {
        self.pool.set_keep(bytes)
    }

    /// Returns the freed memory the backend's pool holds to the driver, down to `keep` bytes
    /// of reserved memory (`cuMemPoolTrimTo`; buffers in use stay). Call after a
    /// synchronization of the op stream to return what its last calls freed.
    pub fn trim_pool(&self, keep: usize) -> std::result::Result<(), CudaError> {
        // SAFETY: a live pool.
        unsafe { drv_result::mem_pool::trim_to(self.pool.0, keep)? };
        Ok(())
    }

    /// The backend pool's memory: (reserved from the driver, in use by buffers), bytes.
    pub fn pool_bytes(&self) -> std::result::Result<(u64, u64), CudaError> {
        use drv_sys::CUmemPool_attribute::*;
        Ok((
            self.pool.attr(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            self.pool.attr(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        ))
    }

    /// `len` values of T from the backend's pool on the op stream, not initialized; during a
    /// graph capture of the stream from the device's pool (cudarc's stream allocation: a
    /// capture turns it into the graph's own allocation node).
    ///
    /// # Safety
    /// The values are whatever the memory held: T must be valid for any bits, and the caller
    /// writes them before reading them.
    unsafe fn alloc_uninit<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        let capturing = self.stream.capture_status().map_err(dev)?
            != drv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        if capturing {
            return unsafe { self.stream.alloc::<T>(len) }.map_err(dev);
        }
        let bytes = (len * std::mem::size_of::<T>()).max(1);
        // SAFETY: a live pool and the backend's stream (its context bound first); the slice
        // owns the allocation and frees it on its stream when dropped.
        unsafe {
            self.ctx.bind_to_thread().map_err(dev)?;
            let ptr =
                drv_result::mem_pool::alloc_async(self.pool.0, bytes, self.stream.cu_stream())
                    .map_err(dev)?;
            Ok(self.stream.upgrade_device_ptr(ptr, len))
        }
    }

    /// `len` zeros of T from the backend's pool (see [`Cuda::alloc_uninit`]).
    fn alloc_zeroed<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: zeroed before any read.
        let mut s = unsafe { self.alloc_uninit::<T>(len) }?;
        self.stream.memset_zeros(&mut s).map_err(dev)?;
        Ok(s)
    }

    /// A copy of `host` in a buffer from the backend's pool (see [`Cuda::alloc_uninit`]).
    fn alloc_copy<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        // SAFETY: every value written by the copy before any read.
        let mut s = unsafe { self.alloc_uninit::<T>(host.len()) }?;
        self.stream.memcpy_htod(host, &mut s).map_err(dev)?;
        Ok(s)
    }

    /// How a prompt's attention (64 query rows or more, f32 cache) runs at a head dim without
    /// a tensor-core prefill kernel (above 128: the Qwen3.5 / Qwen3.6 full-attention layers'
    /// 256): see [`AttnGemm`] (default [`AttnGemm::Fused`]; a benchmark knob).
    pub fn set_attn_gemm(&self, mode: AttnGemm) {
        *lock(&self.attn_gemm) = mode;
    }

    /// [`AttnGemm::Fused`]'s kernel shape: (keys per chunk, stages, query rows per block),
    /// (0, 0, 0) the default; a shape without a compiled kernel falls back to the products.
    /// The same bits for any stages or rows per block; another chunk size is another
    /// summation order (a benchmark knob).
    #[doc(hidden)]
    pub fn set_attn_pf2_shape(&self, keys: usize, stages: usize, rows: usize) {
        *lock(&self.attn_pf2_shape) = (keys, stages, rows);
    }

    /// The key chunks of that path's second product (0, the default: enough for two waves of
    /// its tiles; more chunks: another summation order; for tests).
    #[doc(hidden)]
    pub fn set_attn_gemm_chunks(&self, chunks: usize) {
        self.attn_gemm_chunks.store(chunks, Ordering::Relaxed);
    }

    /// The most score values of one block of rows in that path (default 32M, 128 MB of
    /// scratch); smaller: more blocks of fewer rows (for tests).
    #[doc(hidden)]
    pub fn set_attn_gemm_scores(&self, values: usize) {
        self.attn_gemm_scores
            .store(values.max(1), Ordering::Relaxed);
    }

    /// Values of W per row block that a prefill's cuBLAS matmul of packed bf16 or block-format
    /// weights unpacks and multiplies at a time (default [`UNPACK_VALUES`], 64M; at least
    /// 16 rows). Larger blocks: fewer, larger GEMMs over more scratch (2 bytes a value, twice
    /// for the block formats' hi and lo). cuBLAS picks its kernels by the GEMM's shape, so
    /// another block size may change a prefill's last bits (as [`CudaOptions::cublas_prefill`]
    /// says of cuBLAS rows); a benchmark knob.
    #[doc(hidden)]
    pub fn set_unpack_block(&self, values: usize) {
        self.unpack_values.store(values.max(1), Ordering::Relaxed);
    }

    fn unpack_values(&self) -> usize {
        self.unpack_values.load(Ordering::Relaxed)
    }

    /// Weight scratch values for the cuBLAS matmuls of `ws` one after another
    /// ([`unpack_len`] of the largest).
    fn unpack_scratch(&self, ws: &[&Weight<Self>]) -> usize {
        let values = self.unpack_values();
        ws.iter().map(|w| unpack_len(w, values)).max().unwrap_or(0)
    }

    pub fn set_a8_evict_first(&self, on: bool) {
        *lock(&self.a8_evict_first) = on;
    }
    /// Whether the 3- and 4-stage split Q8_0A8 kernels issue all but one of their weight
    /// stages before their dependency wait (`Some(true)`) or one (`Some(false)`), for the
    /// matmuls launched while set; None (default) = the rule in `matmul_a8` (all but one where
    /// the paired gate / up wrote the activation, else one). Changes no result (a benchmark
    /// knob).
    pub fn set_a8_prewait(&self, all_but_one: Option<bool>) {
        *lock(&self.a8_prewait) = all_but_one;
    }
    /// A hint to the L2 cache: start fetching parts of weight matrices that the next kernels
    /// will stream, so that the memory works while latency-bound kernels (norms, attention
    /// over a short context) run. Each part is `(weight, from..to)`, fractions of the matrix
    /// in its stored order (for the block formats the same fraction of the codes and of the
    /// scales, i.e. whole leading rows / tiles); at most 3 matrices. The fetch is issued on a
    /// second stream after everything queued so far, so no later op waits for it; call
    /// [`Cuda::l2_prefetch_join`] before ending a graph capture (a capture must end on one
    /// stream). Changes no result.
    pub fn l2_prefetch(&self, parts: &[(&Weight<Self>, std::ops::Range<f64>)]) -> Result<()> {
        if parts.len() > 3 {
            return Err(BackendError::Invalid {
                op: "l2_prefetch",
                msg: format!("at most 3 matrices per call, found {}", parts.len()),
            });
        }
        // Pointers are taken on the op stream (the only one that uses the weights); the
        // prefetch stream only reads them through the L2 hint.
        let st = &*self.stream;
        let mut a = RawArgs::default();
        let (mut slots, mut total) = (0, 0u64);
        let mut range = |a: &mut RawArgs, p: u64, bytes: usize, r: &std::ops::Range<f64>| {
            let (lo, hi) = (r.start.clamp(0.0, 1.0), r.end.clamp(0.0, 1.0));
            let (b0, b1) = ((lo * bytes as f64) as u64 & !15, (hi * bytes as f64) as u64);
            a.u64(p + b0).i64(b1.saturating_sub(b0) as i64);
            total += b1.saturating_sub(b0);
            slots += 1;
        };
        for (w, r) in parts {
            match &w.buf {
                CudaWeightBuf::F32(s) => range(&mut a, s.device_ptr(st).0, s.num_bytes(), r),
                CudaWeightBuf::Bf16(s) | CudaWeightBuf::Bf16P(s) | CudaWeightBuf::F16(s) => {
                    range(&mut a, s.device_ptr(st).0, s.num_bytes(), r)
                }
                CudaWeightBuf::Q8_0 { qs, d } => {
                    range(&mut a, qs.device_ptr(st).0, qs.num_bytes(), r);
                    range(&mut a, d.device_ptr(st).0, d.num_bytes(), r);
                }
                CudaWeightBuf::Q4_0 { qs, d } => {
                    range(&mut a, qs.device_ptr(st).0, qs.num_bytes(), r);
                    range(&mut a, d.device_ptr(st).0, d.num_bytes(), r);
                }
                CudaWeightBuf::Q8A8 { qs, d } | CudaWeightBuf::Q4A8 { qs, d } => {
                    range(&mut a, qs.device_ptr(st).0, qs.num_bytes(), r);
                    range(&mut a, d.device_ptr(st).0, d.num_bytes(), r);
                }
            }
        }
        for _ in slots..6 {
            a.u64(0).i64(0);
        }
        if total == 0 {
            return Ok(());
        }
        let f = self.func(Kernel::L2Prefetch)?;
        // One warp per MiB: one multiprocessor issues bulk prefetches at a few hundred GB/s.
        let blocks = (total as usize >> 20).clamp(1, self.num_sms.max(1));
        self.pf_stream.join(&self.stream).map_err(dev)?;
        // SAFETY: the parameters are l2_prefetch's six (pointer, bytes) pairs; the ranges lie
        // inside the weights' allocations (fractions clamped to [0, 1]).
        unsafe {
            a.launch(
                &self.pf_stream,
                &f,
                cfg((blocks as u32, 1, 1), 32, 0),
                false,
            )
        }
    }

    /// Make the op stream wait for the [`Cuda::l2_prefetch`] hints issued so far (required
    /// before a graph capture of the op stream ends; otherwise harmless).
    pub fn l2_prefetch_join(&self) -> Result<()> {
        self.stream.join(&self.pf_stream).map_err(dev)
    }

    /// Zero the per-block trace counters (after everything queued on the op stream), so that
    /// [`Cuda::block_trace`] returns the records of what runs after this call. An error when
    /// the backend was opened without [`CudaOptions::block_trace`].
    pub fn block_trace_reset(&self) -> Result<()> {
        self.block_trace_on("block_trace_reset")?;
        self.reg
            .block_trace_reset(&self.stream)
            .map_err(BackendError::from)
    }

    /// The per-block trace records since [`Cuda::block_trace_reset`] (synchronizes the op
    /// stream), in no particular order, and how many were dropped for want of room (65536 per
    /// kernel module). An error without [`CudaOptions::block_trace`].
    pub fn block_trace(&self) -> Result<(Vec<crate::registry::BlockTraceRecord>, u64)> {
        self.block_trace_on("block_trace")?;
        self.reg
            .block_trace_read(&self.stream)
            .map_err(BackendError::from)
    }

    fn block_trace_on(&self, op: &'static str) -> Result<()> {
        if self.reg.block_trace_enabled() {
            Ok(())
        } else {
            Err(BackendError::Invalid {
                op,
                msg: "the backend was opened without CudaOptions::block_trace".into(),
            })
        }
    }

    /// A timeline mark for benchmarks: record `ev` (an event with timing) when everything
    /// queued on the op stream so far has finished, from a stream of its own (forked from the
    /// op stream), so no later op waits for it. Inside a graph capture the record becomes an
    /// event-record node of the graph (`CU_EVENT_RECORD_EXTERNAL`), run by the front end
    /// without a multiprocessor; the marks of one capture run in order. Call
    /// [`Cuda::timeline_join`] before ending a graph capture. Changes no result.
    pub fn timeline_mark(&self, ev: &cudarc::driver::CudaEvent) -> Result<()> {
        self.tl_stream.join(&self.stream).map_err(dev)?;
        let capturing = self.tl_stream.capture_status().map_err(dev)?
            == drv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE;
        let flags = if capturing {
            drv_sys::CUevent_record_flags_enum::CU_EVENT_RECORD_EXTERNAL
        } else {
            drv_sys::CUevent_record_flags_enum::CU_EVENT_RECORD_DEFAULT
        };
        self.ctx.bind_to_thread().map_err(dev)?;
        // SAFETY: a live event of this backend's context and a live stream.
        unsafe {
            drv_sys::cuEventRecordWithFlags(ev.cu_event(), self.tl_stream.cu_stream(), flags as u32)
        }
        .result()
        .map_err(dev)
    }

    /// Make the op stream wait for the [`Cuda::timeline_mark`] marks issued so far (required
    /// before a graph capture of the op stream ends; otherwise harmless).
    pub fn timeline_join(&self) -> Result<()> {
        self.stream.join(&self.tl_stream).map_err(dev)
    }

    fn func(&self, k: Kernel) -> Result<CudaFunction> {
        self.reg.get(k).map_err(BackendError::from)
    }

    /// (registers per thread, local memory bytes per thread) of a kernel as this device's
    /// driver compiled it (loading its module on first use). A spill shows as local memory.
    fn kernel_resources(&self, k: Kernel) -> Result<(i32, i32)> {
        let f = self.func(k)?;
        let regs = f.num_regs().map_err(dev)?;
        let local = f
            .get_attribute(drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
            .map_err(dev)?;
        Ok((regs, local))
    }

    /// (kernel, registers per thread, local memory bytes per thread) of every kernel whose
    /// entry point contains `filter` (all with ""), as this device's driver compiled them: a
    /// benchmark aid. Entry points are unique within a module, not across them (the q4_0
    /// module repeats the a8 kernels' names): [`Kernel::module`] tells them apart. Register
    /// counts decide how many blocks an SM holds, and so how many waves a launch takes; they
    /// depend on the driver's compiler, not only on the source. Kernels built for another
    /// architecture only ([`Kernel::only_for`]) are left out.
    pub fn kernel_info(&self, filter: &str) -> Result<Vec<(Kernel, i32, i32)>> {
        let arch = self.reg.arch();
        Kernel::ALL
            .iter()
            .filter(|k| k.name().contains(filter))
            .filter(|k| {
                k.only_for()
                    .is_none_or(|a| a == crate::registry::module_arch(k.module(), arch))
            })
            .map(|&k| {
                self.kernel_resources(k)
                    .map(|(regs, local)| (k, regs, local))
            })
            .collect()
    }

    /// Raise a kernel's dynamic shared memory limit (once per kernel and size; a driver call
    /// that is not a stream operation, so graph captures are unaffected).
    fn func_smem(&self, k: Kernel, bytes: usize) -> Result<CudaFunction> {
        let f = self.func(k)?;
        let mut set = lock(&self.smem_set);
        let cur = set.get(&k).copied().unwrap_or(0);
        if bytes > cur {
            f.set_attribute(
                drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(dev)?;
            set.insert(k, bytes);
        }
        Ok(f)
    }

    /// Whether a `gated_delta_rule` call without a stash runs in chunks (q / k L2-normalized,
    /// dk <= [`GDC_DK`], at least [`Cuda::set_delta_chunk_min`] tokens, the recurrent kernels
    /// parallel).
    fn delta_chunked(&self, p: &DeltaParams) -> bool {
        p.qk_l2norm
            && p.dk <= GDC_DK
            && p.t >= self.delta_chunk_min.load(Ordering::Relaxed)
            && *lock(&self.recurrent_parallel)
    }

    /// The register kernel of a token-by-token delta rule (8 warps x R rows per thread cover
    /// dk), or `None` for the shared-memory kernel.
    fn delta_regs_kernel(&self, p: &DeltaParams) -> Option<Kernel> {
        match p.dk {
            _ if !*lock(&self.recurrent_parallel) => None,
            0..=128 => Some(Kernel::GatedDeltaRuleR16),
            129..=256 => Some(Kernel::GatedDeltaRuleR32),
            _ => None,
        }
    }

    /// One token-by-token delta rule launch (the caller checked the shapes): the register
    /// kernel where [`Cuda::delta_regs_kernel`] has one, else the shared-memory kernel, which
    /// takes packed q / k / v and the gates themselves only.
    fn delta_launch(
        &self,
        op: &'static str,
        src: DeltaSrc<'_>,
        p: &DeltaParams,
        state: &mut CudaBuf,
        out: &mut CudaBuf,
        stash: Option<&mut CudaBuf>,
    ) -> Result<()> {
        let (t, nk, nv, dk, dv) = (
            i32_of(op, "t", p.t)?,
            p.n_k_heads as i32,
            i32_of(op, "n_v_heads", p.n_v_heads)?,
            p.dk as i32,
            p.dv as i32,
        );
        let (l2, qs) = (p.qk_l2norm as i32, p.q_scale);
        let regs = self.delta_regs_kernel(p);
        let (f, launch) = match regs {
            Some(k) => (
                self.func(k)?,
                cfg((p.dv.div_ceil(32) as u32, nv as u32, 1), 256, 0),
            ),
            None => {
                let packed = src.qk_rs == p.n_k_heads * p.dk && src.v_rs == p.n_v_heads * p.dv;
                let smem = (p.dk * p.dv + 2 * p.dk + 32) * 4;
                if !packed || src.gates.is_some() {
                    return Err(BackendError::Invalid {
                        op,
                        msg:
                            "the shared-memory delta rule takes packed q / k / v and computed gates"
                                .into(),
                    });
                }
                if p.dv > 1024 || smem > self.smem.block {
                    return Err(BackendError::Invalid {
                        op,
                        msg: format!(
                            "state of {}x{} per head (dk > 256 or the recurrent kernels not parallel) needs dv <= 1024 and {smem} bytes of shared memory, the device allows {} per block",
                            p.dk, p.dv, self.smem.block
                        ),
                    });
                }
                let threads = p.dv.div_ceil(32) * 32;
                (
                    self.func_smem(Kernel::GatedDeltaRule, smem)?,
                    cfg((nv as u32, 1, 1), threads as u32, smem as u32),
                )
            }
        };
        let (qk_rs, v_rs) = (src.qk_rs as i64, src.v_rs as i64);
        let mut b = self.stream.launch_builder(&f);
        b.arg(&src.q)
            .arg(&src.k)
            .arg(&src.v)
            .arg(&src.g)
            .arg(&src.beta);
        b.arg(&t)
            .arg(&nk)
            .arg(&nv)
            .arg(&dk)
            .arg(&dv)
            .arg(&l2)
            .arg(&qs)
            .arg(&mut state.data)
            .arg(&mut out.data);
        match stash {
            Some(s) => b.arg(&mut s.data),
            None => b.arg(&0u64),
        };
        if regs.is_some() {
            b.arg(&qk_rs).arg(&v_rs);
            match src.gates {
                Some((a_log, dt_bias)) => b.arg(&a_log.data).arg(&dt_bias.data),
                None => b.arg(&0u64).arg(&0u64),
            };
        }
        unsafe { b.launch(launch) }.map_err(dev)?;
        Ok(())
    }

    /// `gated_delta_rule` in chunks of [`GDC`] tokens (no stash; the caller checked the
    /// shapes): per span of chunks whose scratch fits, `gdn_chunk_prep` over every chunk side
    /// by side, `gdn_chunk_state` through them in order, then `gdn_chunk_out` over every chunk
    /// side by side.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule_chunked(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        g: &CudaBuf,
        beta: &CudaBuf,
        p: &DeltaParams,
        state: &mut CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let op = "gated_delta_rule";
        let (nk, nv, dk, dv) = (p.n_k_heads, p.n_v_heads, p.dk, p.dv);
        let prep_smem = (2 * GDC * (GDC_DK + 1) + 2 * GDC) * 4;
        let state_smem = (GDC_DK * 32 + 2 * GDC * GDC_DK + GDC * 32) * 4;
        let out_smem = (GDC_DK * 32 + GDC * GDC_DK + GDC * GDC + GDC * 32 + GDC) * 4;
        if state_smem > self.smem.block {
            return Err(BackendError::Invalid {
                op,
                msg: format!(
                    "the chunked kernels need {state_smem} bytes of shared memory per block, the device allows {}",
                    self.smem.block
                ),
            });
        }
        // Per chunk: W and k decayed ([h][GDC][GDC_DK] each), U then the deltas, the decayed
        // q.k, G, the normalized q ([hk][GDC][GDC_DK]) and the state before the chunk.
        let (wk_len, uu_len, qk_len, gc_len) =
            (nv * GDC * GDC_DK, nv * GDC * dv, nv * GDC * GDC, nv * GDC);
        let (qs_len, hs_len) = (nk * GDC * GDC_DK, nv * dk * dv);
        let per_chunk = 2 * wk_len + uu_len + qk_len + gc_len + qs_len + hs_len;
        let chunks = p.t.div_ceil(GDC);
        let span = (DELTA_SCRATCH_VALUES / per_chunk).clamp(1, chunks);
        let prep = self.func_smem(Kernel::GdnChunkPrep, prep_smem)?;
        let state_k = self.func_smem(Kernel::GdnChunkState, state_smem)?;
        let out_k = self.func_smem(Kernel::GdnChunkOut, out_smem)?;
        let mut s = lock(&self.scratch);
        ensure(&self.stream, &mut s.gdn, span * per_chunk).map_err(dev)?;
        let buf = s.gdn.as_mut().ok_or_else(internal)?;
        let (mut wk, mut rest) = buf.split_at_mut(span * wk_len);
        let (mut kd, mut rest) = rest.split_at_mut(span * wk_len);
        let (mut uu, mut rest) = rest.split_at_mut(span * uu_len);
        let (mut qk, mut rest) = rest.split_at_mut(span * qk_len);
        let (mut gc, mut rest) = rest.split_at_mut(span * gc_len);
        let (mut qs, mut hs) = rest.split_at_mut(span * qs_len);
        let (t_len, nk32, nv32, dk32, dv32) = (
            i32_of(op, "t", p.t)?,
            nk as i32,
            nv as i32,
            dk as i32,
            dv as i32,
        );
        let skip = self.delta_skip.load(Ordering::Relaxed);
        for c0 in (0..chunks).step_by(span) {
            let nc = span.min(chunks - c0);
            let (t0, nc32) = ((c0 * GDC) as i32, nc as i32);
            let mut b = self.stream.launch_builder(&prep);
            b.arg(&q.data)
                .arg(&k.data)
                .arg(&v.data)
                .arg(&g.data)
                .arg(&beta.data);
            b.arg(&t0)
                .arg(&t_len)
                .arg(&nk32)
                .arg(&nv32)
                .arg(&dk32)
                .arg(&dv32)
                .arg(&p.q_scale);
            b.arg(&mut wk)
                .arg(&mut kd)
                .arg(&mut uu)
                .arg(&mut qk)
                .arg(&mut gc)
                .arg(&mut qs);
            // SAFETY: gdn_chunk_prep's parameters, in order; the span's chunks fit the scratch.
            if skip & 1 == 0 {
                unsafe { b.launch(cfg((nc as u32, nk as u32, 1), 256, prep_smem as u32)) }
                    .map_err(dev)?;
            }
            let mut b = self.stream.launch_builder(&state_k);
            b.arg(&mut wk).arg(&mut kd).arg(&mut gc);
            b.arg(&nc32).arg(&nv32).arg(&dk32).arg(&dv32);
            b.arg(&mut uu).arg(&mut state.data).arg(&mut hs);
            let grid = (dv.div_ceil(32) as u32, nv as u32, 1);
            // SAFETY: gdn_chunk_state's parameters, in order, over the scratch prep wrote.
            if skip & 2 == 0 {
                unsafe { b.launch(cfg(grid, 256, state_smem as u32)) }.map_err(dev)?;
            }
            let mut b = self.stream.launch_builder(&out_k);
            b.arg(&mut qs)
                .arg(&mut hs)
                .arg(&mut uu)
                .arg(&mut qk)
                .arg(&mut gc);
            b.arg(&t0)
                .arg(&t_len)
                .arg(&nk32)
                .arg(&nv32)
                .arg(&dk32)
                .arg(&dv32);
            b.arg(&mut out.data);
            let grid = (dv.div_ceil(32) as u32, nv as u32, nc as u32);
            // SAFETY: gdn_chunk_out's parameters, in order, over the scratch the two kernels
            // before it wrote.
            if skip & 4 == 0 {
                unsafe { b.launch(cfg(grid, 256, out_smem as u32)) }.map_err(dev)?;
            }
        }
        Ok(())
    }

    /// The preferred shared-memory carveouts, in percent of the most the device allows (-1:
    /// the driver's choice), of the Q8_0A8 matmuls and of every other kernel: by default
    /// [`SMEM_CARVEOUT_A8`](crate::registry::SMEM_CARVEOUT_A8) and
    /// [`SMEM_CARVEOUT_OTHER`](crate::registry::SMEM_CARVEOUT_OTHER). A benchmark knob (the
    /// same bits).
    #[doc(hidden)]
    pub fn set_smem_carveout(&self, a8: i32, other: i32) -> Result<()> {
        Ok(self.reg.set_carveout(a8, other)?)
    }

    /// Compile and load every kernel now (keeps NVRTC out of timings and graph captures).
    pub fn warm_up(&self) -> Result<()> {
        for &k in Kernel::ALL {
            self.func(k)?;
        }
        self.attention_warm_up()
    }

    /// A weight of random values generated on the device (benchmarks): uniform(-amp, amp)
    /// for f32 / bf16 / f16; random codes with f16 scales `amp / 127` (q8_0) or `amp / 8`
    /// (q4_0) for the block formats. Deterministic in `seed`.
    pub fn random_weight(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        format: WeightFormat,
        seed: u64,
        amp: f32,
    ) -> Result<Weight<Self>> {
        let n = rows * cols;
        if format.is_block() && !cols.is_multiple_of(32) {
            return Err(BackendError::Weight(format!(
                "{name}: {format:?} needs cols % 32 == 0, found {cols}"
            )));
        }
        let half = |len: usize, seed: u64, amp: f32, f16: i32| -> Result<CudaSlice<u16>> {
            let mut s = self.stream.alloc_zeros::<u16>(len.max(1)).map_err(dev)?;
            let f = self.func(Kernel::FillRandomHalf)?;
            let n64 = len as i64;
            let mut b = self.stream.launch_builder(&f);
            b.arg(&mut s).arg(&n64).arg(&seed).arg(&amp).arg(&f16);
            unsafe { b.launch(grid_1d(len, 256)) }.map_err(dev)?;
            Ok(s)
        };
        let words = |len: usize, seed: u64| -> Result<CudaSlice<u32>> {
            let mut s = self.stream.alloc_zeros::<u32>(len.max(1)).map_err(dev)?;
            let f = self.func(Kernel::FillRandomU32)?;
            let n64 = len as i64;
            let mut b = self.stream.launch_builder(&f);
            b.arg(&mut s).arg(&n64).arg(&seed);
            unsafe { b.launch(grid_1d(len, 256)) }.map_err(dev)?;
            Ok(s)
        };
        let buf = match format {
            WeightFormat::F32 => {
                let mut s = self.stream.alloc_zeros::<f32>(n.max(1)).map_err(dev)?;
                let f = self.func(Kernel::FillRandomF32)?;
                let n64 = n as i64;
                let mut b = self.stream.launch_builder(&f);
                b.arg(&mut s).arg(&n64).arg(&seed).arg(&amp);
                unsafe { b.launch(grid_1d(n, 256)) }.map_err(dev)?;
                CudaWeightBuf::F32(s)
            }
            // Random values: the fragment order needs no repack, only the padded tiles.
            WeightFormat::Bf16 if cols.is_multiple_of(32) => {
                CudaWeightBuf::Bf16P(half(rows.div_ceil(16) * 16 * cols, seed, amp, 0)?)
            }
            WeightFormat::Bf16 => CudaWeightBuf::Bf16(half(n, seed, amp, 0)?),
            WeightFormat::F16 => CudaWeightBuf::F16(half(n, seed, amp, 1)?),
            WeightFormat::Q8_0 => {
                let mut qs = self.stream.alloc_zeros::<i8>(n.max(4)).map_err(dev)?;
                let f = self.func(Kernel::FillRandomU32)?;
                let words = (n / 4) as i64;
                let mut b = self.stream.launch_builder(&f);
                b.arg(&mut qs).arg(&words).arg(&seed);
                unsafe { b.launch(grid_1d(n / 4, 256)) }.map_err(dev)?;
                let d = half(n / 32, seed ^ 0x5555, amp / 127.0, 1)?;
                CudaWeightBuf::Q8_0 { qs, d }
            }
            WeightFormat::Q8_0A8 => {
                // Random bytes over the whole repacked buffer (padding included: padded rows
                // and blocks are never read into a result).
                let blocks = rows.div_ceil(16) * 16 * a8_kbp(cols);
                let mut qs = self.stream.alloc_zeros::<u8>(blocks * 32).map_err(dev)?;
                let f = self.func(Kernel::FillRandomU32)?;
                let words = (blocks * 8) as i64;
                let mut b = self.stream.launch_builder(&f);
                b.arg(&mut qs).arg(&words).arg(&seed);
                unsafe { b.launch(grid_1d(blocks * 8, 256)) }.map_err(dev)?;
                let d = half(blocks, seed ^ 0x5555, amp / 127.0, 1)?;
                CudaWeightBuf::Q8A8 { qs, d }
            }
            WeightFormat::Q4_0A8 => {
                // Random nibbles over the whole repacked buffer (padding included, as above).
                let blocks = rows.div_ceil(16) * 16 * a8_kbp(cols);
                let mut qs = self.stream.alloc_zeros::<u8>(blocks * 16).map_err(dev)?;
                let f = self.func(Kernel::FillRandomU32)?;
                let words = (blocks * 4) as i64;
                let mut b = self.stream.launch_builder(&f);
                b.arg(&mut qs).arg(&words).arg(&seed);
                unsafe { b.launch(grid_1d(blocks * 4, 256)) }.map_err(dev)?;
                let d = half(blocks, seed ^ 0x5555, amp / 8.0, 1)?;
                CudaWeightBuf::Q4A8 { qs, d }
            }
            WeightFormat::Q4_0 => {
                let qs = words(n / 8, seed)?;
                let d = half(n / 32, seed ^ 0x5555, amp / 8.0, 1)?;
                CudaWeightBuf::Q4_0 { qs, d }
            }
        };
        Ok(Weight {
            name: name.to_string(),
            format,
            rows,
            cols,
            buf,
        })
    }

    /// A buffer of `n` random values uniform in (-amp, amp), generated on the device.
    pub fn random_buf(&self, n: usize, seed: u64, amp: f32) -> Result<CudaBuf> {
        let mut b = self.zeros(n)?;
        let f = self.func(Kernel::FillRandomF32)?;
        let n64 = n as i64;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&mut b.data).arg(&n64).arg(&seed).arg(&amp);
        unsafe { l.launch(grid_1d(n, 256)) }.map_err(dev)?;
        Ok(b)
    }

    /// A buffer filled with `v` (NaN to poison outputs in tests).
    pub fn fill(&self, buf: &mut CudaBuf, v: f32) -> Result<()> {
        let f = self.func(Kernel::Fill)?;
        let n = buf.data.len() as i64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&mut buf.data).arg(&n).arg(&v);
        unsafe { b.launch(grid_1d(n as usize, 256)) }.map_err(dev)?;
        Ok(())
    }

    /// Upload token ids to a device buffer (for [`Cuda::gather_rows_dev`]).
    pub fn upload_ids(&self, ids: &[u32]) -> Result<CudaSlice<u32>> {
        if ids.is_empty() {
            return self.alloc_zeroed::<u32>(1);
        }
        self.alloc_copy(ids)
    }

    /// Embedding lookup with ids already on the device (no host round trip, graph-capturable).
    /// Ids are not range-checked here: the caller guarantees `ids[i] < table.rows`.
    pub fn gather_rows_dev(
        &self,
        table: &Weight<Self>,
        ids: &CudaSlice<u32>,
        n: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        check("gather_rows", "out", n * table.cols, out.len)?;
        check("gather_rows", "ids", n, ids.len())?;
        if n == 0 {
            return Ok(());
        }
        let f = self.func(Kernel::GatherRows)?;
        let fmt = table.buf.fmt_code();
        let cols = i32_of("gather_rows", "cols", table.cols)?;
        // 256 threads x GATHER_PER (4) columns per block (GATHER_COLS in elementwise.cu).
        let pieces = i32_of("gather_rows", "column pieces", table.cols.div_ceil(1024))?;
        let c = cfg((n as u32, pieces.max(1) as u32, 1), 256, 0);
        let mut b = self.stream.launch_builder(&f);
        b.arg(&fmt);
        match &table.buf {
            CudaWeightBuf::F32(s) => b.arg(s).arg(&0u64),
            CudaWeightBuf::Bf16(s) | CudaWeightBuf::Bf16P(s) | CudaWeightBuf::F16(s) => {
                b.arg(s).arg(&0u64)
            }
            CudaWeightBuf::Q8_0 { qs, d } => b.arg(qs).arg(d),
            CudaWeightBuf::Q4_0 { qs, d } => b.arg(qs).arg(d),
            CudaWeightBuf::Q8A8 { qs, d } | CudaWeightBuf::Q4A8 { qs, d } => b.arg(qs).arg(d),
        };
        b.arg(ids).arg(&cols).arg(&mut out.data);
        unsafe { b.launch(c) }.map_err(dev)?;
        Ok(())
    }

    /// Row argmax into a device buffer `out[0..rows]` (graph-capturable).
    pub fn argmax_rows_dev(
        &self,
        x: &CudaBuf,
        row0: usize,
        rows: usize,
        cols: usize,
        out: &mut CudaSlice<u32>,
    ) -> Result<()> {
        check("argmax_rows", "x", (row0 + rows) * cols, x.len)?;
        check("argmax_rows", "out", rows, out.len())?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let nch = cols.div_ceil(ARGMAX_CHUNK);
        let mut s = lock(&self.scratch);
        ensure(&self.stream, &mut s.am_v, rows * nch).map_err(dev)?;
        ensure(&self.stream, &mut s.am_i, rows * nch).map_err(dev)?;
        let Scratch { am_v, am_i, .. } = &mut *s;
        let (am_v, am_i) = (
            am_v.as_mut().ok_or_else(internal)?,
            am_i.as_mut().ok_or_else(internal)?,
        );
        let f1 = self.func(Kernel::ArgmaxPartial)?;
        let f2 = self.func(Kernel::ArgmaxFinal)?;
        let (row0, cols_i, chunk, nch_i) = (
            row0 as i64,
            i32_of("argmax_rows", "cols", cols)?,
            ARGMAX_CHUNK as i32,
            nch as i32,
        );
        // Programmatic dependent launches (with the Q8_0A8 ones, `set_a8_pdl`): both kernels
        // wait for their inputs first thing.
        let pdl = *lock(&self.a8_pdl);
        let st = &*self.stream;
        let mut a = RawArgs::default();
        a.dptr(&x.data, st)
            .i64(row0)
            .i32(cols_i)
            .i32(chunk)
            .dptr_mut(&mut *am_v, st)
            .dptr_mut(&mut *am_i, st);
        // SAFETY: argmax_partial's parameters in order (x, row0, cols, chunk, pv, pi); the
        // partials hold rows * nch values.
        unsafe { a.launch(st, &f1, cfg((nch as u32, rows as u32, 1), 256, 0), pdl) }?;
        let mut a = RawArgs::default();
        a.dptr(&*am_v, st)
            .dptr(&*am_i, st)
            .i32(nch_i)
            .dptr_mut(out, st)
            .u64(0);
        // SAFETY: argmax_final's parameters in order (pv, pi, n_chunks, out, prev = null).
        unsafe {
            a.launch(
                st,
                &f2,
                cfg((rows as u32, 1, 1), am_final_threads(nch), 0),
                pdl,
            )
        }?;
        Ok(())
    }

    /// Q8_0A8: quantize x (q8_0, ggml's bytes) once into the mma B-fragment layout, then one
    /// int8 tensor-core launch over up to 3 matrices of the same K (`mats`: codes, scales,
    /// output rows N, output view). The kernel and its launch shape come from (N, K, SM count)
    /// only, and every choice gives the contract's bits (per-chunk chains, chunk sums added in
    /// order).
    /// Q8_0A8 matmuls of x (quantized first, or silu(x) * up) or of a producer's activation
    /// (`x` None, `act` Some). Ok(false): `act` was stale, nothing launched.
    #[allow(clippy::too_many_arguments)]
    fn matmul_a8(
        &self,
        x: Option<&cudarc::driver::CudaView<'_, f32>>,
        up: Option<&cudarc::driver::CudaView<'_, f32>>,
        act: Option<&A8Act>,
        rows: usize,
        k: usize,
        mats: &mut [A8Launch<'_, '_>],
        accumulate: bool,
    ) -> Result<bool> {
        if !k.is_multiple_of(32) {
            return Err(BackendError::Invalid {
                op: "matmul",
                msg: format!("Q8_0A8 needs cols % 32 == 0, found {k}"),
            });
        }
        if mats.is_empty() || mats.len() > 3 || rows == 0 || rows > SKINNY_ROWS {
            return Err(internal());
        }
        let q4 = mats[0].q4;
        if mats.iter().any(|m| m.q4 != q4) {
            // Q8_0A8 and Q4_0A8 matrices of one x: a launch each (the same bits as one launch).
            for one in mats.chunks_mut(1) {
                if !self.matmul_a8(x, up, act, rows, k, one, accumulate)? {
                    return Ok(false);
                }
            }
            return Ok(true);
        }
        let nt = if rows > 8 { 2 } else { 1 };
        let kbp = a8_kbp(k);
        let nch = (k / 32).div_ceil(A8_CB).max(1);
        let sms = self.num_sms.max(1);
        let tiles: Vec<usize> = mats.iter().map(|m| m.n.div_ceil(16)).collect();
        // Whole-K: the largest tiles-per-block whose busiest SM holds no more tiles than with 1
        // tile per block.
        let whole_ctas = |w: usize| tiles.iter().map(|t| t.div_ceil(w)).sum::<usize>();
        let whole_load = |w: usize| whole_ctas(w).div_ceil(sms) * w;
        let whole_w = [4usize, 2, 1]
            .into_iter()
            .find(|&w| whole_load(w) <= whole_load(1))
            .unwrap_or(1);
        let all_tiles: usize = tiles.iter().sum();
        let mode = match *lock(&self.a8_kernel) {
            // Measured on the H200 (16 rows, graphs of enough distinct copies that the weights
            // come from HBM; us per call incl. the x quantizer, the old auto (whole-K / chunked,
            // 01:57 lease) -> this rule (02:55 lease), `xtask bench gpu --a8-sweep`):
            // * K <= 2048 (1-2 chunks: little to split; the shipped drafter): whole-K;
            // * enough 4-tile blocks for two per SM (gate/up, the lm_heads): 4 tiles x 2
            //   k-slices, 2 stages (x shared by 4 tiles, 2 blocks of 16 warps per SM): 8B
            //   gate/up 40.2 -> 39.2, lm_head 166 -> 169 (whole-K stays ~2% faster there);
            //   27B gate/up 87.5 -> 61.9, lm_head 383 -> 338; since the twenty-seventh
            //   session 4 tiles x 1 slice, 3 stages (3 blocks of 8 warps per SM: the same
            //   copies alone stream 6% faster, `tools/bench/a8_layout.cu`): 8B lm_head 170.1
            //   -> 164.8, gate/up 38.8 -> 32.5, 27B lm_head 339.3 -> 325.3, gate/up 62.4 ->
            //   61.6; the q8_0a8 step -0.9% to -1.4% at both shapes and contexts;
            // * up to 2 tiles per SM (the 8B o and down): 1 tile x 4 slices, 3 stages, 2
            //   blocks per SM: 8B o 12.7 -> 9.2, down 29.4 -> 19.5;
            // * more (the 27B o and down, 320 tiles: 1.2 waves of those 2-per-SM blocks; a
            //   per-block trace of the step showed the second wave's 56 blocks ending 6 us
            //   after the first's): 1 tile x 2 slices, 3 stages, as the q/k/v below (3 per SM,
            //   one wave). The 27B q8_0a8 step (thirteenth session, graph ms, ctx 512 / 8192,
            //   two rounds, against 1 x 4 x 3 for o and 4 x 2 x 2 split across blocks for down,
            //   the rule before): o 1.045 -> 1.033, 1.136 -> 1.128; down 1.045 -> 1.043, 1.136
            //   -> 1.131 (down as 1 x 4 x 3: 1.077 / 1.167; 1 x 4 x 3 across blocks: 1.071 /
            //   1.161; 2 x 4 x 2 across blocks: 1.092 / 1.185);
            // * in between (the fused q/k/v, 384 tiles): 2 tiles x 2 slices, 4 stages: 8B
            //   22.8 -> 13.5, 27B 23.8 -> 16.7; since the ninth session 1 tile x 2 slices, 3
            //   stages (4-warp blocks, 3 per SM: the 384 blocks in one wave where 2 x 2 x 4
            //   left 72 SMs one block): the q8_0a8 step (graph ms, 8B ctx 512 / 8192, 27B
            //   512 / 8192, 11:40 lease, two rounds) 0.655 / 0.813 / 1.102 / 1.219 ->
            //   0.646 / 0.803 / 1.095 / 1.208.
            A8Kernel::Auto if nch < 3 => A8Kernel::WholeK,
            // * the Q4_0A8 twins for 16 rows (a warp per tile for both token groups: half the
            //   warps of a Q8_0A8 block): 2 tiles per block where Q8_0A8 takes 1 (q4_0a8 step,
            //   graph ms, ctx 512, two rounds, 8B / 27B: q/k/v 1 x 2 x 3 -> 2 x 2 x 4 0.561 ->
            //   0.544, 0.874 -> 0.846; 8B o 1 x 4 x 3 -> 2 x 4 x 3 0.547, down 0.553).
            A8Kernel::Auto => {
                let ctas4: usize = tiles.iter().map(|t| t.div_ceil(4)).sum();
                let merged = a8_wpt(nt, q4) < nt;
                if ctas4 >= 2 * sms {
                    A8Kernel::Split(4, 1, 3)
                } else if all_tiles <= 2 * sms {
                    if merged {
                        A8Kernel::Split(2, 4, 3)
                    } else {
                        A8Kernel::Split(1, 4, 3)
                    }
                } else if merged {
                    A8Kernel::Split(2, 2, 4)
                } else {
                    A8Kernel::Split(1, 2, 3)
                }
            }
            m => m,
        };
        // A split choice without a kernel runs whole-K, one whose K fits one round needs no
        // split across blocks (same bits either way).
        let mode = match mode {
            A8Kernel::Split(w, ks, st) | A8Kernel::SplitApart(w, ks, st)
                if a8k_kernel(nt, w as usize, ks as usize, st as usize).is_none() =>
            {
                A8Kernel::WholeK
            }
            A8Kernel::SplitApart(w, ks, st) if nch <= ks as usize => A8Kernel::Split(w, ks, st),
            m => m,
        };
        let (mode, whole_w) = a8_fit(mode, nt, whole_w, self.smem.block, q4).ok_or_else(|| {
            BackendError::Invalid {
                op: "matmul",
                msg: format!(
                    "Q8_0A8 needs {} bytes of shared memory per thread block, the device allows {}",
                    a8_smem_bytes(nt, 4, q4),
                    self.smem.block
                ),
            }
        })?;
        // Split kernels: the rounds (ks chunks each) of K, when split across blocks.
        let rounds_apart = match mode {
            A8Kernel::SplitApart(_, ks, _) => nch.div_ceil(ks as usize),
            _ => 0,
        };
        let is_split = matches!(mode, A8Kernel::Split(..) | A8Kernel::SplitApart(..));
        let (kern, w, smem, warps) = match mode {
            A8Kernel::Split(w, ks, st) | A8Kernel::SplitApart(w, ks, st) => {
                let (w, ks, st) = (w as usize, ks as usize, st as usize);
                let kern = a8k_kernel(nt, w, ks, st).ok_or_else(internal)?;
                (
                    kern,
                    w,
                    a8k_smem_bytes(nt, w, ks, st, q4),
                    w * a8_wpt(nt, q4) * ks,
                )
            }
            _ => {
                let w = whole_w;
                let kern = match (nt, w) {
                    (1, 1) => Kernel::A8N1W1,
                    (1, 2) => Kernel::A8N1W2,
                    (1, _) => Kernel::A8N1W4,
                    (_, 1) => Kernel::A8N2W1,
                    (_, 2) => Kernel::A8N2W2,
                    _ => Kernel::A8N2W4,
                };
                (kern, w, a8_smem_bytes(nt, w, q4), w * a8_wpt(nt, q4))
            }
        };
        let kern = if q4 {
            kern.q4_twin().ok_or_else(internal)?
        } else {
            kern
        };
        let f = self.func_smem(kern, smem)?;
        let fq = self.func(Kernel::A8QuantX)?;
        // SplitApart: per matrix, the chunk sums [chunk][tile][token group][128].
        let groups: Vec<usize> = tiles.iter().map(|t| t.div_ceil(w)).collect();
        let ws_len: Vec<usize> = tiles.iter().map(|t| nch * t * nt * 128).collect();
        let act = if x.is_some() { None } else { act };
        if x.is_none() && act.is_none_or(|a| (a.k, a.rows) != (k, rows)) {
            return Err(BackendError::Invalid {
                op: "matmul_many_q8",
                msg: format!("needs the Q8_0A8 activation of {rows} rows x {k}, found {act:?}"),
            });
        }
        // A producer's activation in the second slot (sized by it for this K and rows).
        let second = act.is_some_and(|a| a.slot == 1);
        let mut s = lock(&self.scratch);
        if let Some(a) = act {
            if !s.a8_current(a) {
                return Ok(false);
            }
        }
        if !second {
            ensure(&self.stream, &mut s.a8_q, kbp * nt * 64).map_err(dev)?;
            ensure(&self.stream, &mut s.a8_d, kbp * nt * 8).map_err(dev)?;
        }
        if rounds_apart > 0 {
            ensure(&self.stream, &mut s.a8_ws, ws_len.iter().sum()).map_err(dev)?;
        }
        let Scratch {
            a8_q,
            a8_d,
            a8_q2,
            a8_d2,
            a8_ws,
            ..
        } = &mut *s;
        let (xq, xd) = if second {
            (
                a8_q2.as_mut().ok_or_else(internal)?,
                a8_d2.as_mut().ok_or_else(internal)?,
            )
        } else {
            (
                a8_q.as_mut().ok_or_else(internal)?,
                a8_d.as_mut().ok_or_else(internal)?,
            )
        };
        let (k_i, t_i) = (i32_of("matmul", "w.cols", k)?, rows as i32);
        let (nt_i, kbp_i) = (nt as i32, i32_of("matmul", "w.cols", kbp)?);
        let pdl = *lock(&self.a8_pdl);
        let st = &*self.stream;
        if let Some(x) = x {
            let q = A8Quant {
                t: t_i,
                k: k_i,
                nt: nt_i,
                kbp: kbp_i,
                pdl,
            };
            self.launch_a8_quant(&fq, x, up, q, xq, xd)?;
        }
        let mut ns = [0i32; 3];
        for (slot, m) in ns.iter_mut().zip(mats.iter()) {
            *slot = i32_of("matmul", "w.rows", m.n)?;
        }
        // Blocks per tile group: the rounds of K when split across blocks.
        let per_group = rounds_apart.max(1);
        let c1 = groups[0] * per_group;
        let c2 = c1 + groups.get(1).map_or(0, |g| g * per_group);
        let grid = groups.iter().sum::<usize>() * per_group;
        let (c1_i, c2_i) = (
            i32_of("matmul", "blocks", c1)?,
            i32_of("matmul", "blocks", c2)?,
        );
        let wso1 = ws_len[0] as i64;
        let wso2 = wso1 + ws_len.get(1).copied().unwrap_or(0) as i64;
        let nch_i = i32_of("matmul", "w.cols", nch)?;
        {
            let mut a = RawArgs::default();
            for (i, m) in mats.iter_mut().enumerate() {
                a.dptr(m.qs, st)
                    .dptr(m.d, st)
                    .dptr_mut(&mut m.out, st)
                    .i32(ns[i]);
            }
            // Unused slots: never reached (c1 / c2 equal the grid size); null pointers.
            for &n_unused in &ns[mats.len()..] {
                a.u64(0).u64(0).u64(0).i32(n_unused);
            }
            a.i32(c1_i)
                .i32(c2_i)
                .dptr(&*xq, st)
                .dptr(&*xd, st)
                .i32(k_i)
                .i32(t_i);
            // Weight stages before the dependency wait: one, where the kernel before is
            // latency-bound (a norm, the attention), whose loads would queue behind more
            // (fifteenth session); all but one after the paired gate / up, whose blocks end
            // unevenly (the last block of an SM streams alone for its last microseconds), so
            // the memory has room for the down projection's blocks that become resident
            // meanwhile (H200, twenty-sixth session: 8B step ctx 512 -0.5%).
            let all_but_one = lock(&self.a8_prewait).unwrap_or(second);
            let ef = i32::from(*lock(&self.a8_evict_first));
            a.i32(if is_split {
                ef | i32::from(all_but_one) << 1
            } else {
                ef
            });
            if is_split {
                a.i32(i32_of("matmul", "rounds", rounds_apart)?);
                match a8_ws.as_mut() {
                    Some(ws) if rounds_apart > 0 => a.dptr_mut(&mut *ws, st),
                    _ => a.u64(0),
                };
                a.i64(if rounds_apart > 0 { wso1 } else { 0 })
                    .i64(if rounds_apart > 0 { wso2 } else { 0 });
            }
            a.i32(i32::from(accumulate));
            // SAFETY: the parameters are those of the A8 / A8K kernel macros in matmul.cu, in
            // order.
            unsafe {
                a.launch(
                    st,
                    &f,
                    cfg((grid as u32, 1, 1), (32 * warps) as u32, smem as u32),
                    pdl,
                )
            }?;
        }
        if rounds_apart > 0 {
            let fs = self.func(Kernel::A8Sum)?;
            let ws = a8_ws.as_mut().ok_or_else(internal)?;
            let total: usize = mats.iter().map(|m| rows * m.n).sum();
            let mut b = self.stream.launch_builder(&fs);
            let (first, rest) = mats.split_first_mut().ok_or_else(internal)?;
            b.arg(&mut first.out).arg(&ns[0]);
            let mut pushed = 1;
            for m in rest.iter_mut() {
                b.arg(&mut m.out).arg(&ns[pushed]);
                pushed += 1;
            }
            for n_unused in &ns[pushed..] {
                b.arg(&*xd).arg(n_unused);
            }
            let acc_i = i32::from(accumulate);
            b.arg(&*ws)
                .arg(&wso1)
                .arg(&wso2)
                .arg(&nt_i)
                .arg(&t_i)
                .arg(&nch_i)
                .arg(&acc_i);
            unsafe { b.launch(grid_1d(total, 256)) }.map_err(dev)?;
        }
        if x.is_some() {
            // The quantizer wrote slot 0: any earlier activation token of it is stale.
            s.a8_written(0, k, rows);
        }
        Ok(true)
    }

    /// Whether [`Backend::layer_tail`] runs as the Q8_0A8 producers (else the separate ops):
    /// Q8_0A8 weights of consistent shapes, 1-16 rows, a hidden size the norm kernel takes.
    fn tail_fuses(rows: usize, h: &CudaBuf, w: &LayerTail<'_, Self>) -> bool {
        let (d, inter) = (w.wo.rows, w.w_gate.rows);
        let a8 = |x: &Weight<Self>| x.buf.a8().map(|p| p.q4);
        // Each projection its own launch; gate and up one paired launch of one format.
        [w.wo, w.w_gate, w.w_up, w.w_down]
            .into_iter()
            .all(|x| a8(x).is_some())
            && a8(w.w_gate) == a8(w.w_up)
            && (1..=SKINNY_ROWS).contains(&rows)
            && d.is_multiple_of(32)
            && d <= 32 * norm_threads(d) as usize
            && inter.is_multiple_of(32)
            && w.w_gate.cols == d
            && (w.w_up.rows, w.w_up.cols) == (inter, d)
            && (w.w_down.rows, w.w_down.cols) == (d, inter)
            && w.post_norm.len >= d
            && h.len >= rows * d
    }

    /// Whether [`Backend::layer_tail`] runs a tail of bf16 / q8_0 / q4_0 weights with the
    /// producers writing the matmuls' x ([`Cuda::split_group`]: the skinny kernels', or a
    /// prefill's cuBLAS matmuls').
    fn tail_skinny(
        &self,
        rows: usize,
        attn: &CudaBuf,
        h: &CudaBuf,
        w: &LayerTail<'_, Self>,
    ) -> bool {
        let (d, inter) = (w.wo.rows, w.w_gate.rows);
        rows > 0
            && self.split_group(&[w.wo], w.wo.cols, rows)
            && self.split_group(&[w.w_gate, w.w_up], d, rows)
            && self.split_group(&[w.w_down], inter, rows)
            && d > 0
            && d <= 32 * norm_threads(d) as usize
            && (w.w_up.rows, w.w_down.rows, w.w_down.cols) == (inter, d, inter)
            && w.post_norm.len >= d
            && h.len >= rows * d
            && attn.len >= rows * w.wo.cols
    }

    /// A layer tail [`Cuda::tail_skinny`] takes: the o projection; the residual add + norm
    /// writing the gate / up projections' x; gate / up in one launch (a prefill: one cuBLAS
    /// matmul each); the SiLU product writing the down projection's x; the down projection
    /// adding into `h` (a prefill: into `s.o`, then `add_assign`). The bits of
    /// [`layer_tail_ops`] (an activation gone stale in between: the rest as separate ops).
    fn tail_skinny_run(
        &self,
        attn: &CudaBuf,
        attn_act: Option<SplitAct>,
        rows: usize,
        h: &mut CudaBuf,
        w: &LayerTail<'_, Self>,
        s: TailScratch<'_, Self>,
    ) -> Result<()> {
        let (d, inter) = (w.wo.rows, w.w_gate.rows);
        // The o projection from the attention's hi / lo where its combine wrote them (and no
        // other launch has since), else from `attn`.
        let from_act = match attn_act {
            Some(a) => self.matmul_many_split(&a, &[w.wo], &mut [&mut *s.o], false)?,
            None => false,
        };
        if !from_act {
            self.matmul(attn, rows, w.wo, s.o)?;
        }
        let act = self.add_rms_norm_split(h, s.o, w.post_norm, rows, d, w.eps)?;
        // Gate and up in one launch writing the down projection's x (1-16 rows).
        if let Some(act2) = self.matmul_glu_split(&act, w.w_gate, w.w_up)? {
            if self.matmul_many_split(&act2, &[w.w_down], &mut [&mut *h], true)? {
                return Ok(());
            }
            // Another thread's launch in between: h holds the residual sum; its norm, then
            // the MLP as separate ops.
            return self.post_norm_mlp_ops(rows, h, w, s);
        }
        if !self.matmul_many_split(
            &act,
            &[w.w_gate, w.w_up],
            &mut [&mut *s.gate, &mut *s.up],
            false,
        )? {
            // h holds the residual sum already: its norm, then the MLP as separate ops.
            return self.post_norm_mlp_ops(rows, h, w, s);
        }
        let act = self.silu_mul_split(s.gate, s.up, rows, inter)?;
        if rows <= SKINNY_ROWS && self.matmul_many_split(&act, &[w.w_down], &mut [&mut *h], true)? {
            return Ok(());
        }
        if rows <= SKINNY_ROWS
            || !self.matmul_many_split(&act, &[w.w_down], &mut [&mut *s.o], false)?
        {
            self.matmul_silu_mul(s.gate, s.up, s.act, rows, w.w_down, s.o)?;
        }
        self.add_assign(h, 0, s.o, rows * d)
    }

    /// The rest of a layer tail from `h` holding the residual sum: the norm of its first
    /// `rows` rows (rms_norm's kernel) into `s.xn`, then the MLP as separate ops.
    fn post_norm_mlp_ops(
        &self,
        rows: usize,
        h: &mut CudaBuf,
        w: &LayerTail<'_, Self>,
        s: TailScratch<'_, Self>,
    ) -> Result<()> {
        let d = w.wo.rows;
        check("layer_tail", "xn", rows * d, s.xn.len)?;
        let f = self.func(Kernel::RmsNorm)?;
        let dd = i32_of("layer_tail", "dim", d)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&h.data)
            .arg(&w.post_norm.data)
            .arg(&mut s.xn.data)
            .arg(&dd)
            .arg(&w.eps);
        // SAFETY: rms_norm(const float *, const float *, float *, int, float).
        unsafe { b.launch(cfg((rows as u32, 1, 1), norm_threads(d), 0)) }.map_err(dev)?;
        mlp_residual_ops(self, rows, h, w, s)
    }

    /// The layer tail after the o projection (a tail [`Cuda::tail_fuses`] takes): the norm
    /// writes the gate / up projections' activation, one paired launch writes the down
    /// projection's, and the down projection adds into `h`.
    fn tail_after_o(
        &self,
        rows: usize,
        h: &mut CudaBuf,
        w: &LayerTail<'_, Self>,
        s: TailScratch<'_, Self>,
    ) -> Result<()> {
        let d = w.wo.rows;
        // Another thread's Q8_0A8 launch on this backend between two of these launches makes
        // an activation stale (the check and the launch are atomic): the rest then runs as
        // the separate ops, on the same h, with the same bits.
        let act = self.rms_norm_q8(h, 0, rows, w.post_norm, d, w.eps)?;
        if let Some(act2) = self.matmul_gate_up_q8_if_current(&act, w.w_gate, w.w_up)? {
            if self.matmul_many_q8_if_current(&act2, &[w.w_down], &mut [h], true)? {
                return Ok(());
            }
        }
        self.rms_norm(h, w.post_norm, d, w.eps, s.xn)?;
        mlp_residual_ops(self, rows, h, w, s)
    }

    /// Whether the fused `qk_norm_rope_kv` kernel takes this head shape (else the separate
    /// ops run).
    fn qk_fused_fits(head_dim: usize, rot_half: usize) -> bool {
        head_dim > 0
            && 2 * rot_half <= head_dim
            && head_dim <= 1024
            && head_dim <= 32 * norm_threads(head_dim) as usize
    }

    /// [`Backend::qk_norm_rope_kv`] in one launch (`qk_norm_rope_kv` in elementwise.cu): the
    /// bits of `rms_norm` x 2 + `rope` x 2 + `copy` x 2 (same arithmetic, same block size); the
    /// bench step calls it too. `k_tmp` is not written.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_kv_fused(
        &self,
        q0: &CudaBuf,
        k0: &CudaBuf,
        v: &CudaBuf,
        q_rows: usize,
        rows: usize,
        p: &QkNormRope<'_, Self>,
        q: &mut CudaBuf,
        cache: KvCacheRows<'_, Self>,
    ) -> Result<()> {
        let (qn, kn, n_heads, n_kv_heads, head_dim) =
            (p.q_norm, p.k_norm, p.n_heads, p.n_kv_heads, p.head_dim);
        let (eps, pos0, spec) = (p.eps, p.pos0, p.rope);
        let (kc, vc, cache_row0) = (cache.k, cache.v, cache.row0);
        let kv16 = cache.storage == KvStorage::F16;
        if q_rows > rows {
            return Err(BackendError::Invalid {
                op: "qk_norm_rope_kv",
                msg: format!("{q_rows} q rows for {rows} k / v rows"),
            });
        }
        let (qw, kvw) = (n_heads * head_dim, n_kv_heads * head_dim);
        check("qk_norm_rope_kv", "q0", q_rows * qw, q0.len)?;
        check("qk_norm_rope_kv", "k0", rows * kvw, k0.len)?;
        check("qk_norm_rope_kv", "v", rows * kvw, v.len)?;
        check("qk_norm_rope_kv", "qn", head_dim, qn.len)?;
        check("qk_norm_rope_kv", "kn", head_dim, kn.len)?;
        check("qk_norm_rope_kv", "q", q_rows * qw, q.len)?;
        if kv16 {
            check_f16_rows("qk_norm_rope_kv", kvw)?;
        }
        // The cache rows in f32 slots (an f16 cache: half a row's values per row).
        let (c0, c1) = (
            cache.storage.slots(cache_row0 * kvw),
            cache.storage.slots((cache_row0 + rows) * kvw),
        );
        check("qk_norm_rope_kv", "kc (f32 slots)", c1, kc.len)?;
        check("qk_norm_rope_kv", "vc (f32 slots)", c1, vc.len)?;
        let half = spec.inv_freq.len();
        let threads = norm_threads(head_dim);
        if !Self::qk_fused_fits(head_dim, half) {
            return Err(BackendError::Invalid {
                op: "qk_norm_rope_kv",
                msg: format!(
                    "head_dim {head_dim} with rot_dim {} not supported",
                    2 * half
                ),
            });
        }
        if rows * (n_heads + n_kv_heads) == 0 {
            return Ok(());
        }
        let mut cache = lock(&self.rope_cache);
        let freqs = rope_freqs(&self.stream, &mut cache, spec)?;
        let f = self.func(Kernel::QkNormRopeKv)?;
        let (h_i, hk_i, hd_i, hr_i, p0) = (
            i32_of("qk_norm_rope_kv", "n_heads", n_heads)?,
            i32_of("qk_norm_rope_kv", "n_kv_heads", n_kv_heads)?,
            head_dim as i32,
            half as i32,
            pos0 as i64,
        );
        let sc = spec.attention_scaling;
        let mut kcv = kc.data.slice_mut(c0..c1);
        let mut vcv = vc.data.slice_mut(c0..c1);
        let st = &*self.stream;
        let mut a = RawArgs::default();
        a.dptr(&q0.data, st)
            .dptr(&k0.data, st)
            .dptr(&v.data, st)
            .dptr(&qn.data, st)
            .dptr(&kn.data, st)
            .dptr_mut(&mut q.data, st)
            .dptr_mut(&mut kcv, st)
            .dptr_mut(&mut vcv, st)
            .i32(h_i)
            .i32(hk_i)
            .i32(hd_i)
            .i32(hr_i)
            .i64(p0)
            .dptr(freqs, st)
            .f32(sc)
            .f32(eps)
            .i32(q_rows as i32)
            .i32(kv16 as i32);
        let pdl = *lock(&self.a8_pdl);
        // A prefill's rows: one block per row (`qk_norm_rope_kv_rows`, the same parameters and
        // bits; its rotation in shared memory, a slice per warp for the normed head).
        if rows > SKINNY_ROWS && threads == 128 && *lock(&self.prefill_producers) {
            let smem = (2 * half + QKR_WARPS * head_dim) * std::mem::size_of::<f32>();
            let fr = self.func_smem(Kernel::QkNormRopeKvRows, smem)?;
            self.prefill_producer_uses[1].fetch_add(1, Ordering::Relaxed);
            // SAFETY: as below (qk_norm_rope_kv_rows takes qk_norm_rope_kv's parameters); its
            // shared memory holds 2 * half + QKR_WARPS * head_dim floats.
            return unsafe {
                a.launch(
                    st,
                    &fr,
                    cfg(
                        (i32_of("qk_norm_rope_kv", "rows", rows)? as u32, 1, 1),
                        32 * QKR_WARPS as u32,
                        smem as u32,
                    ),
                    pdl,
                )
            };
        }
        let blocks = rows * (n_heads + n_kv_heads);
        // SAFETY: qk_norm_rope_kv's parameters in order (q0, k0, v, qn, kn, q_out, kc, vc,
        // n_heads, n_kv, hd, half_rot, pos0, inv_freq, attn_scale, eps, q_rows, kv16).
        unsafe { a.launch(st, &f, cfg((blocks as u32, 1, 1), threads, 0), pdl) }
    }

    /// A token for what activation slot `slot` (0 or 1) holds now, if anything: a timing aid
    /// for ablations that leave a producer out and let its consumer read the slot's older
    /// contents (`xtask bench gpu --a8-sweep ...+skip=N`). The values read are then not the
    /// step's, only its timing is meaningful.
    #[doc(hidden)]
    pub fn a8_slot_token(&self, slot: usize) -> Option<A8Act> {
        let s = lock(&self.scratch);
        let (k, rows) = (*s.a8_shape.get(slot)?)?;
        Some(A8Act {
            k,
            rows,
            slot,
            generation: s.a8_gen[slot],
        })
    }

    /// RMSNorm of rows `row0 .. row0 + rows` of `x` (width `dim`, a multiple of 32; `rows`
    /// <= 16) written straight as a Q8_0A8 activation for [`Cuda::matmul_many_q8`] (K =
    /// `dim`): the bytes a matmul's own quantizer would write from `rms_norm`'s output (same
    /// sum of squares, same block size), with no f32 output and no quantizer launch. Each row
    /// is spread over several thread blocks, each summing the whole row's squares in
    /// `rms_norm`'s order.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_q8(
        &self,
        x: &CudaBuf,
        row0: usize,
        rows: usize,
        w: &CudaBuf,
        dim: usize,
        eps: f32,
    ) -> Result<A8Act> {
        check("rms_norm_q8", "x", (row0 + rows) * dim, x.len)?;
        check("rms_norm_q8", "w", dim, w.len)?;
        let threads = norm_threads(dim) as usize;
        if rows == 0
            || rows > SKINNY_ROWS
            || dim == 0
            || !dim.is_multiple_of(32)
            || dim > 32 * threads
        {
            return Err(BackendError::Invalid {
                op: "rms_norm_q8",
                msg: format!(
                    "needs 1..=16 rows and dim % 32 == 0, dim <= {}; found {rows} rows, dim {dim}",
                    32 * threads
                ),
            });
        }
        let nt = if rows > 8 { 2 } else { 1 };
        let kbp = a8_kbp(dim);
        // Register slots per row, spread over up to 16 blocks (each block quantizes its slots
        // one after another: at dim 4096 one slot per block instead of two). Every block sums
        // the whole row in the same order, so the count changes no bit. H200, q8_0a8 step over
        // f16 caches, two rounds (8 -> 16 -> 32 blocks): 8B ctx 512 0.599-0.604 -> 0.596-0.601
        // -> 0.595-0.598 ms, ctx 8192 0.680-0.683 -> 0.672-0.675 -> 0.672-0.674; 27B ctx 512
        // 0.997-1.015 -> 1.000-1.017 -> 1.030-1.033, ctx 8192 1.047-1.053 -> 1.035-1.054 ->
        // 1.068-1.073.
        let blocks_per_row = dim.div_ceil(threads).min(16);
        let f = self.func(Kernel::RmsNormQ8)?;
        let mut s = lock(&self.scratch);
        let (xq, xd) = s.a8_first(&self.stream, kbp, nt)?;
        let st = &*self.stream;
        let mut a = RawArgs::default();
        a.dptr(&x.data, st)
            .dptr(&w.data, st)
            .i32(rows as i32)
            .i64(row0 as i64)
            .i32(i32_of("rms_norm_q8", "dim", dim)?)
            .f32(eps)
            .i32(blocks_per_row as i32)
            .i32(nt as i32)
            .i32(i32_of("rms_norm_q8", "dim", kbp)?)
            .dptr_mut(&mut *xq, st)
            .dptr_mut(&mut *xd, st);
        let pdl = *lock(&self.a8_pdl);
        let grid = (nt * 8 * blocks_per_row) as u32;
        // SAFETY: rms_norm_q8's parameters in order (x, w, T, row0, dim, eps, C, NT, KBp, xq,
        // xd); the scratch holds kbp * nt * 64 codes words and kbp * nt * 8 scales.
        unsafe { a.launch(st, &f, cfg((grid, 1, 1), threads as u32, 0), pdl) }?;
        Ok(s.a8_written(0, dim, rows))
    }

    /// The activation quantizer `a8_quant_x`: x (or silu(x) * up) into the scratch layout.
    fn launch_a8_quant(
        &self,
        fq: &CudaFunction,
        x: &cudarc::driver::CudaView<'_, f32>,
        up: Option<&cudarc::driver::CudaView<'_, f32>>,
        q: A8Quant,
        xq: &mut CudaSlice<u32>,
        xd: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let st = &*self.stream;
        let mut a = RawArgs::default();
        a.dptr(x, st);
        match up {
            Some(u) => a.dptr(u, st),
            None => a.u64(0),
        };
        a.i32(q.t)
            .i32(q.k)
            .i32(q.nt)
            .i32(q.kbp)
            .dptr_mut(&mut *xq, st)
            .dptr_mut(&mut *xd, st);
        let threads = q.kbp as usize * q.nt as usize * 8 * 32;
        // SAFETY: the parameters are a8_quant_x's (x, up, T, K, NT, KBp, xq, xd); the scratch
        // holds KBp * NT * 64 code words and KBp * NT * 8 scales.
        unsafe { a.launch(st, fq, grid_1d(threads, 256), q.pdl) }
    }

    /// Attention (`fast`: [`Backend::attention_fast`]'s kernels) of `p.n_q` <= 16 queries
    /// into `out`, whose rows are also written as the Q8_0A8 activation that the next
    /// [`Cuda::matmul_many_q8`] of K = `n_heads * head_dim` reads (by the split combine where
    /// it runs, else by the quantizer after the attention): the bytes the o projection's own
    /// quantizer would write from `out`. `kv`: how `k` and `v` are stored (an f16 cache takes
    /// [`Backend::attention_fast_kv16`]'s kernels whatever `fast` says).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_q8(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        p: &AttnParams,
        fast: bool,
        kv: KvStorage,
        out: &mut CudaBuf,
    ) -> Result<A8Act> {
        let kdim = p.n_heads * p.head_dim;
        if p.n_q == 0 || p.n_q > SKINNY_ROWS || !kdim.is_multiple_of(32) {
            return Err(BackendError::Invalid {
                op: "attention_q8",
                msg: format!(
                    "needs 1..=16 queries and n_heads * head_dim % 32 == 0, found {} queries, {kdim}",
                    p.n_q
                ),
            });
        }
        let nt = if p.n_q > 8 { 2 } else { 1 };
        let kbp = a8_kbp(kdim);
        if kv == KvStorage::F16 && !self.kv16_kernel_fits(p) {
            // The unpacking path, then the quantizer below.
            attention_fast_kv16_ops(self, q, k, v, p, out)?;
        } else if let Some(AttnAct::A8(act)) =
            self.attention_op(q, k, v, p, fast, kv, AttnExtra::Q8 { nt, kbp }, out)?
        {
            return Ok(act);
        }
        {
            let fq = self.func(Kernel::A8QuantX)?;
            let mut s = lock(&self.scratch);
            let (xq, xd) = s.a8_first(&self.stream, kbp, nt)?;
            let qz = A8Quant {
                t: p.n_q as i32,
                k: i32_of("attention_q8", "n_heads * head_dim", kdim)?,
                nt: nt as i32,
                kbp: i32_of("attention_q8", "n_heads * head_dim", kbp)?,
                pdl: *lock(&self.a8_pdl),
            };
            let xv = out.data.slice(0..p.n_q * kdim);
            self.launch_a8_quant(&fq, &xv, None, qz, xq, xd)?;
            Ok(s.a8_written(0, kdim, p.n_q))
        }
    }

    /// `outs[i] = x W_i^T` (or `outs[i] += x W_i^T` with `accumulate`) for Q8_0A8 weights of
    /// K = `act.k()`, x the producer's activation `act` (an error if a later launch has
    /// overwritten it): the bits of `matmul_many` on the producer's f32 output (followed by
    /// `add_assign` with `accumulate`), without the quantizer launch.
    pub fn matmul_many_q8(
        &self,
        act: &A8Act,
        ws: &[&Weight<Self>],
        outs: &mut [&mut CudaBuf],
        accumulate: bool,
    ) -> Result<()> {
        if !self.matmul_many_q8_if_current(act, ws, outs, accumulate)? {
            return Err(stale("matmul_many_q8", act));
        }
        Ok(())
    }

    /// [`Cuda::matmul_many_q8`]; Ok(false) (nothing launched) for a stale activation.
    fn matmul_many_q8_if_current(
        &self,
        act: &A8Act,
        ws: &[&Weight<Self>],
        outs: &mut [&mut CudaBuf],
        accumulate: bool,
    ) -> Result<bool> {
        let rows = act.rows;
        let k = act.k;
        if ws.len() != outs.len() || !(1..=3).contains(&ws.len()) {
            return Err(BackendError::Invalid {
                op: "matmul_many_q8",
                msg: format!(
                    "1..=3 weights with one output each, found {} and {}",
                    ws.len(),
                    outs.len()
                ),
            });
        }
        let mut mats = Vec::with_capacity(3);
        for (w, o) in ws.iter().zip(outs.iter_mut()) {
            let Some(A8Parts { qs, d, q4 }) = w.buf.a8() else {
                return Err(BackendError::Invalid {
                    op: "matmul_many_q8",
                    msg: format!("needs Q8_0A8 or Q4_0A8 weights, found {:?}", w.format),
                });
            };
            if w.cols != k || w.rows == 0 {
                return Err(BackendError::shape("matmul_many_q8", "w.cols", k, w.cols));
            }
            check("matmul_many_q8", "out", rows * w.rows, o.len)?;
            mats.push(A8Launch {
                qs,
                d,
                q4,
                n: w.rows,
                out: o.data.slice_mut(0..rows * w.rows),
            });
        }
        self.matmul_a8(None, None, Some(act), rows, k, &mut mats, accumulate)
    }

    /// The SwiGLU gate / up projections of the activation the last [`Cuda::rms_norm_q8`] wrote
    /// (K = `wg.cols`, `rows` rows), written as the down projection's Q8_0A8 activation of
    /// silu(gate) * up (K = `wg.rows`) for the next [`Cuda::matmul_many_q8`]: one launch, no
    /// f32 gate / up and no quantizer launch; the bytes the down projection's own quantizer
    /// writes from `matmul_many` + `silu_mul` (the gate and up results bit for bit those of
    /// `matmul_many`). A block computes 32 features of both matrices (4 tiles, 2 k-slices,
    /// 2 stages).
    pub fn matmul_gate_up_q8(
        &self,
        act: &A8Act,
        wg: &Weight<Self>,
        wu: &Weight<Self>,
    ) -> Result<A8Act> {
        self.matmul_gate_up_q8_if_current(act, wg, wu)?
            .ok_or_else(|| stale("matmul_gate_up_q8", act))
    }

    /// [`Cuda::matmul_gate_up_q8`]; Ok(None) (nothing launched) for a stale activation.
    fn matmul_gate_up_q8_if_current(
        &self,
        act: &A8Act,
        wg: &Weight<Self>,
        wu: &Weight<Self>,
    ) -> Result<Option<A8Act>> {
        let (k, n, rows) = (wg.cols, wg.rows, act.rows);
        let (Some(gp), Some(up)) = (wg.buf.a8(), wu.buf.a8()) else {
            return Err(BackendError::Invalid {
                op: "matmul_gate_up_q8",
                msg: format!(
                    "needs Q8_0A8 or Q4_0A8 weights, found {:?} / {:?}",
                    wg.format, wu.format
                ),
            });
        };
        if gp.q4 != up.q4 {
            return Err(BackendError::Invalid {
                op: "matmul_gate_up_q8",
                msg: format!(
                    "one launch needs gate and up in one format, found {:?} / {:?}",
                    wg.format, wu.format
                ),
            });
        }
        let (gq, gd, uq, ud, q4) = (gp.qs, gp.d, up.qs, up.d, gp.q4);
        if wu.rows != n || wu.cols != k || n == 0 || !n.is_multiple_of(32) {
            return Err(BackendError::Invalid {
                op: "matmul_gate_up_q8",
                msg: format!(
                    "gate {n} x {k} and up {} x {} must have one shape with rows % 32 == 0",
                    wu.rows, wu.cols
                ),
            });
        }
        if act.k != k || act.slot != 0 {
            return Err(BackendError::Invalid {
                op: "matmul_gate_up_q8",
                msg: format!(
                    "needs a first-slot activation of K = {k} (from rms_norm_q8), found {act:?}"
                ),
            });
        }
        let nt = if rows > 8 { 2 } else { 1 };
        let kbp2 = a8_kbp(n);
        let grid = n.div_ceil(16 * 4 / 2);
        let chosen = *lock(&self.a8_pair);
        let nch = (k / 32).div_ceil(A8_CB).max(1);
        let queue = self.pair_queue(n, k, nt, q4);
        let (ks, st_n) = match (chosen, queue) {
            (Some(c), _) => c,
            (None, Some(_)) => (1, 2),
            (None, None) => a8_pair_auto(grid, nt, self.num_sms, self.smem, q4),
        };
        let (w, ks, st_n) = (4usize, usize::from(ks), usize::from(st_n));
        let smem = queue.map_or(a8k_smem_bytes(nt, w, ks, st_n, q4), |q| q.smem);
        if smem > self.smem.block {
            return Err(BackendError::Invalid {
                op: "matmul_gate_up_q8",
                msg: format!(
                    "needs {smem} bytes of shared memory per thread block, the device allows {}",
                    self.smem.block
                ),
            });
        }
        let kern = match (queue, nt) {
            (Some(_), 1) => Kernel::A8KPQN1W4K1S2,
            (Some(_), _) => Kernel::A8KPQN2W4K1S2,
            (None, _) => a8kp_kernel(nt, ks, st_n).ok_or_else(internal)?,
        };
        let kern = if q4 {
            kern.q4_twin().ok_or_else(internal)?
        } else {
            kern
        };
        let f = self.func_smem(kern, smem)?;
        let mut s = lock(&self.scratch);
        if !s.a8_current(act) {
            return Ok(None);
        }
        // The first slot holds `act` (current: written at this size); only the second grows.
        ensure(&self.stream, &mut s.a8_q2, kbp2 * nt * 64).map_err(dev)?;
        ensure(&self.stream, &mut s.a8_d2, kbp2 * nt * 8).map_err(dev)?;
        // The queue launch: the pieces' chunk sums (gate, then up: [chunk][tile][token
        // group][128] each) and the counters.
        let cs_len = nch * (n / 16) * nt * 128;
        if let Some(q) = queue {
            ensure(&self.stream, &mut s.a8_ws, 2 * cs_len).map_err(dev)?;
            // [next piece, blocks done], the pieces' groups' counts.
            ensure(&self.stream, &mut s.a8_qctr, 2 + grid - q.whole).map_err(dev)?;
        }
        let Scratch {
            a8_q,
            a8_d,
            a8_q2,
            a8_d2,
            a8_ws,
            a8_qctr,
            ..
        } = &mut *s;
        let st = &*self.stream;
        let mut a = RawArgs::default();
        a.dptr(gq, st)
            .dptr(gd, st)
            .dptr(uq, st)
            .dptr(ud, st)
            .i32(i32_of("matmul_gate_up_q8", "w.rows", n)?)
            .dptr(a8_q.as_ref().ok_or_else(internal)?, st)
            .dptr(a8_d.as_ref().ok_or_else(internal)?, st)
            .i32(i32_of("matmul_gate_up_q8", "w.cols", k)?)
            .i32(rows as i32)
            .i32(i32::from(*lock(&self.a8_evict_first)))
            .dptr_mut(a8_q2.as_mut().ok_or_else(internal)?, st)
            .dptr_mut(a8_d2.as_mut().ok_or_else(internal)?, st)
            .i32(i32_of("matmul_gate_up_q8", "w.rows", kbp2)?);
        if queue.is_some() {
            let ws = a8_ws.as_mut().ok_or_else(internal)?;
            let (p, _sync) = ws.device_ptr_mut(st);
            a.u64(p)
                .u64(p + (cs_len * std::mem::size_of::<f32>()) as u64)
                .dptr_mut(a8_qctr.as_mut().ok_or_else(internal)?, st);
        }
        if let Some(q) = queue {
            a.i32(i32_of("matmul_gate_up_q8", "pieces", q.pieces)?);
        }
        let grid = queue.map_or(grid, |q| q.whole) as u32;
        let pdl = *lock(&self.a8_pdl);
        // SAFETY: the parameters of A8KP in matmul.cu in order (wq0, ws0, wq1, ws1, n, xq, xd,
        // K, T, ef, xq2, xd2, kbp2), for A8KPQ then (cs0, cs1, ctr, pieces) with 2 x cs_len
        // floats of chunk sums and 2 + the pieces' groups of counters; the second slot holds
        // kbp2 * nt blocks of nt * 8 tokens.
        unsafe {
            a.launch(
                st,
                &f,
                cfg(
                    (grid, 1, 1),
                    (32 * w * a8_wpt(nt, q4) * ks) as u32,
                    smem as u32,
                ),
                pdl,
            )
        }?;
        Ok(Some(s.a8_written(1, n, rows)))
    }

    /// `h += x W^T` for Q8_0A8 weights (the residual add inside the matmul's store): the bits
    /// of `matmul` into a buffer followed by `add_assign(h, 0, ..)`.
    pub fn matmul_add(
        &self,
        x: &CudaBuf,
        rows: usize,
        w: &Weight<Self>,
        h: &mut CudaBuf,
    ) -> Result<()> {
        self.matmul_add_a8(x, None, rows, w, h)
    }

    /// `h += (silu(gate) * up) W^T` for Q8_0A8 weights: the bits of `matmul_silu_mul` into a
    /// buffer followed by `add_assign(h, 0, ..)`.
    pub fn matmul_silu_mul_add(
        &self,
        gate: &CudaBuf,
        up: &CudaBuf,
        rows: usize,
        w: &Weight<Self>,
        h: &mut CudaBuf,
    ) -> Result<()> {
        check("matmul_silu_mul_add", "up", rows * w.cols, up.len)?;
        self.matmul_add_a8(gate, Some(up), rows, w, h)
    }

    fn matmul_add_a8(
        &self,
        x: &CudaBuf,
        up: Option<&CudaBuf>,
        rows: usize,
        w: &Weight<Self>,
        h: &mut CudaBuf,
    ) -> Result<()> {
        let Some(A8Parts { qs, d, q4 }) = w.buf.a8() else {
            return Err(BackendError::Invalid {
                op: "matmul_add",
                msg: format!("needs Q8_0A8 or Q4_0A8 weights, found {:?}", w.format),
            });
        };
        let (k, n) = (w.cols, w.rows);
        check("matmul_add", "x", rows * k, x.len)?;
        check("matmul_add", "h", rows * n, h.len)?;
        let mut r0 = 0;
        while r0 < rows {
            let t = (rows - r0).min(SKINNY_ROWS);
            let xv = x.data.slice(r0 * k..(r0 + t) * k);
            let uv = up.map(|u| u.data.slice(r0 * k..(r0 + t) * k));
            let mut mats = [A8Launch {
                qs,
                d,
                q4,
                n,
                out: h.data.slice_mut(r0 * n..(r0 + t) * n),
            }];
            self.matmul_a8(Some(&xv), uv.as_ref(), None, t, k, &mut mats, true)?;
            r0 += t;
        }
        Ok(())
    }

    /// Test hook: run the Q8_0A8 activation quantizer on `rows` (<= 16) rows of `x` (row
    /// length `k`, a multiple of 32) and return its output re-ordered as ggml blocks: the
    /// codes `[rows, k]` and the f16 scale bits `[rows, k / 32]`.
    pub fn a8_quantize_rows(
        &self,
        x: &CudaBuf,
        rows: usize,
        k: usize,
    ) -> Result<(Vec<i8>, Vec<u16>)> {
        check("a8_quantize_rows", "x", rows * k, x.len)?;
        if rows == 0 || rows > SKINNY_ROWS || !k.is_multiple_of(32) {
            return Err(BackendError::Invalid {
                op: "a8_quantize_rows",
                msg: format!("needs 1..=16 rows and k % 32 == 0, found {rows} rows, k {k}"),
            });
        }
        let nt = if rows > 8 { 2 } else { 1 };
        let kbp = a8_kbp(k);
        let mut xq = self.stream.alloc_zeros::<u32>(kbp * nt * 64).map_err(dev)?;
        let mut xd = self.stream.alloc_zeros::<f32>(kbp * nt * 8).map_err(dev)?;
        let fq = self.func(Kernel::A8QuantX)?;
        let (t_i, k_i, nt_i, kbp_i) = (rows as i32, k as i32, nt as i32, kbp as i32);
        let null = 0u64;
        let mut b = self.stream.launch_builder(&fq);
        b.arg(&x.data)
            .arg(&null)
            .arg(&t_i)
            .arg(&k_i)
            .arg(&nt_i)
            .arg(&kbp_i)
            .arg(&mut xq)
            .arg(&mut xd);
        unsafe { b.launch(grid_1d(kbp * nt * 8 * 32, 256)) }.map_err(dev)?;
        let q = self.stream.clone_dtoh(&xq).map_err(dev)?;
        let d = self.stream.clone_dtoh(&xd).map_err(dev)?;
        let kb = k / 32;
        let mut codes = vec![0i8; rows * k];
        let mut scales = vec![0u16; rows * kb];
        for tok in 0..rows {
            for blk in 0..kb {
                scales[tok * kb + blk] = half::f16::from_f32(d[blk * nt * 8 + tok]).to_bits();
                for kk in 0..32 {
                    let (t, h) = ((kk % 16) / 4, kk / 16);
                    let word = q[((blk * nt + tok / 8) * 32 + (tok % 8) * 4 + t) * 2 + h];
                    codes[tok * k + blk * 32 + kk] = (word >> (8 * (kk % 4))) as u8 as i8;
                }
            }
        }
        Ok((codes, scales))
    }

    fn with_blas<R>(&self, f: impl FnOnce(&CudaBlas) -> Result<R>) -> Result<R> {
        let mut g = lock(&self.blas);
        if g.is_none() {
            *g = Some(CudaBlas::new(self.stream.clone()).map_err(dev)?);
        }
        f(g.as_ref().ok_or_else(internal)?)
    }

    /// Whether a matmul of `rows` rows of x by `w` runs on cuBLAS ([`Cuda::matmul_cublas`]): with
    /// [`CudaOptions::cublas_prefill`], f32 / bf16 weights from [`SKINNY_ROWS`] + 1 rows, the
    /// block formats from [`Cuda::set_quant_prefill_rows`]'s counts (K a multiple of 32).
    fn cublas_takes(&self, w: &Weight<Self>, rows: usize) -> bool {
        if rows <= SKINNY_ROWS || !self.opts.cublas_prefill {
            return false;
        }
        match &w.buf {
            CudaWeightBuf::F32(_) | CudaWeightBuf::Bf16(_) | CudaWeightBuf::Bf16P(_) => true,
            CudaWeightBuf::Q8_0 { .. } | CudaWeightBuf::Q4_0 { .. } => {
                let from = lock(&self.quant_prefill_rows).unwrap_or(QUANT_PREFILL_ROWS);
                rows >= from && w.cols.is_multiple_of(32)
            }
            CudaWeightBuf::Q8A8 { .. } | CudaWeightBuf::Q4A8 { .. } => {
                let from = lock(&self.quant_prefill_rows).unwrap_or(A8_PREFILL_ROWS);
                rows >= from && w.cols.is_multiple_of(32)
            }
            CudaWeightBuf::F16(_) => false,
        }
    }

    /// cuBLAS path for many rows: f32 weights through an f32 GEMM; the others through x split
    /// into bf16 hi + lo ([`Cuda::split_x`], or for Q8_0A8 / Q4_0A8 quantized first) and
    /// [`Cuda::matmul_cublas_split`].
    fn matmul_cublas(
        &self,
        x: &CudaBuf,
        rows: usize,
        w: &Weight<Self>,
        out: &mut CudaBuf,
    ) -> Result<bool> {
        use cublas_sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let (n, k) = (w.rows as i32, w.cols as i32);
        let m = i32_of("matmul", "x rows", rows)?;
        let one = 1.0f32;
        let zero = 0.0f32;
        let fast = self.prefill_fast();
        let a8 = match &w.buf {
            CudaWeightBuf::F32(ws) => {
                return self.with_blas(|blas| {
                    let (wp, _g1) = ws.device_ptr(&self.stream);
                    let (xp, _g2) = x.data.device_ptr(&self.stream);
                    let (op, _g3) = out.data.device_ptr_mut(&self.stream);
                    unsafe {
                        cudarc::cublas::result::gemm_ex(
                            *blas.handle(),
                            cublasOperation_t::CUBLAS_OP_T,
                            cublasOperation_t::CUBLAS_OP_N,
                            n,
                            m,
                            k,
                            &one as *const f32 as *const _,
                            wp as *const _,
                            cudaDataType::CUDA_R_32F,
                            k,
                            xp as *const _,
                            cudaDataType::CUDA_R_32F,
                            k,
                            &zero as *const f32 as *const _,
                            op as *mut _,
                            cudaDataType::CUDA_R_32F,
                            n,
                            cublasComputeType_t::CUBLAS_COMPUTE_32F,
                            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                        )
                    }
                    .map_err(dev)?;
                    Ok(true)
                });
            }
            CudaWeightBuf::Bf16(_) | CudaWeightBuf::Bf16P(_) => false,
            CudaWeightBuf::Q8_0 { .. } | CudaWeightBuf::Q4_0 { .. }
                if self.cublas_takes(w, rows) =>
            {
                false
            }
            CudaWeightBuf::Q8A8 { .. } | CudaWeightBuf::Q4A8 { .. }
                if self.cublas_takes(w, rows) =>
            {
                true
            }
            _ => return Ok(false),
        };
        let len = rows * w.cols;
        let mut s = lock(&self.scratch);
        let (wu, hi, lo) = s.prefill_buffers(&self.stream, self.unpack_scratch(&[w]), len)?;
        // (the fast prefill reads the hi halves only: no lo written)
        let lo_w = (!fast).then_some(&mut *lo);
        self.split_x(x, hi, lo_w, rows, w.cols, a8)?;
        let bufs = SplitBuffers { w: wu, hi, lo };
        self.matmul_cublas_split(bufs, rows, w, out, fast)?;
        Ok(true)
    }

    /// `rows` rows of x (width `k`) split into bf16 hi + lo: by `split_bf16`, or with `a8`
    /// first quantized to q8_0 as the Q8_0A8 kernels quantize them (`a8_split_x`: the values
    /// their product multiplies); `lo` None: hi only (the fast prefill's one product reads no
    /// lo).
    fn split_x(
        &self,
        x: &CudaBuf,
        hi: &mut CudaSlice<u16>,
        lo: Option<&mut CudaSlice<u16>>,
        rows: usize,
        k: usize,
        a8: bool,
    ) -> Result<()> {
        let len = rows * k;
        let f = self.func(if a8 {
            Kernel::A8SplitX
        } else {
            Kernel::SplitBf16
        })?;
        let (m, kk, n64) = (
            i32_of("matmul", "x rows", rows)?,
            i32_of("matmul", "cols", k)?,
            len as i64,
        );
        let mut b = self.stream.launch_builder(&f);
        b.arg(&x.data).arg(&mut *hi);
        match lo {
            Some(lo) => b.arg(lo),
            None => b.arg(&NULL_PTR),
        };
        if a8 {
            b.arg(&m).arg(&kk);
        } else {
            b.arg(&n64);
        }
        // SAFETY: a8_split_x(x, hi, lo, T, K) / split_bf16(x, hi, lo, n) over x's first
        // rows x k values (hi / lo hold as many; a null lo is not written): a warp per 32-value
        // block, one thread per value / four values per thread.
        let threads = if a8 { len } else { len.div_ceil(4) };
        unsafe { b.launch(grid_1d(threads, 256)) }.map_err(dev)?;
        Ok(())
    }

    /// `out = x W^T` on cuBLAS for `rows` rows of x already split into bf16 hi + lo (in
    /// `bufs`; `fast`: hi only, one product per weight half). bf16 weights: two bf16 GEMMs, so
    /// x keeps ~16 bits (packed bf16: row blocks of W unpacked to row-major scratch first);
    /// the block formats: row blocks of W dequantized (the f16 scale times the code, exact in
    /// f32) and split into bf16 hi + lo, and `out = W_hi x_hi + W_hi x_lo + W_lo x_hi` with
    /// f32 accumulation: both sides to ~16 significant bits, at three bf16 products. The
    /// weight scratch holds [`unpack_len`] values.
    fn matmul_cublas_split(
        &self,
        bufs: SplitBuffers<'_>,
        rows: usize,
        w: &Weight<Self>,
        out: &mut CudaBuf,
        fast: bool,
    ) -> Result<()> {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let SplitBuffers { w: wu, hi, lo } = bufs;
        let (nn, kk) = (w.rows, w.cols);
        let (n, k, m) = (
            i32_of("matmul", "rows", nn)?,
            i32_of("matmul", "cols", kk)?,
            i32_of("matmul", "x rows", rows)?,
        );
        check("matmul", "x (bf16 halves)", rows * kk, hi.len())?;
        check("matmul", "out", rows * nn, out.len)?;
        let st = &self.stream;
        let values = self.unpack_values();
        check("matmul", "weight scratch", unpack_len(w, values), wu.len())?;
        let chunk = unpack_chunk(kk, values);
        // The products of a row block of W (`wh` / `wl` its hi / lo halves) into out's
        // columns n0 .. n0 + nc.
        let gemm = |wh: u64, wl: u64, n0: usize, nc: i32, out: &mut CudaBuf, three: bool| {
            self.with_blas(|blas| {
                let (xh, _g1) = hi.device_ptr(st);
                let (xl, _g2) = lo.device_ptr(st);
                let (op, _g3) = out.data.device_ptr_mut(st);
                let op = op + (n0 * std::mem::size_of::<f32>()) as u64;
                let all = [(wh, xh), (wh, xl), (wl, xh)];
                let pairs = match (fast, three) {
                    (true, _) => &all[..1],
                    (false, false) => &all[..2],
                    (false, true) => &all[..],
                };
                // SAFETY: the block's halves are nc x k, x's m x k, out's columns n0 .. n0 +
                // nc of its m rows of n (checked above and by the callers).
                unsafe { gemm_bf16_products(*blas.handle(), pairs, op, nc, m, k, n) }
            })
        };
        match &w.buf {
            CudaWeightBuf::Bf16(ws) => {
                let (wp, _g) = ws.device_ptr(st);
                gemm(wp, 0, 0, n, out, false)
            }
            CudaWeightBuf::Bf16P(ws) => {
                // Row blocks of W unpacked to row-major scratch, each multiplied by cuBLAS
                // into its columns of out.
                let fu = self.func(Kernel::UnpackBf16P)?;
                let mut n0 = 0;
                while n0 < nn {
                    let nc = chunk.min(nn - n0);
                    let (n0_i, nc_i) = (n0 as i64, i32_of("matmul", "rows", nc)?);
                    let mut b = st.launch_builder(&fu);
                    b.arg(ws).arg(&mut *wu).arg(&n0_i).arg(&nc_i).arg(&k);
                    // SAFETY: unpack_bf16p(p, out, n0, rows, cols): rows n0 .. n0 + nc of W
                    // (nc x k values into the scratch), one block per row.
                    unsafe { b.launch(row_blocks(nc)) }.map_err(dev)?;
                    let (wp, _g) = wu.device_ptr(st);
                    gemm(wp, 0, n0, nc_i, out, false)?;
                    n0 += nc;
                }
                Ok(())
            }
            CudaWeightBuf::Q8_0 { .. }
            | CudaWeightBuf::Q4_0 { .. }
            | CudaWeightBuf::Q8A8 { .. }
            | CudaWeightBuf::Q4A8 { .. } => {
                let (fmt, kbp) = match &w.buf {
                    CudaWeightBuf::Q8_0 { .. } => (3i32, 0usize),
                    CudaWeightBuf::Q4_0 { .. } => (4, 0),
                    CudaWeightBuf::Q8A8 { .. } => (5, a8_kbp(kk)),
                    _ => (7, a8_kbp(kk)),
                };
                let ((qs, _gq), (dp, _gd)) = match &w.buf {
                    CudaWeightBuf::Q8_0 { qs, d } => (qs.device_ptr(st), d.device_ptr(st)),
                    CudaWeightBuf::Q4_0 { qs, d } => (qs.device_ptr(st), d.device_ptr(st)),
                    CudaWeightBuf::Q8A8 { qs, d } | CudaWeightBuf::Q4A8 { qs, d } => {
                        (qs.device_ptr(st), d.device_ptr(st))
                    }
                    _ => return Err(internal()),
                };
                let cw = chunk.min(nn) * kk;
                let fu = self.func(Kernel::UnpackQuantHiLo)?;
                let (kbp_i, mut n0) = (i32_of("matmul", "blocks", kbp)?, 0usize);
                while n0 < nn {
                    let nc = chunk.min(nn - n0);
                    let (n0_i, nc_i) = (n0 as i64, i32_of("matmul", "rows", nc)?);
                    let (mut wh, mut wl) = wu.split_at_mut(cw);
                    let mut b = st.launch_builder(&fu);
                    b.arg(&fmt).arg(&qs).arg(&dp).arg(&mut wh);
                    // (the fast prefill reads the hi halves only: no lo written)
                    if fast {
                        b.arg(&NULL_PTR);
                    } else {
                        b.arg(&mut wl);
                    }
                    b.arg(&n0_i).arg(&nc_i).arg(&k).arg(&kbp_i);
                    // SAFETY: unpack_quant_hilo's parameters in order; rows n0 .. n0 + nc of
                    // W (nc x k values into each half of the scratch), one block per row.
                    unsafe { b.launch(row_blocks(nc)) }.map_err(dev)?;
                    let ((hp, _g1), (lp, _g2)) = (wh.device_ptr(st), wl.device_ptr(st));
                    gemm(hp, lp, n0, nc_i, out, true)?;
                    n0 += nc;
                }
                Ok(())
            }
            CudaWeightBuf::F32(_) | CudaWeightBuf::F16(_) => Err(internal()),
        }
    }
}

/// Values of W per row block of a cuBLAS prefill matmul by default
/// ([`Cuda::set_unpack_block`]): 64M, a whole matrix of a dense 8B layer (128 MB of bf16
/// scratch, 256 MB for the block formats' hi + lo). The dense 8B bf16 target's prefill
/// against 16M-value blocks (H100, 2026-12-06, exact / fast): 43.06 -> 39.05 / 28.58 ->
/// 26.17 ms at 512 tokens, 127.21 -> 123.76 / 72.92 -> 70.54 at 2048, 597.76 -> 582.70 /
/// 327.43 -> 322.12 at 8192.
pub const UNPACK_VALUES: usize = 64 << 20;

/// The fewest tokens of a `gated_delta_rule` call without a stash that the chunked kernels
/// take ([`Cuda::set_delta_chunk_min`]). The Qwen3.6-27B linear-layer shape on an H100
/// (2026-12-07), chunked against the register kernel, ms: 0.116 / 0.084 at 64 tokens, 0.147 /
/// 0.160 at 128, 0.398 / 0.686 at 512, 5.74 / 11.21 at 8192.
pub const DELTA_CHUNK_MIN: usize = 128;

/// Tokens per chunk of the chunked delta rule and the largest dk it takes (elementwise.cu's
/// `GDC`, `GDC_DK`).
const GDC: usize = 64;
const GDC_DK: usize = 128;

/// Scratch values of the chunked delta rule at most (256 MB; 29 chunks of the
/// Qwen3.6-27B linear-layer shape, whose state before each chunk is 3 MB): a longer call runs
/// in spans of chunks that fit.
const DELTA_SCRATCH_VALUES: usize = 64 << 20;

/// Rows of W per block a cuBLAS matmul unpacks at a time (at most `values` values, a multiple
/// of 16, at least 16) for K = `k`.
fn unpack_chunk(k: usize, values: usize) -> usize {
    (values / k.max(1)).max(16) / 16 * 16
}

/// Weight scratch values [`Cuda::matmul_cublas_split`] needs for `w` with row blocks of at
/// most `values` values: none for plain bf16, one row block for packed bf16, two (hi and lo)
/// for the block formats.
fn unpack_len(w: &Weight<Cuda>, values: usize) -> usize {
    let block = unpack_chunk(w.cols, values).min(w.rows) * w.cols;
    match &w.buf {
        CudaWeightBuf::Bf16P(_) => block,
        CudaWeightBuf::Q8_0 { .. }
        | CudaWeightBuf::Q4_0 { .. }
        | CudaWeightBuf::Q8A8 { .. }
        | CudaWeightBuf::Q4A8 { .. } => 2 * block,
        _ => 0,
    }
}

/// `out = sum of x_i W_i^T` on cuBLAS over bf16 pairs `(W_i, x_i)` (the first written, the
/// others added, f32 accumulation): each W row-major `nc x k`, each x `m x k`, out `m` rows of
/// `ldc` f32 at `op` (its first `nc` columns written).
///
/// # Safety
/// The pointers must address device buffers of those sizes on the handle's stream.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_bf16_products(
    handle: cudarc::cublas::sys::cublasHandle_t,
    pairs: &[(u64, u64)],
    op: u64,
    nc: i32,
    m: i32,
    k: i32,
    ldc: i32,
) -> Result<()> {
    use cublas_sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
    let (one, zero) = (1.0f32, 0.0f32);
    for (i, &(wp, xp)) in pairs.iter().enumerate() {
        let beta = if i == 0 { &zero } else { &one };
        unsafe {
            cudarc::cublas::result::gemm_ex(
                handle,
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                nc,
                m,
                k,
                &one as *const f32 as *const _,
                wp as *const _,
                cudaDataType::CUDA_R_16BF,
                k,
                xp as *const _,
                cudaDataType::CUDA_R_16BF,
                k,
                beta as *const f32 as *const _,
                op as *mut _,
                cudaDataType::CUDA_R_32F,
                ldc,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(dev)?;
    }
    Ok(())
}

/// Kernel parameters of a raw `cuLaunchKernelEx` launch, each stored in 8 bytes (the vector
/// is not touched while the parameter pointers into it are live; a 4-byte
/// parameter is read from the low half: x86-64 and aarch64 are little-endian). Device
/// pointers are taken on the launch stream, the only stream these buffers are used on.
#[derive(Default)]
struct RawArgs(Vec<u64>);

/// A producer's `lo` argument: the pair's lo halves, or null for a hi-only pair
/// ([`SplitAct`] under [`PrefillPrecision::Fast`]).
fn lo_arg(a: &mut RawArgs, lo: &mut CudaSlice<u16>, hi_only: bool, st: &CudaStream) {
    if hi_only {
        a.u64(0);
    } else {
        a.dptr_mut(lo, st);
    }
}

impl RawArgs {
    fn dptr<T>(&mut self, s: &impl DevicePtr<T>, st: &CudaStream) -> &mut Self {
        let (p, _sync) = s.device_ptr(st);
        self.0.push(p);
        self
    }
    fn dptr_mut<T>(&mut self, s: &mut impl DevicePtrMut<T>, st: &CudaStream) -> &mut Self {
        let (p, _sync) = s.device_ptr_mut(st);
        self.0.push(p);
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.push(v);
        self
    }
    fn append(&mut self, other: RawArgs) -> &mut Self {
        self.0.extend(other.0);
        self
    }
    fn f32(&mut self, v: f32) -> &mut Self {
        self.0.push(u64::from(v.to_bits()));
        self
    }
    fn i32(&mut self, v: i32) -> &mut Self {
        self.0.push(u64::from(v as u32));
        self
    }
    fn i64(&mut self, v: i64) -> &mut Self {
        self.0.push(v as u64);
        self
    }

    /// Launch `f` on `st`; with `pdl` as a programmatic dependent launch (the kernel may
    /// start before the previous kernel on the stream has finished: it must execute
    /// `griddepcontrol.wait` before reading anything that kernel writes).
    ///
    /// # Safety
    /// The parameters must match `f`'s signature in number, order and size.
    unsafe fn launch(
        &mut self,
        st: &CudaStream,
        f: &CudaFunction,
        c: LaunchConfig,
        pdl: bool,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.launch_attrs(st, f, c, pdl, false) }
    }

    /// [`RawArgs::launch`], optionally as a cooperative launch (`coop`: every block resident
    /// at once, or the launch fails with an error; for kernels with a grid barrier).
    ///
    /// # Safety
    /// The parameters must match `f`'s signature in number, order and size.
    unsafe fn launch_attrs(
        &mut self,
        st: &CudaStream,
        f: &CudaFunction,
        c: LaunchConfig,
        pdl: bool,
        coop: bool,
    ) -> Result<()> {
        st.context().bind_to_thread().map_err(dev)?;
        let mut params: Vec<*mut std::ffi::c_void> = self
            .0
            .iter_mut()
            .map(|b| b as *mut u64 as *mut std::ffi::c_void)
            .collect();
        // SAFETY: plain C structs; every field is set below or valid as zero.
        let mut attrs: [drv_sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if pdl {
            attrs[n].id =
                drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if coop {
            attrs[n].id = drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
            attrs[n].value.cooperative = 1;
            n += 1;
        }
        let lc = drv_sys::CUlaunchConfig {
            gridDimX: c.grid_dim.0,
            gridDimY: c.grid_dim.1,
            gridDimZ: c.grid_dim.2,
            blockDimX: c.block_dim.0,
            blockDimY: c.block_dim.1,
            blockDimZ: c.block_dim.2,
            sharedMemBytes: c.shared_mem_bytes,
            hStream: st.cu_stream(),
            attrs: if n > 0 {
                attrs.as_mut_ptr()
            } else {
                std::ptr::null_mut()
            },
            numAttrs: n as u32,
        };
        // SAFETY: `params` points at live values matching the kernel's parameters (caller),
        // `lc` and `attrs` outlive the call.
        unsafe {
            drv_sys::cuLaunchKernelEx(
                &lc,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(dev)
    }
}

/// One matrix of a Q8_0A8 launch.
/// The activation quantizer's sizes (tokens, K, token groups, padded blocks) and launch mode.
#[derive(Clone, Copy)]
struct A8Quant {
    t: i32,
    k: i32,
    nt: i32,
    kbp: i32,
    pdl: bool,
}

struct A8Launch<'a, 'b> {
    qs: &'a CudaSlice<u8>,
    d: &'a CudaSlice<u16>,
    /// Q4_0A8 codes (the kernels' [`Kernel::q4_twin`]).
    q4: bool,
    n: usize,
    out: cudarc::driver::CudaViewMut<'b, f32>,
}

fn internal() -> BackendError {
    BackendError::Invalid {
        op: "cuda",
        msg: "scratch buffer missing after allocation (internal invariant)".into(),
    }
}

/// [`push_weight`] for a [`RawArgs`] launch.
fn raw_weight(a: &mut RawArgs, w: &CudaWeightBuf, st: &CudaStream) {
    match w {
        CudaWeightBuf::F32(s) => {
            a.dptr(s, st).u64(0);
        }
        CudaWeightBuf::Bf16(s) | CudaWeightBuf::Bf16P(s) | CudaWeightBuf::F16(s) => {
            a.dptr(s, st).u64(0);
        }
        CudaWeightBuf::Q8_0 { qs, d } => {
            a.dptr(qs, st).dptr(d, st);
        }
        CudaWeightBuf::Q4_0 { qs, d } => {
            a.dptr(qs, st).dptr(d, st);
        }
        CudaWeightBuf::Q8A8 { qs, d } | CudaWeightBuf::Q4A8 { qs, d } => {
            a.dptr(qs, st).dptr(d, st);
        }
    }
}

fn push_weight<'a>(b: &mut cudarc::driver::LaunchArgs<'a>, w: &'a CudaWeightBuf) {
    match w {
        CudaWeightBuf::F32(s) => {
            b.arg(s).arg(&0u64);
        }
        CudaWeightBuf::Bf16(s) | CudaWeightBuf::Bf16P(s) | CudaWeightBuf::F16(s) => {
            b.arg(s).arg(&0u64);
        }
        CudaWeightBuf::Q8_0 { qs, d } => {
            b.arg(qs).arg(d);
        }
        CudaWeightBuf::Q4_0 { qs, d } => {
            b.arg(qs).arg(d);
        }
        CudaWeightBuf::Q8A8 { qs, d } | CudaWeightBuf::Q4A8 { qs, d } => {
            b.arg(qs).arg(d);
        }
    }
}

/// Row-major bf16 `[rows, cols]` (cols % 32 == 0) in the skinny matmuls' fragment order
/// ([`CudaWeightBuf::Bf16P`]); rows padded to a multiple of 16 with zeros.
pub fn repack_bf16p(v: &[u16], rows: usize, cols: usize) -> Vec<u16> {
    let kt = cols / 32;
    let mut out = vec![0u16; rows.div_ceil(16) * 16 * cols];
    for (r, row) in v.chunks_exact(cols).take(rows).enumerate() {
        let (tile, g, half) = (r / 16, r % 8, (r % 16) / 8);
        for (k, &x) in row.iter().enumerate() {
            let (t, j) = ((k % 32) / 8, k % 8);
            let lane = 4 * g + t;
            out[(((tile * kt + k / 32) * 2 + half) * 32 + lane) * 8 + j] = x;
        }
    }
    out
}

/// The tiles and blocks shared by the Q8_0A8 and Q4_0A8 repacks: per (16-row tile, block
/// padded to whole stages) `wb` bytes of codes (`pad` where no weight is) and the scales as f16
/// pairs `(row g, row g + 8)` per (tile, block, g); `put` writes one block of row `g` /
/// `g + 8` (`hi`) into its tile-block's bytes.
fn repack_a8_tiles<T>(
    blocks: &[T],
    rows: usize,
    cols: usize,
    wb: usize,
    pad: u8,
    scale: impl Fn(&T) -> u16,
    mut put: impl FnMut(&T, usize, usize, &mut [u8]),
) -> (Vec<u8>, Vec<u16>) {
    let kb = cols / 32;
    let kbp = a8_kbp(cols);
    let tiles = rows.div_ceil(16);
    let mut qs = vec![pad; tiles * kbp * wb];
    let mut d = vec![0u16; tiles * kbp * 16];
    for o in 0..rows {
        let (tile, r) = (o / 16, o % 16);
        let (g, hi) = (r % 8, r / 8);
        for b in 0..kb {
            let Some(blk) = blocks.get(o * kb + b) else {
                return (qs, d);
            };
            let pb = tile * kbp + b;
            d[(pb * 8 + g) * 2 + hi] = scale(blk);
            put(blk, g, hi, &mut qs[pb * wb..(pb + 1) * wb]);
        }
    }
    (qs, d)
}

/// Q8_0A8 repack (layout on [`CudaWeightBuf::Q8A8`]); padding is code 0 with scale 0.
pub fn repack_q8_a8(
    blocks: &[dflash_quant::BlockQ8_0],
    rows: usize,
    cols: usize,
) -> (Vec<u8>, Vec<u16>) {
    let scale = |b: &dflash_quant::BlockQ8_0| b.d.to_bits();
    repack_a8_tiles(blocks, rows, cols, 512, 0, scale, |blk, g, hi, out| {
        for (kk, &q) in blk.qs.iter().enumerate() {
            let lane = g * 4 + (kk % 16) / 4;
            let reg = (kk / 16) * 2 + hi;
            out[lane * 16 + reg * 4 + kk % 4] = q as u8;
        }
    })
}

/// Q4_0A8 repack (layout on [`CudaWeightBuf::Q4A8`]); padding is code 8 (the value 0) with
/// scale 0.
pub fn repack_q4_a8(
    blocks: &[dflash_quant::BlockQ4_0],
    rows: usize,
    cols: usize,
) -> (Vec<u8>, Vec<u16>) {
    let scale = |b: &dflash_quant::BlockQ4_0| b.d.to_bits();
    repack_a8_tiles(blocks, rows, cols, 256, 0x88, scale, |blk, g, hi, out| {
        for (j, &byte) in blk.qs.iter().enumerate() {
            out[(g * 4 + j / 4) * 8 + hi * 4 + j % 4] = byte;
        }
    })
}

fn repack_q4_0(blocks: &[dflash_quant::BlockQ4_0]) -> (Vec<u32>, Vec<u16>) {
    let mut qs = Vec::with_capacity(blocks.len() * 4);
    let mut d = Vec::with_capacity(blocks.len());
    for b in blocks {
        d.push(b.d.to_bits());
        for q in 0..4 {
            let mut word = 0u32;
            for i in 0..8 {
                let e = 8 * q + i;
                let nib = if e < 16 {
                    b.qs[e] & 0xf
                } else {
                    b.qs[e - 16] >> 4
                };
                // Element 8q+i: even i in the low half, odd i in the high half, so that
                // `(word >> 4p) & 0x000f000f` is the pair (8q+2p, 8q+2p+1).
                let shift = if i % 2 == 0 { 2 * i } else { 16 + 2 * (i - 1) };
                word |= (nib as u32) << shift;
            }
            qs.push(word);
        }
    }
    (qs, d)
}

impl Backend for Cuda {
    // The fused sequences: the same bits as the trait's defaults, in fewer launches.

    /// Several matmuls of the same `x` (`outs[i] = x W_i^T`), e.g. the q/k/v or gate/up
    /// projections of a layer. Q8_0A8 weights of one K (up to 3) share one quantization of x
    /// and one launch; other formats run one `matmul` each. Results are identical to the
    /// separate calls, bit for bit.
    fn matmul_many(
        &self,
        x: &CudaBuf,
        rows: usize,
        ws: &[&Weight<Self>],
        outs: &mut [&mut CudaBuf],
    ) -> Result<()> {
        if ws.len() != outs.len() {
            return Err(BackendError::Invalid {
                op: "matmul_many",
                msg: format!("{} weights but {} outputs", ws.len(), outs.len()),
            });
        }
        // Launches of up to 3 matrices each (Q8_0A8), 4 for the other formats' skinny kernels.
        let group = if ws.iter().any(|w| w.buf.a8().is_some()) {
            3
        } else {
            skinny::SKINNY_MATS
        };
        if ws.len() > group {
            for (wc, oc) in ws.chunks(group).zip(outs.chunks_mut(group)) {
                self.matmul_many(x, rows, wc, oc)?;
            }
            return Ok(());
        }
        let k = ws.first().map_or(0, |w| w.cols);
        // A prefill's matrices that read x split into bf16 on cuBLAS: that split once for
        // all of them (the bits of one `matmul` per matrix).
        if ws.len() > 1 && rows > SKINNY_ROWS && self.split_group(ws, k, rows) {
            check("matmul", "x", rows * k, x.len)?;
            let fast = self.prefill_fast();
            let wlen = self.unpack_scratch(ws);
            let mut s = lock(&self.scratch);
            let (wu, hi, lo) = s.prefill_buffers(&self.stream, wlen, rows * k)?;
            self.split_x(x, hi, (!fast).then_some(&mut *lo), rows, k, false)?;
            for (w, o) in ws.iter().zip(outs.iter_mut()) {
                let bufs = SplitBuffers {
                    w: &mut *wu,
                    hi: &*hi,
                    lo: &*lo,
                };
                self.matmul_cublas_split(bufs, rows, w, o, fast)?;
            }
            return Ok(());
        }
        // Other prefills that cuBLAS takes (as `matmul` does): one `matmul` per matrix.
        let cublas_rows = ws.iter().any(|w| self.cublas_takes(w, rows));
        let fused = !ws.is_empty()
            && k > 0
            && !cublas_rows
            && ws
                .iter()
                .all(|w| w.cols == k && w.rows > 0 && w.buf.a8().is_some());
        // bf16 / q8_0 / q4_0 matrices of one skinny kernel: per 16 rows one x split and one
        // launch ([`Cuda::matmul_skinny_mma`]).
        let skinny = !fused
            && k > 0
            && rows > 0
            && !cublas_rows
            && self.skinny_common(ws, k, rows.min(SKINNY_ROWS));
        if skinny {
            check("matmul", "x", rows * k, x.len)?;
            for (w, o) in ws.iter().zip(outs.iter()) {
                check("matmul", "out", rows * w.rows, o.len)?;
            }
            let mut r0 = 0;
            while r0 < rows {
                let t = (rows - r0).min(SKINNY_ROWS);
                let mut mats = Vec::with_capacity(3);
                for (w, o) in ws.iter().zip(outs.iter_mut()) {
                    mats.push((*w, o.data.slice_mut(r0 * w.rows..(r0 + t) * w.rows)));
                }
                let xv = x.data.slice(r0 * k..(r0 + t) * k);
                self.matmul_skinny_mma(&xv, t, &mut mats)?;
                r0 += t;
            }
            return Ok(());
        }
        if !fused {
            for (w, o) in ws.iter().zip(outs.iter_mut()) {
                self.matmul(x, rows, w, o)?;
            }
            return Ok(());
        }
        check("matmul", "x", rows * k, x.len)?;
        for (w, o) in ws.iter().zip(outs.iter()) {
            check("matmul", "out", rows * w.rows, o.len)?;
        }
        let mut r0 = 0;
        while r0 < rows {
            let t = (rows - r0).min(SKINNY_ROWS);
            let xv = x.data.slice(r0 * k..(r0 + t) * k);
            let mut mats = Vec::with_capacity(3);
            for (w, o) in ws.iter().zip(outs.iter_mut()) {
                let Some(A8Parts { qs, d, q4 }) = w.buf.a8() else {
                    return Err(internal());
                };
                mats.push(A8Launch {
                    qs,
                    d,
                    q4,
                    n: w.rows,
                    out: o.data.slice_mut(r0 * w.rows..(r0 + t) * w.rows),
                });
            }
            self.matmul_a8(Some(&xv), None, None, t, k, &mut mats, false)?;
            r0 += t;
        }
        Ok(())
    }

    /// `out = (silu(gate) * up) W^T`, the bits of `silu_mul(gate, up, act)` followed by
    /// `matmul(act, rows, w, out)`. For [`WeightFormat::Q8_0A8`] weights the SiLU product is
    /// formed inside the activation quantizer (one launch fewer; `act` is not written);
    /// other formats run exactly the two ops, through `act`.
    fn matmul_silu_mul(
        &self,
        gate: &CudaBuf,
        up: &CudaBuf,
        act: &mut CudaBuf,
        rows: usize,
        w: &Weight<Self>,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let Some(A8Parts { qs, d, q4 }) = w.buf.a8().filter(|_| !self.cublas_takes(w, rows)) else {
            self.silu_mul(gate, up, act)?;
            return self.matmul(act, rows, w, out);
        };
        let (k, n) = (w.cols, w.rows);
        check("matmul_silu_mul", "gate", rows * k, gate.len)?;
        check("matmul_silu_mul", "up", rows * k, up.len)?;
        check("matmul_silu_mul", "out", rows * n, out.len)?;
        let mut r0 = 0;
        while r0 < rows {
            let t = (rows - r0).min(SKINNY_ROWS);
            let gv = gate.data.slice(r0 * k..(r0 + t) * k);
            let uv = up.data.slice(r0 * k..(r0 + t) * k);
            let mut mats = [A8Launch {
                qs,
                d,
                q4,
                n,
                out: out.data.slice_mut(r0 * n..(r0 + t) * n),
            }];
            self.matmul_a8(Some(&gv), Some(&uv), None, t, k, &mut mats, false)?;
            r0 += t;
        }
        Ok(())
    }

    /// With [`WeightFormat::Q8_0A8`] weights (1-3 of one K = `dim`), 1-16 rows and `x`
    /// exactly `rows` rows: the norm writes the projections' activation
    /// ([`Cuda::rms_norm_q8`]), then one launch for the matrices (no quantizer, `xn` not
    /// written); the bits of the separate ops. Anything else runs the separate ops.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_kv(
        &self,
        q0: &CudaBuf,
        k0: &CudaBuf,
        v: &CudaBuf,
        q_rows: usize,
        kv_rows: usize,
        p: &QkNormRope<'_, Self>,
        q: &mut CudaBuf,
        k_tmp: &mut CudaBuf,
        cache: KvCacheRows<'_, Self>,
    ) -> Result<()> {
        // One launch (the bits of the separate ops, which run for head shapes it does not take).
        if !Self::qk_fused_fits(p.head_dim, p.rope.inv_freq.len()) {
            return qk_norm_rope_kv_ops(self, q0, k0, v, q_rows, kv_rows, p, q, k_tmp, cache);
        }
        self.qk_norm_rope_kv_fused(q0, k0, v, q_rows, kv_rows, p, q, cache)
    }

    fn norm_matmul_many(
        &self,
        x: &CudaBuf,
        w: &CudaBuf,
        dim: usize,
        eps: f32,
        xn: &mut CudaBuf,
        rows: usize,
        ws: &[&Weight<Self>],
        outs: &mut [&mut CudaBuf],
    ) -> Result<()> {
        let fused = !ws.is_empty()
            && ws.len() == outs.len()
            && ws
                .iter()
                .all(|m| m.cols == dim && m.rows > 0 && m.buf.a8().is_some())
            && (1..=SKINNY_ROWS).contains(&rows)
            && x.len == rows * dim
            && dim.is_multiple_of(32)
            && dim <= 32 * norm_threads(dim) as usize
            && w.len >= dim;
        if fused {
            // One activation, read by launches of up to 3 matrices each (a drafter's ingest:
            // every layer's k / v projections of the context features).
            let act = self.rms_norm_q8(x, 0, rows, w, dim, eps)?;
            let mut all = true;
            for (wc, oc) in ws.chunks(3).zip(outs.chunks_mut(3)) {
                // Another thread's launch in between: the separate ops below.
                if !self.matmul_many_q8_if_current(&act, wc, oc, false)? {
                    all = false;
                    break;
                }
            }
            if all {
                return Ok(());
            }
        }
        // bf16 / q8_0 / q4_0: the norm writes the matmuls' x (the skinny kernels', or a
        // prefill's for cuBLAS: the bits of the two ops below, one launch fewer). More than 4
        // matrices for the skinny kernels: launches of up to 4 reading that x, the groups
        // `matmul_many` would launch.
        let group = if rows <= SKINNY_ROWS {
            skinny::SKINNY_MATS
        } else {
            ws.len().max(1)
        };
        if !ws.is_empty()
            && ws.len() == outs.len()
            && ws.chunks(group).all(|c| self.split_group(c, dim, rows))
            && x.len == rows * dim
            && w.len >= dim
        {
            let act = self.rms_norm_split(x, w, dim, eps, rows)?;
            let mut done = 0;
            for (wc, oc) in ws.chunks(group).zip(outs.chunks_mut(group)) {
                // Another thread's launch in between: the rest as the separate ops.
                if !self.matmul_many_split(&act, wc, oc, false)? {
                    break;
                }
                done += wc.len();
            }
            if done == ws.len() {
                return Ok(());
            }
            self.rms_norm(x, w, dim, eps, xn)?;
            return self.matmul_many(xn, rows, &ws[done..], &mut outs[done..]);
        }
        self.rms_norm(x, w, dim, eps, xn)?;
        self.matmul_many(xn, rows, ws, outs)
    }

    /// The layer tail with [`WeightFormat::Q8_0A8`] weights and 1-16 rows: the o projection
    /// adds into `h` in its store ([`Cuda::matmul_add`]), the norm writes the gate / up
    /// projections' activation ([`Cuda::rms_norm_q8`]), one paired launch computes gate and
    /// up and writes the down projection's activation of silu(gate) * up
    /// ([`Cuda::matmul_gate_up_q8`]), and the down projection adds into `h`: 4 launches + 1
    /// quantizer instead of 7, no scratch written, the bits of the separate ops. Anything
    /// else runs the separate ops.
    fn layer_tail(
        &self,
        attn: &CudaBuf,
        rows: usize,
        h: &mut CudaBuf,
        w: &LayerTail<'_, Self>,
        s: TailScratch<'_, Self>,
    ) -> Result<()> {
        if !Self::tail_fuses(rows, h, w) {
            if self.tail_skinny(rows, attn, h, w) {
                return self.tail_skinny_run(attn, None, rows, h, w, s);
            }
            return layer_tail_ops(self, attn, rows, h, w, s);
        }
        self.matmul_add(attn, rows, w.wo, h)?;
        self.tail_after_o(rows, h, w, s)
    }

    /// A tail of skinny matmuls, or of a prefill's cuBLAS matmuls: the output gate also
    /// writes the o projection's bf16 hi / lo x (one split launch fewer, the same bits).
    /// Other tails take the default.
    fn sigmoid_gate_layer_tail(
        &self,
        attn: &mut CudaBuf,
        gate: &CudaBuf,
        rows: usize,
        h: &mut CudaBuf,
        w: &LayerTail<'_, Self>,
        s: TailScratch<'_, Self>,
    ) -> Result<()> {
        if rows == 0
            || attn.len != rows * w.wo.cols
            || gate.len != attn.len
            || Self::tail_fuses(rows, h, w)
            || !self.tail_skinny(rows, attn, h, w)
        {
            self.mul_sigmoid(attn, gate)?;
            return self.layer_tail(attn, rows, h, w, s);
        }
        let act = self.mul_sigmoid_split(attn, gate, rows, w.wo.cols)?;
        self.tail_skinny_run(attn, Some(act), rows, h, w, s)
    }

    /// A tail of skinny matmuls, or of a prefill's cuBLAS matmuls: the gated norm also writes
    /// the o projection's bf16 hi / lo x (one split launch fewer, the same bits). Other tails
    /// take the default.
    fn gated_norm_layer_tail(
        &self,
        g: &GatedNorm<'_, Self>,
        normed: &mut CudaBuf,
        rows: usize,
        h: &mut CudaBuf,
        w: &LayerTail<'_, Self>,
        s: TailScratch<'_, Self>,
    ) -> Result<()> {
        let width = w.wo.cols;
        if rows == 0
            || g.dim == 0
            || !width.is_multiple_of(g.dim)
            || g.x.len != rows * width
            || Self::tail_fuses(rows, h, w)
            || !self.tail_skinny(rows, g.x, h, w)
        {
            self.rms_norm_gated(g.x, g.z, g.w, g.dim, g.eps, normed)?;
            return self.layer_tail(normed, rows, h, w, s);
        }
        let act = self.rms_norm_gated_split(g.x, g.z, g.w, g.dim, g.eps, normed, rows, width)?;
        self.tail_skinny_run(normed, Some(act), rows, h, w, s)
    }

    /// The attention's combine (or its quantizer) writes the o projection's Q8_0A8 activation
    /// along with `attn` ([`Cuda::attention_q8`]), and the o projection reads it: one quantizer
    /// launch fewer than the attention then [`Backend::layer_tail`], the same bits. The exact
    /// attention, and tails [`Backend::layer_tail`] runs as separate ops, take the default.
    fn attention_layer_tail(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        p: &AttnParams,
        op: AttnOp,
        attn: &mut CudaBuf,
        h: &mut CudaBuf,
        w: &LayerTail<'_, Self>,
        s: TailScratch<'_, Self>,
    ) -> Result<()> {
        let (rows, kdim) = (p.n_q, p.n_heads * p.head_dim);
        let kv = match op {
            AttnOp::Exact => None,
            AttnOp::Fast => Some(KvStorage::F32),
            AttnOp::FastKv16 => Some(KvStorage::F16),
        };
        match kv {
            Some(kv)
                if Self::tail_fuses(rows, h, w)
                    && w.wo.cols == kdim
                    && kdim.is_multiple_of(32)
                    && attn.len >= rows * kdim =>
            {
                let act = self.attention_q8(q, k, v, p, true, kv, attn)?;
                // Another thread's launch in between: the tail from attn (written too).
                if self.matmul_many_q8_if_current(&act, &[w.wo], &mut [h], true)? {
                    self.tail_after_o(rows, h, w, s)
                } else {
                    self.layer_tail(attn, rows, h, w, s)
                }
            }
            // A tail of skinny matmuls, or of a prefill's cuBLAS matmuls: the combine also
            // writes the o projection's bf16 hi / lo x (one split launch fewer, the same bits).
            _ if rows > 0
                && w.wo.cols == kdim
                && (op != AttnOp::FastKv16 || self.kv16_kernel_fits(p))
                && self.tail_skinny(rows, attn, h, w) =>
            {
                let (fast, kv) = match op {
                    AttnOp::Exact => (false, KvStorage::F32),
                    AttnOp::Fast => (true, KvStorage::F32),
                    AttnOp::FastKv16 => (true, KvStorage::F16),
                };
                let act = match self.attention_op(q, k, v, p, fast, kv, AttnExtra::Split, attn)? {
                    Some(AttnAct::Split(a)) => Some(a),
                    _ => None,
                };
                self.tail_skinny_run(attn, act, rows, h, w, s)
            }
            _ => attention_layer_tail_ops(self, q, k, v, p, op, attn, h, w, s),
        }
    }

    /// [`Cuda::rms_norm_q8`] of the rows, then one [`Cuda::matmul_many_q8`] launch (no
    /// quantizer, `xn` not written) for Q8_0A8 weights and 1-16 rows; else the separate ops.
    fn norm_rows_matmul(
        &self,
        x: &CudaBuf,
        norm: &CudaBuf,
        dim: usize,
        eps: f32,
        row0: usize,
        rows: usize,
        xn: &mut CudaBuf,
        w: &Weight<Self>,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let fused = w.buf.a8().is_some()
            && w.cols == dim
            && w.rows > 0
            && (1..=SKINNY_ROWS).contains(&rows)
            && x.len >= (row0 + rows) * dim
            && dim.is_multiple_of(32)
            && dim <= 32 * norm_threads(dim) as usize
            && norm.len >= dim;
        if fused {
            let act = self.rms_norm_q8(x, row0, rows, norm, dim, eps)?;
            // Another thread's launch in between: the separate ops below.
            if self.matmul_many_q8_if_current(&act, &[w], &mut [out], false)? {
                return Ok(());
            }
        }
        norm_rows_matmul_ops(self, x, norm, dim, eps, row0, rows, xn, w, out)
    }

    /// Residual add fused with the following RMSNorm: `h += o` (the first `rows * dim`
    /// values), then `out = rms_norm(h)`; the bits of `add_assign` + `rms_norm` (same
    /// arithmetic and block size). Rows wider than the kernel's register tile (dim > 8192)
    /// run the two ops.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &self,
        h: &mut CudaBuf,
        o: &CudaBuf,
        w: &CudaBuf,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let n = rows * dim;
        check("add_rms_norm", "h", n, h.len)?;
        check("add_rms_norm", "o", n, o.len)?;
        check("add_rms_norm", "w", dim, w.len)?;
        check("add_rms_norm", "out", n, out.len)?;
        if n == 0 {
            return Ok(());
        }
        let threads = norm_threads(dim);
        if h.len != n || out.len != n || dim > 32 * threads as usize {
            // rms_norm normalises all of its input buffer: keep the exact two-op path for
            // buffers with spare capacity too.
            self.add_assign(h, 0, o, n)?;
            return self.rms_norm(h, w, dim, eps, out);
        }
        let f = self.func(Kernel::AddRmsNorm)?;
        let d = i32_of("add_rms_norm", "dim", dim)?;
        let st = &*self.stream;
        let mut a = RawArgs::default();
        a.dptr_mut(&mut h.data, st)
            .dptr(&o.data, st)
            .dptr(&w.data, st)
            .dptr_mut(&mut out.data, st)
            .i32(d)
            .f32(eps);
        let pdl = *lock(&self.a8_pdl);
        // SAFETY: add_rms_norm's parameters in order (h, o, w, out, dim, eps).
        unsafe { a.launch(st, &f, cfg((rows as u32, 1, 1), threads, 0), pdl) }
    }

    type Buf = CudaBuf;
    type WeightBuf = CudaWeightBuf;

    fn name(&self) -> String {
        format!("cuda:{}", self.ctx.ordinal())
    }

    fn zeros(&self, len: usize) -> Result<CudaBuf> {
        let data = if self.zero_fill.load(Ordering::Relaxed) {
            self.alloc_zeroed::<f32>(len.max(1))?
        } else {
            // SAFETY: f32 is valid for any bits (a timing ablation: the values are the pool's,
            // see set_zero_fill).
            unsafe { self.alloc_uninit::<f32>(len.max(1)) }?
        };
        Ok(CudaBuf { data, len })
    }

    fn scratch(&self, len: usize) -> Result<CudaBuf> {
        // SAFETY: f32 is valid for any bits; the caller writes the values before reading them
        // (Backend::scratch), or they are NaN (set_poison_scratch).
        let data = unsafe { self.alloc_uninit::<f32>(len.max(1)) }?;
        let mut buf = CudaBuf { data, len };
        if self.poison_scratch.load(Ordering::Relaxed) {
            self.fill(&mut buf, f32::NAN)?;
        }
        Ok(buf)
    }

    fn upload(&self, host: &[f32]) -> Result<CudaBuf> {
        if host.is_empty() {
            return self.zeros(0);
        }
        let data = self.alloc_copy(host)?;
        Ok(CudaBuf {
            data,
            len: host.len(),
        })
    }

    fn download(&self, buf: &CudaBuf) -> Result<Vec<f32>> {
        if buf.len == 0 {
            return Ok(Vec::new());
        }
        let v = self
            .stream
            .clone_dtoh(&buf.data.slice(0..buf.len))
            .map_err(dev)?;
        Ok(v)
    }

    fn len(&self, buf: &CudaBuf) -> usize {
        buf.len
    }

    fn upload_weight(&self, w: &HostWeight) -> Result<Weight<Self>> {
        // The shape first: the repacks below index by rows x cols, and nothing is uploaded
        // for a weight that is refused.
        if w.data.n_values() != w.rows * w.cols {
            return Err(BackendError::Weight(format!(
                "{}: expected {}x{} values, found {}",
                w.name,
                w.rows,
                w.cols,
                w.data.n_values()
            )));
        }
        let st = &self.stream;
        let buf = match &w.data {
            HostData::F32(v) => CudaWeightBuf::F32(st.clone_htod(v).map_err(dev)?),
            HostData::Bf16(v) if w.cols.is_multiple_of(32) => CudaWeightBuf::Bf16P(
                st.clone_htod(&repack_bf16p(v, w.rows, w.cols))
                    .map_err(dev)?,
            ),
            HostData::Bf16(v) => CudaWeightBuf::Bf16(st.clone_htod(v).map_err(dev)?),
            HostData::F16(v) => CudaWeightBuf::F16(st.clone_htod(v).map_err(dev)?),
            HostData::Q8_0(blocks) => {
                let mut qs = Vec::with_capacity(blocks.len() * 32);
                let mut d = Vec::with_capacity(blocks.len());
                for b in blocks {
                    d.push(b.d.to_bits());
                    qs.extend_from_slice(&b.qs);
                }
                CudaWeightBuf::Q8_0 {
                    qs: st.clone_htod(&qs).map_err(dev)?,
                    d: st.clone_htod(&d).map_err(dev)?,
                }
            }
            HostData::Q8_0A8(blocks) => {
                let (qs, d) = repack_q8_a8(blocks, w.rows, w.cols);
                CudaWeightBuf::Q8A8 {
                    qs: st.clone_htod(&qs).map_err(dev)?,
                    d: st.clone_htod(&d).map_err(dev)?,
                }
            }
            HostData::Q4_0A8(blocks) => {
                let (qs, d) = repack_q4_a8(blocks, w.rows, w.cols);
                CudaWeightBuf::Q4A8 {
                    qs: st.clone_htod(&qs).map_err(dev)?,
                    d: st.clone_htod(&d).map_err(dev)?,
                }
            }
            HostData::Q4_0(blocks) => {
                let (qs, d) = repack_q4_0(blocks);
                CudaWeightBuf::Q4_0 {
                    qs: st.clone_htod(&qs).map_err(dev)?,
                    d: st.clone_htod(&d).map_err(dev)?,
                }
            }
        };
        Ok(Weight {
            name: w.name.clone(),
            format: w.data.format(),
            rows: w.rows,
            cols: w.cols,
            buf,
        })
    }

    fn copy2d(
        &self,
        src: &CudaBuf,
        src_off: usize,
        src_stride: usize,
        dst: &mut CudaBuf,
        dst_off: usize,
        dst_stride: usize,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        check(
            "copy2d",
            "src",
            src_off + (rows - 1) * src_stride + cols,
            src.len,
        )?;
        check(
            "copy2d",
            "dst",
            dst_off + (rows - 1) * dst_stride + cols,
            dst.len,
        )?;
        let f = self.func(Kernel::Copy2d)?;
        let s = src.data.slice(src_off..);
        let mut d = dst.data.slice_mut(dst_off..);
        let (ss, ds, r, c) = (
            src_stride as i64,
            dst_stride as i64,
            rows as i32,
            cols as i32,
        );
        let mut b = self.stream.launch_builder(&f);
        b.arg(&s).arg(&ss).arg(&mut d).arg(&ds).arg(&r).arg(&c);
        unsafe { b.launch(grid_1d(rows * cols, 256)) }.map_err(dev)?;
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(dev)
    }

    fn matmul(&self, x: &CudaBuf, rows: usize, w: &Weight<Self>, out: &mut CudaBuf) -> Result<()> {
        check("matmul", "x", rows * w.cols, x.len)?;
        check("matmul", "out", rows * w.rows, out.len)?;
        if rows == 0 || w.rows == 0 {
            return Ok(());
        }
        if w.cols == 0 {
            let mut o = out.data.slice_mut(0..rows * w.rows);
            return self.stream.memset_zeros(&mut o).map_err(dev);
        }
        if self.cublas_takes(w, rows) && self.matmul_cublas(x, rows, w, out)? {
            return Ok(());
        }
        let mut r0 = 0;
        while r0 < rows {
            let t = (rows - r0).min(SKINNY_ROWS);
            let xv = x.data.slice(r0 * w.cols..(r0 + t) * w.cols);
            let mut ov = out.data.slice_mut(r0 * w.rows..(r0 + t) * w.rows);
            self.matmul_skinny(&xv, t, w, &mut ov)?;
            r0 += t;
        }
        Ok(())
    }

    fn gather_rows(&self, table: &Weight<Self>, ids: &[u32], out: &mut CudaBuf) -> Result<()> {
        check("gather_rows", "out", ids.len() * table.cols, out.len)?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(BackendError::TokenOutOfRange {
                id,
                rows: table.rows,
            });
        }
        if ids.is_empty() {
            return Ok(());
        }
        let mut s = lock(&self.scratch);
        ensure(&self.stream, &mut s.ids, ids.len()).map_err(dev)?;
        let dev_ids = s.ids.as_mut().ok_or_else(internal)?;
        let mut view = dev_ids.slice_mut(0..ids.len());
        self.stream.memcpy_htod(ids, &mut view).map_err(dev)?;
        let dev_ids: &CudaSlice<u32> = dev_ids;
        self.gather_rows_dev(table, dev_ids, ids.len(), out)
    }

    fn rms_norm(
        &self,
        x: &CudaBuf,
        w: &CudaBuf,
        dim: usize,
        eps: f32,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let rows = dflash_backend::rows_of("rms_norm", x.len, dim)?;
        check("rms_norm", "w", dim, w.len)?;
        check("rms_norm", "out", x.len, out.len)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.func(Kernel::RmsNorm)?;
        let d = i32_of("rms_norm", "dim", dim)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&x.data)
            .arg(&w.data)
            .arg(&mut out.data)
            .arg(&d)
            .arg(&eps);
        unsafe { b.launch(cfg((rows as u32, 1, 1), norm_threads(dim), 0)) }.map_err(dev)?;
        Ok(())
    }

    fn rms_norm_gated(
        &self,
        x: &CudaBuf,
        z: &CudaBuf,
        w: &CudaBuf,
        dim: usize,
        eps: f32,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let rows = dflash_backend::rows_of("rms_norm_gated", x.len, dim)?;
        check("rms_norm_gated", "w", dim, w.len)?;
        check("rms_norm_gated", "z", x.len, z.len)?;
        check("rms_norm_gated", "out", x.len, out.len)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.func(Kernel::RmsNormGated)?;
        let d = i32_of("rms_norm_gated", "dim", dim)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&x.data)
            .arg(&z.data)
            .arg(&w.data)
            .arg(&mut out.data)
            .arg(&d)
            .arg(&eps);
        unsafe { b.launch(cfg((rows as u32, 1, 1), 128, 0)) }.map_err(dev)?;
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CudaBuf,
        rows: usize,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        spec: &RopeSpec,
    ) -> Result<()> {
        check("rope", "x", rows * n_heads * head_dim, x.len)?;
        let half = spec.inv_freq.len();
        if 2 * half > head_dim {
            return Err(BackendError::Invalid {
                op: "rope",
                msg: format!("rot_dim {} exceeds head_dim {head_dim}", 2 * half),
            });
        }
        let n = rows * n_heads * half;
        if n == 0 {
            return Ok(());
        }
        let mut cache = lock(&self.rope_cache);
        let freqs = rope_freqs(&self.stream, &mut cache, spec)?;
        let f = self.func(Kernel::Rope)?;
        let (r, h, d, hr, p0) = (
            rows as i32,
            n_heads as i32,
            head_dim as i32,
            half as i32,
            pos0 as i64,
        );
        let sc = spec.attention_scaling;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&mut x.data)
            .arg(&r)
            .arg(&h)
            .arg(&d)
            .arg(&hr)
            .arg(&p0)
            .arg(freqs)
            .arg(&sc);
        unsafe { b.launch(grid_1d(n, 256)) }.map_err(dev)?;
        Ok(())
    }

    fn attention(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        p: &AttnParams,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.attention_op(q, k, v, p, false, KvStorage::F32, AttnExtra::None, out)
            .map(|_| ())
    }

    /// The 1xTF32 tensor-core kernel (one tf32 product per term; Q, K, V truncated and P
    /// rounded to tf32) where the exact kernel would be the 3xTF32 one; otherwise the exact op.
    fn attention_fast(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        p: &AttnParams,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.attention_op(q, k, v, p, true, KvStorage::F32, AttnExtra::None, out)
            .map(|_| ())
    }

    /// The f16-cache tensor-core kernel (`attn_h16kv_*`: the f16 kernel's arithmetic with the
    /// K / V tiles copied straight from the cache) for head dims 32 / 64 / 128, with the
    /// automatic split and row-warp rules of the other kernels; other head dims unpack the
    /// cache ([`attention_fast_kv16_ops`]).
    fn attention_fast_kv16(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        p: &AttnParams,
        out: &mut CudaBuf,
    ) -> Result<()> {
        if !self.kv16_kernel_fits(p) {
            return attention_fast_kv16_ops(self, q, k, v, p, out);
        }
        self.attention_op(q, k, v, p, true, KvStorage::F16, AttnExtra::None, out)
            .map(|_| ())
    }

    fn f16_pack(&self, src: &CudaBuf, dst: &mut CudaBuf, h0: usize, n: usize) -> Result<()> {
        check_f16_range("f16_pack", h0, n)?;
        check("f16_pack", "src", n, src.len)?;
        check("f16_pack", "dst (f32 slots)", (h0 + n) / 2, dst.len)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.func(Kernel::F16Pack)?;
        let pairs = n / 2;
        let s = src.data.slice(0..n);
        let mut d = dst.data.slice_mut(h0 / 2..h0 / 2 + pairs);
        let np = pairs as i64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&s).arg(&mut d).arg(&np);
        unsafe { b.launch(grid_1d(pairs, 256)) }.map_err(dev)?;
        Ok(())
    }

    fn f16_unpack(&self, src: &CudaBuf, h0: usize, n: usize, dst: &mut CudaBuf) -> Result<()> {
        check_f16_range("f16_unpack", h0, n)?;
        check("f16_unpack", "src (f32 slots)", (h0 + n) / 2, src.len)?;
        check("f16_unpack", "dst", n, dst.len)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.func(Kernel::F16Unpack)?;
        let pairs = n / 2;
        let s = src.data.slice(h0 / 2..h0 / 2 + pairs);
        let mut d = dst.data.slice_mut(0..n);
        let np = pairs as i64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&s).arg(&mut d).arg(&np);
        unsafe { b.launch(grid_1d(pairs, 256)) }.map_err(dev)?;
        Ok(())
    }

    fn silu_mul(&self, gate: &CudaBuf, up: &CudaBuf, out: &mut CudaBuf) -> Result<()> {
        let n = gate.len;
        check("silu_mul", "up", n, up.len)?;
        check("silu_mul", "out", n, out.len)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.func(Kernel::SiluMul)?;
        let n64 = n as i64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&gate.data).arg(&up.data).arg(&mut out.data).arg(&n64);
        unsafe { b.launch(grid_1d(n, 256)) }.map_err(dev)?;
        Ok(())
    }

    fn add_assign(
        &self,
        dst: &mut CudaBuf,
        dst_off: usize,
        src: &CudaBuf,
        len: usize,
    ) -> Result<()> {
        check("add_assign", "dst", dst_off + len, dst.len)?;
        check("add_assign", "src", len, src.len)?;
        if len == 0 {
            return Ok(());
        }
        let f = self.func(Kernel::AddAssign)?;
        let mut d = dst.data.slice_mut(dst_off..dst_off + len);
        let n64 = len as i64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&mut d).arg(&src.data).arg(&n64);
        unsafe { b.launch(grid_1d(len, 256)) }.map_err(dev)?;
        Ok(())
    }

    fn scale(&self, x: &mut CudaBuf, s: f32) -> Result<()> {
        if x.len == 0 {
            return Ok(());
        }
        let f = self.func(Kernel::Scale)?;
        let n64 = x.len as i64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&mut x.data).arg(&n64).arg(&s);
        unsafe { b.launch(grid_1d(x.len, 256)) }.map_err(dev)?;
        Ok(())
    }

    fn mul_sigmoid(&self, x: &mut CudaBuf, gate: &CudaBuf) -> Result<()> {
        check("mul_sigmoid", "gate", x.len, gate.len)?;
        if x.len == 0 {
            return Ok(());
        }
        let f = self.func(Kernel::MulSigmoid)?;
        let n64 = x.len as i64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&mut x.data).arg(&gate.data).arg(&n64);
        unsafe { b.launch(grid_1d(x.len, 256)) }.map_err(dev)?;
        Ok(())
    }

    fn argmax_rows(&self, x: &CudaBuf, row0: usize, rows: usize, cols: usize) -> Result<Vec<u32>> {
        if rows == 0 {
            return Ok(Vec::new());
        }
        if cols == 0 {
            return Err(BackendError::Invalid {
                op: "argmax_rows",
                msg: "cols must be > 0".into(),
            });
        }
        let mut s = lock(&self.scratch);
        ensure(&self.stream, &mut s.toks, rows).map_err(dev)?;
        let mut toks = s.toks.take().ok_or_else(internal)?;
        drop(s);
        let r = self.argmax_rows_dev(x, row0, rows, cols, &mut toks);
        let out = r.and_then(|_| self.stream.clone_dtoh(&toks.slice(0..rows)).map_err(dev));
        lock(&self.scratch).toks = Some(toks);
        out
    }

    fn causal_conv1d(
        &self,
        x: &CudaBuf,
        t: usize,
        channels: usize,
        kernel: usize,
        w: &CudaBuf,
        state: &mut CudaBuf,
        out: &mut CudaBuf,
        stash: Option<&mut CudaBuf>,
    ) -> Result<()> {
        let op = "causal_conv1d";
        if kernel == 0 || kernel > 16 {
            return Err(BackendError::Invalid {
                op,
                msg: format!("kernel size {kernel} must be in 1..=16"),
            });
        }
        check(op, "x", t * channels, x.len)?;
        check(op, "w", channels * kernel, w.len)?;
        check(op, "state", (kernel - 1) * channels, state.len)?;
        check(op, "out", t * channels, out.len)?;
        if let Some(s) = &stash {
            check(op, "stash", t * (kernel - 1) * channels, s.len)?;
        }
        if channels == 0 {
            return Ok(());
        }
        let f = self.func(Kernel::CausalConv1d)?;
        let (ti, ci, ki) = (
            i32_of(op, "t", t)?,
            i32_of(op, "channels", channels)?,
            kernel as i32,
        );
        // Chunks of at least kernel - 1 tokens: only chunk 0 reads the state.
        let chunk = if *lock(&self.recurrent_parallel) {
            CONV_CHUNK.max(kernel - 1).max(t.div_ceil(65535))
        } else {
            t.max(1)
        };
        let chunks = t.div_ceil(chunk).max(1);
        let mut b = self.stream.launch_builder(&f);
        let chunk_i = chunk as i32;
        b.arg(&x.data)
            .arg(&ti)
            .arg(&ci)
            .arg(&ki)
            .arg(&chunk_i)
            .arg(&w.data)
            .arg(&mut state.data)
            .arg(&mut out.data);
        match stash {
            Some(s) => b.arg(&mut s.data),
            None => b.arg(&0u64),
        };
        let grid = (channels.div_ceil(128) as u32, chunks as u32, 1);
        unsafe { b.launch(cfg(grid, 128, 0)) }.map_err(dev)?;
        Ok(())
    }

    fn gdn_gates(
        &self,
        a: &CudaBuf,
        b_in: &CudaBuf,
        a_log: &CudaBuf,
        dt_bias: &CudaBuf,
        n_heads: usize,
        g: &mut CudaBuf,
        beta: &mut CudaBuf,
    ) -> Result<()> {
        let op = "gdn_gates";
        if n_heads == 0 || !a.len.is_multiple_of(n_heads) {
            return Err(BackendError::Invalid {
                op,
                msg: format!(
                    "a has {} values, not a multiple of n_heads {n_heads}",
                    a.len
                ),
            });
        }
        let n = a.len;
        check(op, "b", n, b_in.len)?;
        check(op, "a_log", n_heads, a_log.len)?;
        check(op, "dt_bias", n_heads, dt_bias.len)?;
        check(op, "g", n, g.len)?;
        check(op, "beta", n, beta.len)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.func(Kernel::GdnGates)?;
        let (h, n64) = (n_heads as i32, n as i64);
        let mut b = self.stream.launch_builder(&f);
        b.arg(&a.data)
            .arg(&b_in.data)
            .arg(&a_log.data)
            .arg(&dt_bias.data)
            .arg(&h)
            .arg(&n64)
            .arg(&mut g.data)
            .arg(&mut beta.data);
        unsafe { b.launch(grid_1d(n, 256)) }.map_err(dev)?;
        Ok(())
    }

    fn gated_delta_rule(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        g: &CudaBuf,
        beta: &CudaBuf,
        p: &DeltaParams,
        state: &mut CudaBuf,
        out: &mut CudaBuf,
        stash: Option<&mut CudaBuf>,
    ) -> Result<()> {
        let op = "gated_delta_rule";
        if p.n_k_heads == 0 || !p.n_v_heads.is_multiple_of(p.n_k_heads) || p.dk == 0 || p.dv == 0 {
            return Err(BackendError::Invalid {
                op,
                msg: format!(
                    "n_v_heads {} must be a multiple of n_k_heads {}, dv = {} and dk = {} positive",
                    p.n_v_heads, p.n_k_heads, p.dv, p.dk
                ),
            });
        }
        check(op, "q", p.t * p.n_k_heads * p.dk, q.len)?;
        check(op, "k", p.t * p.n_k_heads * p.dk, k.len)?;
        check(op, "v", p.t * p.n_v_heads * p.dv, v.len)?;
        check(op, "g", p.t * p.n_v_heads, g.len)?;
        check(op, "beta", p.t * p.n_v_heads, beta.len)?;
        check(op, "state", p.n_v_heads * p.dk * p.dv, state.len)?;
        check(op, "out", p.t * p.n_v_heads * p.dv, out.len)?;
        if let Some(s) = &stash {
            check(op, "stash", p.t * p.n_v_heads * p.dk * p.dv, s.len)?;
        }
        if p.n_v_heads == 0 {
            return Ok(());
        }
        if stash.is_none() && self.delta_chunked(p) {
            return self.gated_delta_rule_chunked(q, k, v, g, beta, p, state, out);
        }
        let src = DeltaSrc {
            q: q.data.slice(..),
            k: k.data.slice(..),
            v: v.data.slice(..),
            g: g.data.slice(..),
            beta: beta.data.slice(..),
            qk_rs: p.n_k_heads * p.dk,
            v_rs: p.n_v_heads * p.dv,
            gates: None,
        };
        self.delta_launch(op, src, p, state, out, stash)
    }

    fn gated_delta_rule_qkv(
        &self,
        qkv: &CudaBuf,
        a: &CudaBuf,
        b: &CudaBuf,
        a_log: &CudaBuf,
        dt_bias: &CudaBuf,
        p: &DeltaParams,
        state: &mut CudaBuf,
        out: &mut CudaBuf,
        stash: Option<&mut CudaBuf>,
    ) -> Result<()> {
        let op = "gated_delta_rule_qkv";
        let heads_ok = p.n_k_heads > 0
            && p.n_v_heads > 0
            && p.n_v_heads.is_multiple_of(p.n_k_heads)
            && p.dk > 0
            && p.dv > 0;
        // The register kernels read q / k / v in place and compute the gates; the chunked
        // form, the shared-memory kernel and bad shapes (their errors) go through the ops.
        if !heads_ok
            || (stash.is_none() && self.delta_chunked(p))
            || self.delta_regs_kernel(p).is_none()
        {
            return dflash_backend::gated_delta_rule_qkv_ops(
                self, qkv, a, b, a_log, dt_bias, p, state, out, stash,
            );
        }
        let ch = dflash_backend::delta_qkv_width(op, qkv.len, p)?;
        dflash_backend::delta_gate_inputs(op, a.len, b.len, p)?;
        check(op, "a_log", p.n_v_heads, a_log.len)?;
        check(op, "dt_bias", p.n_v_heads, dt_bias.len)?;
        check(op, "state", p.n_v_heads * p.dk * p.dv, state.len)?;
        check(op, "out", p.t * p.n_v_heads * p.dv, out.len)?;
        if let Some(s) = &stash {
            check(op, "stash", p.t * p.n_v_heads * p.dk * p.dv, s.len)?;
        }
        if p.t == 0 {
            return Ok(());
        }
        let kd = p.n_k_heads * p.dk;
        let src = DeltaSrc {
            q: qkv.data.slice(..),
            k: qkv.data.slice(kd..),
            v: qkv.data.slice(2 * kd..),
            g: a.data.slice(..),
            beta: b.data.slice(..),
            qk_rs: ch,
            v_rs: ch,
            gates: Some((a_log, dt_bias)),
        };
        self.delta_launch(op, src, p, state, out, stash)
    }

    fn markov_chain(
        &self,
        logits: &mut CudaBuf,
        n: usize,
        vocab: usize,
        first_prev: u32,
        w1: &Weight<Self>,
        w2: &Weight<Self>,
    ) -> Result<Vec<u32>> {
        if first_prev as usize >= w1.rows {
            return Err(BackendError::TokenOutOfRange {
                id: first_prev,
                rows: w1.rows,
            });
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut prev = self.stream.clone_htod(&[first_prev]).map_err(dev)?;
        let mut toks = self.stream.alloc_zeros::<u32>(n).map_err(dev)?;
        self.markov_chain_dev(logits, n, vocab, &mut prev, &mut toks, w1, w2)?;
        self.stream.clone_dtoh(&toks).map_err(dev)
    }
}

#[cfg(test)]
mod tests {
    //! Host emulations of the device-side decode tricks and of the repacked layouts: these run
    //! everywhere (no GPU) and pin the constants and bit layouts the kernels rely on.
    use super::{
        a8_fit, a8_kbp, a8_pair_auto, a8_pair_queue, a8_smem_bytes, a8_wpt, a8k_kernel,
        a8k_smem_bytes, repack_bf16p, repack_q4_0, repack_q4_a8, repack_q8_a8,
        skinny::{skinny_r4, skinny_splits, SKINNY_BLOCKS_PER_SM},
        A8Kernel, SmemLimits,
    };

    fn bf16(bits: u16) -> f32 {
        f32::from_bits((bits as u32) << 16)
    }

    #[test]
    fn repack_bf16p_puts_each_value_where_the_kernels_read_it() {
        // bf16p_index in prelude.cuh, transcribed.
        let index = |row: usize, col: usize, cols: usize| {
            let (kt, r, kk) = (col >> 5, row & 15, col & 31);
            ((((row >> 4) * (cols >> 5) + kt) * 2 + (r >> 3)) * 32 + (r & 7) * 4 + (kk >> 3)) * 8
                + (kk & 7)
        };
        for &(rows, cols) in &[(1usize, 32usize), (16, 64), (37, 96), (130, 256)] {
            let v: Vec<u16> = (0..rows * cols).map(|i| (i % 65521) as u16 + 1).collect();
            let p = repack_bf16p(&v, rows, cols);
            assert_eq!(p.len(), rows.div_ceil(16) * 16 * cols);
            let mut seen = vec![false; p.len()];
            for r in 0..rows {
                for c in 0..cols {
                    let i = index(r, c, cols);
                    assert_eq!(p[i], v[r * cols + c], "({r}, {c}) of {rows}x{cols}");
                    assert!(!seen[i]);
                    seen[i] = true;
                }
            }
            // Everything else is the zero padding of the last tile.
            assert!(p.iter().zip(&seen).all(|(&x, &s)| s || x == 0));
            // A lane's 8 values of a row are contiguous (16-byte loads).
            assert_eq!(index(rows - 1, 8, cols) + 7, index(rows - 1, 15, cols));
        }
    }

    #[test]
    fn skinny_splits_fill_one_wave_and_cover_k() {
        for sms in [66usize, 108, 132] {
            for nb in [1usize, 7, 32, 128, 383, 384, 660, 2374] {
                for kt in [1usize, 3, 8, 40, 128, 384, 544] {
                    let (splits, tps) = skinny_splits(nb, kt, sms);
                    // Every split has k tiles, together exactly kt.
                    assert!(splits >= 1 && tps >= 1, "{nb} {kt} {sms}");
                    assert!(
                        (splits - 1) * tps < kt && splits * tps >= kt,
                        "{nb} {kt} {sms}"
                    );
                    // At most 8 partial sums; at least 8 k tiles per split when split.
                    assert!(splits <= 8 && (splits == 1 || tps >= 8), "{nb} {kt} {sms}");
                    // One wave at 5 blocks per SM whenever the column tiles alone fit one.
                    if nb <= SKINNY_BLOCKS_PER_SM * sms {
                        assert!(nb * splits <= SKINNY_BLOCKS_PER_SM * sms, "{nb} {kt} {sms}");
                    }
                }
            }
        }
    }

    #[test]
    fn skinny_r4_keeps_the_split_and_bf16_decode_on_32_row_tiles() {
        for sms in [66usize, 108, 132] {
            for t32 in [1usize, 32, 192, 384, 660, 768, 1088, 1600, 4748] {
                for kt in [3usize, 128, 160, 384] {
                    for rows in [1usize, 8, 9, 16] {
                        for q in [false, true] {
                            if !skinny_r4(t32, kt, rows, q, sms) {
                                continue;
                            }
                            // 64-row tiles only where the split is one (R never changes
                            // a split, so never a bit), and bf16 at 1-8 rows never.
                            assert!(
                                skinny_splits(t32, kt, sms).0 == 1,
                                "{t32} {kt} {rows} {q} {sms}"
                            );
                            assert!(q || rows > 8, "{t32} {kt} {rows} {sms}");
                        }
                    }
                }
            }
        }
        // The measured cases (H200, 132 SMs): the 8B paired gate / up at 16 rows takes the
        // 64-row tiles, the 27B one (1.37 waves of them) and the 8B q/k/v do not.
        assert!(skinny_r4(768, 128, 16, false, 132));
        assert!(!skinny_r4(768, 128, 1, false, 132));
        assert!(skinny_r4(768, 128, 1, true, 132));
        assert!(!skinny_r4(1088, 160, 16, false, 132));
        assert!(!skinny_r4(192, 128, 16, true, 132));
    }

    #[test]
    fn q8_magic_decode_is_exact_for_every_byte() {
        for b in i8::MIN..=i8::MAX {
            // __byte_perm(x ^ 0x80, 0x4B000000, i | 0x7650) -> 0x4B0000uu; minus 2^23 + 128.
            let u = (b as u8 ^ 0x80) as u32;
            let f = f32::from_bits(0x4B00_0000 | u) - 8_388_736.0;
            assert_eq!(f, b as f32, "byte {b}");
            // The high half-word of that f32 is its exact bf16 (hi_halves).
            assert_eq!(
                bf16((f.to_bits() >> 16) as u16),
                b as f32,
                "bf16 of byte {b}"
            );
        }
    }

    #[test]
    fn q4_magic_decode_is_exact_for_every_nibble() {
        // fma.rn.bf16x2(0x4300 | n, 1.0, -136): 0x3f80 = 1.0, 0xc308 = -136.
        assert_eq!(bf16(0x3f80), 1.0);
        assert_eq!(bf16(0xc308), -136.0);
        for n in 0u16..16 {
            let v = bf16(0x4300 | n);
            assert_eq!(v, 128.0 + n as f32);
            let r = v.mul_add(1.0, -136.0);
            assert_eq!(r, n as f32 - 8.0);
            // exactly representable in bf16, so the bf16 fma rounds to the same value
            assert_eq!(bf16((r.to_bits() >> 16) as u16), r);
        }
    }

    #[test]
    fn q4_repack_matches_ggml_dequantization() {
        let x: Vec<f32> = (0..32 * 64)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 37.0)
            .collect();
        let blocks = dflash_quant::quantize_q4_0(&x).expect("quantize");
        let mut want = vec![0.0f32; x.len()];
        dflash_quant::dequantize_q4_0(&blocks, &mut want);
        let (qs, d) = repack_q4_0(&blocks);
        for (b, blk) in want.chunks(32).enumerate() {
            let scale = half::f16::from_bits(d[b]).to_f32();
            for (e, &w) in blk.iter().enumerate() {
                let word = qs[b * 4 + e / 8];
                let i = e % 8;
                // load_w's scalar extraction (prelude.cuh)
                let shift = if i % 2 == 1 { 16 + 2 * (i - 1) } else { 2 * i };
                let nib = (word >> shift) & 0xf;
                assert_eq!((nib as f32 - 8.0) * scale, w, "block {b} element {e}");
                // decode_a's pair extraction: (word >> 4p) & 0x000f000f = (elem 2p, elem 2p+1)
                let p = i / 2;
                let pair = (word >> (4 * p)) & 0x000f_000f;
                let got = if i % 2 == 0 { pair & 0xf } else { pair >> 16 };
                assert_eq!(got, nib, "pair layout, block {b} element {e}");
            }
        }
    }

    #[test]
    fn q8_a8_repack_is_the_mma_fragment_layout() {
        // 37 rows (a partial 16-row tile) x 9 blocks (a partial pipeline stage).
        let (rows, cols) = (37usize, 288usize);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 37.0)
            .collect();
        let blocks = dflash_quant::quantize_q8_0(&x).expect("quantize");
        let (qs, d) = repack_q8_a8(&blocks, rows, cols);
        let kbp = a8_kbp(cols);
        assert_eq!(kbp, 16);
        assert_eq!(qs.len(), 3 * kbp * 512);
        assert_eq!(d.len(), 3 * kbp * 16);
        let kb = cols / 32;
        for o in 0..rows {
            for b in 0..kb {
                let blk = &blocks[o * kb + b];
                let (tile, r) = (o / 16, o % 16);
                let (g, hi) = (r % 8, r / 8);
                let pb = tile * kbp + b;
                assert_eq!(d[(pb * 8 + g) * 2 + hi], blk.d.to_bits(), "scale {o} {b}");
                for kk in 0..32 {
                    // m16n8k32 s8 A fragment: lane (g, t) holds rows g / g+8, k 4t.. and
                    // 16+4t.. in registers (a0: g lo-k, a1: g+8 lo-k, a2: g hi-k, a3: g+8 hi-k).
                    let (t, hk) = ((kk % 16) / 4, kk / 16);
                    let lane = g * 4 + t;
                    let reg = hk * 2 + hi;
                    let byte = qs[(pb * 32 + lane) * 16 + reg * 4 + kk % 4] as i8;
                    assert_eq!(byte, blk.qs[kk], "code {o} {b} {kk}");
                }
            }
        }
        // Padding (rows 37..48, blocks 9..16) is scale 0 (every real block has a scale > 0).
        assert_eq!(d.iter().filter(|&&v| v != 0).count(), rows * kb);
    }

    #[test]
    fn q4_a8_repack_widens_into_the_q8_a8_fragments() {
        // The Q4_0A8 bytes, widened as a8_frag does (matmul.cu: per word (w << 4) & 0xf0f0f0f0
        // and w & 0xf0f0f0f0, each ^ 0x80808080), are the Q8_0A8 fragments of the widened
        // blocks times 16; the scales are the same. 37 rows x 9 blocks, as above.
        let (rows, cols) = (37usize, 288usize);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 37.0)
            .collect();
        let q4 = dflash_quant::quantize_q4_0(&x).expect("quantize");
        let wide: Vec<_> = q4.iter().map(dflash_quant::widen_q4_0).collect();
        let (qs4, d4) = repack_q4_a8(&q4, rows, cols);
        let (qs8, d8) = repack_q8_a8(&wide, rows, cols);
        assert_eq!(d4, d8);
        assert_eq!(qs4.len() * 2, qs8.len());
        let word = |v: &[u8], i: usize| u32::from_le_bytes([v[i], v[i + 1], v[i + 2], v[i + 3]]);
        let kb = cols / 32;
        let kbp = a8_kbp(cols);
        for pb in 0..rows.div_ceil(16) * kbp {
            let real = pb % kbp < kb;
            for lane in 0..32 {
                let (w0, w1) = (
                    word(&qs4, (pb * 32 + lane) * 8),
                    word(&qs4, (pb * 32 + lane) * 8 + 4),
                );
                let frag = [
                    ((w0 << 4) & 0xf0f0_f0f0) ^ 0x8080_8080,
                    ((w1 << 4) & 0xf0f0_f0f0) ^ 0x8080_8080,
                    (w0 & 0xf0f0_f0f0) ^ 0x8080_8080,
                    (w1 & 0xf0f0_f0f0) ^ 0x8080_8080,
                ];
                for (reg, f) in frag.iter().enumerate() {
                    for (i, &b) in f.to_le_bytes().iter().enumerate() {
                        let want = qs8[(pb * 32 + lane) * 16 + reg * 4 + i] as i8;
                        // Padding: code 8 (value 0) where Q8_0A8 pads with code 0.
                        let want = if real { want } else { 0 };
                        assert_eq!(
                            b as i8 as i32,
                            16 * want as i32,
                            "pb {pb} lane {lane} reg {reg} byte {i}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a8_pair_auto_fills_one_wave() {
        let (sms, lim) = (132, SmemLimits::SM90);
        // The 8B gate / up (12288 features: 384 blocks): 3 per SM hold them.
        assert_eq!(a8_pair_auto(384, 2, sms, lim, false), (1, 3));
        // The 27B one (17408: 544 blocks): 3 per SM would be 1.37 waves, 5 per SM hold them.
        assert_eq!(a8_pair_auto(544, 2, sms, lim, false), (1, 2));
        // More than 5 per SM hold: (1, 3) again.
        assert_eq!(a8_pair_auto(1000, 2, sms, lim, false), (1, 3));
        // The occupancy the rule assumes: 3 and 5 blocks of each per SM.
        assert_eq!(lim.sm / (a8k_smem_bytes(2, 4, 1, 3, false) + 1024), 3);
        assert_eq!(lim.sm / (a8k_smem_bytes(2, 4, 1, 2, false) + 1024), 5);
        // The Q4_0A8 twins: 2 k-slices x 2 stages for 16 rows (a warp per tile for both token
        // groups), the Q8_0A8 rule for 1-8 rows (a warp per tile either way).
        for grid in [384, 544, 1000] {
            assert_eq!(a8_pair_auto(grid, 2, sms, lim, true), (2, 2));
        }
        assert_eq!(a8_pair_auto(384, 1, sms, lim, true), (1, 3));
        assert_eq!(a8_wpt(2, true), 1);
        assert_eq!((a8_wpt(2, false), a8_wpt(1, true)), (2, 1));
    }

    #[test]
    fn a8_pair_queue_only_where_groups_spread_unevenly() {
        let (sms, lim) = (132, SmemLimits::SM90);
        // 8B (384 groups: 3 on most SMs, 2.91 on average) keeps the plain launch.
        assert_eq!(a8_pair_queue(384, 4, 2, sms, lim, false), None);
        // 27B (544 groups of 5 chunks: 5 on some SMs, 4.12 on average): 4 blocks per SM, one
        // group each, and the other 16 groups as 16 x 4 tiles x 5 chunks pieces.
        let q = a8_pair_queue(544, 5, 2, sms, lim, false).expect("a queue launch");
        assert_eq!((q.bps, q.whole, q.pieces), (4, 528, 320));
        assert_eq!(lim.sm / (q.smem + 1024), 4);
        assert!(q.smem >= a8k_smem_bytes(2, 4, 1, 2, false) + 16);
        assert!(q.smem >= super::A8_CB * (2 * 288 + 544) + 16);
        // As many groups as SMs x a whole number: even already.
        assert_eq!(a8_pair_queue(528, 5, 2, sms, lim, false), None);
        // Fewer groups than SMs: nothing to even out; more than 5 per SM: not this launch.
        assert_eq!(a8_pair_queue(100, 5, 2, sms, lim, false), None);
        assert_eq!(a8_pair_queue(132 * 5 + 20, 5, 2, sms, lim, false), None);
        // 1-8 rows: the same plan (smaller stages, the same padding rule).
        let q1 = a8_pair_queue(544, 5, 1, sms, lim, false).expect("a queue launch");
        assert_eq!((q1.whole, lim.sm / (q1.smem + 1024)), (528, 4));
        // Q4_0A8 (smaller stages): the same plan at 27B.
        let q4 = a8_pair_queue(544, 5, 2, sms, lim, true).expect("a queue launch");
        assert_eq!(
            (q4.whole, q4.pieces, lim.sm / (q4.smem + 1024)),
            (528, 320, 4)
        );
    }

    #[test]
    fn a8_choices_fit_the_shared_memory_of_the_device() {
        // Every split configuration with a kernel, the automatic rule's choices and whole-K
        // with 1 / 2 / 4 tiles per block.
        let mut modes: Vec<(A8Kernel, usize)> = vec![
            (A8Kernel::WholeK, 1),
            (A8Kernel::WholeK, 2),
            (A8Kernel::WholeK, 4),
        ];
        for w in [1u8, 2, 4] {
            for ks in [2u8, 4] {
                for st in [2u8, 3, 4] {
                    if a8k_kernel(2, w.into(), ks.into(), st.into()).is_some() {
                        modes.push((A8Kernel::Split(w, ks, st), 1));
                        modes.push((A8Kernel::SplitApart(w, ks, st), 1));
                    }
                }
            }
        }
        let smem = |nt: usize, m: A8Kernel, ww: usize| match m {
            A8Kernel::Split(w, ks, st) | A8Kernel::SplitApart(w, ks, st) => {
                a8k_smem_bytes(nt, w.into(), ks.into(), st.into(), false)
            }
            _ => a8_smem_bytes(nt, ww, false),
        };
        for nt in [1usize, 2] {
            for &(m, ww) in &modes {
                // sm_90: every choice runs as chosen (the H200 measurements hold).
                assert_eq!(
                    a8_fit(m, nt, ww, SmemLimits::SM90.block, false),
                    Some((m, ww)),
                    "{m:?} nt {nt}"
                );
                // A100 (163 KiB) and sm_86 / sm_89 (99 KiB): something that fits, of the same
                // family (SplitApart keeps its workspace path) or whole-K.
                for limit in [163 * 1024, 99 * 1024] {
                    let (f, fw) = a8_fit(m, nt, ww, limit, false).expect("a fitting choice");
                    assert!(
                        smem(nt, f, fw) <= limit,
                        "{m:?} nt {nt} -> {f:?} at {limit}"
                    );
                    if let A8Kernel::SplitApart(..) = m {
                        assert!(
                            matches!(f, A8Kernel::SplitApart(..) | A8Kernel::WholeK),
                            "{m:?} -> {f:?}"
                        );
                    }
                }
            }
            // A device with 48 KiB per block: no Q8_0A8 kernel fits (an error, not a launch
            // failure).
            assert_eq!(a8_fit(A8Kernel::WholeK, nt, 4, 48 * 1024, false), None);
        }
    }
}
