//! Panel-packed weights and the outer-product matmul kernels for f32 / bf16 / f16 weights.
//!
//! Layout: output features are grouped in panels of [`NP`] = 16; panel `p` stores, for each
//! input index `i`, the 16 values `W[16p + j, i]` contiguously (`panel[i * 16 + j]`), the
//! last panel zero-padded. The same number of elements as the row-major matrix (plus the
//! padding), in the weight's own 16-bit or 32-bit encoding.
//!
//! Arithmetic: every output element is one sequential fused multiply-add chain
//! `acc = fma(x[r, i], W[o, i], acc)` for `i = 0, 1, ..., k-1` from `acc = 0`. Tiles only share
//! loads between elements, so a row's result never depends on the rows, panels or threads
//! computed with it; and since FMA is exactly rounded, the AVX-512, AVX2 and portable kernels
//! give identical bits (the portable one uses `f32::mul_add`).

use super::kernel::Isa;

/// Output features per panel.
pub(crate) const NP: usize = 16;

/// Storage kinds a panel can hold.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    F32,
    Bf16,
    F16,
}

/// An element of a packed panel.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    const KIND: Kind;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    const KIND: Kind = Kind::F32;
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
}

/// bf16 bit pattern.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct Bf16Bits(pub u16);

impl Elem for Bf16Bits {
    const KIND: Kind = Kind::Bf16;
    #[inline]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// IEEE binary16 bit pattern.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct F16Bits(pub u16);

impl Elem for F16Bits {
    const KIND: Kind = Kind::F16;
    #[inline]
    fn to_f32(self) -> f32 {
        half::f16::from_bits(self.0).to_f32()
    }
}

/// Pack a row-major `[rows, k]` matrix into panels.
pub(crate) fn pack<T: Elem + Default>(src: &[T], rows: usize, k: usize) -> Vec<T> {
    let n_panels = rows.div_ceil(NP);
    let mut out = vec![T::default(); n_panels * k * NP];
    for (o, row) in src.chunks_exact(k.max(1)).take(rows).enumerate() {
        if k == 0 {
            break;
        }
        let (p, j) = (o / NP, o % NP);
        let panel = &mut out[p * k * NP..(p + 1) * k * NP];
        for (i, &v) in row.iter().enumerate() {
            panel[i * NP + j] = v;
        }
    }
    out
}

/// Row `o` of a packed matrix, decoded.
pub(crate) fn unpack_row<T: Elem>(packed: &[T], k: usize, o: usize, out: &mut [f32]) {
    let (p, j) = (o / NP, o % NP);
    let panel = &packed[p * k * NP..(p + 1) * k * NP];
    for (i, y) in out.iter_mut().take(k).enumerate() {
        *y = panel[i * NP + j].to_f32();
    }
}

/// bf16 panels in step pairs (the AVX-512 backends' bf16 layout): within a panel, steps
/// `2m, 2m + 1` of output `j` sit side by side at `32 m + 2 j` and `32 m + 2 j + 1` (one 32-bit
/// word per output and pair: the low half is step `2m`, the high half step `2m + 1`), so one
/// shift and one mask turn 32 of them into two vectors of f32; an odd last step is stored as
/// in [`pack`] (`16 (k - 1) + j`). Same element count as [`pack`].
pub(crate) fn pack_bf16_pairs(src: &[Bf16Bits], rows: usize, k: usize) -> Vec<Bf16Bits> {
    let n_panels = rows.div_ceil(NP);
    let mut out = vec![Bf16Bits::default(); n_panels * k * NP];
    for (o, row) in src.chunks_exact(k.max(1)).take(rows).enumerate() {
        if k == 0 {
            break;
        }
        let (p, j) = (o / NP, o % NP);
        let panel = &mut out[p * k * NP..(p + 1) * k * NP];
        for (i, &v) in row.iter().enumerate() {
            panel[pair_index(i, j, k)] = v;
        }
    }
    out
}

/// Position of step `i`, output `j` in a [`pack_bf16_pairs`] panel of `k` steps.
#[inline]
fn pair_index(i: usize, j: usize, k: usize) -> usize {
    if i < k / 2 * 2 {
        (i / 2) * 2 * NP + 2 * j + (i % 2)
    } else {
        i * NP + j
    }
}

/// Row `o` of a [`pack_bf16_pairs`] matrix, decoded.
pub(crate) fn unpack_row_bf16_pairs(packed: &[Bf16Bits], k: usize, o: usize, out: &mut [f32]) {
    let (p, j) = (o / NP, o % NP);
    let panel = &packed[p * k * NP..(p + 1) * k * NP];
    for (i, y) in out.iter_mut().take(k).enumerate() {
        *y = panel[pair_index(i, j, k)].to_f32();
    }
}

/// bf16 panels in the pair layout of [`pack_bf16_pairs`].
pub(crate) struct Bf16Pairs<'a>(pub &'a [Bf16Bits]);

impl PanelSrc for Bf16Pairs<'_> {
    #[inline]
    fn tile<const R: usize, const P: usize>(
        &self,
        isa: Isa,
        xs: [&[f32]; R],
        ps: [usize; P],
        k: usize,
    ) -> TileOut<R, P> {
        let ws: [&[Bf16Bits]; P] = std::array::from_fn(|d| {
            self.0
                .get(ps[d] * k * NP..(ps[d] + 1) * k * NP)
                .unwrap_or(&[])
        });
        let ok = xs.iter().all(|x| x.len() >= k) && ws.iter().all(|w| w.len() >= k * NP);
        if !ok {
            // Internal invariant (the callers slice operands to size).
            return [[[f32::NAN; NP]; P]; R];
        }
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512 {
            // SAFETY: the backend only holds an `Isa` that `Isa::supported` accepted on this
            // CPU; every operand holds what the kernel reads (checked above).
            return unsafe { avx512_pairs::tile_bf16_pairs::<R, P>(xs, ws, k) };
        }
        let _ = isa;
        // Any other instruction set (a weight packed by an AVX-512 backend used by another):
        // the same FMA chains, element by element.
        let mut acc = [[[0.0f32; NP]; P]; R];
        for i in 0..k {
            for (p, w) in ws.iter().enumerate() {
                for (r, x) in xs.iter().enumerate() {
                    let xv = x[i];
                    for (j, a) in acc[r][p].iter_mut().enumerate() {
                        *a = xv.mul_add(w[pair_index(i, j, k)].to_f32(), *a);
                    }
                }
            }
        }
        acc
    }
}

/// Tile result: `[R][P][16]`.
pub(crate) type TileOut<const R: usize, const P: usize> = [[[f32; NP]; P]; R];

/// `out[r][p][j] = Σ_i x_r[i] · panel_p[i*16 + j]` (one FMA chain per element).
/// `xs[r]` must hold `k` values and `ws[p]` `16 k` elements (callers slice them).
#[inline]
fn tile<T: Elem, const R: usize, const P: usize>(
    isa: Isa,
    xs: [&[f32]; R],
    ws: [&[T]; P],
    k: usize,
) -> TileOut<R, P> {
    let ok = xs.iter().all(|x| x.len() >= k) && ws.iter().all(|w| w.len() >= k * NP);
    if !ok {
        // Internal invariant (the callers slice operands to size); NaN makes a breach visible.
        return [[[f32::NAN; NP]; P]; R];
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the backend only holds an `Isa` that `Isa::supported` accepted on this CPU,
        // and every operand holds what the kernel reads (checked above).
        Isa::Avx512 => unsafe { avx512::tile::<T, R, P>(xs, ws, k) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2Fma => unsafe { avx2::tile::<T, R, P>(xs, ws, k) },
        _ => tile_portable::<T, R, P>(xs, ws, k),
    }
}

fn tile_portable<T: Elem, const R: usize, const P: usize>(
    xs: [&[f32]; R],
    ws: [&[T]; P],
    k: usize,
) -> TileOut<R, P> {
    let mut acc = [[[0.0f32; NP]; P]; R];
    for i in 0..k {
        for (p, w) in ws.iter().enumerate() {
            let wi = &w[i * NP..(i + 1) * NP];
            for (r, x) in xs.iter().enumerate() {
                let xv = x[i];
                for (a, &wv) in acc[r][p].iter_mut().zip(wi) {
                    *a = xv.mul_add(wv.to_f32(), *a);
                }
            }
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Elem, Kind, TileOut, NP};

    /// # Safety
    /// AVX-512F (and F16C for f16) available; `p` points at 16 readable elements.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load16<T: Elem>(p: *const T) -> __m512 {
        // SAFETY: per the function contract.
        unsafe {
            match T::KIND {
                Kind::F32 => _mm512_loadu_ps(p as *const f32),
                Kind::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256(p as *const __m256i),
                ))),
                Kind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
            }
        }
    }

    /// # Safety
    /// AVX-512F available; `xs[r]` holds `k` values, `ws[p]` holds `16 k` elements.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn tile<T: Elem, const R: usize, const P: usize>(
        xs: [&[f32]; R],
        ws: [&[T]; P],
        k: usize,
    ) -> TileOut<R, P> {
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        let xp: [*const f32; R] = std::array::from_fn(|r| xs[r].as_ptr());
        let wp: [*const T; P] = std::array::from_fn(|p| ws[p].as_ptr());
        for i in 0..k {
            let mut wv = [_mm512_setzero_ps(); P];
            for p in 0..P {
                // SAFETY: i * 16 + 16 <= 16 k <= ws[p].len().
                wv[p] = unsafe { load16(wp[p].add(i * NP)) };
            }
            for r in 0..R {
                // SAFETY: i < k <= xs[r].len().
                let xb = _mm512_set1_ps(unsafe { *xp[r].add(i) });
                for p in 0..P {
                    acc[r][p] = _mm512_fmadd_ps(xb, wv[p], acc[r][p]);
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
mod avx512_pairs {
    use std::arch::x86_64::*;

    use super::{Bf16Bits, TileOut, NP};

    /// Tile over [`super::pack_bf16_pairs`] panels: per 64-byte load, `vpslld 16` gives the f32
    /// of step `2m` and a mask of the high halves the f32 of step `2m + 1` (two single-uop
    /// operations for 32 values, where widening takes two per 16). The FMA chain of every
    /// element is the same as in the other kernels (steps in order).
    ///
    /// # Safety
    /// AVX-512F available; `xs[r]` holds `k` values, `ws[p]` holds `16 k` elements.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn tile_bf16_pairs<const R: usize, const P: usize>(
        xs: [&[f32]; R],
        ws: [&[Bf16Bits]; P],
        k: usize,
    ) -> TileOut<R, P> {
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        let xp: [*const f32; R] = std::array::from_fn(|r| xs[r].as_ptr());
        let wp: [*const u16; P] = std::array::from_fn(|p| ws[p].as_ptr() as *const u16);
        let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        let k2 = k / 2 * 2;
        let mut i = 0;
        if R <= P {
            // Few rows, many panels (1-3 rows x 8 panels): keep the R broadcasts in registers
            // and widen one panel at a time (R x P accumulators + R + 2 registers).
            while i < k2 {
                for half in 0..2 {
                    // SAFETY: i + half < k <= xs[r].len().
                    let xb: [__m512; R] =
                        std::array::from_fn(|r| _mm512_set1_ps(unsafe { *xp[r].add(i + half) }));
                    for p in 0..P {
                        // SAFETY: (i + 2) * 16 <= 16 k <= ws[p].len().
                        let v = unsafe { _mm512_loadu_si512(wp[p].add(i * NP) as *const _) };
                        let w = if half == 0 {
                            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))
                        } else {
                            _mm512_castsi512_ps(_mm512_and_si512(v, high))
                        };
                        for r in 0..R {
                            acc[r][p] = _mm512_fmadd_ps(xb[r], w, acc[r][p]);
                        }
                    }
                }
                i += 2;
            }
        }
        while i < k2 {
            let mut wv = [_mm512_setzero_ps(); P];
            for p in 0..P {
                // SAFETY: (i + 2) * 16 <= 16 k <= ws[p].len() (pairs region, 32 u16 from 16 i).
                let v = unsafe { _mm512_loadu_si512(wp[p].add(i * NP) as *const _) };
                wv[p] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
            }
            for r in 0..R {
                // SAFETY: i < k <= xs[r].len().
                let xb = _mm512_set1_ps(unsafe { *xp[r].add(i) });
                for p in 0..P {
                    acc[r][p] = _mm512_fmadd_ps(xb, wv[p], acc[r][p]);
                }
            }
            for p in 0..P {
                // SAFETY: as above.
                let v = unsafe { _mm512_loadu_si512(wp[p].add(i * NP) as *const _) };
                wv[p] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
            }
            for r in 0..R {
                // SAFETY: i + 1 < k <= xs[r].len().
                let xb = _mm512_set1_ps(unsafe { *xp[r].add(i + 1) });
                for p in 0..P {
                    acc[r][p] = _mm512_fmadd_ps(xb, wv[p], acc[r][p]);
                }
            }
            i += 2;
        }
        if i < k {
            // odd last step, stored plainly at 16 i
            let mut wv = [_mm512_setzero_ps(); P];
            for p in 0..P {
                // SAFETY: 16 i + 16 = 16 k <= ws[p].len().
                let h = unsafe { _mm256_loadu_si256(wp[p].add(i * NP) as *const __m256i) };
                wv[p] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
            }
            for r in 0..R {
                // SAFETY: i < k <= xs[r].len().
                let xb = _mm512_set1_ps(unsafe { *xp[r].add(i) });
                for p in 0..P {
                    acc[r][p] = _mm512_fmadd_ps(xb, wv[p], acc[r][p]);
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

    use super::{Elem, Kind, TileOut, NP};

    /// # Safety
    /// AVX2, FMA and F16C available; `p` points at 8 readable elements.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<T: Elem>(p: *const T) -> __m256 {
        // SAFETY: per the function contract.
        unsafe {
            match T::KIND {
                Kind::F32 => _mm256_loadu_ps(p as *const f32),
                Kind::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128(p as *const __m128i),
                ))),
                Kind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            }
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C available; `xs[r]` holds `k` values, `ws[p]` holds `16 k` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile<T: Elem, const R: usize, const P: usize>(
        xs: [&[f32]; R],
        ws: [&[T]; P],
        k: usize,
    ) -> TileOut<R, P> {
        let mut acc = [[[_mm256_setzero_ps(); 2]; P]; R];
        let xp: [*const f32; R] = std::array::from_fn(|r| xs[r].as_ptr());
        let wp: [*const T; P] = std::array::from_fn(|p| ws[p].as_ptr());
        for i in 0..k {
            let mut wv = [[_mm256_setzero_ps(); 2]; P];
            for p in 0..P {
                // SAFETY: i * 16 + 16 <= 16 k <= ws[p].len().
                unsafe {
                    wv[p][0] = load8(wp[p].add(i * NP));
                    wv[p][1] = load8(wp[p].add(i * NP + 8));
                }
            }
            for r in 0..R {
                // SAFETY: i < k <= xs[r].len().
                let xb = _mm256_set1_ps(unsafe { *xp[r].add(i) });
                for p in 0..P {
                    acc[r][p][0] = _mm256_fmadd_ps(xb, wv[p][0], acc[r][p][0]);
                    acc[r][p][1] = _mm256_fmadd_ps(xb, wv[p][1], acc[r][p][1]);
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

/// A matrix stored in panels of 16 output features that can compute tiles.
pub(crate) trait PanelSrc: Sync {
    /// `out[r][d][j] = Σ_i x_r[i] · W[16 ps[d] + j, i]`, one sequential FMA chain per element.
    fn tile<const R: usize, const P: usize>(
        &self,
        isa: Isa,
        xs: [&[f32]; R],
        ps: [usize; P],
        k: usize,
    ) -> TileOut<R, P>;
}

/// f32 / bf16 / f16 panels.
pub(crate) struct Dense<'a, T>(pub &'a [T]);

impl<T: Elem> PanelSrc for Dense<'_, T> {
    #[inline]
    fn tile<const R: usize, const P: usize>(
        &self,
        isa: Isa,
        xs: [&[f32]; R],
        ps: [usize; P],
        k: usize,
    ) -> TileOut<R, P> {
        let ws = std::array::from_fn(|d| {
            self.0
                .get(ps[d] * k * NP..(ps[d] + 1) * k * NP)
                .unwrap_or(&[])
        });
        tile::<T, R, P>(isa, xs, ws, k)
    }
}

/// Computes outputs `16 p0 .. min(16 p1, n_out)` for all `rows` into `out`, laid out
/// `[rows, width]` with `width = min(16 p1, n_out) - 16 p0` (one thread's chunk).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_panels<S: PanelSrc>(
    isa: Isa,
    x: &[f32],
    rows: usize,
    k: usize,
    src: &S,
    n_out: usize,
    p0: usize,
    p1: usize,
    out: &mut [f32],
) {
    match isa {
        // 32 zmm: 8 rows x 3 panels = 24 accumulators; one row: 8 panels. (`panel_unit`
        // must agree.)
        Isa::Avx512 => run_avx512(isa, x, rows, k, src, n_out, p0, p1, out),
        // 16 ymm: 4 rows x 1 panel = 8 accumulators; one row: 4 panels.
        _ => run::<S, 4, 1, 4>(isa, x, rows, k, src, n_out, p0, p1, out),
    }
}

/// Hand a tile's rows and panels (starting at row `r`, panel `p`) to `put`.
fn emit<const R: usize, const P: usize>(
    put: &mut impl FnMut(usize, usize, &[f32; NP]),
    r: usize,
    p: usize,
    t: &TileOut<R, P>,
) {
    for (dr, tr) in t.iter().enumerate() {
        for (dp, v) in tr.iter().enumerate() {
            put(r + dr, p + dp, v);
        }
    }
}

/// Panels per thread chunk should be a multiple of this (whole tiles).
pub(crate) fn panel_unit(isa: Isa, rows: usize) -> usize {
    match (isa, rows >= 4) {
        (Isa::Avx512, true) => 3,
        (Isa::Avx512, false) => 8,
        (_, true) => 1,
        (_, false) => 4,
    }
}

/// The `R` rows from row `r` over the `np` panels from panel `p` (3 at a time, then 2, 1).
#[allow(clippy::too_many_arguments)]
fn rows_by_3<S: PanelSrc, const R: usize>(
    isa: Isa,
    src: &S,
    x: &[f32],
    k: usize,
    r: usize,
    p: usize,
    np: usize,
    put: &mut impl FnMut(usize, usize, &[f32; NP]),
) {
    let xs: [&[f32]; R] = std::array::from_fn(|d| &x[(r + d) * k..(r + d + 1) * k]);
    let mut q = p;
    while q + 3 <= p + np {
        emit(put, r, q, &src.tile::<R, 3>(isa, xs, [q, q + 1, q + 2], k));
        q += 3;
    }
    match p + np - q {
        2 => emit(put, r, q, &src.tile::<R, 2>(isa, xs, [q, q + 1], k)),
        1 => emit(put, r, q, &src.tile::<R, 1>(isa, xs, [q], k)),
        _ => {}
    }
}

/// The `R` rows from row `r` over panels `p0..p1`, `PW` panels at a time, then one by one.
#[allow(clippy::too_many_arguments)]
fn rows_wide<S: PanelSrc, const R: usize, const PW: usize>(
    isa: Isa,
    src: &S,
    x: &[f32],
    k: usize,
    r: usize,
    p0: usize,
    p1: usize,
    put: &mut impl FnMut(usize, usize, &[f32; NP]),
) {
    let xs: [&[f32]; R] = std::array::from_fn(|d| &x[(r + d) * k..(r + d + 1) * k]);
    let mut p = p0;
    while p + PW <= p1 {
        emit(
            put,
            r,
            p,
            &src.tile::<R, PW>(isa, xs, std::array::from_fn(|d| p + d), k),
        );
        p += PW;
    }
    while p < p1 {
        emit(put, r, p, &src.tile::<R, 1>(isa, xs, [p], k));
        p += 1;
    }
}

/// AVX-512 (32 zmm): 13 to 16 rows: `rows x 1` tiles, 9 to 12 rows: `rows x 2` tiles (every
/// weight vector widened once for all rows); 4 to 8 rows: `rows x 3` tiles (more rows, e.g.
/// at other call sites: `ceil(rows / 8)` balanced row tiles of 4 to 8 rows per 3 panels);
/// 2 or 3 rows: `rows x 8` tiles; one row: 1 x 8 tiles. At most 24 accumulators. Every element stays one sequential FMA chain over `k`, so the tiling changes
/// no bits.
#[allow(clippy::too_many_arguments)]
fn run_avx512<S: PanelSrc>(
    isa: Isa,
    x: &[f32],
    rows: usize,
    k: usize,
    src: &S,
    n_out: usize,
    p0: usize,
    p1: usize,
    out: &mut [f32],
) {
    if rows <= 1 {
        return run::<S, 8, 3, 8>(isa, x, rows, k, src, n_out, p0, p1, out);
    }
    let o0 = p0 * NP;
    let width = (p1 * NP).min(n_out) - o0;
    let mut put = |r: usize, p: usize, vals: &[f32; NP]| {
        let o = p * NP;
        let n = NP.min(n_out - o);
        out[r * width + o - o0..][..n].copy_from_slice(&vals[..n]);
    };
    // The 9-16-row tiles broadcast each x value into one or two FMAs: when those rows of x
    // outgrow L1 the broadcasts become L2 loads (Zen 4, 32 KiB: a 16-row verify of
    // Qwen3-0.6B, k 1024 / 3072, 204 -> 120 ms with the 8 x 3 tiles below). Same bits.
    let wide_fits = rows * k * 4 <= Isa::l1d_bytes();
    match rows {
        9..=16 if !wide_fits => {}
        2 => return rows_wide::<S, 2, 8>(isa, src, x, k, 0, p0, p1, &mut put),
        3 => return rows_wide::<S, 3, 8>(isa, src, x, k, 0, p0, p1, &mut put),
        9 => return rows_wide::<S, 9, 2>(isa, src, x, k, 0, p0, p1, &mut put),
        10 => return rows_wide::<S, 10, 2>(isa, src, x, k, 0, p0, p1, &mut put),
        11 => return rows_wide::<S, 11, 2>(isa, src, x, k, 0, p0, p1, &mut put),
        12 => return rows_wide::<S, 12, 2>(isa, src, x, k, 0, p0, p1, &mut put),
        13 => return rows_wide::<S, 13, 1>(isa, src, x, k, 0, p0, p1, &mut put),
        14 => return rows_wide::<S, 14, 1>(isa, src, x, k, 0, p0, p1, &mut put),
        15 => return rows_wide::<S, 15, 1>(isa, src, x, k, 0, p0, p1, &mut put),
        16 => return rows_wide::<S, 16, 1>(isa, src, x, k, 0, p0, p1, &mut put),
        _ => {}
    }
    let n_tiles = rows.div_ceil(8);
    let (base, extra) = (rows / n_tiles, rows % n_tiles);
    let mut p = p0;
    while p < p1 {
        let np = 3.min(p1 - p);
        let mut r = 0;
        for t in 0..n_tiles {
            let size = base + usize::from(t < extra);
            match size {
                8 => rows_by_3::<S, 8>(isa, src, x, k, r, p, np, &mut put),
                7 => rows_by_3::<S, 7>(isa, src, x, k, r, p, np, &mut put),
                6 => rows_by_3::<S, 6>(isa, src, x, k, r, p, np, &mut put),
                5 => rows_by_3::<S, 5>(isa, src, x, k, r, p, np, &mut put),
                // rows >= 4 makes every size 4..=8.
                _ => rows_by_3::<S, 4>(isa, src, x, k, r, p, np, &mut put),
            }
            r += size;
        }
        p += np;
    }
}

/// `RM x PM`: the multi-row tile; `PR`: panels of the one-row tile.
#[allow(clippy::too_many_arguments)]
fn run<S: PanelSrc, const RM: usize, const PM: usize, const PR: usize>(
    isa: Isa,
    x: &[f32],
    rows: usize,
    k: usize,
    src: &S,
    n_out: usize,
    p0: usize,
    p1: usize,
    out: &mut [f32],
) {
    let o0 = p0 * NP;
    let width = (p1 * NP).min(n_out) - o0;
    let xr = |r: usize| &x[r * k..(r + 1) * k];
    // Write a tile's valid outputs.
    let mut put = |r: usize, p: usize, vals: &[f32; NP]| {
        let o = p * NP;
        let n = NP.min(n_out - o);
        out[r * width + o - o0..][..n].copy_from_slice(&vals[..n]);
    };
    if rows >= 4 {
        let mut p = p0;
        while p < p1 {
            let np = PM.min(p1 - p);
            let mut r = 0;
            // RM-row tiles over the np (<= PM <= 3) panels.
            while r + RM <= rows {
                let xs = std::array::from_fn(|d| xr(r + d));
                match np {
                    3 => emit(
                        &mut put,
                        r,
                        p,
                        &src.tile::<RM, 3>(isa, xs, [p, p + 1, p + 2], k),
                    ),
                    2 => emit(&mut put, r, p, &src.tile::<RM, 2>(isa, xs, [p, p + 1], k)),
                    _ => emit(&mut put, r, p, &src.tile::<RM, 1>(isa, xs, [p], k)),
                }
                r += RM;
            }
            // Leftover rows: 4-row then 1-row tiles, panel by panel.
            for q in p..p + np {
                let mut rr = r;
                while rr + 4 <= rows {
                    emit(
                        &mut put,
                        rr,
                        q,
                        &src.tile::<4, 1>(isa, std::array::from_fn(|d| xr(rr + d)), [q], k),
                    );
                    rr += 4;
                }
                while rr < rows {
                    emit(&mut put, rr, q, &src.tile::<1, 1>(isa, [xr(rr)], [q], k));
                    rr += 1;
                }
            }
            p += np;
        }
    } else {
        for r in 0..rows {
            let mut p = p0;
            while p + PR <= p1 {
                let t = src.tile::<1, PR>(isa, [xr(r)], std::array::from_fn(|d| p + d), k);
                for (dp, v) in t[0].iter().enumerate() {
                    put(r, p + dp, v);
                }
                p += PR;
            }
            while p < p1 {
                let t = src.tile::<1, 1>(isa, [xr(r)], [p], k);
                put(r, p, &t[0][0]);
                p += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_unpack_roundtrip() {
        let (rows, k) = (37, 5);
        let src: Vec<f32> = (0..rows * k).map(|i| i as f32).collect();
        let p = pack(&src, rows, k);
        assert_eq!(p.len(), 3 * k * NP);
        let mut row = vec![0.0; k];
        for o in 0..rows {
            unpack_row(&p, k, o, &mut row);
            assert_eq!(row, src[o * k..(o + 1) * k]);
        }
    }

    #[test]
    fn all_isas_give_identical_bits() {
        let (rows, n, k) = (17, 53, 67);
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 37) % 101) as f32 / 17.0 - 3.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 53) % 97) as f32 / 13.0 - 3.5)
            .collect();
        let packed = pack(&w, n, k);
        let np = n.div_ceil(NP);
        let mut results = Vec::new();
        for isa in [Isa::Portable, Isa::Avx2Fma, Isa::Avx512]
            .into_iter()
            .filter(|i| i.supported())
        {
            for r in [rows, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] {
                let mut out = vec![0.0f32; r * n];
                matmul_panels(isa, &x, r, k, &Dense(&packed), n, 0, np, &mut out);
                // Check against a sequential fma chain.
                for rr in 0..r {
                    for o in 0..n {
                        let mut a = 0.0f32;
                        for i in 0..k {
                            a = x[rr * k + i].mul_add(w[o * k + i], a);
                        }
                        assert_eq!(
                            out[rr * n + o].to_bits(),
                            a.to_bits(),
                            "{isa:?} rows {r} ({rr}, {o})"
                        );
                    }
                }
                results.push(out[..n].to_vec());
            }
        }
        assert!(results.windows(2).all(|w| w[0] == w[1]));
    }
}
