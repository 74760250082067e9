//! q8_0 / q4_0 weights repacked in panels of 16 output features, dequantized in registers.
//!
//! Per panel `p` and 32-value block `b` (`nb = k / 32` blocks per row):
//! * `d[(p nb + b) 16 + j]`: the block scale of output `16p + j`, as f32 (exact from f16);
//! * q8_0: `qs[((p nb + b) 32 + i) 16 + j]`: the signed code of element `32b + i`;
//! * q4_0: `qs[((p nb + b) 16 + i) 16 + j]`: ggml's byte `i` of the block (low nibble: element
//!   `32b + i`, high nibble: element `32b + 16 + i`).
//!
//! A weight value is `code as f32 * d` (q4_0: `(nibble - 8) as f32 * d`), exactly ggml's
//! dequantization, and it enters the same sequential FMA chain as the f32 panels: a quantized
//! matmul gives the bits of the f32 matmul of the dequantized matrix. Storage: 1.06x the
//! q8_0 blocks, 1.11x the q4_0 blocks.

use dflash_quant::{BlockQ4_0, BlockQ8_0, QK};

use super::kernel::Isa;
use super::panel::{PanelSrc, TileOut, NP};

/// Quantized panels.
#[derive(Debug)]
pub(crate) struct QPanels {
    /// q4_0 (nibbles) or q8_0 (bytes).
    pub q4: bool,
    pub d: Vec<f32>,
    pub qs: Vec<u8>,
}

impl QPanels {
    /// Code bytes per (panel, block).
    fn qb(&self) -> usize {
        if self.q4 {
            (QK / 2) * NP
        } else {
            QK * NP
        }
    }

    pub fn pack_q8(blocks: &[BlockQ8_0], rows: usize, k: usize) -> QPanels {
        let nb = k / QK;
        let n_panels = rows.div_ceil(NP);
        let mut d = vec![0.0f32; n_panels * nb * NP];
        let mut qs = vec![0u8; n_panels * nb * QK * NP];
        for o in 0..rows {
            let (p, j) = (o / NP, o % NP);
            for b in 0..nb {
                let blk = &blocks[o * nb + b];
                let pb = p * nb + b;
                d[pb * NP + j] = blk.d.to_f32();
                for (i, &q) in blk.qs.iter().enumerate() {
                    qs[(pb * QK + i) * NP + j] = q as u8;
                }
            }
        }
        QPanels { q4: false, d, qs }
    }

    pub fn pack_q4(blocks: &[BlockQ4_0], rows: usize, k: usize) -> QPanels {
        let nb = k / QK;
        let n_panels = rows.div_ceil(NP);
        let mut d = vec![0.0f32; n_panels * nb * NP];
        // Padding outputs: code 0x88 decodes to 0 * d = 0 with d = 0 anyway.
        let mut qs = vec![0x88u8; n_panels * nb * (QK / 2) * NP];
        for o in 0..rows {
            let (p, j) = (o / NP, o % NP);
            for b in 0..nb {
                let blk = &blocks[o * nb + b];
                let pb = p * nb + b;
                d[pb * NP + j] = blk.d.to_f32();
                for (i, &q) in blk.qs.iter().enumerate() {
                    qs[(pb * (QK / 2) + i) * NP + j] = q;
                }
            }
        }
        QPanels { q4: true, d, qs }
    }

    /// Values stored (including the padding), for shape checks: `n_panels * 16 * k`.
    pub fn n_values(&self) -> usize {
        self.d.len() * QK
    }

    pub fn bytes(&self) -> usize {
        4 * self.d.len() + self.qs.len()
    }

    /// Row `o`, dequantized.
    pub fn unpack_row(&self, k: usize, o: usize, out: &mut [f32]) {
        let nb = k / QK;
        let (p, j) = (o / NP, o % NP);
        for (b, ob) in out.chunks_exact_mut(QK).take(nb).enumerate() {
            let pb = p * nb + b;
            let d = self.d[pb * NP + j];
            for (i, y) in ob.iter_mut().enumerate() {
                *y = if self.q4 {
                    let byte = self.qs[(pb * (QK / 2) + i % (QK / 2)) * NP + j];
                    let nib = if i < QK / 2 { byte & 0x0F } else { byte >> 4 };
                    (nib as i32 - 8) as f32 * d
                } else {
                    (self.qs[(pb * QK + i) * NP + j] as i8) as f32 * d
                };
            }
        }
    }
}

impl PanelSrc for QPanels {
    #[inline]
    fn tile<const R: usize, const P: usize>(
        &self,
        isa: Isa,
        xs: [&[f32]; R],
        ps: [usize; P],
        k: usize,
    ) -> TileOut<R, P> {
        let nb = k / QK;
        let qb = self.qb();
        let ds: [&[f32]; P] = std::array::from_fn(|d| {
            self.d
                .get(ps[d] * nb * NP..(ps[d] + 1) * nb * NP)
                .unwrap_or(&[])
        });
        let qs: [&[u8]; P] = std::array::from_fn(|d| {
            self.qs
                .get(ps[d] * nb * qb..(ps[d] + 1) * nb * qb)
                .unwrap_or(&[])
        });
        let ok = k.is_multiple_of(QK)
            && xs.iter().all(|x| x.len() >= k)
            && ds.iter().all(|d| d.len() == nb * NP)
            && qs.iter().all(|q| q.len() == nb * qb);
        if !ok {
            // Internal invariant (callers pass whole panels); NaN makes a breach visible.
            return [[[f32::NAN; NP]; P]; R];
        }
        match (isa, self.q4) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the backend only holds an `Isa` that `Isa::supported` accepted, and the
            // operands hold what the kernels read (checked above).
            (Isa::Avx512, false) => unsafe { avx512::tile::<false, R, P>(xs, ds, qs, nb) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            (Isa::Avx512, true) => unsafe { avx512::tile::<true, R, P>(xs, ds, qs, nb) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            (Isa::Avx2Fma, false) => unsafe { avx2::tile::<false, R, P>(xs, ds, qs, nb) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            (Isa::Avx2Fma, true) => unsafe { avx2::tile::<true, R, P>(xs, ds, qs, nb) },
            (_, q4) => tile_portable::<R, P>(q4, xs, ds, qs, nb),
        }
    }
}

fn tile_portable<const R: usize, const P: usize>(
    q4: bool,
    xs: [&[f32]; R],
    ds: [&[f32]; P],
    qs: [&[u8]; P],
    nb: usize,
) -> TileOut<R, P> {
    let mut acc = [[[0.0f32; NP]; P]; R];
    let mut w = [0.0f32; NP];
    for b in 0..nb {
        for i in 0..QK {
            for p in 0..P {
                let d = &ds[p][b * NP..(b + 1) * NP];
                for (j, wj) in w.iter_mut().enumerate() {
                    *wj = if q4 {
                        let byte = qs[p][((b * (QK / 2)) + i % (QK / 2)) * NP + j];
                        let nib = if i < QK / 2 { byte & 0x0F } else { byte >> 4 };
                        (nib as i32 - 8) as f32 * d[j]
                    } else {
                        (qs[p][(b * QK + i) * NP + j] as i8) as f32 * d[j]
                    };
                }
                for r in 0..R {
                    let xv = xs[r][b * QK + i];
                    for (a, &wj) in acc[r][p].iter_mut().zip(&w) {
                        *a = xv.mul_add(wj, *a);
                    }
                }
            }
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{TileOut, NP, QK};

    /// # Safety
    /// AVX-512F available; `xs[r]` holds `32 nb` values, `ds[p]` `16 nb`, `qs[p]` the codes
    /// of `nb` blocks.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn tile<const Q4: bool, const R: usize, const P: usize>(
        xs: [&[f32]; R],
        ds: [&[f32]; P],
        qs: [&[u8]; P],
        nb: usize,
    ) -> TileOut<R, P> {
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        let xp: [*const f32; R] = std::array::from_fn(|r| xs[r].as_ptr());
        let qb = if Q4 { QK / 2 * NP } else { QK * NP };
        let low = _mm_set1_epi8(0x0F);
        let eight = _mm_set1_epi8(8);
        for b in 0..nb {
            let mut dv = [_mm512_setzero_ps(); P];
            let mut qp = [std::ptr::null::<u8>(); P];
            for p in 0..P {
                // SAFETY: (b + 1) 16 <= ds[p].len(); b qb < qs[p].len().
                unsafe {
                    dv[p] = _mm512_loadu_ps(ds[p].as_ptr().add(b * NP));
                    qp[p] = qs[p].as_ptr().add(b * qb);
                }
            }
            for i in 0..QK {
                let mut wv = [_mm512_setzero_ps(); P];
                for p in 0..P {
                    // SAFETY: the 16 code bytes of step i lie inside block b.
                    let codes = unsafe {
                        if Q4 {
                            let raw =
                                _mm_loadu_si128(qp[p].add((i % (QK / 2)) * NP) as *const __m128i);
                            let nib = if i < QK / 2 {
                                raw
                            } else {
                                _mm_srli_epi16::<4>(raw)
                            };
                            _mm_sub_epi8(_mm_and_si128(nib, low), eight)
                        } else {
                            _mm_loadu_si128(qp[p].add(i * NP) as *const __m128i)
                        }
                    };
                    wv[p] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), dv[p]);
                }
                for r in 0..R {
                    // SAFETY: 32 b + i < 32 nb <= xs[r].len().
                    let xb = _mm512_set1_ps(unsafe { *xp[r].add(b * QK + i) });
                    for p in 0..P {
                        acc[r][p] = _mm512_fmadd_ps(xb, wv[p], acc[r][p]);
                    }
                }
            }
        }
        let mut out = [[[0.0f32; NP]; P]; R];
        for r in 0..R {
            for p in 0..P {
                // SAFETY: out[r][p] holds 16 f32.
                unsafe { _mm512_storeu_ps(out[r][p].as_mut_ptr(), acc[r][p]) };
            }
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{TileOut, NP, QK};

    /// # Safety
    /// AVX2, FMA available; `xs[r]` holds `32 nb` values, `ds[p]` `16 nb`, `qs[p]` the codes
    /// of `nb` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile<const Q4: bool, const R: usize, const P: usize>(
        xs: [&[f32]; R],
        ds: [&[f32]; P],
        qs: [&[u8]; P],
        nb: usize,
    ) -> TileOut<R, P> {
        let mut acc = [[[_mm256_setzero_ps(); 2]; P]; R];
        let xp: [*const f32; R] = std::array::from_fn(|r| xs[r].as_ptr());
        let qb = if Q4 { QK / 2 * NP } else { QK * NP };
        let low = _mm_set1_epi8(0x0F);
        let eight = _mm_set1_epi8(8);
        for b in 0..nb {
            let mut dv = [[_mm256_setzero_ps(); 2]; P];
            let mut qp = [std::ptr::null::<u8>(); P];
            for p in 0..P {
                // SAFETY: (b + 1) 16 <= ds[p].len(); b qb < qs[p].len().
                unsafe {
                    dv[p][0] = _mm256_loadu_ps(ds[p].as_ptr().add(b * NP));
                    dv[p][1] = _mm256_loadu_ps(ds[p].as_ptr().add(b * NP + 8));
                    qp[p] = qs[p].as_ptr().add(b * qb);
                }
            }
            for i in 0..QK {
                let mut wv = [[_mm256_setzero_ps(); 2]; P];
                for p in 0..P {
                    // SAFETY: the 16 code bytes of step i lie inside block b.
                    let codes = unsafe {
                        if Q4 {
                            let raw =
                                _mm_loadu_si128(qp[p].add((i % (QK / 2)) * NP) as *const __m128i);
                            let nib = if i < QK / 2 {
                                raw
                            } else {
                                _mm_srli_epi16::<4>(raw)
                            };
                            _mm_sub_epi8(_mm_and_si128(nib, low), eight)
                        } else {
                            _mm_loadu_si128(qp[p].add(i * NP) as *const __m128i)
                        }
                    };
                    let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
                    let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(codes)));
                    wv[p][0] = _mm256_mul_ps(lo, dv[p][0]);
                    wv[p][1] = _mm256_mul_ps(hi, dv[p][1]);
                }
                for r in 0..R {
                    // SAFETY: 32 b + i < 32 nb <= xs[r].len().
                    let xb = _mm256_set1_ps(unsafe { *xp[r].add(b * QK + i) });
                    for p in 0..P {
                        acc[r][p][0] = _mm256_fmadd_ps(xb, wv[p][0], acc[r][p][0]);
                        acc[r][p][1] = _mm256_fmadd_ps(xb, wv[p][1], acc[r][p][1]);
                    }
                }
            }
        }
        let mut out = [[[0.0f32; NP]; P]; R];
        for r in 0..R {
            for p in 0..P {
                // SAFETY: out[r][p] holds 16 f32.
                unsafe {
                    _mm256_storeu_ps(out[r][p].as_mut_ptr(), acc[r][p][0]);
                    _mm256_storeu_ps(out[r][p].as_mut_ptr().add(8), acc[r][p][1]);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::panel::{matmul_panels, pack, Dense};
    use super::*;

    #[test]
    fn quantized_panels_equal_f32_panels_of_decoded_values() {
        let (rows, n, k) = (9, 37, 96);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 53) % 97) as f32 / 13.0 - 3.5)
            .collect();
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 37) % 101) as f32 / 17.0 - 3.0)
            .collect();
        let q8 = dflash_quant::quantize_q8_0(&w).unwrap();
        let q4 = dflash_quant::quantize_q4_0(&w).unwrap();
        let mut d8 = vec![0.0; n * k];
        let mut d4 = vec![0.0; n * k];
        dflash_quant::dequantize_q8_0(&q8, &mut d8);
        dflash_quant::dequantize_q4_0(&q4, &mut d4);
        let np = n.div_ceil(NP);
        for (qp, dec) in [
            (QPanels::pack_q8(&q8, n, k), d8),
            (QPanels::pack_q4(&q4, n, k), d4),
        ] {
            let mut row = vec![0.0; k];
            for o in 0..n {
                qp.unpack_row(k, o, &mut row);
                assert_eq!(row, dec[o * k..(o + 1) * k]);
            }
            let fp = pack(&dec, n, k);
            for isa in [Isa::Portable, Isa::Avx2Fma, Isa::Avx512]
                .into_iter()
                .filter(|i| i.supported())
            {
                for r in [rows, 1] {
                    let mut a = vec![0.0f32; r * n];
                    let mut b = vec![1.0f32; r * n];
                    matmul_panels(isa, &x, r, k, &qp, n, 0, np, &mut a);
                    matmul_panels(isa, &x, r, k, &Dense(&fp), n, 0, np, &mut b);
                    assert_eq!(a, b, "{isa:?} q4 {} rows {r}", qp.q4);
                }
            }
        }
    }
}
