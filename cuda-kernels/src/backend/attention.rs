//! The attention op of the CUDA backend: the tensor-core (3xTF32) split kernel for head dims
//! 32 / 64 / 128 (and 256 with 2 key warps), its f16 twins (over f32 or f16 caches, and the
//! FlashAttention-2-style f16-cache kernel for long spans with its Hopper warpgroup-MMA twin,
//! [`AttnFa`]), the f32 SIMT split kernel (on request, and where a tensor-core launch does not
//! fit the device's shared memory), the generic one-warp-per-row kernel for other
//! head dims, the prefill's FlashAttention-2-style kernel over f32 caches (`attn_pf_*`,
//! [`Cuda::set_attn_prefill_fa`]), and the ordered combine of the splits
//! (kernels/attention.cu).

use super::{
    cfg, check, ensure, grid_1d, i32_of, internal, lock, A8Act, AttnGemm, AttnParams, BackendError,
    Cuda, CudaBuf, Kernel, KvStorage, PushKernelArg, RawArgs, Result, Scratch, SmemLimits,
    SplitAct,
};
use crate::error::dev;
use crate::registry::{module_arch, Module};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

/// Keys per split by default (a multiple of 64).
pub(super) const ATT_SPLIT: usize = 256;

/// The fewest query rows a call takes through [`Cuda::attention_gemm`] (head dims without a
/// tensor-core prefill kernel, f32 cache, no fused activation).
pub(super) const ATTN_GEMM_MIN_ROWS: usize = 64;

/// Score values of one block of rows at most (128 MB) in [`Cuda::attention_gemm`].
pub(super) const ATTN_GEMM_SCORES: usize = 32 << 20;

/// Key chunks of [`Cuda::attention_gemm`]'s second product at most.
pub(super) const ATTN_GEMM_MAX_CHUNKS: usize = 16;

/// What the attention's split combine writes besides its f32 output: the next projection's
/// activation, in the layout its matmul reads ([`Cuda::attention_op`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum AttnExtra {
    /// The f32 output only.
    None,
    /// The Q8_0A8 activation of `nt` token groups and `kbp` padded blocks (first slot).
    Q8 { nt: usize, kbp: usize },
    /// The skinny matmuls' bf16 hi / lo x ([`SplitAct`]).
    Split,
}

/// The activation [`Cuda::attention_op`]'s combine wrote (its token).
#[derive(Clone, Copy, Debug)]
pub(super) enum AttnAct {
    A8(A8Act),
    Split(SplitAct),
}
/// Non-causal attention over at most this many keys (a context of up to 1024 positions plus
/// a 16-row block) splits them into about 6 (automatic split): a sixth of the span rounded up
/// to 64 keys, at least 128, in blocks of 2 row warps where the grid still reaches half the
/// multiprocessors ([`SplitRule::Short`]). The drafter's block attention over a short context:
/// 256-key splits left the GPU part idle (8 kv heads, 64 query rows, 528 keys: 96 blocks for
/// 132 SMs on the H200). The ninth session's rule (a quarter of the span up to 1024 keys, blocks
/// of one row warp: 528 keys -> 192, 96 blocks of 4 warps) left one warp per scheduler running
/// ~4200 dependent instructions (ncu, twelfth session: 12 us for 528 keys, 75% of the cycles
/// with no eligible warp). Blocks of 2 row warps share each K / V chunk between two query
/// groups and keep 2 warps per scheduler (q8_0a8 step, graph ms, H200, twelfth session, two
/// rounds each; old rule -> this one): 8B 528 keys 0.618 / 0.616 -> 0.609 / 0.609 and 0.620 /
/// 0.619 -> 0.612 / 0.613 (128-key splits, 80 blocks; two leases); 1040 keys (ctx 1024, which
/// the old limit of 1024 left at 256-key splits) 0.660 / 0.658 -> 0.628 / 0.628 (192, 96
/// blocks; 1 row warp 0.646 / 0.646), over an f16 cache 0.635 / 0.634 -> 0.627 / 0.626; 27B 528
/// keys 1.065 / 1.067 -> 1.055 / 1.059, 1040 keys 1.100 / 1.119 -> 1.067 / 1.087; 256 keys (ctx
/// 240) the same launch. Splits of 64 / 256 / 320 keys with 2 row warps, and 2 key warps per
/// block, measured slower at 528 keys.
pub(super) const SHORT_NONCAUSAL_KV: usize = 1040;
/// Non-causal attention over a visible span (`n_kv`, or the window when smaller) of more than
/// this many keys splits it so that all splits of all kv heads run in one wave, one block each
/// (blocks of all the query rows of a kv head, 4 row warps: one per multiprocessor): at most
/// `num_sms / n_kv_heads - 1` splits (a window may straddle one more), a multiple of 64 keys,
/// at least 256. H200 (132 SMs), 8 kv heads: 8208 keys -> 576 (15 splits, 120 blocks; 512
/// gave 17 splits = 136 blocks, a second wave of 4 blocks that cost ~27% of the kernel's time
/// in ncu); 4112 -> 320.
pub(super) const WAVE_NONCAUSAL_KV: usize = 2048;

/// Keys per split of a causal row under the automatic split, by the keys the row sees (its
/// position + 1 - `kv_pos0`, at most its window): (from this many keys, keys per split), the
/// last entry that applies; the table for heads of up to 128 dimensions. A function of the row
/// alone, so a row of a verify sums its keys in the pieces of its own one-row decode (decode ==
/// verify bit for bit); a verify whose rows straddle a threshold runs as one call per split.
///
/// Short contexts in short splits, so that a few kv heads still fill the multiprocessors: at
/// 512 keys 256-key splits gave 2 splits x 8 kv heads = 16 blocks. H100, the dense 8B target
/// (`xtask bench gpu --attn-causal`, one binary, verify16 / decode1 ms; fifty-fifth session):
/// 64 keys below 1024 took ctx 512 7.245 / 6.980 -> 7.198 / 6.702 (f16 cache 6.867 / 6.642 ->
/// 6.852 / 6.538), 128 below 2048 took ctx 1024 7.485 / 6.998 -> 7.363 / 6.822 (f16 6.917 /
/// 6.620 -> 6.939 / 6.580); 128 at ctx 2048 cost the f16 verify16 7.054 -> 7.279, so 256 from
/// there.
///
/// Long contexts in longer splits: fewer blocks, each streaming more keys, and fewer partial
/// outputs (a 16-row verify at ctx 32768 wrote 129 splits' partials, 34 MB per layer at the 8B
/// shape: a quarter of its f16 K / V again). H100, the dense 8B target (one split size for
/// every row, ms, f32 / f16 cache): at ctx 32768 256 -> 1024 keys took verify16 16.41 -> 14.04
/// / 11.70 -> 9.34 and decode1 11.58 -> 10.46 / 9.50 -> 8.51; at ctx 8192 1024 keys cost
/// decode1 7.99 -> 8.48, at 512 even 512 keys cost 7.09 -> 7.58.
pub(super) const CAUSAL_SPLITS: [(usize, usize); 6] = [
    (0, 64),
    (1024, 128),
    (2048, ATT_SPLIT),
    (16384, 512),
    (32768, 1024),
    (65536, 2048),
];

/// [`CAUSAL_SPLITS`] for heads of more than 128 dimensions (the hybrid target's attention
/// layers, head dim 256, 4 kv heads: 256-key splits gave 8 blocks at 512 keys). H100, that
/// layer's attention call alone, decode / verify16 us (fifty-fifth session): 512 keys 45.3 /
/// 46.5 -> 19.9 / 24.7 (64 keys per split), 1024 45.5 / 47.1 -> 21.0 / 37.8 (64), 2048 45.5 /
/// 58.1 -> 29.1 / 49.4 (128), 4096 46.4 / 73.2 -> 31.7 / 71.8 (128); 128 at 8192 cost the
/// verify 116.6 -> 135.4, so 256 from there.
pub(super) const CAUSAL_SPLITS_WIDE: [(usize, usize); 6] = [
    (0, 64),
    (2048, 128),
    (8192, ATT_SPLIT),
    (16384, 512),
    (32768, 1024),
    (65536, 2048),
];

/// The default causal split table for a head dim: [`CAUSAL_SPLITS`] up to 128 dimensions,
/// [`CAUSAL_SPLITS_WIDE`] above.
pub(super) fn causal_splits_default(head_dim: usize) -> &'static [(usize, usize)] {
    if head_dim > 128 {
        &CAUSAL_SPLITS_WIDE
    } else {
        &CAUSAL_SPLITS
    }
}

/// Whether `table` is a valid causal split table: entries from 0, thresholds increasing, all
/// multiples of 64, splits of 64..=4096 keys.
pub(super) fn valid_causal_table(table: &[(usize, usize)]) -> bool {
    table.first().is_some_and(|e| e.0 == 0)
        && table.windows(2).all(|w| w[0].0 < w[1].0)
        && table.iter().all(|&(from, sk)| {
            from.is_multiple_of(64) && sk.is_multiple_of(64) && (64..=4096).contains(&sk)
        })
}

/// The keys causal query row `i` of `p` sees: those up to its position, within its window (0
/// before the first key).
pub(super) fn causal_keys(p: &AttnParams, i: usize) -> usize {
    let k = (p.q_pos0 + i + 1).saturating_sub(p.kv_pos0);
    p.window.map_or(k, |w| k.min(w))
}

/// The keys per split a [`CAUSAL_SPLITS`]-style table gives a row that sees `keys` keys.
pub(super) fn causal_split_keys(keys: usize, table: &[(usize, usize)]) -> usize {
    table
        .iter()
        .take_while(|&&(from, _)| from <= keys)
        .last()
        .map_or(ATT_SPLIT, |&(_, sk)| sk)
}

/// The automatic split of [`Cuda::set_attn_split_auto`]: a function of `n_kv`, the window,
/// causality, `n_kv_heads` and the device's multiprocessor count, never of the query rows.
/// Returns the keys per split and the rule that chose them.
pub(super) fn split_keys_auto(p: &AttnParams, num_sms: usize) -> (usize, SplitRule) {
    let span = p.window.map_or(p.n_kv, |w| w.min(p.n_kv));
    match () {
        _ if p.causal => (ATT_SPLIT, SplitRule::Fixed),
        _ if span <= SHORT_NONCAUSAL_KV => (
            span.div_ceil(6).next_multiple_of(64).max(128),
            SplitRule::Short,
        ),
        _ if span > WAVE_NONCAUSAL_KV => {
            let n = (num_sms / p.n_kv_heads.max(1)).saturating_sub(1).max(1);
            (
                span.div_ceil(n).next_multiple_of(64).max(ATT_SPLIT),
                SplitRule::OneWave,
            )
        }
        _ => (ATT_SPLIT, SplitRule::Fixed),
    }
}

/// Which rule sized the splits of an attention call; it also sets how many blocks the grid
/// should have before the tensor-core kernel takes fewer, taller blocks (row warps change no
/// bit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SplitRule {
    /// 256 keys, or the split set by [`Cuda::set_attn_split`]: blocks until the grid covers
    /// every multiprocessor.
    Fixed,
    /// A short non-causal span ([`SHORT_NONCAUSAL_KV`]): taller blocks while the grid covers
    /// half the multiprocessors.
    Short,
    /// A long non-causal span split for one wave of blocks of all the query rows of a kv head
    /// ([`WAVE_NONCAUSAL_KV`]).
    OneWave,
}
/// The splits `[lo, hi)` of `split_keys` keys that some query row can see: with a window the
/// splits wholly before the first row's window, with a causal mask those wholly after the last
/// row's position, are exact no-ops in the combine (a row's partial there is o = 0, l = 0), so
/// the tensor-core grid leaves them out (the same bits). All splits when no key is visible.
pub(super) fn live_splits(p: &AttnParams, split_keys: usize) -> (usize, usize) {
    let n_split = p.n_kv.div_ceil(split_keys);
    let (q0, k0) = (p.q_pos0 as i128, p.kv_pos0 as i128);
    let mut lo = 0i128;
    let mut hi = p.n_kv as i128;
    if let Some(w) = p.window {
        lo = lo.max(q0 - w as i128 + 1 - k0);
    }
    if p.causal {
        hi = hi.min(q0 + p.n_q as i128 - k0);
    }
    if p.n_q == 0 || hi <= lo {
        return (0, n_split);
    }
    let sk = split_keys as i128;
    (
        (lo / sk) as usize,
        ((hi + sk - 1) / sk).min(n_split as i128) as usize,
    )
}

/// Query rows per block of the SIMT split kernel.
const ATT_QT: usize = 16;

/// Which attention kernel runs for the head dims the tensor-core kernel takes (32, 64, 128;
/// 256 with 2 key warps only).
/// Each choice, like the split size, fixes the summation order: any fixed choice keeps
/// attention per-row deterministic, changing it between calls changes the bits (within
/// tolerance). A benchmark and test knob; set it once, before any attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKernel {
    /// The default: the tensor-core kernel with 4 key warps (head dims 32 / 64 / 128; 2 at
    /// head dim 256, whose only tensor-core split kernel that is); a
    /// prefill's causal rows the FlashAttention-2-style kernels
    /// ([`Cuda::set_attn_prefill_fa`]).
    Auto,
    /// The f32 CUDA-core split kernel (16 query rows per block), as before the tensor-core one.
    Simt,
    /// The 3xTF32 tensor-core kernel with `key_warps` (2 or 4) warps over the keys of each
    /// chunk and `row_warps` (1, 2 or 4; 0 = chosen from the grid size) warps of 16 query
    /// rows per block and `stages` (1, 2 or 3; 0 = chosen from the grid size) cp.async
    /// pipeline stages; with `ffma_pv` the tensor cores run S = Q K^T only and P V runs on the
    /// CUDA cores (f32 FMA) alongside. `row_warps` and `stages` do not change any bits.
    Tc {
        key_warps: usize,
        row_warps: usize,
        ffma_pv: bool,
        stages: usize,
    },
}

impl AttnKernel {
    /// The choice [`AttnKernel::Auto`] stands for (the others are returned as they are).
    pub fn resolve(self) -> AttnKernel {
        match self {
            AttnKernel::Auto => AttnKernel::Tc {
                key_warps: 4,
                row_warps: 0,
                ffma_pv: false,
                stages: 0,
            },
            k => k,
        }
    }
}

/// Shared memory of the SIMT split kernel.
fn simt_smem_bytes(d: usize) -> usize {
    (16 * d + 64 * (d + 4) + 64 * d + 64 * 16 + 48) * 4 + 16 * 8 + 16 * 4
}

/// The shared-memory layout family of a tensor-core attention kernel: tf32 mma (exact or
/// 1xTF32), tf32 with P V on the CUDA cores, f16 operands (`attn_h16_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TcFlavor {
    Tf32,
    Fpv,
    H16,
    /// The f16-cache twin of `H16` (`attn_h16kv_*`): `nst` stages of f16 K / V tiles.
    H16Kv,
    /// The FlashAttention-2-style f16-cache kernel (`attn_fa16kv_*`, one key warp): `nst`
    /// stages of 64-key f16 K / V tiles, Q in registers, no merge.
    Fa16Kv,
    /// Its Hopper warpgroup-MMA twin (`attn_wg16kv_d128`): the same stages unpadded and
    /// 128-byte swizzled, always 4 row warps (one warpgroup, 64 rows).
    Wg16Kv,
}

impl TcFlavor {
    fn of(fpv: bool) -> Self {
        if fpv {
            TcFlavor::Fpv
        } else {
            TcFlavor::Tf32
        }
    }
}

/// Shared memory of the tensor-core kernel: Q rows, `nst` pipeline stages of K / V chunks, or
/// (after the loop, in the same space) the saved states of the key warps being merged. The f16
/// kernel: Q, K and V tiles in f16 (rows of d + 8 halves) and `nst` f32 staging slots of
/// unpadded K / V chunks.
fn tc_smem_bytes(d: usize, kw: usize, rw: usize, nst: usize, fl: TcFlavor) -> usize {
    let ck = 16 * kw;
    let fpv = fl == TcFlavor::Fpv;
    if fl == TcFlavor::H16 {
        let main = (rw * 16 + 2 * ck) * (d + 8) * 2 + nst * 2 * ck * d * 4;
        return main.max(rw * kw * (d / 2 + 4) * 32 * 4);
    }
    if fl == TcFlavor::Fa16Kv {
        return nst * 2 * 64 * (d + 8) * 2;
    }
    if fl == TcFlavor::Wg16Kv {
        // (+ 1 KiB: the swizzled tiles start at a 1024-byte boundary)
        return nst * 2 * 64 * d * 2 + 1024;
    }
    if fl == TcFlavor::H16Kv {
        let main = (rw * 16 + nst * 2 * ck) * (d + 8) * 2;
        return main.max(rw * kw * (d / 2 + 4) * 32 * 4);
    }
    let mut main = rw * 16 * (d + 16) + nst * ck * (d + 16) + nst * ck * (d + 4);
    let merge = if fpv {
        // Per warp: P^T (16 x ATT_PTP = 20) and 16 rescale factors.
        main += rw * kw * (16 * 20 + 16);
        rw * (kw - 1) * (d / 2) * 32 + rw * kw * 32
    } else {
        // Every key warp's state (the merge runs split over the output column groups).
        rw * kw * (d / 2 + 4) * 32
    };
    main.max(merge) * 4
}

/// Resident blocks per multiprocessor of a tensor-core launch with `nst` stages: by shared
/// memory (the device's limits `lim`), and by registers (the kernels are built for 128 per
/// thread, 255 at head dim 256).
fn tc_blocks_per_sm(
    d: usize,
    kw: usize,
    rw: usize,
    nst: usize,
    fl: TcFlavor,
    lim: SmemLimits,
) -> usize {
    let smem = tc_smem_bytes(d, kw, rw, nst, fl);
    if smem > lim.block {
        return 0;
    }
    // (head dim 256: one block per multiprocessor, up to 255 registers)
    let regs = if d > 128 { 256 } else { 128 };
    let by_regs = 65536 / (32 * kw * rw * regs);
    (lim.sm / (smem + 1024)).min(by_regs)
}

/// Pipeline stages of the tensor-core kernel for a grid of `blocks` on `sms` multiprocessors:
/// 3 where that keeps as many resident blocks per multiprocessor as 2, else 2; and 1 for
/// blocks of one row warp when that needs fewer waves (two such blocks per multiprocessor:
/// decode over a long context, 264 blocks at ctx 8192: 52 -> 44 us on the H200; blocks of more
/// row warps measured slower with 1 stage). Scheduling only: no bits change.
fn tc_stages(
    d: usize,
    kw: usize,
    rw: usize,
    fl: TcFlavor,
    blocks: usize,
    sms: usize,
    lim: SmemLimits,
) -> usize {
    let waves = |nst: usize| {
        let per = tc_blocks_per_sm(d, kw, rw, nst, fl, lim);
        if per == 0 {
            usize::MAX
        } else {
            blocks.div_ceil(per * sms.max(1))
        }
    };
    let (per3, per2) = (
        tc_blocks_per_sm(d, kw, rw, 3, fl, lim),
        tc_blocks_per_sm(d, kw, rw, 2, fl, lim),
    );
    let deep = if per3 > 0 && per3 >= per2 {
        3
    } else if per2 > 0 {
        2
    } else {
        1
    };
    if rw == 1 && waves(1) < waves(deep) {
        1
    } else {
        deep
    }
}

/// Pipeline stages of the FA kernel or its wgmma twin (`fl`; `regs` registers per thread, as
/// compiled for this device): the deepest (up to 4; the wgmma twin: 3 to 5) that needs no more
/// waves than 2 stages (the wgmma twin: 3). Scheduling only: no bits change.
fn fa_stages(
    d: usize,
    rw: usize,
    regs: usize,
    blocks: usize,
    sms: usize,
    lim: SmemLimits,
    fl: TcFlavor,
) -> usize {
    let waves = |nst: usize| {
        let smem = tc_smem_bytes(d, 1, rw, nst, fl);
        let by_regs = 65536 / (32 * rw * regs.next_multiple_of(8).max(8));
        let per = if smem > lim.block {
            0
        } else {
            (lim.sm / (smem + 1024)).min(by_regs)
        };
        if per == 0 {
            usize::MAX
        } else {
            blocks.div_ceil(per * sms.max(1))
        }
    };
    if fl == TcFlavor::Wg16Kv {
        // Its loop reads two chunks while the next ones land: at least 3 stages.
        let base = waves(3);
        return (3..=5).rev().find(|&n| waves(n) <= base).unwrap_or(3);
    }
    let base = waves(2).min(waves(1));
    (1..=4).rev().find(|&n| waves(n) <= base).unwrap_or(1)
}

/// The tensor-core kernel for head dim `d`, `kw` key warps, P V on the CUDA cores (`fpv`),
/// and one tf32 product per term (`x1`: [`Backend::attention_fast`](dflash_backend::Backend::attention_fast); only without `fpv`).
fn tc_kernel(d: usize, kw: usize, fpv: bool, x1: bool) -> Option<Kernel> {
    if x1 {
        return Some(match (d, kw, fpv) {
            (32, 2, false) => Kernel::AttnTcD32Kw2X1,
            (64, 2, false) => Kernel::AttnTcD64Kw2X1,
            (128, 2, false) => Kernel::AttnTcD128Kw2X1,
            (32, 4, false) => Kernel::AttnTcD32Kw4X1,
            (64, 4, false) => Kernel::AttnTcD64Kw4X1,
            (128, 4, false) => Kernel::AttnTcD128Kw4X1,
            (256, 2, false) => Kernel::AttnTcD256Kw2X1,
            _ => return None,
        });
    }
    Some(match (d, kw, fpv) {
        (32, 2, false) => Kernel::AttnTcD32Kw2,
        (64, 2, false) => Kernel::AttnTcD64Kw2,
        (128, 2, false) => Kernel::AttnTcD128Kw2,
        (32, 4, false) => Kernel::AttnTcD32Kw4,
        (64, 4, false) => Kernel::AttnTcD64Kw4,
        (128, 4, false) => Kernel::AttnTcD128Kw4,
        (256, 2, false) => Kernel::AttnTcD256Kw2,
        (32, 2, true) => Kernel::AttnTcD32Kw2Fpv,
        (64, 2, true) => Kernel::AttnTcD64Kw2Fpv,
        (128, 2, true) => Kernel::AttnTcD128Kw2Fpv,
        (32, 4, true) => Kernel::AttnTcD32Kw4Fpv,
        (64, 4, true) => Kernel::AttnTcD64Kw4Fpv,
        (128, 4, true) => Kernel::AttnTcD128Kw4Fpv,
        _ => return None,
    })
}

/// The f16-cache kernel (`attention_fast_kv16`) for head dim `d` (4 key warps).
fn h16kv_kernel(d: usize) -> Option<Kernel> {
    Some(match d {
        32 => Kernel::AttnH16KvD32Kw4,
        64 => Kernel::AttnH16KvD64Kw4,
        128 => Kernel::AttnH16KvD128Kw4,
        _ => return None,
    })
}

/// The warpgroup-MMA twin of the FA kernel for head dim `d`, where the attention module was
/// compiled for `sm_90a` (`module_arch`).
fn wg_kernel(d: usize, arch: &'static str) -> Option<Kernel> {
    (d == 128 && module_arch(Module::Attention, arch) == "sm_90a").then_some(Kernel::AttnWg16KvD128)
}

/// The prefill kernel over an f32 cache for head dim `d` ([`Cuda::set_attn_prefill_fa`]):
/// `x3` the exact op's three bf16 products, else the f16 one.
fn pf_kernel(d: usize, x3: bool) -> Option<Kernel> {
    Some(match (d, x3) {
        (32, true) => Kernel::AttnPfD32X3,
        (32, false) => Kernel::AttnPfD32X1,
        (64, true) => Kernel::AttnPfD64X3,
        (64, false) => Kernel::AttnPfD64X1,
        (128, true) => Kernel::AttnPfD128X3,
        (128, false) => Kernel::AttnPfD128X1,
        _ => return None,
    })
}

/// The prefill kernel over [`Cuda::attention_gemm`]'s operands for head dim `d`
/// ([`AttnGemm::Fused`]): `x3` the exact op's three bf16 products, else the f16 one.
/// `shape`: (keys per chunk, stages, rows per block), (0, 0, 0) for the default, else one of
/// the compiled variants ([`Cuda::set_attn_pf2_shape`]); returns the kernel with its shape.
/// The defaults, H100 at 8192 tokens (27B layer, fifty-second session): bf16 x3 32 keys x 2
/// stages x 64 rows (9.05 ms; 3 stages 8.97), f16 32 x 2 x 128 (4.24 ms; 64 rows 5.27, 64-key
/// chunks 4.59).
fn pf2_kernel(d: usize, x3: bool, shape: Pf2Shape) -> Option<(Kernel, Pf2Shape)> {
    let shape = match (x3, shape) {
        (true, (0, 0, 0)) => (32, 2, 64),
        (false, (0, 0, 0)) => (32, 2, 128),
        _ => shape,
    };
    let k = match (d, x3, shape) {
        (256, true, (32, 2, 64)) => Kernel::AttnPf2D256X3,
        (256, true, (32, 3, 64)) => Kernel::AttnPf2D256X3S3,
        (256, false, (32, 2, 64)) => Kernel::AttnPf2D256X1,
        (256, false, (64, 2, 64)) => Kernel::AttnPf2D256X1C64,
        (256, false, (32, 3, 64)) => Kernel::AttnPf2D256X1S3,
        (256, false, (32, 2, 128)) => Kernel::AttnPf2D256X1R8,
        _ => return None,
    };
    Some((k, shape))
}

/// An `attn_pf2_*` kernel's (keys per chunk, stages, GQA-packed query rows per block: 16 per
/// pair of warps).
type Pf2Shape = (usize, usize, usize);

/// Shared memory of an `attn_pf2_*` launch at head dim 256 of shape `(ck, nst, rows)`: the
/// 16-bit tiles (K and V, hi and lo for `x3`; rows padded by 8 halves) and the warps' partial
/// scores (ck / 2 values a lane, two warps per 16 rows).
fn pf2_smem_bytes(x3: bool, (ck, nst, rows): Pf2Shape) -> usize {
    let tiles = if x3 { 4 } else { 2 };
    nst * tiles * ck * (256 + 8) * 2 + (rows / 8) * 32 * (ck / 2) * 4
}

/// One strided-batched cuBLAS product of column-major matrices, C (f32, beta 0) = alpha op(A)
/// B: A m x k (`trans_a`: stored k x m), B k x n, each of `batch` with strides `sa`, `sb`,
/// `sc` values; A and B of type `ab`. Addresses are device pointers.
struct BatchedGemm {
    op: &'static str,
    trans_a: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: u64,
    lda: usize,
    sa: usize,
    b: u64,
    ldb: usize,
    sb: usize,
    c: u64,
    ldc: usize,
    sc: usize,
    batch: usize,
    ab: cudarc::cublas::sys::cudaDataType,
    compute: cudarc::cublas::sys::cublasComputeType_t,
}

impl BatchedGemm {
    /// # Safety
    /// The addresses hold the matrices the sizes, leading dimensions and strides address,
    /// ordered on the handle's stream.
    unsafe fn run(&self, blas: &cudarc::cublas::CudaBlas) -> Result<()> {
        use cudarc::cublas::sys::{cublasGemmAlgo_t, cublasOperation_t as Op, cudaDataType};
        let i = |what: &str, v: usize| i32_of(self.op, what, v);
        let zero = 0.0f32;
        let ta = if self.trans_a {
            Op::CUBLAS_OP_T
        } else {
            Op::CUBLAS_OP_N
        };
        // SAFETY: the caller's contract.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *blas.handle(),
                ta,
                Op::CUBLAS_OP_N,
                i("m", self.m)?,
                i("n", self.n)?,
                i("k", self.k)?,
                &self.alpha as *const f32 as *const _,
                self.a as *const _,
                self.ab,
                i("lda", self.lda)?,
                self.sa as i64,
                self.b as *const _,
                self.ab,
                i("ldb", self.ldb)?,
                self.sb as i64,
                &zero as *const f32 as *const _,
                self.c as *mut _,
                cudaDataType::CUDA_R_32F,
                i("ldc", self.ldc)?,
                self.sc as i64,
                i("batch", self.batch)?,
                self.compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(dev)
    }
}

/// Threads of an `attn_pf_*` block (8 warps of 16 query rows).
const PF_THREADS: usize = 256;

/// Shared memory of an `attn_pf_*` launch with `nst` f32 staging stages: the 16-bit tiles (K
/// and V, hi and lo for `x3`; 64 keys, rows padded by 8 halves) and the stages (K and V, 64
/// keys of f32).
fn pf_smem_bytes(d: usize, x3: bool, nst: usize) -> usize {
    let tiles = if x3 { 4 } else { 2 };
    tiles * 64 * (d + 8) * 2 + nst * 2 * 64 * d * 4
}

/// The FlashAttention-2-style f16-cache kernel for head dim `d`.
fn fa_kernel(d: usize) -> Option<Kernel> {
    Some(match d {
        32 => Kernel::AttnFa16KvD32,
        64 => Kernel::AttnFa16KvD64,
        128 => Kernel::AttnFa16KvD128,
        _ => return None,
    })
}

/// Which [`Backend::attention_fast_kv16`](dflash_backend::Backend::attention_fast_kv16) calls run the FlashAttention-2-style kernel
/// (`attn_fa16kv_*`): a warp owns 16 query rows and computes all 64 keys of every chunk, with
/// its Q fragments in registers, where the 4-key-warp kernel (`attn_h16kv_*`) gives each warp
/// 16 keys of a chunk and merges the warps' states at the end. 2.4x fewer instructions (ncu,
/// H200, 8B shape at ctx 8192: 3.2M against 7.6M); the split + combine 27.0 -> 22.2 us alone,
/// the q8_0a8 step over f16 caches 0.670 -> 0.664 ms (three interleaved runs, twentieth
/// session). The two fix different summation orders (within the f16 bound of each other): set
/// it once, before any attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnFa {
    /// Non-causal visible spans (`n_kv`, or the window when smaller) of more than 1040 keys:
    /// those the one-wave split rule takes (more than 2048) and the 256-key splits between
    /// (the 27B shape's 2048-key windows over longer contexts: its step at ctx 8192 1.018 ->
    /// 1.013 ms, three interleaved runs). Default `true`.
    pub long: bool,
    /// Every other call too (short spans and causal calls; no faster in the step at ctx 512).
    /// Default `false`.
    pub all: bool,
    /// Resident blocks per multiprocessor that the one-wave rule sizes the long spans' splits
    /// for: `num_sms * blocks_per_sm / n_kv_heads - 1` splits (1..=4). Default 1 (the
    /// 4-key-warp kernel's split: 15 splits at ctx 8192 on the H200); 2 and 3 ran the kernel
    /// alone faster (22.0 / 21.4 us) and the step slower (more partials for the combine).
    pub blocks_per_sm: usize,
    /// On compute capability 9.0 (H100 / H200) at head dim 128: its Hopper warpgroup-MMA twin
    /// (`attn_wg16kv_d128`: K / V read by the tensor cores straight from 128-byte-swizzled
    /// shared memory, no ldmatrix, the next chunk's scores computed during this chunk's softmax;
    /// its own summation order, within the same f16 bound). Default `true`; where the NVRTC or
    /// driver cannot build sm_90a the mma.sync kernel runs. H200, 8B shape, split + combine
    /// alone: 22.3 -> 19.6 us at ctx 8192, 12.7 -> 11.4 at 2048; the q8_0a8 step at ctx 8192
    /// 0.665 -> 0.645 ms (27B: 1.037 -> 1.025; three interleaved rounds in one lease).
    pub wgmma: bool,
}

impl Default for AttnFa {
    fn default() -> Self {
        AttnFa {
            long: true,
            all: false,
            blocks_per_sm: 1,
            wgmma: true,
        }
    }
}

/// The f16 tensor-core kernel (`attention_fast`) for head dim `d` and `kw` key warps.
fn h16_kernel(d: usize, kw: usize) -> Option<Kernel> {
    Some(match (d, kw) {
        (32, 4) => Kernel::AttnH16D32Kw4,
        (64, 4) => Kernel::AttnH16D64Kw4,
        (128, 4) => Kernel::AttnH16D128Kw4,
        _ => return None,
    })
}

fn simt_kernel(d: usize) -> Option<Kernel> {
    Some(match d {
        32 => Kernel::AttnSplitD32,
        64 => Kernel::AttnSplitD64,
        128 => Kernel::AttnSplitD128,
        256 => Kernel::AttnSplitD256,
        _ => return None,
    })
}

impl Cuda {
    /// Keys per split of the context-split attention kernels (default 256; a multiple of 64
    /// in 64..=4096). The split boundaries sit at fixed key positions, so any fixed value
    /// keeps attention per-row deterministic; changing it between calls changes the
    /// summation order (a benchmark knob: set it once, before any attention).
    pub fn set_attn_split(&self, keys: usize) -> Result<()> {
        if !(64..=4096).contains(&keys) || !keys.is_multiple_of(64) {
            return Err(BackendError::Invalid {
                op: "set_attn_split",
                msg: format!("split of {keys} keys: expected a multiple of 64 in 64..=4096"),
            });
        }
        *lock(&self.attn_split) = Some(keys);
        Ok(())
    }

    /// Back to the automatic split (the default): 256 keys, except for non-causal calls
    /// whose visible span (`n_kv`, or the window when smaller) is at most 1040 keys, which
    /// take a sixth of it (a multiple of 64, at least 128), or more than 2048, which are split
    /// for one wave of blocks (at most
    /// `num_sms / n_kv_heads - 1` splits). A function of `n_kv`, the
    /// window, `n_kv_heads` and the device, never of the query rows, so rows stay
    /// deterministic across calls of any height; causal rows, where decode must equal verify
    /// bit for bit, take the split of the keys they see (a table per head dim, see
    /// [`Cuda::set_attn_causal_splits`]).
    pub fn set_attn_split_auto(&self) {
        *lock(&self.attn_split) = None;
    }

    /// The causal rows' splits under the automatic split, for every head dim (default: a
    /// table per head dim, `CAUSAL_SPLITS` up to 128 dimensions, `CAUSAL_SPLITS_WIDE` above):
    /// `(from this many keys seen, keys per split)` entries, the first from 0, thresholds
    /// increasing, every value a multiple of 64, splits of 64..=4096 keys. Each table fixes its
    /// own bits (decode == verify holds under any one): a benchmark knob, set once before any
    /// attention.
    pub fn set_attn_causal_splits(&self, table: &[(usize, usize)]) -> Result<()> {
        if !valid_causal_table(table) {
            return Err(BackendError::Invalid {
                op: "set_attn_causal_splits",
                msg: format!(
                    "{table:?}: expected (keys seen, keys per split) entries from 0, increasing, all multiples of 64, splits of 64..=4096 keys"
                ),
            });
        }
        *lock(&self.attn_causal_splits) = Some(table.to_vec());
        Ok(())
    }

    /// Back to the default causal split tables, one per head dim.
    pub fn set_attn_causal_splits_default(&self) {
        *lock(&self.attn_causal_splits) = None;
    }

    /// Keys per split of causal calls of more than [`SKINNY_ROWS`](super::SKINNY_ROWS) query
    /// rows under the automatic split (a prompt's prefill, whose grid has blocks enough
    /// without splitting the keys): a multiple of 64, or 0 for the splits of the keys each row
    /// sees, as every other call. Default [`ATTN_PREFILL_SPLIT`](super::ATTN_PREFILL_SPLIT):
    /// one split of the whole span, measured -20% on the dense 8B target's prefill of 8192
    /// tokens (H100: bf16 1131 -> 910 ms, Q8_0A8 with an f16 cache 1017 -> 801) and no change
    /// at 512. Such rows are never compared with a decode's (the prefill is the one start a
    /// speculative and a plain run share; a verify has at most
    /// [`SKINNY_ROWS`](super::SKINNY_ROWS) rows, as for
    /// [`CudaOptions::cublas_prefill`](super::CudaOptions::cublas_prefill)), so this changes
    /// no stream.
    pub fn set_attn_prefill_split(&self, keys: usize) -> Result<()> {
        if !keys.is_multiple_of(64) {
            return Err(BackendError::Invalid {
                op: "set_attn_prefill_split",
                msg: format!("{keys} keys: expected 0 or a multiple of 64"),
            });
        }
        *lock(&self.attn_prefill_split) = keys;
        Ok(())
    }

    /// Whether a prefill's causal rows (more than [`SKINNY_ROWS`](super::SKINNY_ROWS) query
    /// rows, head dims 32 / 64 / 128, the automatic kernel choice) run the FlashAttention-2-style
    /// kernels (default `true`): over an f32 cache `attn_pf_*` (128 rows per block, each chunk
    /// of K / V converted once into 16-bit tiles; exact: bf16 hi + lo operands, three products;
    /// [`PrefillPrecision::Fast`](super::PrefillPrecision::Fast) and `attention_fast`: f16, one
    /// product), over an f16 cache the FA kernel (`attn_fa16kv_*`, its warpgroup-MMA twin on
    /// sm_90a). `false`: the split kernels of the other calls (3xTF32 / 1xTF32 / f16 with 4 key
    /// warps). Such rows are never compared with a decode's (see
    /// [`Cuda::set_attn_prefill_split`]), so this changes no stream.
    pub fn set_attn_prefill_fa(&self, on: bool) {
        *lock(&self.attn_prefill_fa) = on;
    }

    /// Whether [`Backend::attention_fast`](dflash_backend::Backend::attention_fast) runs the f16 tensor-core kernel (the default: head
    /// dims 32 / 64 / 128 with 4 key warps over a non-causal span of more than 2048 keys, the
    /// calls the one-wave split rule takes; Q, K, V and P rounded to f16) or always the 1xTF32
    /// twin of the exact kernel (`false`; a benchmark knob: each fixes its own bits, so set it
    /// once, before any attention).
    pub fn set_attn_fast_f16(&self, on: bool) {
        *lock(&self.attn_fast_f16) = on;
    }

    /// Which f16-cache calls run the FlashAttention-2-style kernel (default
    /// [`AttnFa::default`]); see [`AttnFa`].
    pub fn set_attn_fa(&self, fa: AttnFa) -> Result<()> {
        if !(1..=4).contains(&fa.blocks_per_sm) {
            return Err(BackendError::Invalid {
                op: "set_attn_fa",
                msg: format!("blocks_per_sm {} (expected 1..=4)", fa.blocks_per_sm),
            });
        }
        *lock(&self.attn_fa) = fa;
        Ok(())
    }

    /// Pick the attention kernel (default [`AttnKernel::Auto`]); see [`AttnKernel`].
    pub fn set_attn_kernel(&self, k: AttnKernel) -> Result<()> {
        if let AttnKernel::Tc {
            key_warps,
            row_warps,
            stages,
            ..
        } = k
        {
            if !matches!(key_warps, 2 | 4)
                || !matches!(row_warps, 0 | 1 | 2 | 4)
                || !matches!(stages, 0..=3)
            {
                return Err(BackendError::Invalid {
                    op: "set_attn_kernel",
                    msg: format!(
                        "key_warps {key_warps} (expected 2 or 4), row_warps {row_warps} (expected 0, 1, 2 or 4), stages {stages} (expected 0, 1, 2 or 3)"
                    ),
                });
            }
        }
        *lock(&self.attn_kernel) = k;
        Ok(())
    }

    /// (entry point, registers per thread, local memory bytes per thread) of the head-dim 128
    /// tensor-core attention kernels and the prefill's: a benchmark aid (spills show as local
    /// memory).
    pub fn attn_kernel_info(&self) -> Result<Vec<(&'static str, i32, i32)>> {
        let kernels = [2, 4]
            .into_iter()
            .flat_map(|kw| {
                [(false, false), (true, false), (false, true)]
                    .map(|(fpv, x1)| tc_kernel(128, kw, fpv, x1))
            })
            .chain([pf_kernel(128, true), pf_kernel(128, false)]);
        kernels
            .flatten()
            .map(|k| {
                self.kernel_resources(k)
                    .map(|(regs, local)| (k.name(), regs, local))
            })
            .collect()
    }

    /// Whether [`Backend::attention_fast_kv16`](dflash_backend::Backend::attention_fast_kv16) runs its own kernel for these parameters (head
    /// dims 32 / 64 / 128 within the device's shared memory); the others unpack the cache.
    pub(super) fn kv16_kernel_fits(&self, p: &AttnParams) -> bool {
        h16kv_kernel(p.head_dim).is_some()
            && tc_smem_bytes(p.head_dim, 4, 1, 1, TcFlavor::H16Kv) <= self.smem.block
    }

    /// Raise the shared-memory limits of the attention kernels to their largest launch.
    pub(super) fn attention_warm_up(&self) -> Result<()> {
        // The largest launch of a tensor-core kernel that fits the device.
        let most = |d: usize, kw: usize, fl: TcFlavor| {
            [1, 2, 4]
                .iter()
                .flat_map(|&rw| (1..=3).map(move |nst| (rw, nst)))
                .map(|(rw, nst)| tc_smem_bytes(d, kw, rw, nst, fl))
                .filter(|&b| b <= self.smem.block)
                .max()
                .unwrap_or(0)
        };
        for d in [32, 64, 128, 256] {
            for x3 in [true, false] {
                if let Some(k) = pf_kernel(d, x3) {
                    if let Some(b) = [2, 1]
                        .map(|nst| pf_smem_bytes(d, x3, nst))
                        .into_iter()
                        .find(|&b| b <= self.smem.block)
                    {
                        self.func_smem(k, b)?;
                    }
                }
            }
            if let Some(k) = simt_kernel(d).filter(|_| simt_smem_bytes(d) <= self.smem.block) {
                self.func_smem(k, simt_smem_bytes(d))?;
            }
            for kw in [2, 4] {
                for (fpv, x1) in [(false, false), (true, false), (false, true)] {
                    if let Some(k) = tc_kernel(d, kw, fpv, x1) {
                        self.func_smem(k, most(d, kw, TcFlavor::of(fpv)))?;
                    }
                }
                if let Some(k) = h16_kernel(d, kw) {
                    self.func_smem(k, most(d, kw, TcFlavor::H16))?;
                }
                if let Some(k) = h16kv_kernel(d).filter(|_| kw == 4) {
                    self.func_smem(k, most(d, kw, TcFlavor::H16Kv))?;
                }
                if let Some(k) = fa_kernel(d).filter(|_| kw == 4) {
                    let most_fa = (1..=4)
                        .map(|nst| tc_smem_bytes(d, 1, 4, nst, TcFlavor::Fa16Kv))
                        .filter(|&b| b <= self.smem.block)
                        .max()
                        .unwrap_or(0);
                    self.func_smem(k, most_fa)?;
                }
            }
        }
        Ok(())
    }

    /// A prompt's attention as products ([`AttnGemm`]): per block of query rows, the keys
    /// [jlo, jhi) its rows see. `f16`: one product on f16 operands (a prefill under
    /// `PrefillPrecision::Fast`), else [`Cuda::set_attn_gemm`]'s.
    fn attention_gemm(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        p: &AttnParams,
        f16: bool,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let f32_products = *lock(&self.attn_gemm) == AttnGemm::F32;
        let (d, hq, hkv) = (p.head_dim, p.n_heads, p.n_kv_heads);
        let scores = self
            .attn_gemm_scores
            .load(std::sync::atomic::Ordering::Relaxed);
        // f32 products run one kv head at a time; the 16-bit ones every head at once.
        let heads = if f32_products { hq / hkv } else { hq };
        let rows_per_block = (scores / (heads * p.n_kv.max(1))).max(1).min(p.n_q);
        if !f32_products {
            // K and V as 16-bit operands once for every block: [kv head][key], the padding
            // past n_kv zeros (a block's last key chunk may reach into it).
            let nkvp = p.n_kv.next_multiple_of(8) + 8 * ATTN_GEMM_MAX_CHUNKS;
            let parts = if f16 { 1 } else { 3 };
            let mut s = lock(&self.scratch);
            let s = &mut *s;
            ensure(&self.stream, &mut s.att_k3, nkvp * hkv * parts * d).map_err(dev)?;
            ensure(&self.stream, &mut s.att_v3, nkvp * hkv * parts * d).map_err(dev)?;
            let kv = p.n_kv * hkv * d;
            for (x, y) in [
                (k.data.slice(..kv), s.att_k3.as_mut().ok_or_else(internal)?),
                (v.data.slice(..kv), s.att_v3.as_mut().ok_or_else(internal)?),
            ] {
                self.gemm_operand(&x, y, (p.n_kv, nkvp, hkv, d), 0b010, f16)?;
            }
            let shape = *lock(&self.attn_pf2_shape);
            let fused = pf2_kernel(d, !f16, shape).filter(|&(_, shape)| {
                *lock(&self.attn_gemm) == AttnGemm::Fused
                    && pf2_smem_bytes(!f16, shape) <= self.smem.block
            });
            if let Some(kern) = fused {
                return self.attention_pf2(q, p, kern, (nkvp, f16), &s.att_k3, &s.att_v3, out);
            }
        }
        for r0 in (0..p.n_q).step_by(rows_per_block) {
            let r = rows_per_block.min(p.n_q - r0);
            let jlo = p.visible_keys(r0).0;
            let jhi = (r0..r0 + r).map(|i| p.visible_keys(i).1).max().unwrap_or(0);
            if jhi <= jlo {
                // No row of the block sees a key: its outputs are zeros.
                let (a, e) = (r0 * hq * d, (r0 + r) * hq * d);
                self.stream
                    .memset_zeros(&mut out.data.slice_mut(a..e))
                    .map_err(dev)?;
                continue;
            }
            if f32_products {
                self.attention_gemm_f32(q, k, v, p, (r0, r, jlo, jhi), rows_per_block, out)?;
            } else {
                self.attention_gemm_16(q, p, (r0, r, jlo, jhi), rows_per_block, f16, out)?;
            }
        }
        Ok(())
    }

    /// [`AttnGemm::Fused`]: every row in one `attn_pf2_*` launch over K and V as
    /// [`Cuda::attention_gemm`]'s operands (`nkvp` keys per kv head, f16 or bf16 hi / lo / hi).
    #[allow(clippy::too_many_arguments)]
    fn attention_pf2(
        &self,
        q: &CudaBuf,
        p: &AttnParams,
        (kern, shape): (Kernel, Pf2Shape),
        (nkvp, f16): (usize, bool),
        kop: &Option<CudaSlice<u16>>,
        vop: &Option<CudaSlice<u16>>,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let op = if f16 { "attention_fast" } else { "attention" };
        let rows = p.n_q * (p.n_heads / p.n_kv_heads);
        if p.n_kv_heads > 65535 {
            return Err(BackendError::Invalid {
                op,
                msg: format!("n_kv_heads {}: at most 65535 on CUDA", p.n_kv_heads),
            });
        }
        let smem = pf2_smem_bytes(!f16, shape);
        let f = self.func_smem(kern, smem)?;
        let (nkvp_a, nq, nkv) = (
            i32_of(op, "kv operand rows", nkvp)?,
            i32_of(op, "n_q", p.n_q)?,
            i32_of(op, "n_kv", p.n_kv)?,
        );
        let (h, hkv) = (
            i32_of(op, "n_heads", p.n_heads)?,
            i32_of(op, "n_kv_heads", p.n_kv_heads)?,
        );
        i32_of(op, "query rows x group", rows)?;
        let (qp0, kp0) = (p.q_pos0 as i64, p.kv_pos0 as i64);
        let (causal, window) = (p.causal as i32, p.window.map(|w| w as i64).unwrap_or(-1));
        let mut b = self.stream.launch_builder(&f);
        b.arg(&q.data)
            .arg(kop.as_ref().ok_or_else(internal)?)
            .arg(vop.as_ref().ok_or_else(internal)?)
            .arg(&nkvp_a)
            .arg(&nq)
            .arg(&nkv)
            .arg(&h)
            .arg(&hkv)
            .arg(&qp0)
            .arg(&kp0)
            .arg(&causal)
            .arg(&window)
            .arg(&p.scale)
            .arg(&mut out.data);
        let grid = (rows.div_ceil(shape.2) as u32, 1, p.n_kv_heads as u32);
        // SAFETY: attn_pf2_*(q, kop, vop, nkvp, n_q, n_kv, H, Hkv, q_pos0, kv_pos0, causal,
        // window, scale, out): q / out hold n_q rows of n_heads * d (checked by attention_op),
        // the operands n_kv_heads * nkvp rows of (3 or 1) * d (attention_gemm sized them).
        unsafe { b.launch(cfg(grid, (shape.2 * 4) as u32, smem as u32)) }.map_err(dev)?;
        Ok(())
    }

    /// [`AttnGemm::F32`]'s block of rows (`blk`: first row, rows, keys [jlo, jhi)): per kv
    /// head, S = scale K^T Q (one f32 product batched over its query heads), the masked
    /// softmax in place (`attn_softmax_rows`), O = V P into `out`'s rows.
    #[allow(clippy::too_many_arguments)]
    fn attention_gemm_f32(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        p: &AttnParams,
        (r0, r, jlo, jhi): (usize, usize, usize, usize),
        rows_per_block: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        use cudarc::cublas::sys::{cublasComputeType_t as Ct, cudaDataType as Dt};
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let op = "attention";
        let (d, hq, hkv) = (p.head_dim, p.n_heads, p.n_kv_heads);
        let (g, nk, f) = (hq / hkv, jhi - jlo, 4u64);
        let sm = self.func(Kernel::AttnSoftmaxRows)?;
        let mut s = lock(&self.scratch);
        ensure(
            &self.stream,
            &mut s.att_s,
            g * rows_per_block * p.n_kv.max(1),
        )
        .map_err(dev)?;
        let sbuf = s.att_s.as_mut().ok_or_else(internal)?;
        let (nk_a, r_a, r0_a, jlo_a) = (nk as i32, r as i32, r0 as i64, jlo as i64);
        let (qp0, kp0, nkv) = (p.q_pos0 as i64, p.kv_pos0 as i64, p.n_kv as i64);
        let (causal, window) = (p.causal as i32, p.window.map(|w| w as i64).unwrap_or(-1));
        for hk in 0..hkv {
            // S (column-major nk x r per query head) = K^T Q.
            self.with_blas(|blas| {
                let (sp, _gs) = sbuf.device_ptr_mut(&self.stream);
                let (kp, _gk) = k.data.device_ptr(&self.stream);
                let (qp, _gq) = q.data.device_ptr(&self.stream);
                let gm = BatchedGemm {
                    op,
                    trans_a: true,
                    m: nk,
                    n: r,
                    k: d,
                    alpha: p.scale,
                    a: kp + ((jlo * hkv + hk) * d) as u64 * f,
                    lda: hkv * d,
                    sa: 0,
                    b: qp + (((r0 * hq) + hk * g) * d) as u64 * f,
                    ldb: hq * d,
                    sb: d,
                    c: sp,
                    ldc: nk,
                    sc: r * nk,
                    batch: g,
                    ab: Dt::CUDA_R_32F,
                    compute: Ct::CUBLAS_COMPUTE_32F,
                };
                // SAFETY: the views address q / k / the scratch within their lengths
                // (checked by attention_op and sized above) on the handle's stream.
                unsafe { gm.run(blas) }
            })?;
            {
                let mut b = self.stream.launch_builder(&sm);
                b.arg(&mut *sbuf)
                    .arg(&nk_a)
                    .arg(&r_a)
                    .arg(&r0_a)
                    .arg(&jlo_a)
                    .arg(&qp0)
                    .arg(&kp0)
                    .arg(&nkv)
                    .arg(&causal)
                    .arg(&window);
                // SAFETY: attn_softmax_rows's parameters, in order; g * r rows of nk scores.
                unsafe { b.launch(cfg(((g * r) as u32, 1, 1), 256, 0)) }.map_err(dev)?;
            }
            // O (column-major d x r per query head, rows of `out`) = V P.
            self.with_blas(|blas| {
                let (op_, _go) = out.data.device_ptr_mut(&self.stream);
                let (vp, _gv) = v.data.device_ptr(&self.stream);
                let (sp, _gs) = sbuf.device_ptr(&self.stream);
                let gm = BatchedGemm {
                    op,
                    trans_a: false,
                    m: d,
                    n: r,
                    k: nk,
                    alpha: 1.0,
                    a: vp + ((jlo * hkv + hk) * d) as u64 * f,
                    lda: hkv * d,
                    sa: 0,
                    b: sp,
                    ldb: nk,
                    sb: r * nk,
                    c: op_ + (((r0 * hq) + hk * g) * d) as u64 * f,
                    ldc: hq * d,
                    sc: d,
                    batch: g,
                    ab: Dt::CUDA_R_32F,
                    compute: Ct::CUBLAS_COMPUTE_32F,
                };
                // SAFETY: as above; out holds n_q * n_heads * head_dim values.
                unsafe { gm.run(blas) }
            })?;
        }
        Ok(())
    }

    /// `attn_gemm_operand` of `x` ([`Cuda::attention_gemm`]'s 16-bit operands): `valid` rows
    /// of `heads` rows of `w` values (a token's heads) into `rows_out` rows per head,
    /// head-major (`dims` = (valid, rows_out, heads, w)); three bf16 parts by `lo_parts`, or
    /// one f16 value.
    fn gemm_operand(
        &self,
        x: &CudaView<f32>,
        y: &mut CudaSlice<u16>,
        (valid, rows_out, heads, w): (usize, usize, usize, usize),
        lo_parts: i32,
        f16: bool,
    ) -> Result<()> {
        let op = "attention";
        let f = self.func(Kernel::AttnGemmOperand)?;
        let (valid_a, rows_a) = (valid as i64, rows_out as i64);
        let (heads_a, w_a, f16_a) = (
            i32_of(op, "heads", heads)?,
            i32_of(op, "head_dim", w)?,
            f16 as i32,
        );
        let mut b = self.stream.launch_builder(&f);
        b.arg(x)
            .arg(y)
            .arg(&valid_a)
            .arg(&rows_a)
            .arg(&heads_a)
            .arg(&w_a)
            .arg(&lo_parts)
            .arg(&f16_a);
        // SAFETY: attn_gemm_operand(x, y, valid, rows_out, heads, w, lo_parts, f16): x holds
        // valid * heads * w values, y (3 or 1) * rows_out * heads * w (the callers' sizes).
        unsafe { b.launch(grid_1d(rows_out * heads * w, 256)) }.map_err(dev)?;
        Ok(())
    }

    /// The 16-bit products' block of rows (`blk`: first row, rows, keys [jlo, jhi)), every
    /// head at once, over K and V as operands already ([`Cuda::attention_gemm`]: [kv head][key],
    /// `ATTN_GEMM_MAX_CHUNKS` chunks' padding past n_kv): Q as the block's operand
    /// (`attn_gemm_operand`: bf16 [hi | hi | lo] against K's [hi | lo | hi], or f16, head-major
    /// rows), S = scale K^T Q (one product batched over the kv heads), the masked softmax
    /// written as P's operand in `nc` chunks of keys (`attn_softmax_rows_p16`), O's partials =
    /// V P per kv head (a product batched over the chunks: they split the long inner dimension
    /// so that the product fills the GPU), and their sum in chunk order into `out`'s rows
    /// (`attn_gemm_reduce`).
    #[allow(clippy::too_many_arguments)]
    fn attention_gemm_16(
        &self,
        q: &CudaBuf,
        p: &AttnParams,
        (r0, r, jlo, jhi): (usize, usize, usize, usize),
        rows_per_block: usize,
        f16: bool,
        out: &mut CudaBuf,
    ) -> Result<()> {
        use cudarc::cublas::sys::{cublasComputeType_t as Ct, cudaDataType as Dt};
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let op = "attention";
        let (d, hq, hkv) = (p.head_dim, p.n_heads, p.n_kv_heads);
        let (g, nk) = (hq / hkv, jhi - jlo);
        let gr = g * r;
        let nkvp = p.n_kv.next_multiple_of(8) + 8 * ATTN_GEMM_MAX_CHUNKS;
        // Operand values per source value: three bf16 parts, or one f16.
        let parts = if f16 { 1 } else { 3 };
        // Key chunks: enough chunk tiles of a kv head's second product for two waves, at
        // least 256 keys a chunk (or the test knob's count).
        let tiles = d.div_ceil(128) * gr.div_ceil(128);
        let nc = match self
            .attn_gemm_chunks
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            0 => (2 * self.num_sms)
                .div_ceil(tiles.max(1))
                .clamp(1, (nk / 256).clamp(1, ATTN_GEMM_MAX_CHUNKS)),
            n => n.clamp(1, nk.min(ATTN_GEMM_MAX_CHUNKS)),
        };
        let kc = nk.div_ceil(nc).next_multiple_of(8);
        let ldk = parts * kc;
        {
            let mut s = lock(&self.scratch);
            let s = &mut *s;
            ensure(
                &self.stream,
                &mut s.att_s,
                hq * rows_per_block * p.n_kv.max(1),
            )
            .map_err(dev)?;
            ensure(&self.stream, &mut s.att_q3, rows_per_block * hq * parts * d).map_err(dev)?;
            ensure(
                &self.stream,
                &mut s.att_p3,
                hq * rows_per_block * parts * (nc * kc),
            )
            .map_err(dev)?;
            ensure(&self.stream, &mut s.att_o, nc * hq * rows_per_block * d).map_err(dev)?;
        }
        let mut guard = lock(&self.scratch);
        let s = &mut *guard;
        self.gemm_operand(
            &q.data.slice(r0 * hq * d..(r0 + r) * hq * d),
            s.att_q3.as_mut().ok_or_else(internal)?,
            (r, r, hq, d),
            0b100,
            f16,
        )?;
        let ab = if f16 { Dt::CUDA_R_16F } else { Dt::CUDA_R_16BF };
        let h = 2u64;
        // S [kv head][query head of the group, row][key] = scale K^T Q.
        self.with_blas(|blas| {
            let (sp, _gs) = s
                .att_s
                .as_mut()
                .ok_or_else(internal)?
                .device_ptr_mut(&self.stream);
            let (kp, _gk) = s
                .att_k3
                .as_ref()
                .ok_or_else(internal)?
                .device_ptr(&self.stream);
            let (qp, _gq) = s
                .att_q3
                .as_ref()
                .ok_or_else(internal)?
                .device_ptr(&self.stream);
            let gm = BatchedGemm {
                op,
                trans_a: true,
                m: nk,
                n: gr,
                k: parts * d,
                alpha: p.scale,
                a: kp + (jlo * parts * d) as u64 * h,
                lda: parts * d,
                sa: nkvp * parts * d,
                b: qp,
                ldb: parts * d,
                sb: gr * parts * d,
                c: sp,
                ldc: nk,
                sc: gr * nk,
                batch: hkv,
                ab,
                compute: Ct::CUBLAS_COMPUTE_32F,
            };
            // SAFETY: the operands (sized above) within their lengths, on the handle's stream.
            unsafe { gm.run(blas) }
        })?;
        {
            let sm = self.func(Kernel::AttnSoftmaxRowsP16)?;
            let (nk_a, r_a, gr_a, kc_a, nc_a) =
                (nk as i32, r as i32, gr as i32, kc as i32, nc as i32);
            let (r0_a, jlo_a) = (r0 as i64, jlo as i64);
            let (qp0, kp0, nkv) = (p.q_pos0 as i64, p.kv_pos0 as i64, p.n_kv as i64);
            let (causal, window) = (p.causal as i32, p.window.map(|w| w as i64).unwrap_or(-1));
            let f16_a = f16 as i32;
            let mut b = self.stream.launch_builder(&sm);
            b.arg(s.att_s.as_ref().ok_or_else(internal)?)
                .arg(s.att_p3.as_mut().ok_or_else(internal)?)
                .arg(&nk_a)
                .arg(&r_a)
                .arg(&gr_a)
                .arg(&kc_a)
                .arg(&nc_a)
                .arg(&r0_a)
                .arg(&jlo_a)
                .arg(&qp0)
                .arg(&kp0)
                .arg(&nkv)
                .arg(&causal)
                .arg(&window)
                .arg(&f16_a);
            // SAFETY: attn_softmax_rows_p16's parameters, in order; hq * r rows of nk scores,
            // P hkv * nc * gr rows of parts * kc values.
            unsafe { b.launch(cfg(((hq * r) as u32, 1, 1), 256, 0)) }.map_err(dev)?;
        }
        // O's partials [kv head][chunk][query head of the group, row][d] = V P, per kv head.
        for hk in 0..hkv {
            self.with_blas(|blas| {
                let (op_, _go) = s
                    .att_o
                    .as_mut()
                    .ok_or_else(internal)?
                    .device_ptr_mut(&self.stream);
                let (vp, _gv) = s
                    .att_v3
                    .as_ref()
                    .ok_or_else(internal)?
                    .device_ptr(&self.stream);
                let (pp, _gp) = s
                    .att_p3
                    .as_ref()
                    .ok_or_else(internal)?
                    .device_ptr(&self.stream);
                let gm = BatchedGemm {
                    op,
                    trans_a: false,
                    m: d,
                    n: gr,
                    k: ldk,
                    alpha: 1.0,
                    a: vp + ((hk * nkvp + jlo) * parts * d) as u64 * h,
                    lda: d,
                    sa: ldk * d,
                    b: pp + (hk * nc * gr * ldk) as u64 * h,
                    ldb: ldk,
                    sb: gr * ldk,
                    c: op_ + (hk * nc * gr * d) as u64 * 4,
                    ldc: d,
                    sc: gr * d,
                    batch: nc,
                    ab,
                    compute: Ct::CUBLAS_COMPUTE_32F,
                };
                // SAFETY: as above (the chunks end within the kv head's padded keys).
                unsafe { gm.run(blas) }
            })?;
        }
        let red = self.func(Kernel::AttnGemmReduce)?;
        let (r_a, hq_a, g_a, d_a, nc_a) = (r as i32, hq as i32, g as i32, d as i32, nc as i32);
        let mut o = out.data.slice_mut(r0 * hq * d..(r0 + r) * hq * d);
        let mut b = self.stream.launch_builder(&red);
        b.arg(s.att_o.as_ref().ok_or_else(internal)?)
            .arg(&mut o)
            .arg(&r_a)
            .arg(&hq_a)
            .arg(&g_a)
            .arg(&d_a)
            .arg(&nc_a);
        // SAFETY: attn_gemm_reduce(part, out, r, hq, g, d, nc): part holds hkv * nc * g * r * d
        // values, out r * hq * d.
        unsafe { b.launch(grid_1d(r * hq * d, 256)) }.map_err(dev)?;
        Ok(())
    }

    /// The attention op; `extra`: what the split combine writes besides `out` (the next
    /// projection's activation; returned if it did: the paths without a combine write `out`
    /// only).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_op(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        p: &AttnParams,
        fast: bool,
        kv: KvStorage,
        extra: AttnExtra,
        out: &mut CudaBuf,
    ) -> Result<Option<AttnAct>> {
        // A long prompt's rows at a head dim the tensor-core prefill kernels do not take: two
        // cuBLAS products per block of rows around a masked softmax ([`AttnGemm`]); f16
        // operands for a prefill under `PrefillPrecision::Fast` (as the prefill kernels' f16
        // arithmetic), else `set_attn_gemm`'s.
        if kv == KvStorage::F32
            && matches!(extra, AttnExtra::None)
            && p.n_q >= ATTN_GEMM_MIN_ROWS
            && p.n_kv_heads > 0
            && p.n_heads.is_multiple_of(p.n_kv_heads)
            && p.n_heads > 0
            && p.head_dim > 0
            && p.window != Some(0)
            && pf_kernel(p.head_dim, true).is_none()
            && *lock(&self.attn_gemm) != AttnGemm::Off
        {
            let op = if fast { "attention_fast" } else { "attention" };
            check(op, "q", p.n_q * p.n_heads * p.head_dim, q.len)?;
            let kv_slots = p.n_kv * p.n_kv_heads * p.head_dim;
            check(op, "k", kv_slots, k.len)?;
            check(op, "v", kv_slots, v.len)?;
            check(op, "out", p.n_q * p.n_heads * p.head_dim, out.len)?;
            let f16 = p.causal && self.prefill_fast();
            self.attention_gemm(q, k, v, p, f16, out)?;
            return Ok(None);
        }
        let w = p.n_heads * p.head_dim;
        // Causal rows under the automatic split: each row's keys in the splits the keys it
        // sees choose ([`causal_splits_default`]), so a row of a verify has the bits of its decode;
        // rows on both sides of a threshold run as one call per split. (first row, end, split)
        let mut groups: Vec<(usize, usize, Option<usize>)> = Vec::with_capacity(1);
        let prefill = *lock(&self.attn_prefill_split);
        // A prefill's rows in 1xTF32 under `PrefillPrecision::Fast` (an f16 cache: the same).
        let fast = fast || (p.causal && p.n_q > super::SKINNY_ROWS && self.prefill_fast());
        if p.causal && p.n_q > super::SKINNY_ROWS && prefill > 0 && lock(&self.attn_split).is_none()
        {
            groups.push((0, p.n_q, Some(prefill)));
        } else if p.causal && lock(&self.attn_split).is_none() {
            let set = lock(&self.attn_causal_splits);
            let table = set
                .as_deref()
                .unwrap_or_else(|| causal_splits_default(p.head_dim));
            for i in 0..p.n_q.max(1) {
                let sk = Some(causal_split_keys(causal_keys(p, i), table));
                match groups.last_mut() {
                    Some(g) if g.2 == sk => g.1 = i + 1,
                    _ => groups.push((i, i + 1, sk)),
                }
            }
        } else {
            groups.push((0, p.n_q, None));
        }
        if let [(_, _, split)] = groups[..] {
            return self.attention_rows(
                &q.data.slice(..),
                k,
                v,
                p,
                fast,
                kv,
                extra,
                split,
                &mut out.data.slice_mut(..),
            );
        }
        let op = "attention";
        check(op, "q", p.n_q * w, q.len)?;
        check(op, "out", p.n_q * w, out.len)?;
        for (i0, i1, sk) in groups {
            let pg = AttnParams {
                n_q: i1 - i0,
                q_pos0: p.q_pos0 + i0,
                ..*p
            };
            self.attention_rows(
                &q.data.slice(i0 * w..i1 * w),
                k,
                v,
                &pg,
                fast,
                kv,
                AttnExtra::None,
                sk,
                &mut out.data.slice_mut(i0 * w..i1 * w),
            )?;
        }
        // (No activation: the callers quantize or split `out`.)
        Ok(None)
    }

    /// [`Cuda::attention_op`] over the rows of views `q` / `out`; `split`: the keys per split of
    /// a causal call under the automatic split (None: the other rules).
    #[allow(clippy::too_many_arguments)]
    fn attention_rows(
        &self,
        q: &CudaView<'_, f32>,
        k: &CudaBuf,
        v: &CudaBuf,
        p: &AttnParams,
        fast: bool,
        kv: KvStorage,
        extra: AttnExtra,
        split: Option<usize>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<Option<AttnAct>> {
        let kv16 = kv == KvStorage::F16;
        let op = match (fast, kv16) {
            (_, true) => "attention_fast_kv16",
            (true, false) => "attention_fast",
            (false, false) => "attention",
        };
        if p.n_heads == 0
            || p.n_kv_heads == 0
            || !p.n_heads.is_multiple_of(p.n_kv_heads)
            || p.head_dim == 0
        {
            return Err(BackendError::Invalid {
                op,
                msg: format!(
                    "n_heads {} must be a positive multiple of n_kv_heads {} (head_dim {})",
                    p.n_heads, p.n_kv_heads, p.head_dim
                ),
            });
        }
        if kv16 && !self.kv16_kernel_fits(p) {
            return Err(BackendError::Invalid {
                op,
                msg: format!("head_dim {}: no f16-cache kernel", p.head_dim),
            });
        }
        check(op, "q", p.n_q * p.n_heads * p.head_dim, q.len())?;
        let kv_slots = kv.slots(p.n_kv * p.n_kv_heads * p.head_dim);
        check(op, "k (f32 slots)", kv_slots, k.len)?;
        check(op, "v (f32 slots)", kv_slots, v.len)?;
        check(op, "out", p.n_q * p.n_heads * p.head_dim, out.len())?;
        if p.n_q == 0 {
            return Ok(None);
        }
        if p.window == Some(0) {
            return Err(BackendError::Invalid {
                op,
                msg: "window of 0".into(),
            });
        }
        let (nq, nkv, h, hkv) = (
            i32_of(op, "n_q", p.n_q)?,
            i32_of(op, "n_kv", p.n_kv)?,
            i32_of(op, "n_heads", p.n_heads)?,
            i32_of(op, "n_kv_heads", p.n_kv_heads)?,
        );
        let (qp0, kp0) = (p.q_pos0 as i64, p.kv_pos0 as i64);
        let causal = p.causal as i32;
        let window = p.window.map(|w| w as i64).unwrap_or(-1);
        let scale = p.scale;
        let d = p.head_dim;
        let rows_total = p.n_q * p.n_heads;
        let g = p.n_heads / p.n_kv_heads;
        let qr = p.n_q * g;
        i32_of(op, "n_q * n_heads", rows_total)?;

        // (kernel, threads, shared bytes, rows per block, pipeline stages) of the split kernel.
        let choice = *lock(&self.attn_kernel);
        // A prefill's causal rows through the FlashAttention-2-style kernels
        // ([`Cuda::set_attn_prefill_fa`]).
        let prefill_fa = p.causal
            && p.n_q > super::SKINNY_ROWS
            && choice == AttnKernel::Auto
            && *lock(&self.attn_prefill_fa);
        let fa_cfg = *lock(&self.attn_fa);
        let fa_fits = kv16
            && fa_kernel(d).is_some()
            && tc_smem_bytes(d, 1, 1, 1, TcFlavor::Fa16Kv) <= self.smem.block;
        let (split_keys, rule) = match (split, *lock(&self.attn_split)) {
            (Some(k), _) | (None, Some(k)) => (k, SplitRule::Fixed),
            // The FA kernel's long spans: splits for `blocks_per_sm` blocks per multiprocessor.
            (None, None) if fa_fits && fa_cfg.long => {
                split_keys_auto(p, self.num_sms * fa_cfg.blocks_per_sm)
            }
            (None, None) => split_keys_auto(p, self.num_sms),
        };
        let one_wave = rule == SplitRule::OneWave;
        // Long spans: the one-wave rule's, and the non-causal windows over longer contexts
        // (the 27B shape's 2048-key windows).
        let span = p.window.map_or(p.n_kv, |w| w.min(p.n_kv));
        let fa = fa_fits
            && (fa_cfg.all
                || prefill_fa
                || (fa_cfg.long && (one_wave || (!p.causal && span > SHORT_NONCAUSAL_KV))));
        // Its warpgroup-MMA twin where the device has one (sm_90a, head dim 128).
        let wg = match wg_kernel(d, self.arch()) {
            Some(k)
                if fa
                    && fa_cfg.wgmma
                    && tc_smem_bytes(d, 1, 4, 3, TcFlavor::Wg16Kv) <= self.smem.block
                    && self.reg.has(k).map_err(BackendError::from)? =>
            {
                Some(k)
            }
            _ => None,
        };
        let n_split = p.n_kv.div_ceil(split_keys);
        // The tensor-core kernels run the live splits only (the SIMT kernel all of them).
        let (split0, n_live) = {
            let (lo, hi) = live_splits(p, split_keys);
            (lo, hi - lo)
        };
        let tc = match choice.resolve() {
            // An f16 cache: its one kernel (4 key warps), the choice's row warps and stages.
            AttnKernel::Tc {
                row_warps, stages, ..
            } if kv16 => Some((if fa { 1 } else { 4 }, row_warps, false, stages)),
            _ if kv16 => Some((if fa { 1 } else { 4 }, 0, false, 0)),
            AttnKernel::Simt | AttnKernel::Auto => None,
            AttnKernel::Tc {
                key_warps,
                row_warps,
                ffma_pv,
                stages,
            } => Some((key_warps, row_warps, ffma_pv, stages)),
        };
        // Head dim 256 has the 2-key-warp kernel only (64 keys of padded f32 K and V leave
        // room for one stage): the automatic choice takes it there.
        let tc = tc.map(|(kw, rw, fpv, st)| match tc_kernel(d, kw, fpv, false) {
            None if choice == AttnKernel::Auto
                && !kv16
                && tc_kernel(d, 2, fpv, false).is_some() =>
            {
                (2, rw, fpv, st)
            }
            _ => (kw, rw, fpv, st),
        });
        // Kernels whose smallest launch does not fit the device's shared memory per block
        // (e.g. 99 KiB on sm_86 / sm_89) are not chosen; row warps and stages change no bit.
        let lim = self.smem;
        // An f32 cache's prefill rows: `attn_pf_*`, two staging stages where they fit.
        let x3 = !fast;
        let pf = pf_kernel(d, x3)
            .filter(|_| !kv16 && prefill_fa && pf_smem_bytes(d, x3, 1) <= lim.block);
        let split: Option<(Kernel, u32, usize, usize, i32)> = match tc {
            _ if pf.is_some() => {
                let nst = if pf_smem_bytes(d, x3, 2) <= lim.block {
                    2
                } else {
                    1
                };
                Some((
                    pf.ok_or_else(internal)?,
                    PF_THREADS as u32,
                    pf_smem_bytes(d, x3, nst),
                    PF_THREADS / 2,
                    nst as i32,
                ))
            }
            Some((kw, rw, fpv, stages))
                if kv16
                    || (tc_kernel(d, kw, fpv, false).is_some()
                        && tc_smem_bytes(d, kw, 1, 1, TcFlavor::of(fpv)) <= lim.block) =>
            {
                // The fast op takes the f16 kernel over the long non-causal spans the one-wave
                // rule splits (4 key warps, P V on the tensor cores; unless
                // `set_attn_fast_f16(false)`), else the 1xTF32 twin of the exact kernel (not for
                // P V on the CUDA cores); the grid is the same. H200, q8_0a8 step (one lease, two
                // rounds, 1xTF32 -> f16 everywhere): 8B 0.772 -> 0.741 ms at ctx 8192, 27B 1.187
                // -> 1.170; but 0.621 -> 0.627 and 1.059 -> 1.068 at ctx 512 (one row warp per
                // block: 2 staging slots where the f32 kernel keeps 3 chunks in flight). A
                // function of the span, never of the query rows (per-row determinism).
                let h16 = h16_kernel(d, kw)
                    .filter(|_| !kv16 && fast && !fpv && one_wave && *lock(&self.attn_fast_f16))
                    .filter(|_| tc_smem_bytes(d, kw, 1, 1, TcFlavor::H16) <= lim.block);
                let fl = match () {
                    _ if wg.is_some() => TcFlavor::Wg16Kv,
                    _ if fa => TcFlavor::Fa16Kv,
                    _ if kv16 => TcFlavor::H16Kv,
                    _ if h16.is_some() => TcFlavor::H16,
                    _ => TcFlavor::of(fpv),
                };
                let kern = wg
                    .or_else(|| fa_kernel(d).filter(|_| fa))
                    .or_else(|| h16kv_kernel(d).filter(|_| kv16))
                    .or(h16)
                    .or_else(|| tc_kernel(d, kw, fpv, fast))
                    .or_else(|| tc_kernel(d, kw, fpv, false))
                    .ok_or_else(internal)?;
                let rw = if wg.is_some() {
                    4 // one warpgroup
                } else if rw > 0 {
                    rw
                } else {
                    // As many rows per block as the rows allow while the grid still fills the
                    // GPU (more rows per block = fewer reads of each K/V chunk; a split of the
                    // one-wave rule was sized for these blocks; a short span's, for half the
                    // multiprocessors) and one stage fits the shared memory.
                    let fill = match rule {
                        SplitRule::Fixed => self.num_sms,
                        SplitRule::Short => self.num_sms / 2,
                        SplitRule::OneWave => 0,
                    };
                    let mut rw = 4;
                    while rw > 1
                        && (qr <= 16 * (rw / 2)
                            || n_live * p.n_kv_heads * qr.div_ceil(16 * rw) < fill
                            || tc_smem_bytes(d, kw, rw, 1, fl) > lim.block)
                    {
                        rw /= 2;
                    }
                    rw
                };
                let blocks = n_live * p.n_kv_heads * qr.div_ceil(16 * rw);
                let nst = match stages {
                    0 if fa => {
                        let regs = self.func(kern)?.num_regs().map_err(dev)? as usize;
                        fa_stages(d, rw, regs, blocks, self.num_sms, lim, fl)
                    }
                    0 => tc_stages(d, kw, rw, fl, blocks, self.num_sms, lim),
                    // (the wgmma twin: 3 to 5 stages)
                    n if wg.is_some() => n.clamp(3, 5),
                    n if tc_smem_bytes(d, kw, rw, n, fl) <= lim.block => n,
                    _ => tc_stages(d, kw, rw, fl, blocks, self.num_sms, lim),
                };
                Some((
                    kern,
                    (32 * kw * rw) as u32,
                    tc_smem_bytes(d, kw, rw, nst, fl),
                    16 * rw,
                    nst as i32,
                ))
            }
            _ => simt_kernel(d)
                .filter(|_| simt_smem_bytes(d) <= lim.block)
                .map(|k| (k, 256, simt_smem_bytes(d), ATT_QT, 0)),
        };

        match split {
            Some((kern, threads, smem, rows_per_block, nst)) if p.n_kv > 0 => {
                let f = self.func_smem(kern, smem)?;
                let split_i = split_keys as i32;
                // Splits launched (and partial slots): the live ones for the tensor-core kernels.
                let (split0, n_split) = if nst > 0 {
                    (split0, n_live)
                } else {
                    (0, n_split)
                };
                // A prefill kernel's call of one split writes its rows itself (and the o
                // projection's bf16 x where asked): no partial, no combine, the same bits.
                let direct = pf.is_some()
                    && n_split == 1
                    && !matches!(extra, AttnExtra::Q8 { .. })
                    && *lock(&self.prefill_producers);
                let mut s = lock(&self.scratch);
                let (po, pml) = if direct {
                    (1, 1)
                } else {
                    (n_split * rows_total * d, n_split * rows_total * 2)
                };
                ensure(&self.stream, &mut s.att_o, po).map_err(dev)?;
                ensure(&self.stream, &mut s.att_ml, pml).map_err(dev)?;
                // attn_pf_*'s last parameters (out, hi, lo).
                let mut tail = RawArgs::default();
                let mut wrote = None;
                if direct {
                    tail.dptr_mut(out, &self.stream);
                    match extra {
                        AttnExtra::Split => {
                            let hi_only = self.split_hi_only(p.n_q);
                            let (act, hi, lo) =
                                s.split_written(&self.stream, p.n_heads * d, p.n_q, hi_only)?;
                            tail.dptr_mut(hi, &self.stream);
                            super::lo_arg(&mut tail, lo, hi_only, &self.stream);
                            wrote = Some(AttnAct::Split(act));
                        }
                        _ => {
                            tail.u64(0).u64(0);
                        }
                    }
                } else if pf.is_some() {
                    tail.u64(0).u64(0).u64(0);
                }
                let Scratch { att_o, att_ml, .. } = &mut *s;
                let (wo, wml) = (
                    att_o.as_mut().ok_or_else(internal)?,
                    att_ml.as_mut().ok_or_else(internal)?,
                );
                let st = &*self.stream;
                let mut a = RawArgs::default();
                a.dptr(q, st)
                    .dptr(&k.data, st)
                    .dptr(&v.data, st)
                    .dptr_mut(&mut *wo, st)
                    .dptr_mut(&mut *wml, st)
                    .i32(nq)
                    .i32(nkv)
                    .i32(h)
                    .i32(hkv)
                    .i64(qp0)
                    .i64(kp0)
                    .i32(causal)
                    .i64(window)
                    .f32(scale)
                    .i32(split_i);
                if nst > 0 {
                    a.i32(nst).i32(i32_of(op, "first live split", split0)?);
                }
                a.append(tail);
                // The tensor-core kernel takes (row groups, splits, kv heads), the SIMT one
                // (splits, kv heads, row groups).
                if nst > 0 && (n_split > 65535 || p.n_kv_heads > 65535) {
                    return Err(BackendError::Invalid {
                        op,
                        msg: format!(
                            "n_kv {} ({n_split} splits of {split_keys} keys) and n_kv_heads {}: at most 65535 of each on CUDA",
                            p.n_kv, p.n_kv_heads
                        ),
                    });
                }
                let groups = qr.div_ceil(rows_per_block) as u32;
                let grid = if nst > 0 {
                    (groups, n_split as u32, p.n_kv_heads as u32)
                } else {
                    (n_split as u32, p.n_kv_heads as u32, groups)
                };
                // Programmatic dependent launches (with the Q8_0A8 ones, `set_a8_pdl`): the
                // split kernel and the combine wait for their inputs first thing.
                let pdl = *lock(&self.a8_pdl);
                // SAFETY: the parameters of attn_tc_* (with nst, split0) / attn_split_d* in order
                // (attn_pf_*: then out, hi, lo; out / hi hold n_q rows of n_heads * d, as checked
                // and as split_written sized them).
                unsafe { a.launch(st, &f, cfg(grid, threads, smem as u32), pdl) }?;
                if direct {
                    return Ok(wrote);
                }
                // More than 16 splits: the combine that loads 64 partial outputs in its first
                // round trip (the same bits; H200, 8B drafter shape at ctx 8192, 33 splits:
                // 13.5 -> 9.0 us; at 5 splits it would cost 4.5 -> 7.0 us).
                let fc = self.func(if n_split > 16 {
                    Kernel::AttnCombineWide
                } else {
                    Kernel::AttnCombine
                })?;
                let (ns, rt, di) = (n_split as i32, rows_total as i64, d as i32);
                let mut a = RawArgs::default();
                a.dptr(&*wo, st)
                    .dptr(&*wml, st)
                    .i32(ns)
                    .i64(rt)
                    .i32(di)
                    .dptr_mut(out, st)
                    .i32(h);
                // The Q8_0A8 activation too (one warp per 32 values of a row): padding tokens
                // up to nt * 8 get blocks of their own. Or the skinny matmuls' bf16 hi / lo x
                // (the combine's D <= 256 threads cover a row).
                let extra = match extra {
                    AttnExtra::Q8 { nt, .. }
                        if !(d.is_multiple_of(32) && d <= 256 && p.n_q <= nt * 8) =>
                    {
                        AttnExtra::None
                    }
                    AttnExtra::Split if d > 256 => AttnExtra::None,
                    e => e,
                };
                let (blocks, wrote) = match extra {
                    AttnExtra::Q8 { nt, kbp } => {
                        let (xq, xd) = s.a8_first(&self.stream, kbp, nt)?;
                        a.i32(nt as i32)
                            .i32(i32_of(op, "n_heads * head_dim", kbp)?)
                            .dptr_mut(xq, st)
                            .dptr_mut(xd, st)
                            .u64(0)
                            .u64(0);
                        let act = s.a8_written(0, p.n_heads * d, p.n_q);
                        (nt * 8 * p.n_heads, Some(AttnAct::A8(act)))
                    }
                    AttnExtra::Split => {
                        let hi_only = self.split_hi_only(p.n_q);
                        let (act, hi, lo) =
                            s.split_written(&self.stream, p.n_heads * d, p.n_q, hi_only)?;
                        a.i32(0).i32(0).u64(0).u64(0).dptr_mut(hi, st);
                        super::lo_arg(&mut a, lo, hi_only, st);
                        (rows_total, Some(AttnAct::Split(act)))
                    }
                    AttnExtra::None => {
                        a.i32(0).i32(0).u64(0).u64(0).u64(0).u64(0);
                        (rows_total, None)
                    }
                };
                let c = cfg((blocks as u32, 1, 1), d.min(256) as u32, 0);
                // SAFETY: attn_combine's parameters in order (ws_o, ws_ml, n_split, rows_total,
                // D, out, H, NT, KBp, xq, xd, hi, lo); with xq the scratch holds the activation
                // of nt * 8 tokens x kbp blocks (a8_first sized it), with hi / lo n_q rows of
                // n_heads * D (split_written sized them).
                unsafe { a.launch(st, &fc, c, pdl) }?;
                return Ok(wrote);
            }
            _ => {
                if d > 512 {
                    return Err(BackendError::Invalid {
                        op,
                        msg: format!("head_dim {d} > 512 is not supported on CUDA"),
                    });
                }
                let f = self.func(Kernel::AttnGeneric)?;
                let di = d as i32;
                let mut b = self.stream.launch_builder(&f);
                b.arg(q).arg(&k.data).arg(&v.data).arg(out);
                b.arg(&nq)
                    .arg(&nkv)
                    .arg(&h)
                    .arg(&hkv)
                    .arg(&di)
                    .arg(&qp0)
                    .arg(&kp0)
                    .arg(&causal)
                    .arg(&window)
                    .arg(&scale);
                unsafe { b.launch(cfg((rows_total.div_ceil(4) as u32, 1, 1), 128, 0)) }
                    .map_err(dev)?;
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The automatic split depends on causality, `n_kv`, the window, `n_kv_heads` and the
    /// multiprocessor count only (never on the query rows).
    #[test]
    fn split_keys_auto_rule() {
        let p = |n_q, n_kv, causal, window| AttnParams {
            n_q,
            n_kv,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            q_pos0: 0,
            kv_pos0: 0,
            causal,
            window,
            scale: 1.0,
        };
        for n_q in [1, 16] {
            for n_kv in [16, 528, 4112, 8208, 100_000] {
                assert_eq!(
                    split_keys_auto(&p(n_q, n_kv, true, None), 132),
                    (256, SplitRule::Fixed)
                );
            }
            let auto = |n_kv, window| split_keys_auto(&p(n_q, n_kv, false, window), 132);
            // Short spans: a sixth, rounded up to 64 keys, at least 128.
            let short = |k| (k, SplitRule::Short);
            assert_eq!(auto(16, None), short(128));
            assert_eq!(auto(256, None), short(128));
            assert_eq!(auto(528, None), short(128));
            assert_eq!(auto(784, None), short(192));
            assert_eq!(auto(1024, None), short(192));
            assert_eq!(auto(1040, None), short(192));
            assert_eq!(auto(8208, Some(512)), short(128));
            assert_eq!(auto(1041, None), (256, SplitRule::Fixed));
            assert_eq!(auto(2048, None), (256, SplitRule::Fixed));
            assert_eq!(auto(8208, Some(2048)), (256, SplitRule::Fixed));
            // One wave: 132 / 8 - 1 = 15 splits at most, a multiple of 64 keys, >= 256.
            let wave = |k| (k, SplitRule::OneWave);
            assert_eq!(auto(4112, None), wave(320));
            assert_eq!(auto(8208, None), wave(576));
            assert_eq!(auto(2112, None), wave(256));
            for n_kv in [2049, 4112, 8208, 33_000, 100_000] {
                let (k, _) = auto(n_kv, None);
                assert!(
                    n_kv.div_ceil(k) <= 15 && k.is_multiple_of(64),
                    "{n_kv}: {k}"
                );
            }
            // Fewer multiprocessors, more kv heads: still at least one split per kv head.
            assert_eq!(
                split_keys_auto(&p(n_q, 8208, false, None), 78).0,
                8208usize.div_ceil(8).next_multiple_of(64)
            );
        }
    }

    /// The live splits hold every key some row can see and leave out only whole splits no row
    /// can (checked key by key against the mask).
    #[test]
    fn live_splits_cover_every_visible_key() {
        for (n_q, n_kv, q_pos0, kv_pos0, causal, window) in [
            (16, 8208, 8192, 0, false, Some(2048)),
            (16, 8208, 8192, 0, false, None),
            (16, 8208, 8192, 0, true, None),
            (1, 8208, 100, 0, true, None),
            (16, 4000, 4100, 200, true, Some(300)),
            (7, 300, 5, 0, true, Some(1)),
            (3, 64, 1000, 0, false, Some(10)),
            (16, 528, 512, 0, false, None),
        ] {
            let p = AttnParams {
                n_q,
                n_kv,
                n_heads: 32,
                n_kv_heads: 8,
                head_dim: 128,
                q_pos0,
                kv_pos0,
                causal,
                window,
                scale: 1.0,
            };
            for sk in [128, 256, 576] {
                let (lo, hi) = live_splits(&p, sk);
                let n_split = n_kv.div_ceil(sk);
                assert!(
                    lo < hi && hi <= n_split,
                    "{p:?} {sk}: {lo}..{hi} of {n_split}"
                );
                let visible = |j: usize| {
                    let kpos = kv_pos0 + j;
                    (0..n_q).any(|i| {
                        let qp = q_pos0 + i;
                        (!causal || kpos <= qp) && window.is_none_or(|w| qp < kpos + w)
                    })
                };
                let any = (0..n_kv).any(visible);
                for s in 0..n_split {
                    let seen = (s * sk..((s + 1) * sk).min(n_kv)).any(visible);
                    if seen {
                        assert!(
                            (lo..hi).contains(&s),
                            "{p:?} {sk}: split {s} seen, live {lo}..{hi}"
                        );
                    }
                    if any && (lo..hi).contains(&s) && (s == lo || s + 1 == hi) {
                        assert!(
                            seen,
                            "{p:?} {sk}: edge split {s} of {lo}..{hi} sees nothing"
                        );
                    }
                }
                if !any {
                    assert_eq!((lo, hi), (0, n_split));
                }
            }
        }
    }

    /// A causal row's split: from the table by the keys it sees (within its window), the same
    /// for the row whatever else the call holds.
    #[test]
    fn causal_splits_by_the_keys_a_row_sees() {
        for (head_dim, cases) in [
            (
                128,
                [
                    (0, 64),
                    (1023, 64),
                    (1024, 128),
                    (2047, 128),
                    (2048, 256),
                    (8192, 256),
                ],
            ),
            (
                256,
                [
                    (0, 64),
                    (1023, 64),
                    (2047, 64),
                    (2048, 128),
                    (8191, 128),
                    (8192, 256),
                ],
            ),
        ] {
            let t = causal_splits_default(head_dim);
            assert!(valid_causal_table(t), "head dim {head_dim}");
            let long = [
                (16383, 256),
                (16384, 512),
                (32767, 512),
                (32768, 1024),
                (65535, 1024),
                (65536, 2048),
                (1 << 20, 2048),
            ];
            for (keys, want) in cases.into_iter().chain(long) {
                assert_eq!(
                    causal_split_keys(keys, t),
                    want,
                    "head dim {head_dim}, {keys} keys"
                );
            }
        }
        assert!(std::ptr::eq(
            causal_splits_default(64),
            causal_splits_default(128)
        ));
        assert!(!valid_causal_table(&[]));
        assert!(!valid_causal_table(&[(0, 32)]));
        assert!(!valid_causal_table(&[(64, 128)]));
        assert!(!valid_causal_table(&[(0, 64), (0, 128)]));
        let p = |q_pos0, kv_pos0, window| AttnParams {
            n_q: 16,
            n_kv: 40_000,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            q_pos0,
            kv_pos0,
            causal: true,
            window,
            scale: 1.0,
        };
        assert_eq!(causal_keys(&p(100, 0, None), 0), 101);
        assert_eq!(causal_keys(&p(100, 0, None), 15), 116);
        assert_eq!(causal_keys(&p(100, 50, None), 0), 51);
        assert_eq!(causal_keys(&p(10, 50, None), 0), 0);
        assert_eq!(causal_keys(&p(40_000, 0, Some(2048)), 3), 2048);
        // A row's keys do not depend on the rows before it in the call.
        let v = p(32760, 0, None);
        for i in 0..16 {
            let alone = AttnParams {
                n_q: 1,
                q_pos0: v.q_pos0 + i,
                ..v
            };
            assert_eq!(causal_keys(&v, i), causal_keys(&alone, 0));
        }
    }

    /// Every launch of the tensor-core kernel fits the H100 / H200 shared memory (227 KB), and
    /// the stage choice prefers more resident blocks only where the grid needs them.
    #[test]
    fn tc_smem_fits() {
        // The stages chosen fit the block limit of an H200 (227 KiB) and, for every row-warp
        // count whose one-stage launch fits there, of sm_86 / sm_89 (99 KiB) and A100 (163 KiB).
        let small = [
            SmemLimits::SM90,
            SmemLimits {
                block: 163 * 1024,
                sm: 164 * 1024,
            },
            SmemLimits {
                block: 99 * 1024,
                sm: 100 * 1024,
            },
        ];
        for lim in small {
            for d in [32, 64, 128] {
                for kw in [2, 4] {
                    for rw in [1, 2, 4] {
                        for fl in [TcFlavor::Tf32, TcFlavor::Fpv, TcFlavor::H16] {
                            if tc_smem_bytes(d, kw, rw, 1, fl) > lim.block {
                                continue;
                            }
                            for blocks in [1, 96, 264, 528, 5000] {
                                let nst = tc_stages(d, kw, rw, fl, blocks, 132, lim);
                                assert!(
                                    tc_smem_bytes(d, kw, rw, nst, fl) <= lim.block,
                                    "d {d} kw {kw} rw {rw} {fl:?} limit {}",
                                    lim.block
                                );
                            }
                        }
                    }
                }
            }
        }
        // One row warp always fits on the small parts (the automatic row warps go down to it).
        for d in [32, 64, 128] {
            for kw in [2, 4] {
                assert!(
                    tc_smem_bytes(d, kw, 1, 1, TcFlavor::of(false)) <= 99 * 1024,
                    "d {d} kw {kw}"
                );
            }
        }
        let h = SmemLimits::SM90;
        assert_eq!(tc_smem_bytes(128, 4, 4, 2, TcFlavor::of(false)), 44544 * 4);
        // d 128, 4 key warps: one row warp, a grid that fits one wave either way: 3 stages;
        // 264 blocks (decode at ctx 8192): 1 stage, two blocks per multiprocessor, one wave.
        assert_eq!(tc_stages(128, 4, 1, TcFlavor::of(false), 96, 132, h), 3);
        assert_eq!(tc_blocks_per_sm(128, 4, 1, 1, TcFlavor::of(false), h), 2);
        assert_eq!(tc_stages(128, 4, 1, TcFlavor::of(false), 264, 132, h), 1);
        // The FA kernel (4 row warps, 195 registers: two blocks per multiprocessor at most):
        // 120 blocks (ctx 8192, one per SM) take 4 stages (139 KB); 264 blocks 3 (104 KB, two
        // per SM, one wave); 344 blocks 2 waves either way: 3; a part with 99 KB per block: 2.
        assert_eq!(
            tc_smem_bytes(128, 1, 4, 3, TcFlavor::Fa16Kv),
            3 * 2 * 64 * 136 * 2
        );
        let fa = TcFlavor::Fa16Kv;
        assert_eq!(fa_stages(128, 4, 195, 120, 132, h, fa), 4);
        assert_eq!(fa_stages(128, 4, 195, 264, 132, h, fa), 3);
        assert_eq!(fa_stages(128, 4, 195, 344, 132, h, fa), 3);
        // The wgmma twin's unpadded stages (32 KB each): 5 for one block per SM; 264 blocks at
        // 168 registers (3 per SM by registers, 2 by 3 stages' 96 KB): 3.
        let wg = TcFlavor::Wg16Kv;
        assert_eq!(tc_smem_bytes(128, 1, 4, 4, wg), 4 * 32768 + 1024);
        assert_eq!(fa_stages(128, 4, 168, 120, 132, h, wg), 5);
        assert_eq!(fa_stages(128, 4, 168, 264, 132, h, wg), 3);
        for lim in small {
            for blocks in [1, 120, 264, 5000] {
                for fl in [fa, wg] {
                    let nst = fa_stages(128, 4, 195, blocks, 132, lim, fl);
                    assert!(tc_smem_bytes(128, 1, 4, nst, fl) <= lim.block);
                }
            }
        }
        // The wgmma kernel exists where the attention module is compiled for sm_90a.
        assert_eq!(wg_kernel(128, "sm_90"), Some(Kernel::AttnWg16KvD128));
        assert_eq!(wg_kernel(64, "sm_90"), None);
        assert_eq!(wg_kernel(128, "sm_80"), None);
        assert_eq!(wg_kernel(128, "sm_100"), None);
        // 4 row warps (512 threads: one block per multiprocessor by registers): 2 stages (3
        // would not fit).
        assert_eq!(tc_stages(128, 4, 4, TcFlavor::of(false), 264, 132, h), 2);
        // 2 key warps x 4 row warps: two blocks per multiprocessor with 1 or 2 stages: 2.
        assert_eq!(tc_stages(128, 2, 4, TcFlavor::of(false), 264, 132, h), 2);
        // 2 row warps (ctx 2048, 16 queries: 144 blocks): 3 stages (fit, one block per
        // multiprocessor either way), not 1 (measured 36.8 us vs 39.6).
        assert_eq!(tc_stages(128, 4, 2, TcFlavor::of(false), 144, 132, h), 3);
        // The f16 kernel, d 128: 64 query rows (the one-wave rule at ctx 8192) take 2 staging
        // slots (3 would not fit), one row warp (ctx 512) 2 as well (Q 16 rows + K / V tiles
        // 34816 bytes + 2 x 65536).
        assert_eq!(tc_stages(128, 4, 4, TcFlavor::H16, 120, 132, h), 2);
        assert_eq!(
            tc_smem_bytes(128, 4, 1, 2, TcFlavor::H16),
            144 * 136 * 2 + 2 * 65536
        );
        assert_eq!(tc_stages(128, 4, 1, TcFlavor::H16, 96, 132, h), 2);
    }
}
