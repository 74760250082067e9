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
/// Most rows of one tile.
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

type Tile<const R: usize> = [[f32; NP]; R];

/// Outputs of panel `p` for `R` rows.
fn tile<const R: usize>(isa: Isa, w: &A8Panels, p: usize, rows: [Row<'_>; R], k: usize) -> Tile<R> {
    let nb = k / QK;
    let ds = w.d.get(p * nb * NP..(p + 1) * nb * NP).unwrap_or(&[]);
    let qs = w.qs.get(p * nb * QB..(p + 1) * nb * QB).unwrap_or(&[]);
    let ok = ds.len() == nb * NP
        && qs.len() == nb * QB
        && rows
            .iter()
            .all(|r| r.codes.len() == k && r.dx.len() == nb && r.ncorr.len() == nb);
    if !ok {
        // Internal invariant (the caller passes whole panels and rows); NaN makes a breach
        // visible.
        return [[f32::NAN; NP]; R];
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && vnni_supported() {
        // SAFETY: AVX-512F and AVX-512 VNNI were detected; the operands hold what the kernel
        // reads (checked above).
        return unsafe { vnni::tile::<R>(ds, qs, rows, nb) };
    }
    let _ = isa;
    tile_portable::<R>(ds, qs, rows, nb)
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

    use super::{Row, Tile, NG, NP, QB, QK};

    /// # Safety
    /// AVX-512F and AVX-512 VNNI available; `ds` holds `16 nb` scales, `qs` `512 nb` bytes,
    /// every row `32 nb` codes and `nb` scales and corrections.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(super) unsafe fn tile<const R: usize>(
        ds: &[f32],
        qs: &[u8],
        rows: [Row<'_>; R],
        nb: usize,
    ) -> Tile<R> {
        let mut acc = [_mm512_setzero_ps(); R];
        let xp: [*const i8; R] = std::array::from_fn(|r| rows[r].codes.as_ptr());
        let dxp: [*const f32; R] = std::array::from_fn(|r| rows[r].dx.as_ptr());
        let ncp: [*const i32; R] = std::array::from_fn(|r| rows[r].ncorr.as_ptr());
        let wp = qs.as_ptr();
        let dp = ds.as_ptr();
        for b in 0..nb {
            // SAFETY (all loads below): b < nb and the lengths in the function contract.
            let w: [__m512i; NG] = std::array::from_fn(|g| unsafe {
                _mm512_loadu_si512(wp.add(b * QB + g * 64) as *const __m512i)
            });
            let dw = unsafe { _mm512_loadu_ps(dp.add(b * NP)) };
            for r in 0..R {
                let mut ia = _mm512_set1_epi32(unsafe { *ncp[r].add(b) });
                for (g, wg) in w.iter().enumerate() {
                    let x4 = unsafe { (xp[r].add(b * QK + 4 * g) as *const i32).read_unaligned() };
                    ia = _mm512_dpbusd_epi32(ia, *wg, _mm512_set1_epi32(x4));
                }
                let s = _mm512_mul_ps(dw, _mm512_set1_ps(unsafe { *dxp[r].add(b) }));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), s, acc[r]);
            }
        }
        let mut out = [[0.0f32; NP]; R];
        for r in 0..R {
            // SAFETY: out[r] holds 16 f32.
            unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
        }
        out
    }
}

/// Rows `r0 .. r0 + R` over panels `p0 .. p1`, each tile handed to `put(row, panel, values)`.
fn rows_over_panels<const R: usize>(
    isa: Isa,
    w: &A8Panels,
    qx: &QRows,
    r0: usize,
    p0: usize,
    p1: usize,
    put: &mut impl FnMut(usize, usize, &[f32; NP]),
) {
    let rows: [Row<'_>; R] = std::array::from_fn(|d| qx.row(r0 + d));
    for p in p0..p1 {
        let t = tile::<R>(isa, w, p, rows, qx.k);
        for (d, v) in t.iter().enumerate() {
            put(r0 + d, p, v);
        }
    }
}

/// Computes outputs `16 p0 .. min(16 p1, n_out)` for all quantized rows into `out`, laid out
/// `[rows, width]` with `width = min(16 p1, n_out) - 16 p0` (one thread's chunk). Rows go in
/// balanced tiles of at most 16 rows x 1 panel.
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
    let o0 = p0 * NP;
    let width = (p1 * NP).min(n_out) - o0;
    let mut put = |r: usize, p: usize, vals: &[f32; NP]| {
        let o = p * NP;
        let n = NP.min(n_out - o);
        out[r * width + o - o0..][..n].copy_from_slice(&vals[..n]);
    };
    let n_tiles = rows.div_ceil(MAX_R);
    let (base, extra) = (rows / n_tiles, rows % n_tiles);
    let mut r = 0;
    for t in 0..n_tiles {
        let size = base + usize::from(t < extra);
        macro_rules! go {
            ($($n:literal)*) => {
                match size {
                    $($n => rows_over_panels::<$n>(isa, w, qx, r, p0, p1, &mut put),)*
                    _ => {}
                }
            };
        }
        go!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
        r += size;
    }
}
