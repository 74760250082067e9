//! The CPU reference backend: f32 math, rayon across output panels / rows / kv heads (only
//! above a work threshold: small ops run on the calling thread), AVX-512 / AVX2 kernels chosen
//! at run time with a portable fallback.
//!
//! * `matmul`: weights are repacked at upload in panels of 16 output features (same memory
//!   as the host data: f32 / bf16 / f16 values as they are, q8_0 / q4_0 codes with f32 block
//!   scales), widened or dequantized in registers. Each output element is one sequential FMA
//!   chain over the inner dimension, so its bits depend neither on the other rows of the call
//!   (per-row determinism) nor on the thread count nor on the instruction set; a quantized
//!   weight gives exactly the f32 matmul of its dequantized values. One row reads each weight
//!   once (memory bound); 16 rows run register tiles of 8 rows x 48 outputs (compute bound,
//!   near the FMA peak).
//! * `matmul` on [`WeightFormat::Q8_0A8`] and [`WeightFormat::Q4_0A8`] (see `a8panel`; q4_0
//!   through its widened q8_0 codes): each row of `x` quantized to q8_0
//!   once per call (reused thread-local buffers), exact int32 block dots with AVX-512 VNNI
//!   `vpdpbusd` when the CPU has it (`Isa::Avx512` + [`vnni_supported`]), else AVX2 `vpmaddwd`
//!   on the codes widened to 16 bits (`Isa::Avx2Fma` or `Isa::Avx512` + [`avx2_supported`];
//!   on a 2-core AMD EPYC without AVX-512 the README's main command went from 0.08x to
//!   its speedup of the VNNI machines), a portable integer
//!   loop otherwise, then the f32 block accumulation of the format's contract: identical bits
//!   on every path, thread count and tiling (up to 8 rows x 16 outputs per tile, ~190 G MAC/s
//!   on the 2-core Sapphire Rapids vs ~70 for the f32 tiles).
//! * `attention`: per kv head, scores by query x key tiles (each with the bits of one fixed
//!   order dot product), softmax (vectorised exp, same bits on every path), values accumulated
//!   by one FMA chain per output element with the value loads shared by blocks of queries.
//!   A query's output depends only on its own position and keys. `attention_fast_kv16` is the
//!   same code over an f16 cache: the AVX-512 kernels widen the values as they load them (up
//!   to 32 query rows per kv head), else each key block is widened once into a small buffer;
//!   the widening is exact, so the bits are those of the f32 attention over the f16 values.
//!
//! Buffers are `Vec<f32>`. A buffer may be longer than what an op reads or writes (scratch
//! reuse); the ops check that every operand is long enough and name it when it is not.

mod a8panel;
mod argmax;
mod kernel;
mod panel;
mod qpanel;

use std::sync::{Arc, Mutex};

use dflash_quant::QK;
use rayon::prelude::*;

pub use a8panel::{avx2_supported, vnni_supported};
pub use kernel::Isa;

use crate::{
    check_f16_range, check_f16_rows, f16_pair_bits, f16_pair_values, AttnParams, Backend,
    BackendError, DeltaParams, HostData, HostWeight, Result, RopeSpec, Weight, WeightFormat,
};

/// The CPU backend. `Cpu::default()` uses rayon's global pool and the best instruction set
/// of the machine.
#[derive(Clone, Debug)]
pub struct Cpu {
    pool: Option<Arc<rayon::ThreadPool>>,
    isa: Isa,
    par_min_work: usize,
    rope_cache: Arc<Mutex<Vec<RopeCache>>>,
}

/// cos / sin of the RoPE pairs for positions `0 .. table.len() / half` of one spec.
#[derive(Debug)]
struct RopeCache {
    inv_freq: Vec<u32>,
    scaling: u32,
    table: Vec<(f32, f32)>,
}

/// Positions beyond this are computed on the fly rather than cached.
const ROPE_CACHE_POSITIONS: usize = 1 << 16;
/// Specs remembered (drafter and target may differ).
const ROPE_CACHE_SPECS: usize = 4;

/// `(cos, sin) * attention_scaling` of each pair at `pos`, in f32 as transformers computes them.
fn rope_row(spec: &RopeSpec, pos: usize) -> Vec<(f32, f32)> {
    let p = pos as f32;
    spec.inv_freq
        .iter()
        .map(|&f| {
            let a = p * f;
            (
                a.cos() * spec.attention_scaling,
                a.sin() * spec.attention_scaling,
            )
        })
        .collect()
}

impl Default for Cpu {
    fn default() -> Self {
        Cpu {
            pool: None,
            par_min_work: PAR_MIN_WORK,
            rope_cache: Arc::default(),
            isa: Isa::detect(),
        }
    }
}

impl Cpu {
    /// Same as `Cpu::default()`.
    pub fn new() -> Self {
        Self::default()
    }

    /// A backend running on its own rayon pool of `threads` threads (`0` = rayon's default).
    pub fn with_threads(threads: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("dflash-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::Device(Box::new(e)))?;
        Ok(Cpu {
            pool: Some(Arc::new(pool)),
            par_min_work: PAR_MIN_WORK,
            rope_cache: Arc::default(),
            isa: Isa::detect(),
        })
    }

    /// Force an instruction set (tests compare them). Asking for one the CPU lacks is an error.
    pub fn with_isa(mut self, isa: Isa) -> Result<Self> {
        if !isa.supported() {
            return Err(BackendError::Invalid {
                op: "with_isa",
                msg: format!("{isa:?} is not supported by this CPU"),
            });
        }
        self.isa = isa;
        Ok(self)
    }

    /// Run ops on the pool only above `work` multiply-adds (default 131072; 0 = always, which
    /// tests use to exercise the parallel paths on small shapes). Results do not depend on it.
    pub fn with_par_min_work(mut self, work: usize) -> Self {
        self.par_min_work = work;
        self
    }

    /// The instruction set the kernels use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Threads the backend's parallel ops use.
    pub fn threads(&self) -> usize {
        match &self.pool {
            Some(p) => p.current_num_threads().max(1),
            None => rayon::current_num_threads().max(1),
        }
    }

    /// `f(i, row)` over `data.chunks_mut(width)`, on the rayon pool when `work` (a rough count
    /// of multiply-adds) pays for the threads, on the calling thread otherwise. Every row is
    /// computed the same way either way.
    fn for_rows(
        &self,
        data: &mut [f32],
        width: usize,
        work: usize,
        f: impl Fn(usize, &mut [f32]) + Sync + Send,
    ) {
        if width == 0 {
            return;
        }
        if self.threads() <= 1 || work < self.par_min_work || data.len() <= width {
            data.chunks_mut(width)
                .enumerate()
                .for_each(|(i, c)| f(i, c));
        } else {
            self.install(|| {
                data.par_chunks_mut(width)
                    .enumerate()
                    .for_each(|(i, c)| f(i, c))
            });
        }
    }

    /// The cached (cos, sin) rows of positions `pos0 .. pos0 + rows` (`rows * half` pairs),
    /// or `None` when they fall outside the cache (computed per row then: same values).
    fn rope_table(&self, spec: &RopeSpec, pos0: usize, rows: usize) -> Option<Vec<(f32, f32)>> {
        let end = pos0.checked_add(rows)?;
        if end > ROPE_CACHE_POSITIONS {
            return None;
        }
        let half = spec.inv_freq.len();
        let key: Vec<u32> = spec.inv_freq.iter().map(|f| f.to_bits()).collect();
        let scaling = spec.attention_scaling.to_bits();
        let mut caches = self.rope_cache.lock().ok()?;
        let idx = match caches
            .iter()
            .position(|c| c.inv_freq == key && c.scaling == scaling)
        {
            Some(i) => i,
            None => {
                if caches.len() >= ROPE_CACHE_SPECS {
                    caches.remove(0);
                }
                caches.push(RopeCache {
                    inv_freq: key,
                    scaling,
                    table: Vec::new(),
                });
                caches.len() - 1
            }
        };
        let c = &mut caches[idx];
        let have = c.table.len() / half.max(1);
        if have < end {
            // Grow in steps so that decoding one position at a time stays cheap.
            let target = end.max(have * 2).clamp(256, ROPE_CACHE_POSITIONS);
            for pos in have..target {
                c.table.extend(rope_row(spec, pos));
            }
        }
        Some(c.table[pos0 * half..end * half].to_vec())
    }

    /// Run `f` on one of the backend's pool threads (its own pool, or rayon's global one for
    /// `Cpu::default()`), so that every parallel op `f` calls forks and joins inside the pool.
    /// Called from any other thread, each parallel op is handed to the pool and the caller
    /// sleeps until it is done: two thread wake-ups per op, which at the shipped pair's size
    /// (about 80 ops per forward, most well under a millisecond) costs more than the second
    /// core gives (`dflash bench --threads 2 --profile` on a 2-core AMD EPYC: a 1-row verify at
    /// ctx 156 takes 0.95 ms from outside the pool, 0.27-0.31 inside it, 0.38-0.42 on one
    /// thread). Drive a whole decode loop through this when the backend has more than one
    /// thread; with one thread it just calls `f`. Results never depend on the thread `f` runs
    /// on.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.threads() <= 1 {
            return f();
        }
        match &self.pool {
            Some(p) => p.install(f),
            None => rayon::scope(|_| f()),
        }
    }

    fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }
}

// ------------------------------------------------------------------------------------------
// shape helpers

/// `found >= expected`, or a shape error.
fn at_least(op: &'static str, operand: &'static str, expected: usize, found: usize) -> Result<()> {
    if found < expected {
        Err(BackendError::shape(op, operand, expected, found))
    } else {
        Ok(())
    }
}

fn exactly(op: &'static str, operand: &'static str, expected: usize, found: usize) -> Result<()> {
    if found != expected {
        Err(BackendError::shape(op, operand, expected, found))
    } else {
        Ok(())
    }
}

fn invalid(op: &'static str, msg: impl Into<String>) -> BackendError {
    BackendError::Invalid {
        op,
        msg: msg.into(),
    }
}

/// `a * b` with an error instead of an overflow.
fn mul(op: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| invalid(op, format!("size {a} x {b} overflows")))
}

fn mul3(op: &'static str, a: usize, b: usize, c: usize) -> Result<usize> {
    mul(op, mul(op, a, b)?, c)
}

/// `1 / (1 + e^-x)` with the backend's exp ([`kernel::exp_f32`], about 1 ulp).
#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + kernel::exp_f32(-x))
}

/// `x / (1 + e^-x)` with the backend's exp (the same bits as the vectorised `silu_mul`).
#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + kernel::exp_f32(-x))
}

/// torch's `softplus(x)` with beta 1 and threshold 20.
#[inline]
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Sum of squares with the kernels' fixed order.
#[inline]
fn sum_sq(isa: Isa, x: &[f32]) -> f32 {
    kernel::dot(isa, x, x)
}

// ------------------------------------------------------------------------------------------
// weights

/// A weight resident on the CPU backend: f32 / bf16 / f16 weights packed in panels of 16
/// output features (see `panel`), block formats as their blocks (dequantized a few rows at a
/// time inside `matmul`). Same memory as the host data, plus at most 15 padding rows.
#[derive(Debug)]
pub struct CpuWeight {
    data: Packed,
}

#[derive(Debug)]
enum Packed {
    F32(Vec<f32>),
    Bf16(Vec<panel::Bf16Bits>),
    /// bf16 in the step-pair layout of `panel::pack_bf16_pairs` (AVX-512 backends).
    Bf16Pairs(Vec<panel::Bf16Bits>),
    F16(Vec<panel::F16Bits>),
    /// q8_0 or q4_0.
    Quant(qpanel::QPanels),
    /// q8_0 (or q4_0 widened to q8_0) for the integer dot with quantized activations
    /// (Q8_0A8, Q4_0A8).
    A8(a8panel::A8Panels),
}

impl CpuWeight {
    /// Bytes of storage.
    pub fn bytes(&self) -> usize {
        match &self.data {
            Packed::F32(v) => 4 * v.len(),
            Packed::Bf16(v) | Packed::Bf16Pairs(v) => 2 * v.len(),
            Packed::F16(v) => 2 * v.len(),
            Packed::Quant(q) => q.bytes(),
            Packed::A8(q) => q.bytes(),
        }
    }

    fn format(&self) -> WeightFormat {
        match &self.data {
            Packed::F32(_) => WeightFormat::F32,
            Packed::Bf16(_) | Packed::Bf16Pairs(_) => WeightFormat::Bf16,
            Packed::F16(_) => WeightFormat::F16,
            Packed::Quant(q) if q.q4 => WeightFormat::Q4_0,
            Packed::Quant(_) => WeightFormat::Q8_0,
            Packed::A8(q) if q.q4 => WeightFormat::Q4_0A8,
            Packed::A8(_) => WeightFormat::Q8_0A8,
        }
    }

    /// Stored elements (values, or blocks for the block formats) expected for `[rows, cols]`.
    /// Values stored (with the padding of the last panel) expected for `[rows, cols]`.
    fn expected_len(&self, rows: usize, cols: usize) -> Option<usize> {
        rows.div_ceil(panel::NP)
            .checked_mul(panel::NP)?
            .checked_mul(cols)
    }

    fn stored_len(&self) -> usize {
        match &self.data {
            Packed::F32(v) => v.len(),
            Packed::Bf16(v) | Packed::Bf16Pairs(v) => v.len(),
            Packed::F16(v) => v.len(),
            Packed::Quant(q) => q.n_values(),
            Packed::A8(q) => q.n_values(),
        }
    }
}

/// Row `o` of any weight, decoded into `out` (`cols` values).
fn decode_row(data: &Packed, cols: usize, o: usize, out: &mut [f32]) {
    match data {
        Packed::F32(v) => panel::unpack_row(v, cols, o, out),
        Packed::Bf16(v) => panel::unpack_row(v, cols, o, out),
        Packed::Bf16Pairs(v) => panel::unpack_row_bf16_pairs(v, cols, o, out),
        Packed::F16(v) => panel::unpack_row(v, cols, o, out),
        Packed::Quant(q) => q.unpack_row(cols, o, out),
        Packed::A8(q) => q.unpack_row(cols, o, out),
    }
}

/// Below this many multiply-adds a matmul runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 17;

fn check_host_data(w: &HostWeight) -> Result<()> {
    let fmt = w.data.format();
    let blocks = fmt.is_block();
    if blocks && !w.cols.is_multiple_of(QK) {
        return Err(BackendError::Weight(format!(
            "{}: {fmt:?} needs rows whose length is a multiple of {QK}, found {}",
            w.name, w.cols
        )));
    }
    let n = w
        .rows
        .checked_mul(w.cols)
        .ok_or_else(|| BackendError::Weight(format!("{}: size overflows", w.name)))?;
    if w.data.n_values() != n {
        return Err(BackendError::Weight(format!(
            "{}: expected {}x{} = {n} values, found {}",
            w.name,
            w.rows,
            w.cols,
            w.data.n_values()
        )));
    }
    Ok(())
}

/// Checks that a weight's storage matches its declared shape (a `Weight` has public fields).
fn check_weight(op: &'static str, w: &Weight<Cpu>) -> Result<()> {
    if w.buf.format() != w.format {
        return Err(invalid(
            op,
            format!(
                "{}: declared {:?}, stored {:?}",
                w.name,
                w.format,
                w.buf.format()
            ),
        ));
    }
    if w.format.is_block() && !w.cols.is_multiple_of(QK) {
        return Err(invalid(
            op,
            format!("{}: {:?} with {} columns", w.name, w.format, w.cols),
        ));
    }
    let n = w
        .buf
        .expected_len(w.rows, w.cols)
        .ok_or_else(|| invalid(op, format!("{}: size overflows", w.name)))?;
    exactly(op, "weight", n, w.buf.stored_len())
}

/// A K or V cache as the attention reads it: rows of `n_kv_heads * head_dim` values.
#[derive(Clone, Copy)]
enum KvCache<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// f16 values ([`crate::KvStorage::F16`] read little-endian: value `2 i` is the low half of
    /// f32 slot `i`).
    F16(&'a [half::f16]),
}

impl<'a> KvCache<'a> {
    /// Values stored.
    fn len(self) -> usize {
        match self {
            KvCache::F32(b) => b.len(),
            KvCache::F16(h) => h.len(),
        }
    }

    /// Keys `b0 .. b1` of kv head `g` (`hd` values at `g * hd` in rows of `stride`) as the
    /// kernels read them: the cache itself (f32, or f16 when `direct` ([`KvCache::direct`]):
    /// the kernels widen it as they load it), else the f16 rows widened (exactly) into
    /// `scratch`. The caller keeps keys `b0 .. b1` within the cache and `hd > 0`.
    #[allow(clippy::too_many_arguments)]
    fn block<'s>(
        self,
        isa: Isa,
        direct: bool,
        g: usize,
        hd: usize,
        stride: usize,
        (b0, b1): (usize, usize),
        scratch: &'s mut Vec<f32>,
    ) -> KvView<'s>
    where
        'a: 's,
    {
        match self {
            KvCache::F32(buf) => KvView::F32(KvBlock {
                buf,
                stride,
                off: g * hd,
                base: 0,
            }),
            KvCache::F16(buf) => {
                let h = KvBlock {
                    buf,
                    stride,
                    off: g * hd,
                    base: 0,
                };
                if direct {
                    KvView::F16(h)
                } else {
                    KvView::F32(h.widen(isa, hd, b0, b1, scratch))
                }
            }
        }
    }

    /// Whether the kernels read f16 keys / values straight from the cache (widening 16 per
    /// load) rather than from blocks widened once: only the AVX-512 kernels can (the score
    /// strips for `hd` a multiple of 16), and it pays only while few query tiles (of up to 4
    /// rows) re-read, so re-widen, each key: `m` query rows per kv head. Measured on a 2-vCPU
    /// Zen 4 EPYC (`matmul_perf`'s `attention_kv16_vs_f32`, f16 us / f32 us, 1 and 2 threads,
    /// ctx 512 and 2048): read directly 0.64-1.10 at m <= 8 where widened blocks gave
    /// 1.2-1.6; at m = 16 0.81-1.10 against 0.94-1.17; at m = 32 within 4% of each other
    /// either way (direct better at heads of 128); at m = 64 direct 1.10 against 1.03 at
    /// heads of 64.
    fn direct(isa: Isa, hd: usize, m: usize) -> bool {
        isa == Isa::Avx512 && hd.is_multiple_of(16) && m <= 32
    }
}

/// The rows of one kv head for keys `base ..`: key `j` = `buf[at(j) ..][.. hd]`.
#[derive(Clone, Copy)]
struct KvBlock<'a, T> {
    buf: &'a [T],
    stride: usize,
    off: usize,
    base: usize,
}

impl<T> KvBlock<'_, T> {
    /// Where key `j` (`j >= base`) starts in `buf`.
    fn at(&self, j: usize) -> usize {
        self.off + (j - self.base) * self.stride
    }
}

impl KvBlock<'_, half::f16> {
    /// Keys `j0 .. j1` widened into `scratch` (grown if shorter than `(j1 - j0) * hd`).
    fn widen<'s>(
        &self,
        isa: Isa,
        hd: usize,
        j0: usize,
        j1: usize,
        scratch: &'s mut Vec<f32>,
    ) -> KvBlock<'s, f32> {
        let n = (j1 - j0) * hd;
        if scratch.len() < n {
            scratch.resize(n, 0.0);
        }
        let dst = &mut scratch[..n];
        kernel::f16_rows_to_f32(isa, self.buf, self.at(j0), self.stride, hd, dst);
        KvBlock {
            buf: dst,
            stride: hd,
            off: 0,
            base: j0,
        }
    }
}

/// One kv head's keys (or values) of a block as the kernels read them.
#[derive(Clone, Copy)]
enum KvView<'a> {
    F32(KvBlock<'a, f32>),
    /// Widened in the kernels' loads (where [`KvCache::direct`]).
    F16(KvBlock<'a, half::f16>),
}

/// Queries per attention tile for `left` queries still to do (4, 2 or 1): the scores and the
/// values walk the queries in the same tiles.
fn query_tile(left: usize) -> usize {
    match left {
        4.. => 4,
        2..=3 => 2,
        _ => 1,
    }
}

/// Whole strips of `KN` keys from `bl` in one kernel call where the ISA has one (same bits
/// as [`kernel::dot_grid`]); how many keys it did.
#[allow(clippy::too_many_arguments)]
fn score_strip_of<const QN: usize, const KN: usize, T: kernel::KvElem>(
    isa: Isa,
    qs: [&[f32]; QN],
    kv: KvBlock<'_, T>,
    bl: usize,
    bh: usize,
    scale: f32,
    sc: &mut [f32],
    rows: [usize; QN],
) -> usize {
    let (j0, j1) = (bl - kv.base, bh - kv.base);
    kernel::score_strip::<QN, KN, T>(isa, qs, kv.buf, kv.off, kv.stride, j0, j1, scale, sc, rows)
}

/// Scores of queries `u0 .. u0 + QN` against keys `bl .. bh`:
/// `sc[u * width + j - lo_all] = dot(q_u, k_j) * scale`, `QN x KN` at a time. Keys the strip
/// kernel leaves of an f16 view are widened into `tail`.
#[allow(clippy::too_many_arguments)]
fn score_tiles<'a, const QN: usize, const KN: usize>(
    isa: Isa,
    qrow: &impl Fn(usize) -> &'a [f32],
    kv: KvView<'_>,
    tail: &mut Vec<f32>,
    u0: usize,
    bl: usize,
    bh: usize,
    lo_all: usize,
    width: usize,
    scale: f32,
    sc: &mut [f32],
) {
    let qs: [&[f32]; QN] = std::array::from_fn(|d| qrow(u0 + d));
    let hd = qs[0].len();
    let rows: [usize; QN] = std::array::from_fn(|d| (u0 + d) * width + bl - lo_all);
    let done = match kv {
        KvView::F32(b) => score_strip_of::<QN, KN, f32>(isa, qs, b, bl, bh, scale, sc, rows),
        KvView::F16(b) => score_strip_of::<QN, KN, _>(isa, qs, b, bl, bh, scale, sc, rows),
    };
    let mut j = bl + done;
    if j >= bh {
        return;
    }
    let kv = match kv {
        KvView::F32(b) => b,
        KvView::F16(b) => b.widen(isa, hd, j, bh, tail),
    };
    let key = |j: usize| &kv.buf[kv.at(j)..][..hd];
    while j + KN <= bh {
        let t = kernel::dot_grid::<QN, KN>(isa, qs, std::array::from_fn(|d| key(j + d)));
        for (d, row) in t.iter().enumerate() {
            let base = (u0 + d) * width + j - lo_all;
            for (s, &v) in sc[base..base + KN].iter_mut().zip(row) {
                *s = v * scale;
            }
        }
        j += KN;
    }
    for jj in j..bh {
        for (d, qv) in qs.iter().enumerate() {
            sc[(u0 + d) * width + jj - lo_all] = kernel::dot(isa, qv, key(jj)) * scale;
        }
    }
}

/// What the attention output accumulation of one kv head reads.
struct PvCtx<'a> {
    isa: Isa,
    /// Normalised weights, `[m, width]` over keys `lo_all ..`.
    sc: &'a [f32],
    width: usize,
    lo_all: usize,
    /// Visible keys of each query.
    ranges: &'a [(usize, usize)],
    hd: usize,
}

impl PvCtx<'_> {
    /// Weights of query `u` for keys `a .. b`.
    fn w(&self, u: usize, a: usize, b: usize) -> &[f32] {
        &self.sc[u * self.width + a - self.lo_all..u * self.width + b - self.lo_all]
    }

    /// One query alone over keys `a .. b` (values `v`), continuing its accumulation in `o`.
    fn one<T: kernel::KvElem>(
        &self,
        v: KvBlock<'_, T>,
        u: usize,
        o: &mut [f32],
        a: usize,
        b: usize,
    ) {
        if a < b {
            let w = self.w(u, a, b);
            kernel::weighted_acc::<1, T>(self.isa, [o], [w], v.buf, v.at(a), v.stride);
        }
    }

    /// Queries `u0 .. u0 + QN` (outputs `out`, `[QN, hd]`) over their visible keys within
    /// `b0 .. b1` (values `v`, holding these keys): each one continues a single sequential FMA
    /// chain over its keys in order, the common keys processed jointly (shared loads).
    fn block<const QN: usize>(
        &self,
        v: KvView<'_>,
        u0: usize,
        out: &mut [f32],
        b0: usize,
        b1: usize,
    ) {
        match v {
            KvView::F32(v) => self.block_of::<QN, f32>(v, u0, out, b0, b1),
            KvView::F16(v) => self.block_of::<QN, _>(v, u0, out, b0, b1),
        }
    }

    fn block_of<const QN: usize, T: kernel::KvElem>(
        &self,
        v: KvBlock<'_, T>,
        u0: usize,
        out: &mut [f32],
        b0: usize,
        b1: usize,
    ) {
        let rs: [(usize, usize); QN] = std::array::from_fn(|d| {
            let (lo, hi) = self.ranges[u0 + d];
            (lo.max(b0), hi.min(b1))
        });
        let c_lo = rs.iter().map(|r| r.0).max().unwrap_or(0);
        let c_hi = rs.iter().map(|r| r.1).min().unwrap_or(0);
        let mut it = out.chunks_exact_mut(self.hd);
        let mut os: [&mut [f32]; QN] = std::array::from_fn(|_| it.next().unwrap_or_default());
        if QN == 1 || c_lo >= c_hi || rs.iter().any(|r| r.0 >= r.1) {
            for (d, o) in os.iter_mut().enumerate() {
                self.one(v, u0 + d, o, rs[d].0, rs[d].1);
            }
            return;
        }
        for (d, o) in os.iter_mut().enumerate() {
            self.one(v, u0 + d, o, rs[d].0, c_lo);
        }
        let ws: [&[f32]; QN] = std::array::from_fn(|d| self.w(u0 + d, c_lo, c_hi));
        {
            let joint: [&mut [f32]; QN] = os.each_mut().map(|o| &mut **o);
            kernel::weighted_acc::<QN, T>(self.isa, joint, ws, v.buf, v.at(c_lo), v.stride);
        }
        for (d, o) in os.iter_mut().enumerate() {
            self.one(v, u0 + d, o, c_hi, rs[d].1);
        }
    }
}

impl Cpu {
    /// [`Backend::attention`] over K and V stored as `k` / `v` (the one implementation of the
    /// f32 and the f16 cache).
    fn attention_on(
        &self,
        op: &'static str,
        q: &[f32],
        k: KvCache<'_>,
        v: KvCache<'_>,
        p: &AttnParams,
        out: &mut [f32],
    ) -> Result<()> {
        if p.n_heads == 0 || p.n_kv_heads == 0 || p.head_dim == 0 {
            return Err(invalid(
                op,
                "n_heads, n_kv_heads and head_dim must be positive",
            ));
        }
        if !p.n_heads.is_multiple_of(p.n_kv_heads) {
            return Err(invalid(
                op,
                format!(
                    "n_heads {} is not a multiple of n_kv_heads {}",
                    p.n_heads, p.n_kv_heads
                ),
            ));
        }
        if p.window == Some(0) {
            return Err(invalid(op, "window of 0"));
        }
        let hd = p.head_dim;
        let qw = mul(op, p.n_heads, hd)?;
        let kw = mul(op, p.n_kv_heads, hd)?;
        at_least(op, "q", mul(op, p.n_q, qw)?, q.len())?;
        at_least(op, "k", mul(op, p.n_kv, kw)?, k.len())?;
        at_least(op, "v", mul(op, p.n_kv, kw)?, v.len())?;
        at_least(op, "out", mul(op, p.n_q, qw)?, out.len())?;
        let group = p.n_heads / p.n_kv_heads;
        let isa = self.isa;
        let p = *p;
        let stride = kw;
        // Visible keys of query i: one contiguous range of j.
        let range = |i: usize| p.visible_keys(i);
        // The queries of one kv head: u = i * group + hh reads head g * group + hh.
        let m = p.n_q * group;
        let head = |g: usize| -> Vec<f32> {
            let mut res = vec![0.0f32; m * hd];
            let ranges: Vec<(usize, usize)> = (0..m).map(|u| range(u / group)).collect();
            let span = |us: std::ops::Range<usize>| {
                ranges[us]
                    .iter()
                    .filter(|r| r.0 < r.1)
                    .fold((usize::MAX, 0), |a, r| (a.0.min(r.0), a.1.max(r.1)))
            };
            let (lo_all, hi_all) = span(0..m);
            if lo_all >= hi_all {
                return res;
            }
            let width = hi_all - lo_all;
            let ones = vec![1.0f32; width];
            let qrow =
                |u: usize| &q[((u / group) * p.n_heads + g * group + u % group) * hd..][..hd];
            // Keys are visited in blocks of about 24 KiB of K (or V) so that a block stays in
            // L1 while every query of the head reads it. This is only a loop order: each score
            // has the bits of one `dot`, and each output element is one FMA chain over its keys
            // in increasing order (continued across blocks), whatever the block size.
            let kblock = (6144 / hd).max(16) / 16 * 16;
            // Widened f16 rows (where the kernels do not read them from the cache): those of
            // the block being read, and the keys the score strips leave.
            let (mut scratch, mut tail) = (Vec::new(), Vec::new());
            let direct = KvCache::direct(isa, hd, m);
            let blocks = || {
                (lo_all..hi_all)
                    .step_by(kblock)
                    .map(move |b0| (b0, (b0 + kblock).min(hi_all)))
            };
            // Scores: tiles of queries x keys (each score has the bits of one `dot`).
            let mut sc = vec![0.0f32; m * width];
            for (b0, b1) in blocks() {
                let kvs = k.block(isa, direct, g, hd, stride, (b0, b1), &mut scratch);
                let mut u = 0;
                while u < m {
                    let qn = query_tile(m - u);
                    let (bl, bh) = span(u..u + qn);
                    let (bl, bh) = (bl.max(b0), bh.min(b1));
                    if bl < bh {
                        match qn {
                            4 => score_tiles::<4, 4>(
                                isa, &qrow, kvs, &mut tail, u, bl, bh, lo_all, width, p.scale,
                                &mut sc,
                            ),
                            2 => score_tiles::<2, 8>(
                                isa, &qrow, kvs, &mut tail, u, bl, bh, lo_all, width, p.scale,
                                &mut sc,
                            ),
                            _ => score_tiles::<1, 16>(
                                isa, &qrow, kvs, &mut tail, u, bl, bh, lo_all, width, p.scale,
                                &mut sc,
                            ),
                        }
                    }
                    u += qn;
                }
            }
            // Softmax per query over its visible keys.
            for (u, &(lo, hi)) in ranges.iter().enumerate() {
                if lo >= hi {
                    continue;
                }
                let scores = &mut sc[u * width + lo - lo_all..u * width + hi - lo_all];
                // max, subtract, exp, sum with the dot kernel's fixed order (x * 1 + acc is
                // exact addition), normalise
                kernel::softmax_in_place(isa, scores, &ones);
            }
            // Weights times values, queries in the same blocks as the scores.
            let pv = PvCtx {
                isa,
                sc: &sc,
                width,
                lo_all,
                ranges: &ranges,
                hd,
            };
            for (b0, b1) in blocks() {
                let vs = v.block(isa, direct, g, hd, stride, (b0, b1), &mut scratch);
                let mut u = 0;
                while u < m {
                    let qn = query_tile(m - u);
                    let block = &mut res[u * hd..(u + qn) * hd];
                    match qn {
                        4 => pv.block::<4>(vs, u, block, b0, b1),
                        2 => pv.block::<2>(vs, u, block, b0, b1),
                        _ => pv.block::<1>(vs, u, block, b0, b1),
                    }
                    u += qn;
                }
            }
            res
        };
        let work = m
            .saturating_mul(p.n_kv)
            .saturating_mul(hd)
            .saturating_mul(p.n_kv_heads);
        let per_head: Vec<Vec<f32>> =
            if self.threads() <= 1 || p.n_kv_heads == 1 || work < self.par_min_work {
                (0..p.n_kv_heads).map(head).collect()
            } else {
                self.install(|| (0..p.n_kv_heads).into_par_iter().map(head).collect())
            };
        for (g, res) in per_head.iter().enumerate() {
            for (u, r) in res.chunks_exact(hd).enumerate() {
                let (i, h) = (u / group, g * group + u % group);
                out[(i * p.n_heads + h) * hd..][..hd].copy_from_slice(r);
            }
        }
        Ok(())
    }
}

// ------------------------------------------------------------------------------------------

impl Backend for Cpu {
    type Buf = Vec<f32>;
    type WeightBuf = CpuWeight;

    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn zeros(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn upload(&self, host: &[f32]) -> Result<Vec<f32>> {
        Ok(host.to_vec())
    }

    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(buf.clone())
    }

    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn upload_weight(&self, w: &HostWeight) -> Result<Weight<Self>> {
        check_host_data(w)?;
        let (rows, cols) = (w.rows, w.cols);
        let data = match &w.data {
            HostData::F32(v) => Packed::F32(panel::pack(v, rows, cols)),
            HostData::Bf16(v) => {
                let bits: Vec<panel::Bf16Bits> = v.iter().map(|&b| panel::Bf16Bits(b)).collect();
                if self.isa == Isa::Avx512 {
                    Packed::Bf16Pairs(panel::pack_bf16_pairs(&bits, rows, cols))
                } else {
                    Packed::Bf16(panel::pack(&bits, rows, cols))
                }
            }
            HostData::F16(v) => {
                let bits: Vec<panel::F16Bits> = v.iter().map(|&b| panel::F16Bits(b)).collect();
                Packed::F16(panel::pack(&bits, rows, cols))
            }
            HostData::Q8_0(b) => Packed::Quant(qpanel::QPanels::pack_q8(b, rows, cols)),
            HostData::Q4_0(b) => Packed::Quant(qpanel::QPanels::pack_q4(b, rows, cols)),
            HostData::Q8_0A8(b) => Packed::A8(a8panel::A8Panels::pack(b, rows, cols)),
            HostData::Q4_0A8(b) => Packed::A8(a8panel::A8Panels::pack_q4(b, rows, cols)),
        };
        Ok(Weight {
            name: w.name.clone(),
            format: w.data.format(),
            rows,
            cols,
            buf: CpuWeight { data },
        })
    }

    /// In place (the trait's default goes through copies of the buffers).
    fn f16_pack(&self, src: &Vec<f32>, dst: &mut Vec<f32>, h0: usize, n: usize) -> Result<()> {
        check_f16_range("f16_pack", h0, n)?;
        at_least("f16_pack", "src", n, src.len())?;
        at_least("f16_pack", "dst (f32 slots)", (h0 + n) / 2, dst.len())?;
        for (d, p) in dst[h0 / 2..(h0 + n) / 2]
            .iter_mut()
            .zip(src[..n].chunks_exact(2))
        {
            *d = f32::from_bits(f16_pair_bits(p[0], p[1]));
        }
        Ok(())
    }

    /// In place (the trait's default goes through copies of the buffers).
    fn f16_unpack(&self, src: &Vec<f32>, h0: usize, n: usize, dst: &mut Vec<f32>) -> Result<()> {
        check_f16_range("f16_unpack", h0, n)?;
        at_least("f16_unpack", "src (f32 slots)", (h0 + n) / 2, src.len())?;
        at_least("f16_unpack", "dst", n, dst.len())?;
        for (d, s) in dst[..n].chunks_exact_mut(2).zip(&src[h0 / 2..(h0 + n) / 2]) {
            d.copy_from_slice(&f16_pair_values(s.to_bits()));
        }
        Ok(())
    }

    fn copy2d(
        &self,
        src: &Vec<f32>,
        src_off: usize,
        src_stride: usize,
        dst: &mut Vec<f32>,
        dst_off: usize,
        dst_stride: usize,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        const OP: &str = "copy2d";
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        if rows > 1 && cols > dst_stride {
            return Err(invalid(
                OP,
                format!("{cols} columns overlap rows of destination stride {dst_stride}"),
            ));
        }
        let src_end = mul(OP, rows - 1, src_stride)?
            .checked_add(src_off + cols)
            .ok_or_else(|| invalid(OP, "overflow"))?;
        let dst_end = mul(OP, rows - 1, dst_stride)?
            .checked_add(dst_off + cols)
            .ok_or_else(|| invalid(OP, "overflow"))?;
        at_least(OP, "src", src_end, src.len())?;
        at_least(OP, "dst", dst_end, dst.len())?;
        for r in 0..rows {
            let s = src_off + r * src_stride;
            let d = dst_off + r * dst_stride;
            dst[d..d + cols].copy_from_slice(&src[s..s + cols]);
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn matmul(
        &self,
        x: &Vec<f32>,
        rows: usize,
        w: &Weight<Self>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        const OP: &str = "matmul";
        check_weight(OP, w)?;
        let (k, n_out) = (w.cols, w.rows);
        at_least(OP, "x", mul(OP, rows, k)?, x.len())?;
        at_least(OP, "out", mul(OP, rows, n_out)?, out.len())?;
        if rows == 0 || n_out == 0 {
            return Ok(());
        }
        let x = &x[..rows * k];
        let isa = self.isa;
        let threads = self.threads();
        let work = rows.saturating_mul(n_out).saturating_mul(k);
        let serial = threads <= 1 || work < self.par_min_work;
        let data = &w.buf.data;
        // Q8_0A8: the rows of x quantized once, before the outputs are split.
        let qx = match data {
            Packed::A8(_) => {
                let mut q = a8panel::QRows::take();
                match q.quantize(&w.name, x, rows, k) {
                    Ok(()) => Some(q),
                    Err(e) => {
                        q.recycle();
                        return Err(e);
                    }
                }
            }
            _ => None,
        };
        // Threads take contiguous runs of panels.
        let n_panels = n_out.div_ceil(panel::NP);
        let chunk_p = if serial {
            n_panels
        } else {
            let unit = match data {
                Packed::A8(_) => 1,
                _ => panel::panel_unit(isa, rows),
            };
            // a quarter of the parallel threshold per chunk at least: threads the op has no
            // work for stay idle instead of shredding a small matrix into one-panel chunks
            let min_p = (self.par_min_work / 4).div_ceil((rows * k * panel::NP).max(1));
            n_panels.div_ceil(4 * threads).max(min_p).div_ceil(unit) * unit
        };
        let chunk_o = chunk_p * panel::NP;
        let run_chunk = |c: usize, ot: &mut [f32]| {
            let p0 = c * chunk_p;
            let p1 = (p0 + chunk_p).min(n_panels);
            match data {
                Packed::F32(v) => {
                    panel::matmul_panels(isa, x, rows, k, &panel::Dense(v), n_out, p0, p1, ot)
                }
                Packed::Bf16(v) => {
                    panel::matmul_panels(isa, x, rows, k, &panel::Dense(v), n_out, p0, p1, ot)
                }
                Packed::Bf16Pairs(v) => {
                    panel::matmul_panels(isa, x, rows, k, &panel::Bf16Pairs(v), n_out, p0, p1, ot)
                }
                Packed::F16(v) => {
                    panel::matmul_panels(isa, x, rows, k, &panel::Dense(v), n_out, p0, p1, ot)
                }
                Packed::Quant(q) => panel::matmul_panels(isa, x, rows, k, q, n_out, p0, p1, ot),
                Packed::A8(q) => {
                    if let Some(qx) = &qx {
                        a8panel::matmul_panels(isa, qx, q, n_out, p0, p1, ot)
                    }
                }
            }
        };
        // Each chunk writes `[rows, width]` for its outputs: with one chunk (or one row) that
        // is `out` itself.
        if serial || chunk_p >= n_panels {
            run_chunk(0, &mut out[..rows * n_out]);
        } else if rows == 1 {
            self.install(|| {
                out[..n_out]
                    .par_chunks_mut(chunk_o)
                    .enumerate()
                    .for_each(|(c, ot)| run_chunk(c, ot))
            });
        } else {
            let mut tmp = vec![0.0f32; rows * n_out];
            self.install(|| {
                tmp.par_chunks_mut(rows * chunk_o)
                    .enumerate()
                    .for_each(|(c, ot)| run_chunk(c, ot))
            });
            for (c, part) in tmp.chunks(rows * chunk_o).enumerate() {
                let o0 = c * chunk_o;
                let width = part.len() / rows;
                for (r, seg) in part.chunks_exact(width).enumerate() {
                    out[r * n_out + o0..][..width].copy_from_slice(seg);
                }
            }
        }
        if let Some(q) = qx {
            q.recycle();
        }
        Ok(())
    }

    fn gather_rows(&self, table: &Weight<Self>, ids: &[u32], out: &mut Vec<f32>) -> Result<()> {
        const OP: &str = "gather_rows";
        check_weight(OP, table)?;
        let cols = table.cols;
        at_least(OP, "out", mul(OP, ids.len(), cols)?, out.len())?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(BackendError::TokenOutOfRange {
                id,
                rows: table.rows,
            });
        }
        if cols == 0 {
            return Ok(());
        }
        for (&id, o) in ids.iter().zip(out.chunks_exact_mut(cols)) {
            decode_row(&table.buf.data, cols, id as usize, o);
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        dim: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        const OP: &str = "rms_norm";
        crate::rows_of(OP, x.len(), dim)?;
        exactly(OP, "w", dim, w.len())?;
        at_least(OP, "out", x.len(), out.len())?;
        let isa = self.isa;
        let n = x.len();
        self.for_rows(&mut out[..n], dim, 4 * n, |i, o| {
            let xr = &x[i * dim..(i + 1) * dim];
            let r = 1.0 / (sum_sq(isa, xr) / dim as f32 + eps).sqrt();
            for ((o, &xv), &wv) in o.iter_mut().zip(xr).zip(w.iter()) {
                *o = wv * (xv * r);
            }
        });
        Ok(())
    }

    fn rms_norm_gated(
        &self,
        x: &Vec<f32>,
        z: &Vec<f32>,
        w: &Vec<f32>,
        dim: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        const OP: &str = "rms_norm_gated";
        crate::rows_of(OP, x.len(), dim)?;
        exactly(OP, "w", dim, w.len())?;
        at_least(OP, "z", x.len(), z.len())?;
        at_least(OP, "out", x.len(), out.len())?;
        let isa = self.isa;
        let n = x.len();
        self.for_rows(&mut out[..n], dim, 16 * n, |i, o| {
            let xr = &x[i * dim..(i + 1) * dim];
            let zr = &z[i * dim..(i + 1) * dim];
            let r = 1.0 / (sum_sq(isa, xr) / dim as f32 + eps).sqrt();
            for (((o, &xv), &wv), &zv) in o.iter_mut().zip(xr).zip(w.iter()).zip(zr) {
                *o = (wv * (xv * r)) * silu(zv);
            }
        });
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        rows: usize,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        spec: &RopeSpec,
    ) -> Result<()> {
        const OP: &str = "rope";
        let rot = spec.rot_dim();
        if rot > head_dim {
            return Err(invalid(
                OP,
                format!("rot_dim {rot} exceeds head_dim {head_dim}"),
            ));
        }
        let width = mul(OP, n_heads, head_dim)?;
        at_least(OP, "x", mul(OP, rows, width)?, x.len())?;
        if rows == 0 || width == 0 || rot == 0 {
            return Ok(());
        }
        let half = rot / 2;
        let table = self.rope_table(spec, pos0, rows);
        self.for_rows(&mut x[..rows * width], width, rows * width * 4, |r, row| {
            let computed;
            let cs: &[(f32, f32)] = match &table {
                Some(t) => &t[r * half..(r + 1) * half],
                None => {
                    computed = rope_row(spec, pos0 + r);
                    &computed
                }
            };
            for head in row.chunks_exact_mut(head_dim) {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let x1 = head[i];
                    let x2 = head[i + half];
                    head[i] = x1 * c - x2 * s;
                    head[i + half] = x2 * c + x1 * s;
                }
            }
        });
        Ok(())
    }

    /// The f16 rows widened where the attention reads them: by the AVX-512 kernels as they
    /// load (a kv head of at most 32 query rows), else each kv head's rows
    /// of one key block (about 24 KiB of f32) into a small per-head buffer just before the f32
    /// kernels read it (F16C where the CPU has it); never a copy of the whole cache. The bits
    /// of the trait's default (unpack, then the exact attention): the widening is exact and the
    /// kernels, blocks and orders are those of [`Backend::attention`]. (Unpacking the whole
    /// cache for every call made the shipped pair's plain decode ~30% slower than with an f32
    /// cache.)
    fn attention_fast_kv16(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        p: &AttnParams,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        const OP: &str = "attention_fast_kv16";
        if cfg!(target_endian = "big") {
            // The slots' low halves are the even values: a little-endian reading.
            return crate::attention_fast_kv16_ops(self, q, k, v, p, out);
        }
        let kvw = mul(OP, p.n_kv_heads, p.head_dim)?;
        check_f16_rows(OP, kvw)?;
        let n = mul(OP, p.n_kv, kvw)?;
        at_least(OP, "k (f32 slots)", n / 2, k.len())?;
        at_least(OP, "v (f32 slots)", n / 2, v.len())?;
        let (kh, vh) = (bytemuck::cast_slice(k), bytemuck::cast_slice(v));
        self.attention_on(OP, q, KvCache::F16(kh), KvCache::F16(vh), p, out)
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        p: &AttnParams,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.attention_on("attention", q, KvCache::F32(k), KvCache::F32(v), p, out)
    }

    fn silu_mul(&self, gate: &Vec<f32>, up: &Vec<f32>, out: &mut Vec<f32>) -> Result<()> {
        const OP: &str = "silu_mul";
        let n = gate.len();
        at_least(OP, "up", n, up.len())?;
        at_least(OP, "out", n, out.len())?;
        const W: usize = 4096;
        let isa = self.isa;
        self.for_rows(&mut out[..n], W, 8 * n, |i, o| {
            let g = &gate[i * W..][..o.len()];
            let u = &up[i * W..][..o.len()];
            // e^-g vectorised, then the same expression as `silu` (identical bits).
            for (e, &gv) in o.iter_mut().zip(g) {
                *e = -gv;
            }
            kernel::exp_in_place(isa, o);
            for ((o, &gv), &uv) in o.iter_mut().zip(g).zip(u) {
                *o = (gv / (1.0 + *o)) * uv;
            }
        });
        Ok(())
    }

    fn add_assign(
        &self,
        dst: &mut Vec<f32>,
        dst_off: usize,
        src: &Vec<f32>,
        len: usize,
    ) -> Result<()> {
        const OP: &str = "add_assign";
        at_least(
            OP,
            "dst",
            dst_off
                .checked_add(len)
                .ok_or_else(|| invalid(OP, "overflow"))?,
            dst.len(),
        )?;
        at_least(OP, "src", len, src.len())?;
        for (d, s) in dst[dst_off..dst_off + len].iter_mut().zip(&src[..len]) {
            *d += *s;
        }
        Ok(())
    }

    fn scale(&self, x: &mut Vec<f32>, s: f32) -> Result<()> {
        for v in x.iter_mut() {
            *v *= s;
        }
        Ok(())
    }

    fn mul_sigmoid(&self, x: &mut Vec<f32>, gate: &Vec<f32>) -> Result<()> {
        at_least("mul_sigmoid", "gate", x.len(), gate.len())?;
        for (v, &g) in x.iter_mut().zip(gate.iter()) {
            *v *= sigmoid(g);
        }
        Ok(())
    }

    fn argmax_rows(&self, x: &Vec<f32>, row0: usize, rows: usize, cols: usize) -> Result<Vec<u32>> {
        const OP: &str = "argmax_rows";
        if rows > 0 && cols == 0 {
            return Err(invalid(OP, "argmax of rows of width 0"));
        }
        if cols > u32::MAX as usize {
            return Err(invalid(
                OP,
                format!("{cols} columns do not fit a u32 index"),
            ));
        }
        let end = row0
            .checked_add(rows)
            .ok_or_else(|| invalid(OP, "overflow"))?;
        at_least(OP, "x", mul(OP, end, cols)?, x.len())?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let rows_slice = &x[row0 * cols..end * cols];
        let isa = self.isa;
        let argmax = |row: &[f32]| argmax::argmax(isa, row) as u32;
        if rows == 1 || self.threads() <= 1 || rows * cols < self.par_min_work {
            return Ok(rows_slice.chunks(cols).map(argmax).collect());
        }
        Ok(self.install(|| rows_slice.par_chunks(cols).map(argmax).collect()))
    }

    fn causal_conv1d(
        &self,
        x: &Vec<f32>,
        t: usize,
        channels: usize,
        kernel: usize,
        w: &Vec<f32>,
        state: &mut Vec<f32>,
        out: &mut Vec<f32>,
        stash: Option<&mut Vec<f32>>,
    ) -> Result<()> {
        const OP: &str = "causal_conv1d";
        if kernel == 0 {
            return Err(invalid(OP, "kernel of 0"));
        }
        let c = channels;
        let sl = kernel - 1;
        let n = mul(OP, t, c)?;
        at_least(OP, "x", n, x.len())?;
        at_least(OP, "w", mul(OP, c, kernel)?, w.len())?;
        at_least(OP, "state", mul(OP, sl, c)?, state.len())?;
        at_least(OP, "out", n, out.len())?;
        if let Some(s) = &stash {
            at_least(OP, "stash", mul3(OP, t, sl, c)?, s.len())?;
        }
        // xpad = [state ; x], (sl + t) rows of c.
        let mut xpad = Vec::with_capacity((sl + t) * c);
        xpad.extend_from_slice(&state[..sl * c]);
        xpad.extend_from_slice(&x[..n]);
        if c > 0 && t > 0 {
            self.for_rows(&mut out[..n], c, n * kernel, |ti, orow| {
                for (ch, o) in orow.iter_mut().enumerate() {
                    let wc = &w[ch * kernel..(ch + 1) * kernel];
                    let mut acc = 0.0f32;
                    for (j, &wj) in wc.iter().enumerate() {
                        acc += wj * xpad[(ti + j) * c + ch];
                    }
                    *o = silu(acc);
                }
            });
        }
        if let Some(s) = stash {
            for ti in 0..t {
                s[ti * sl * c..(ti + 1) * sl * c]
                    .copy_from_slice(&xpad[(ti + 1) * c..(ti + 1 + sl) * c]);
            }
        }
        state[..sl * c].copy_from_slice(&xpad[t * c..(t + sl) * c]);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn gdn_gates(
        &self,
        a: &Vec<f32>,
        b: &Vec<f32>,
        a_log: &Vec<f32>,
        dt_bias: &Vec<f32>,
        n_heads: usize,
        g: &mut Vec<f32>,
        beta: &mut Vec<f32>,
    ) -> Result<()> {
        const OP: &str = "gdn_gates";
        if n_heads == 0 {
            return Err(invalid(OP, "n_heads is 0"));
        }
        if !a.len().is_multiple_of(n_heads) {
            return Err(invalid(
                OP,
                format!(
                    "a has {} values, not a multiple of n_heads {n_heads}",
                    a.len()
                ),
            ));
        }
        let n = a.len();
        at_least(OP, "b", n, b.len())?;
        exactly(OP, "a_log", n_heads, a_log.len())?;
        exactly(OP, "dt_bias", n_heads, dt_bias.len())?;
        at_least(OP, "g", n, g.len())?;
        at_least(OP, "beta", n, beta.len())?;
        for i in 0..n {
            let h = i % n_heads;
            g[i] = -a_log[h].exp() * softplus(a[i] + dt_bias[h]);
            beta[i] = sigmoid(b[i]);
        }
        Ok(())
    }

    fn gated_delta_rule(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        g: &Vec<f32>,
        beta: &Vec<f32>,
        p: &DeltaParams,
        state: &mut Vec<f32>,
        out: &mut Vec<f32>,
        stash: Option<&mut Vec<f32>>,
    ) -> Result<()> {
        const OP: &str = "gated_delta_rule";
        if p.n_k_heads == 0 || p.n_v_heads == 0 || p.dk == 0 || p.dv == 0 {
            return Err(invalid(OP, "head counts and head dims must be positive"));
        }
        if !p.n_v_heads.is_multiple_of(p.n_k_heads) {
            return Err(invalid(
                OP,
                format!(
                    "n_v_heads {} is not a multiple of n_k_heads {}",
                    p.n_v_heads, p.n_k_heads
                ),
            ));
        }
        let (t, nk, nv, dk, dv) = (p.t, p.n_k_heads, p.n_v_heads, p.dk, p.dv);
        at_least(OP, "q", mul3(OP, t, nk, dk)?, q.len())?;
        at_least(OP, "k", mul3(OP, t, nk, dk)?, k.len())?;
        at_least(OP, "v", mul3(OP, t, nv, dv)?, v.len())?;
        at_least(OP, "g", mul(OP, t, nv)?, g.len())?;
        at_least(OP, "beta", mul(OP, t, nv)?, beta.len())?;
        let ss = mul(OP, dk, dv)?;
        at_least(OP, "state", mul(OP, nv, ss)?, state.len())?;
        at_least(OP, "out", mul3(OP, t, nv, dv)?, out.len())?;
        if let Some(s) = &stash {
            at_least(OP, "stash", mul(OP, mul(OP, t, nv)?, ss)?, s.len())?;
        }
        let group = nv / nk;
        let isa = self.isa;
        let want_stash = stash.is_some();
        let norm = |x: &[f32], scale: f32| -> Vec<f32> {
            if p.qk_l2norm {
                let inv = 1.0 / (sum_sq(isa, x) + 1e-6).sqrt();
                x.iter().map(|&e| e * inv * scale).collect()
            } else {
                x.iter().map(|&e| e * scale).collect()
            }
        };
        // One task per value head: (per-token outputs [t, dv], per-token states [t, dk, dv]).
        let head = |h: usize, s: &mut [f32]| -> (Vec<f32>, Vec<f32>) {
            let kh = h / group;
            let mut o = vec![0.0f32; t * dv];
            let mut st = if want_stash {
                Vec::with_capacity(t * ss)
            } else {
                Vec::new()
            };
            let mut kv_mem = vec![0.0f32; dv];
            for ti in 0..t {
                let qn = norm(&q[(ti * nk + kh) * dk..][..dk], p.q_scale);
                let kn = norm(&k[(ti * nk + kh) * dk..][..dk], 1.0);
                let vt = &v[(ti * nv + h) * dv..][..dv];
                let decay = g[ti * nv + h].exp();
                let bt = beta[ti * nv + h];
                for e in s.iter_mut() {
                    *e *= decay;
                }
                kv_mem.fill(0.0);
                for (kk, srow) in s.chunks_exact(dv).enumerate() {
                    for (m, &e) in kv_mem.iter_mut().zip(srow) {
                        *m += e * kn[kk];
                    }
                }
                for (m, &vv) in kv_mem.iter_mut().zip(vt) {
                    *m = (vv - *m) * bt; // now delta
                }
                for (kk, srow) in s.chunks_exact_mut(dv).enumerate() {
                    for (e, &d) in srow.iter_mut().zip(kv_mem.iter()) {
                        *e += kn[kk] * d;
                    }
                }
                let ot = &mut o[ti * dv..(ti + 1) * dv];
                for (kk, srow) in s.chunks_exact(dv).enumerate() {
                    for (od, &e) in ot.iter_mut().zip(srow) {
                        *od += e * qn[kk];
                    }
                }
                if want_stash {
                    st.extend_from_slice(s);
                }
            }
            (o, st)
        };
        let per_head: Vec<(Vec<f32>, Vec<f32>)> =
            if self.threads() <= 1 || nv == 1 || t * nv * ss * 4 < self.par_min_work {
                state[..nv * ss]
                    .chunks_mut(ss)
                    .enumerate()
                    .map(|(h, s)| head(h, s))
                    .collect()
            } else {
                self.install(|| {
                    state[..nv * ss]
                        .par_chunks_mut(ss)
                        .enumerate()
                        .map(|(h, s)| head(h, s))
                        .collect()
                })
            };
        for (h, (o, _)) in per_head.iter().enumerate() {
            for ti in 0..t {
                out[(ti * nv + h) * dv..][..dv].copy_from_slice(&o[ti * dv..(ti + 1) * dv]);
            }
        }
        if let Some(s) = stash {
            for (h, (_, st)) in per_head.iter().enumerate() {
                for ti in 0..t {
                    s[(ti * nv + h) * ss..][..ss].copy_from_slice(&st[ti * ss..(ti + 1) * ss]);
                }
            }
        }
        Ok(())
    }
}
