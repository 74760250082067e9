//! [`WeightFormat::Q8_0A8`](crate::WeightFormat::Q8_0A8): q8_0 weights times activations
//! quantized to q8_0 at matmul time, with integer block dots (AVX-512 VNNI `vpdpbusd` where
//! the CPU has it, else AVX2 `vpmaddwd` on 16-bit codes, else a portable integer loop).
//!
//! Weight layout, in panels of 16 output features. Per panel `p` and 32-value block `b`
//! (`nb = k / 32` blocks per row, `pb = p nb + b`):
//! * `qs[pb 512 + g 64 + 4 j + t] = code(16p + j, 32b + 4g + t) + 128` as a byte
//!   (`g < 8`, `t < 4`): one 64-byte vector per group of 4 inputs, 4 consecutive inputs of one
//!   output per 32-bit lane, which is the unsigned operand of `vpdpbusd`;
//! * `d[pb 16 + j]`: the block scale of output `16p + j`, as f32 (exact from f16).
//!
//! Activations: each row of `x` is quantized with `dflash_quant::quantize_row_q8_0` (ggml's
//! bytes), giving per block the codes `q_x` (signed operand of `vpdpbusd`), the scale `d_x`
//! and `ncorr = -128 Σ q_x`. Since `Σ (q_w + 128) q_x + ncorr = Σ q_w q_x`, starting the
//! int32 accumulator at `ncorr` gives the exact block sum `isum` (`|isum| <= 32·128·127`, and
//! every intermediate fits in int32: `vpdpbusd` wraps, it never saturates).
//!
//! f32 part (the contract of the format, identical on every path): the blocks in chunks of
//! [`A8_CHUNK_BLOCKS`] (32), per chunk `c` a fresh chain
//! `acc_c = 0.0; for b in chunk c { acc_c = fma(isum_b as f32, d_w[b] * d_x[b], acc_c) }`, then
//! `out = acc_0 + acc_1 + ...` (plain f32 adds, in chunk order). `isum as f32` is exact
//! (`< 2^24`), and so is `d_w * d_x` (two f16 values: 22 significant bits, far from the f32
//! range limits), so the only roundings are the fused multiply-adds and the chunk adds: the
//! portable and VNNI kernels give identical bits, and a row's result depends on nothing but
//! that row (the quantization is per row, the tiles only share loads).

use std::cell::Cell;

use dflash_quant::{BlockQ4_0, BlockQ8_0, QK};

use super::kernel::Isa;
use super::panel::NP;
use crate::{BackendError, Result, A8_CHUNK_BLOCKS};

/// Bytes of codes per (panel, block).
const QB: usize = QK * NP;
/// Groups of 4 inputs per block.
const NG: usize = QK / 4;
/// Most rows of one tile (16-row tiles spill registers).
const MAX_R: usize = 8;

/// q8_0 weights repacked for the integer dot.
#[derive(Debug)]
pub(crate) struct A8Panels {
    pub d: Vec<f32>,
    pub qs: Vec<u8>,
    /// Packed from q4_0 blocks ([`WeightFormat::Q4_0A8`](crate::WeightFormat::Q4_0A8)):
    /// their widened codes, so the same kernels and the same bits.
    pub q4: bool,
}

impl A8Panels {
    /// q4_0 blocks through their q8_0 form ([`dflash_quant::widen_q4_0`]): the codes
    /// `code - 8` with the same scales, which is all the integer dot needs.
    pub fn pack_q4(blocks: &[BlockQ4_0], rows: usize, k: usize) -> A8Panels {
        let wide: Vec<BlockQ8_0> = blocks.iter().map(dflash_quant::widen_q4_0).collect();
        A8Panels {
            q4: true,
            ..A8Panels::pack(&wide, rows, k)
        }
    }

    pub fn pack(blocks: &[BlockQ8_0], rows: usize, k: usize) -> A8Panels {
        let nb = k / QK;
        let n_panels = rows.div_ceil(NP);
        let mut d = vec![0.0f32; n_panels * nb * NP];
        // Padding outputs: code 0 (byte 128) with scale 0.
        let mut qs = vec![128u8; n_panels * nb * QB];
        for o in 0..rows {
            let (p, j) = (o / NP, o % NP);
            for b in 0..nb {
                let blk = &blocks[o * nb + b];
                let pb = p * nb + b;
                d[pb * NP + j] = blk.d.to_f32();
                for (i, &q) in blk.qs.iter().enumerate() {
                    qs[pb * QB + (i / 4) * 64 + 4 * j + i % 4] = (q as u8) ^ 0x80;
                }
            }
        }
        A8Panels { d, qs, q4: false }
    }

    /// Values stored (including the padding): `n_panels * 16 * k`.
    pub fn n_values(&self) -> usize {
        self.d.len() * QK
    }

    pub fn bytes(&self) -> usize {
        4 * self.d.len() + self.qs.len()
    }

    /// Row `o`, dequantized exactly as q8_0 (`code as f32 * d`).
    pub fn unpack_row(&self, k: usize, o: usize, out: &mut [f32]) {
        let nb = k / QK;
        let (p, j) = (o / NP, o % NP);
        for (b, ob) in out.chunks_exact_mut(QK).take(nb).enumerate() {
            let pb = p * nb + b;
            let d = self.d[pb * NP + j];
            for (i, y) in ob.iter_mut().enumerate() {
                let byte = self.qs[pb * QB + (i / 4) * 64 + 4 * j + i % 4];
                *y = ((byte ^ 0x80) as i8) as f32 * d;
            }
        }
    }
}

/// Rows of `x` quantized to q8_0, unpacked for the kernels.
#[derive(Debug, Default)]
pub(crate) struct QRows {
    k: usize,
    rows: usize,
    blocks: Vec<BlockQ8_0>,
    /// `[rows, k]` codes.
    codes: Vec<i8>,
    /// `[rows, nb]` block scales as f32.
    dx: Vec<f32>,
    /// `[rows, nb]`: `-128 Σ codes of the block`.
    ncorr: Vec<i32>,
}

thread_local! {
    /// Reused quantization buffers (taken out while in use, so a nested call on the same
    /// thread, e.g. through rayon work stealing, simply allocates its own).
    static SCRATCH: Cell<Option<QRows>> = const { Cell::new(None) };
}

impl QRows {
    /// A buffer from the thread's scratch (or a new one), to hand back with [`QRows::recycle`].
    pub fn take() -> QRows {
        SCRATCH.with(|s| s.take()).unwrap_or_default()
    }

    pub fn recycle(self) {
        SCRATCH.with(|s| s.set(Some(self)));
    }

    /// Quantize rows `0 .. rows` of `x` (`[rows, k]`, `k` a multiple of 32). A non-finite
    /// value is an error (q8_0 cannot encode it).
    pub fn quantize(&mut self, weight: &str, x: &[f32], rows: usize, k: usize) -> Result<()> {
        let nb = k / QK;
        self.k = k;
        self.rows = rows;
        self.blocks.resize(rows * nb, bytemuck::Zeroable::zeroed());
        self.codes.resize(rows * k, 0);
        self.dx.resize(rows * nb, 0.0);
        self.ncorr.resize(rows * nb, 0);
        if k == 0 {
            return Ok(());
        }
        for (r, (xr, br)) in x
            .chunks_exact(k)
            .take(rows)
            .zip(self.blocks.chunks_exact_mut(nb))
            .enumerate()
        {
            dflash_quant::quantize_row_q8_0(xr, br).map_err(|e| BackendError::Invalid {
                op: "matmul",
                msg: format!("{weight} (Q8_0A8): row {r} of x cannot be quantized to q8_0: {e}"),
            })?;
        }
        for (((blk, dx), nc), codes) in self
            .blocks
            .iter()
            .zip(self.dx.iter_mut())
            .zip(self.ncorr.iter_mut())
            .zip(self.codes.chunks_exact_mut(QK))
        {
            *dx = blk.d.to_f32();
            codes.copy_from_slice(&blk.qs);
            *nc = -128 * blk.qs.iter().map(|&q| q as i32).sum::<i32>();
        }
        Ok(())
    }

    fn row(&self, r: usize) -> Row<'_> {
        let nb = self.k / QK;
        Row {
            codes: &self.codes[r * self.k..(r + 1) * self.k],
            dx: &self.dx[r * nb..(r + 1) * nb],
            ncorr: &self.ncorr[r * nb..(r + 1) * nb],
        }
    }
}

/// One quantized row.
#[derive(Clone, Copy)]
struct Row<'a> {
    codes: &'a [i8],
    dx: &'a [f32],
    ncorr: &'a [i32],
}

/// Whether the CPU has AVX-512 VNNI (the `Isa::Avx512` backend then uses it for Q8_0A8).
pub fn vnni_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU has AVX2 and FMA (the Q8_0A8 kernels' integer dot in 16-bit products
/// where AVX-512 VNNI is absent).
pub fn avx2_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

type Tile<const R: usize> = [[f32; NP]; R];

/// Where a row tile writes: `out[(r0 + r) * width + o - 16 p0]` for output `o` of tile row
/// `r`, outputs `16 p0 .. min(16 p1, n_out)`.
struct Dest<'a> {
    out: &'a mut [f32],
    width: usize,
    r0: usize,
    p0: usize,
    p1: usize,
    n_out: usize,
}

/// Rows `rows` (tile rows `r0 ..`) over panels `p0 .. p1`, written into `dst`.
fn row_tile<const R: usize>(isa: Isa, w: &A8Panels, rows: [Row<'_>; R], k: usize, dst: Dest<'_>) {
    let nb = k / QK;
    let Dest {
        out,
        width,
        r0,
        p0,
        p1,
        n_out,
    } = dst;
    let ok = p0 < p1
        && w.d.len() >= p1 * nb * NP
        && w.qs.len() >= p1 * nb * QB
        && n_out > (p1 - 1) * NP
        && width == (p1 * NP).min(n_out) - p0 * NP
        && out.len() >= (r0 + R) * width
        && rows
            .iter()
            .all(|r| r.codes.len() == k && r.dx.len() == nb && r.ncorr.len() == nb);
    if !ok {
        // Internal invariant (the caller passes whole panels and rows); NaN makes a breach
        // visible.
        if let Some(o) = out.get_mut(r0 * width..) {
            o.iter_mut().take(R * width).for_each(|v| *v = f32::NAN);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && vnni_supported() {
        // SAFETY: AVX-512F and AVX-512 VNNI were detected; the operands hold what the kernel
        // reads and writes (checked above).
        unsafe { vnni::row_tile::<R>(&w.d, &w.qs, rows, nb, out, width, r0, p0, p1, n_out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2Fma | Isa::Avx512) && avx2_supported() {
        // SAFETY: AVX2 and FMA were detected; the operands hold what the kernel reads and
        // writes (checked above).
        unsafe { avx2::row_tile::<R>(&w.d, &w.qs, rows, nb, out, width, r0, p0, p1, n_out) };
        return;
    }
    let _ = isa;
    for p in p0..p1 {
        let t = tile_portable::<R>(
            &w.d[p * nb * NP..(p + 1) * nb * NP],
            &w.qs[p * nb * QB..(p + 1) * nb * QB],
            rows,
            nb,
        );
        let o = p * NP;
        let n = NP.min(n_out - o);
        for (r, v) in t.iter().enumerate() {
            out[(r0 + r) * width + o - p0 * NP..][..n].copy_from_slice(&v[..n]);
        }
    }
}

fn tile_portable<const R: usize>(ds: &[f32], qs: &[u8], rows: [Row<'_>; R], nb: usize) -> Tile<R> {
    let mut tot = [[0.0f32; NP]; R];
    for c0 in (0..nb).step_by(A8_CHUNK_BLOCKS) {
        let mut acc = [[0.0f32; NP]; R];
        for b in c0..(c0 + A8_CHUNK_BLOCKS).min(nb) {
            let wq = &qs[b * QB..(b + 1) * QB];
            for (r, row) in rows.iter().enumerate() {
                let xq = &row.codes[b * QK..(b + 1) * QK];
                let dx = row.dx[b];
                for (j, a) in acc[r].iter_mut().enumerate() {
                    let mut isum = 0i32;
                    for (i, &xv) in xq.iter().enumerate() {
                        let wv = (wq[(i / 4) * 64 + 4 * j + i % 4] ^ 0x80) as i8;
                        isum += wv as i32 * xv as i32;
                    }
                    *a = (isum as f32).mul_add(ds[b * NP + j] * dx, *a);
                }
            }
        }
        if c0 == 0 {
            tot = acc;
        } else {
            for (t, a) in tot.iter_mut().zip(&acc) {
                for (tv, av) in t.iter_mut().zip(a) {
                    *tv += *av;
                }
            }
        }
    }
    tot
}

/// AVX2 + FMA: the weight codes (stored + 128) back to signed, widened to 16 bits once per
/// (panel, block), and `vpmaddwd` against each row's 4 codes of a group (pairs of 16-bit
/// products summed into 32 bits, exact: `|w x| <= 128 · 128`), two partial sums per output
/// lane added at the end of the block; then the contract's f32 part with 8-lane fused
/// multiply-adds (the bits of the portable and VNNI kernels).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Row, A8_CHUNK_BLOCKS, NG, NP, QB, QK};

    /// Tile rows `r` (`< R`) over panels `p0 .. p1`, as the VNNI kernel.
    ///
    /// # Safety
    /// AVX2 and FMA available; the lengths as for the VNNI kernel.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn row_tile<const R: usize>(
        ds: &[f32],
        qs: &[u8],
        rows: [Row<'_>; R],
        nb: usize,
        out: &mut [f32],
        width: usize,
        r0: usize,
        p0: usize,
        p1: usize,
        n_out: usize,
    ) {
        let xp: [*const i8; R] = std::array::from_fn(|r| rows[r].codes.as_ptr());
        let dxp: [*const f32; R] = std::array::from_fn(|r| rows[r].dx.as_ptr());
        let flip = _mm_set1_epi8(-128);
        for p in p0..p1 {
            // SAFETY (all pointer arithmetic below): within the lengths of the contract.
            let wp = unsafe { qs.as_ptr().add(p * nb * QB) };
            let dp = unsafe { ds.as_ptr().add(p * nb * NP) };
            let mut tot = [[_mm256_setzero_ps(); 2]; R];
            for c0 in (0..nb).step_by(A8_CHUNK_BLOCKS) {
                let mut acc = [[_mm256_setzero_ps(); 2]; R];
                for b in c0..(c0 + A8_CHUNK_BLOCKS).min(nb) {
                    // Group g, quarter q: outputs 4q .. 4q + 3, 4 inputs each, as i16.
                    let w: [__m256i; 4 * NG] = std::array::from_fn(|i| {
                        let (g, q) = (i / 4, i % 4);
                        let v = unsafe {
                            _mm_loadu_si128(wp.add(b * QB + g * 64 + q * 16) as *const __m128i)
                        };
                        _mm256_cvtepi8_epi16(_mm_xor_si128(v, flip))
                    });
                    let (dlo, dhi) = unsafe {
                        (
                            _mm256_loadu_ps(dp.add(b * NP)),
                            _mm256_loadu_ps(dp.add(b * NP + 8)),
                        )
                    };
                    for r in 0..R {
                        let mut ia = [_mm256_setzero_si256(); 4];
                        for g in 0..NG {
                            let x4 = unsafe {
                                (xp[r].add(b * QK + 4 * g) as *const i32).read_unaligned()
                            };
                            // [x0 x1 x2 x3] as i16, repeated over the 4 outputs of a quarter.
                            let xv =
                                _mm256_broadcastq_epi64(_mm_cvtepi8_epi16(_mm_cvtsi32_si128(x4)));
                            for (q, a) in ia.iter_mut().enumerate() {
                                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(w[4 * g + q], xv));
                            }
                        }
                        // Lanes (o, o) pairs -> one sum per output, outputs in order.
                        let lo = _mm256_permute4x64_epi64(_mm256_hadd_epi32(ia[0], ia[1]), 0xD8);
                        let hi = _mm256_permute4x64_epi64(_mm256_hadd_epi32(ia[2], ia[3]), 0xD8);
                        let dx = _mm256_set1_ps(unsafe { *dxp[r].add(b) });
                        acc[r][0] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(lo),
                            _mm256_mul_ps(dlo, dx),
                            acc[r][0],
                        );
                        acc[r][1] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(hi),
                            _mm256_mul_ps(dhi, dx),
                            acc[r][1],
                        );
                    }
                }
                if c0 == 0 {
                    tot = acc;
                } else {
                    for r in 0..R {
                        for h in 0..2 {
                            tot[r][h] = _mm256_add_ps(tot[r][h], acc[r][h]);
                        }
                    }
                }
            }
            let o = p * NP;
            let n = NP.min(n_out - o);
            for (r, t) in tot.iter().enumerate() {
                let mut v = [0.0f32; NP];
                // SAFETY: v holds 16 values.
                unsafe {
                    _mm256_storeu_ps(v.as_mut_ptr(), t[0]);
                    _mm256_storeu_ps(v.as_mut_ptr().add(8), t[1]);
                }
                out[(r0 + r) * width + o - p0 * NP..][..n].copy_from_slice(&v[..n]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use std::arch::x86_64::*;

    use super::{Row, A8_CHUNK_BLOCKS, NG, NP, QB, QK};

    /// Tile rows `r` (`< R`) over panels `p0 .. p1`: output `o` of row `r` goes to
    /// `out[(r0 + r) width + o - 16 p0]` for `o < n_out`.
    ///
    /// # Safety
    /// AVX-512F and AVX-512 VNNI available; `ds` holds `16 nb p1` scales, `qs` `512 nb p1`
    /// bytes, every row `32 nb` codes and `nb` scales and corrections;
    /// `16 (p1 - 1) < n_out`, `width = min(16 p1, n_out) - 16 p0`,
    /// `out.len() >= (r0 + R) width`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(super) unsafe fn row_tile<const R: usize>(
        ds: &[f32],
        qs: &[u8],
        rows: [Row<'_>; R],
        nb: usize,
        out: &mut [f32],
        width: usize,
        r0: usize,
        p0: usize,
        p1: usize,
        n_out: usize,
    ) {
        let xp: [*const i8; R] = std::array::from_fn(|r| rows[r].codes.as_ptr());
        let dxp: [*const f32; R] = std::array::from_fn(|r| rows[r].dx.as_ptr());
        let ncp: [*const i32; R] = std::array::from_fn(|r| rows[r].ncorr.as_ptr());
        let op = out.as_mut_ptr();
        for p in p0..p1 {
            // SAFETY (all pointer arithmetic below): within the lengths of the contract.
            let wp = unsafe { qs.as_ptr().add(p * nb * QB) };
            let dp = unsafe { ds.as_ptr().add(p * nb * NP) };
            let mut tot = [_mm512_setzero_ps(); R];
            for c0 in (0..nb).step_by(A8_CHUNK_BLOCKS) {
                // One chain per chunk, then the ordered chunk adds (the contract).
                let mut acc = [_mm512_setzero_ps(); R];
                for b in c0..(c0 + A8_CHUNK_BLOCKS).min(nb) {
                    let w: [__m512i; NG] = std::array::from_fn(|g| unsafe {
                        _mm512_loadu_si512(wp.add(b * QB + g * 64) as *const __m512i)
                    });
                    let dw = unsafe { _mm512_loadu_ps(dp.add(b * NP)) };
                    for r in 0..R {
                        let mut ia = _mm512_set1_epi32(unsafe { *ncp[r].add(b) });
                        for (g, wg) in w.iter().enumerate() {
                            let x4 = unsafe {
                                (xp[r].add(b * QK + 4 * g) as *const i32).read_unaligned()
                            };
                            ia = _mm512_dpbusd_epi32(ia, *wg, _mm512_set1_epi32(x4));
                        }
                        let s = _mm512_mul_ps(dw, _mm512_set1_ps(unsafe { *dxp[r].add(b) }));
                        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), s, acc[r]);
                    }
                }
                if c0 == 0 {
                    tot = acc;
                } else {
                    for r in 0..R {
                        tot[r] = _mm512_add_ps(tot[r], acc[r]);
                    }
                }
            }
            let acc = tot;
            let o = p * NP;
            let n = NP.min(n_out - o);
            let mask = ((1u32 << n) - 1) as __mmask16;
            for (r, a) in acc.iter().enumerate() {
                // SAFETY: (r0 + r) width + o - 16 p0 + n <= (r0 + R) width <= out.len().
                unsafe { _mm512_mask_storeu_ps(op.add((r0 + r) * width + o - p0 * NP), mask, *a) };
            }
        }
    }
}

/// Computes outputs `16 p0 .. min(16 p1, n_out)` for all quantized rows into `out`, laid out
/// `[rows, width]` with `width = min(16 p1, n_out) - 16 p0` (one thread's chunk). Rows go in
/// balanced tiles of at most 8 rows, each over all the panels.
pub(crate) fn matmul_panels(
    isa: Isa,
    qx: &QRows,
    w: &A8Panels,
    n_out: usize,
    p0: usize,
    p1: usize,
    out: &mut [f32],
) {
    let rows = qx.rows;
    if rows == 0 || p0 >= p1 {
        return;
    }
    let width = (p1 * NP).min(n_out) - p0 * NP;
    let n_tiles = rows.div_ceil(MAX_R);
    let (base, extra) = (rows / n_tiles, rows % n_tiles);
    let mut r = 0;
    for t in 0..n_tiles {
        let size = base + usize::from(t < extra);
        let dst = Dest {
            out: &mut *out,
            width,
            r0: r,
            p0,
            p1,
            n_out,
        };
        macro_rules! go {
            ($($n:literal)*) => {
                match size {
                    $($n => row_tile::<$n>(
                        isa,
                        w,
                        std::array::from_fn(|d| qx.row(r + d)),
                        qx.k,
                        dst,
                    ),)*
                    _ => {}
                }
            };
        }
        go!(1 2 3 4 5 6 7 8);
        r += size;
    }
}
