//! [`WeightFormat::Q8_0A8`](crate::WeightFormat::Q8_0A8): q8_0 weights times activations
//! quantized to q8_0 at matmul time, with integer block dots (AVX-512 VNNI `vpdpbusd` where
//! the CPU has it, a portable integer loop otherwise).
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
//! f32 part (the contract of the format, identical on every path):
//! `acc = 0.0; for b in 0..nb { acc = fma(isum_b as f32, d_w[b] * d_x[b], acc) }`. `isum as
//! f32` is exact (`< 2^24`), and so is `d_w * d_x` (two f16 values: 22 significant bits, far
//! from the f32 range limits), so the only roundings are the `nb` fused multiply-adds: the
//! portable and VNNI kernels give identical bits, and a row's result depends on nothing but
//! that row (the quantization is per row, the tiles only share loads).

use std::cell::Cell;

use dflash_quant::{BlockQ8_0, QK};

use super::kernel::Isa;
use super::panel::NP;
use crate::{BackendError, Result};

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
}

impl A8Panels {
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
        A8Panels { d, qs }
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
    pub fn quantize(
        &mut self,
        isa: Isa,
        weight: &str,
        x: &[f32],
        rows: usize,
        k: usize,
    ) -> Result<()> {
        let nb = k / QK;
        self.k = k;
        self.rows = rows;
        self.codes.resize(rows * k, 0);
        self.dx.resize(rows * nb, 0.0);
        self.ncorr.resize(rows * nb, 0);
        if k == 0 {
            return Ok(());
        }
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512 && vnni_supported() && x.len() >= rows * k {
            let mut ok = true;
            for (((xr, c), d), n) in x
                .chunks_exact(k)
                .take(rows)
                .zip(self.codes.chunks_exact_mut(k))
                .zip(self.dx.chunks_exact_mut(nb))
                .zip(self.ncorr.chunks_exact_mut(nb))
            {
                // SAFETY: `Isa::Avx512` was detected (AVX-512F, F16C); the slices have matching
                // lengths.
                ok &= unsafe { vnni::quantize_row(xr, c, d, n) };
            }
            if ok {
                return Ok(());
            }
            // A non-finite value: the reference path below names it.
        }
        let _ = isa;
        self.blocks.resize(rows * nb, bytemuck::Zeroable::zeroed());
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
    let mut acc = [[0.0f32; NP]; R];
    for b in 0..nb {
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
    acc
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use std::arch::x86_64::*;

    use super::{Row, NG, NP, QB, QK};

    /// One row of `x` quantized to q8_0 exactly as `dflash_quant::quantize_row_q8_0` (ggml's
    /// reference: `d = amax / 127`, `id = 1 / d` or 0, codes `roundf(x * id)` with C's int8
    /// store, i.e. 0 when `id` is infinite; `d` stored as f16, round to nearest even), written
    /// as codes, `f32(f16(d))` and `-128 Σ codes` per block. Returns false (outputs then
    /// unspecified) when `x` holds a NaN or an infinity.
    ///
    /// `roundf` is `trunc(t)` plus `copysign(1, t)` where `|t - trunc(t)| >= 0.5` (the
    /// subtraction is exact).
    ///
    /// # Safety
    /// AVX-512F and F16C available; `codes.len() == x.len()`, `dx.len() == ncorr.len() == x.len() / 32`.
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn quantize_row(
        x: &[f32],
        codes: &mut [i8],
        dx: &mut [f32],
        ncorr: &mut [i32],
    ) -> bool {
        let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
        let sign_mask = _mm512_set1_epi32(i32::MIN);
        let one = _mm512_castps_si512(_mm512_set1_ps(1.0));
        let half = _mm512_set1_ps(0.5);
        for (((xb, cb), d_out), n_out) in x
            .chunks_exact(QK)
            .zip(codes.chunks_exact_mut(QK))
            .zip(dx.iter_mut())
            .zip(ncorr.iter_mut())
        {
            // SAFETY: xb holds 32 floats.
            let (x0, x1) = unsafe {
                (
                    _mm512_loadu_ps(xb.as_ptr()),
                    _mm512_loadu_ps(xb.as_ptr().add(16)),
                )
            };
            let a = _mm512_max_epu32(
                _mm512_and_si512(_mm512_castps_si512(x0), abs_mask),
                _mm512_and_si512(_mm512_castps_si512(x1), abs_mask),
            );
            let amax_bits = _mm512_reduce_max_epu32(a);
            if amax_bits > 0x7f7f_ffff {
                return false;
            }
            let d = f32::from_bits(amax_bits) / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let id = if id.is_infinite() { 0.0 } else { id };
            let idv = _mm512_set1_ps(id);
            let code = |xv: __m512| {
                let t = _mm512_mul_ps(xv, idv);
                let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
                let frac = _mm512_abs_ps(_mm512_sub_ps(t, r));
                let away = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, half);
                let step = _mm512_castsi512_ps(_mm512_or_si512(
                    _mm512_and_si512(_mm512_castps_si512(t), sign_mask),
                    one,
                ));
                _mm512_cvttps_epi32(_mm512_mask_add_ps(r, away, r, step))
            };
            let (q0, q1) = (code(x0), code(x1));
            // SAFETY: cb holds 32 bytes.
            unsafe {
                _mm_storeu_si128(cb.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(q0));
                _mm_storeu_si128(
                    cb.as_mut_ptr().add(16) as *mut __m128i,
                    _mm512_cvtepi32_epi8(q1),
                );
            }
            *n_out = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            // f16 round to nearest even (imm 0) and back: `half::f16::from_f32(d).to_f32()`.
            *d_out = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<0>(_mm_set_ss(d))));
        }
        true
    }

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
            let mut acc = [_mm512_setzero_ps(); R];
            for b in 0..nb {
                let w: [__m512i; NG] = std::array::from_fn(|g| unsafe {
                    _mm512_loadu_si512(wp.add(b * QB + g * 64) as *const __m512i)
                });
                let dw = unsafe { _mm512_loadu_ps(dp.add(b * NP)) };
                for r in 0..R {
                    let mut ia = _mm512_set1_epi32(unsafe { *ncp[r].add(b) });
                    for (g, wg) in w.iter().enumerate() {
                        let x4 =
                            unsafe { (xp[r].add(b * QK + 4 * g) as *const i32).read_unaligned() };
                        ia = _mm512_dpbusd_epi32(ia, *wg, _mm512_set1_epi32(x4));
                    }
                    let s = _mm512_mul_ps(dw, _mm512_set1_ps(unsafe { *dxp[r].add(b) }));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), s, acc[r]);
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX-512 activation quantizer against `dflash_quant::quantize_row_q8_0` (the
    /// portable path), byte for byte, on rows built to hit its corners.
    #[test]
    fn fused_quantizer_matches_dflash_quant() {
        if !(Isa::Avx512.supported() && vnni_supported()) {
            eprintln!("no AVX-512 VNNI: nothing to compare");
            return;
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let k = 256;
        for case in 0..4000 {
            let x: Vec<f32> = (0..k)
                .map(|i| {
                    let r = rnd();
                    let u = (r >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
                    match (case + i / QK) % 9 {
                        // halves after scaling: amax 127 gives d = 1, id = 1
                        0 => {
                            if i % QK == 0 {
                                127.0
                            } else {
                                ((r % 255) as f32 - 127.0) + 0.5 * (r % 2) as f32
                            }
                        }
                        1 => 0.0,
                        2 => (u * 1e-40) as f32,
                        3 => (u * 3e38) as f32,
                        4 => (u * 1e-20) as f32,
                        5 => {
                            f32::from_bits(rnd() as u32 & 0x7f7f_ffff)
                                * if r % 2 == 0 { 1.0 } else { -1.0 }
                        }
                        6 => -0.0,
                        7 => ((r % 2001) as f32 - 1000.0) / 8.0,
                        _ => u as f32,
                    }
                })
                .collect();
            let mut a = QRows::default();
            let mut b = QRows::default();
            a.quantize(Isa::Avx512, "w", &x, 1, k).unwrap();
            b.quantize(Isa::Portable, "w", &x, 1, k).unwrap();
            assert_eq!(a.codes, b.codes, "case {case}");
            assert_eq!(a.ncorr, b.ncorr, "case {case}");
            let (da, db): (Vec<u32>, Vec<u32>) = (
                a.dx.iter().map(|v| v.to_bits()).collect(),
                b.dx.iter().map(|v| v.to_bits()).collect(),
            );
            assert_eq!(da, db, "case {case}");
        }
        // Non-finite values: an error on both paths, naming the row.
        let mut x = vec![1.0f32; 2 * k];
        x[k + 7] = f32::INFINITY;
        for isa in [Isa::Avx512, Isa::Portable] {
            let err = QRows::default().quantize(isa, "w", &x, 2, k).unwrap_err();
            assert!(err.to_string().contains("row 1"), "{err}");
        }
    }
}
