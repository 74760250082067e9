//! Dot-product kernels of the CPU backend (attention scores, norms), the attention value
//! accumulation and the vectorised exp. Matmul uses the panel kernels of `panel`.
//!
//! Every output element `dot(x_r, w_o)` is computed with the same sequence of operations
//! whatever tile it sits in: eight lane accumulators over the inner dimension in chunks of
//! eight (lane `l` accumulates elements `8c + l` in increasing `c`), a fixed reduction tree
//! `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`, then the tail elements in increasing order. A tile
//! only shares loads between elements, never arithmetic, so a row's result does not depend on
//! how many rows or outputs are computed with it (the backend's per-row determinism).
//!
//! Three instruction sets: AVX-512F (16 lanes: the lanes pair as `l + (l+8)` first, then the
//! eight-lane tree), AVX2 + FMA (x86-64, detected at run time) and a portable fallback
//! (separate multiply and add). A backend uses one of them for every call, so results are
//! reproducible within a process; they differ in the last bits between instruction sets.

/// Lanes per accumulator.
pub(crate) const LANES: usize = 8;

/// Instruction set used by the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, separate multiply and add.
    Portable,
    /// x86-64 AVX2 with fused multiply-add.
    Avx2Fma,
    /// x86-64 AVX-512F (16 lanes, fused multiply-add).
    Avx512,
}

impl Isa {
    /// The best instruction set this CPU supports.
    pub fn detect() -> Isa {
        [Isa::Avx512, Isa::Avx2Fma]
            .into_iter()
            .find(|i| i.supported())
            .unwrap_or(Isa::Portable)
    }

    /// Bytes of L1 data cache per core (CPUID: leaf 4 on Intel, 0x8000_0005 on AMD; 32 KiB
    /// where it does not say). The AVX-512 matmul picks its tile shape by it.
    pub fn l1d_bytes() -> usize {
        static L1D: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        *L1D.get_or_init(|| l1d_from_cpuid().unwrap_or(32 * 1024))
    }

    /// Whether this CPU can run `self`.
    pub fn supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f") && Isa::Avx2Fma.supported()
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// `out[r][o] = dot(xs[r][..k], ws[o][..k])` for an `R x O` tile.
///
/// Every slice must hold at least `k` values (callers slice them to `k`).
#[inline]
pub(crate) fn dot_tile<const R: usize, const O: usize>(
    isa: Isa,
    xs: [&[f32]; R],
    ws: [&[f32]; O],
    k: usize,
) -> [[f32; O]; R] {
    // Internal invariant: the callers slice every operand to `k` values. Checked here so the
    // unsafe loads below stay in bounds whatever a future caller does.
    let ok = xs.iter().all(|x| x.len() >= k) && ws.iter().all(|w| w.len() >= k);
    if !ok {
        return [[f32::NAN; O]; R];
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the backend only holds an `Isa` that `Isa::supported` accepted on this CPU
        // (`Cpu::default` detects it, `Cpu::with_isa` checks it), and every slice holds at
        // least `k` values (checked above).
        Isa::Avx2Fma => unsafe { avx2::dot_tile::<R, O>(xs, ws, k) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 => unsafe { avx512::dot_tile::<R, O>(xs, ws, k) },
        _ => dot_tile_portable::<R, O>(xs, ws, k),
    }
}

/// Single dot product with the tile kernels' order.
#[inline]
pub(crate) fn dot(isa: Isa, x: &[f32], w: &[f32]) -> f32 {
    let k = x.len().min(w.len());
    dot_tile::<1, 1>(isa, [x], [w], k)[0][0]
}

/// `QN x KN = 16` dot products `dot(xs[q], ws[k])` with exactly the bits of [`dot`] (the
/// AVX-512 path shares loads and the reduction shuffles; other paths call [`dot`]).
#[inline]
pub(crate) fn dot_grid<const QN: usize, const KN: usize>(
    isa: Isa,
    xs: [&[f32]; QN],
    ws: [&[f32]; KN],
) -> [[f32; KN]; QN] {
    let k = xs[0].len();
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512
        && QN * KN == 16
        && xs.iter().all(|x| x.len() == k)
        && ws.iter().all(|w| w.len() >= k)
    {
        // SAFETY: AVX-512F was checked by `Isa::supported` for this backend; every slice
        // holds at least `k` values.
        return unsafe { avx512::dot_grid::<QN, KN>(xs, ws, k) };
    }
    std::array::from_fn(|q| std::array::from_fn(|t| dot(isa, xs[q], ws[t])))
}

/// A K / V cache value the attention kernels read: f32, or f16 widened (exactly) as it is
/// loaded, so that both give the same f32 operands and the same bits. Only `f32` and
/// `half::f16` implement it (the AVX-512 loads read 16 of `F16 ? 2 : 4` bytes).
pub(crate) trait KvElem: Copy + Send + Sync + 'static {
    /// Stored as f16 (the AVX-512 kernels load 16 with `vcvtph2ps`).
    const F16: bool;
    /// The value as f32 (exact).
    fn widen(self) -> f32;
    /// The slice itself when it already holds f32.
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
}

impl KvElem for f32 {
    const F16: bool = false;
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
}

impl KvElem for half::f16 {
    const F16: bool = true;
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn as_f32(_: &[half::f16]) -> Option<&[f32]> {
        None
    }
}

/// Scores of `QN` queries against the keys `j0 .. j1` of a strided K (`key j` =
/// `k[koff + j * stride ..][.. hd]`, `hd = xs[q].len()`):
/// `sc[rows[q] + j - j0] = dot(xs[q], key j) * scale`, with the bits of [`dot_grid`] (over
/// the keys' f32 values). Returns how many keys from `j0` it handled (a multiple of `KN`, 0
/// when this ISA or shape has no strip kernel); the caller does the rest.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn score_strip<const QN: usize, const KN: usize, T: KvElem>(
    isa: Isa,
    xs: [&[f32]; QN],
    k: &[T],
    koff: usize,
    stride: usize,
    j0: usize,
    j1: usize,
    scale: f32,
    sc: &mut [f32],
    rows: [usize; QN],
) -> usize {
    let hd = xs[0].len();
    let n = (j1.saturating_sub(j0)) / KN * KN;
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512
        && QN * KN == 16
        && n > 0
        && hd > 0
        && hd.is_multiple_of(16)
        && xs.iter().all(|x| x.len() == hd)
        && koff + (j0 + n - 1) * stride + hd <= k.len()
        && rows.iter().all(|&r| r + n <= sc.len())
    {
        // SAFETY: AVX-512F was checked by `Isa::supported` for this backend; the bounds are
        // checked above.
        unsafe {
            avx512::score_strip::<QN, KN, T>(xs, k, koff, stride, j0, j0 + n, scale, sc, rows)
        };
        return n;
    }
    let _ = (isa, k, koff, stride, scale, sc, rows);
    0
}

/// Attention output accumulation for `QN` queries over the same keys:
/// `os[q][d] = fma(ps[q][t], v[v0 + t·stride + d], os[q][d])` for `t = 0, 1, ...` in order,
/// continuing from the current `os` (one sequential FMA chain per element: the result does
/// not depend on how the keys are split into calls nor on `QN`; identical bits on every path,
/// f16 values giving the bits of their f32 widening). f16 values off AVX-512 take a scalar
/// loop (the attention widens them into an f32 block first there).
pub(crate) fn weighted_acc<const QN: usize, T: KvElem>(
    isa: Isa,
    os: [&mut [f32]; QN],
    ps: [&[f32]; QN],
    v: &[T],
    v0: usize,
    stride: usize,
) {
    let n = os[0].len();
    let t_len = ps[0].len();
    let fits = os.iter().all(|o| o.len() == n)
        && ps.iter().all(|p| p.len() == t_len)
        && (t_len == 0 || v0 + (t_len - 1) * stride + n <= v.len());
    if !fits {
        // Internal invariant (the caller checked the shapes); NaN makes a breach visible.
        for o in os {
            o.fill(f32::NAN);
        }
        return;
    }
    if t_len == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        let n16 = n / 16 * 16;
        let mut ptrs: [*mut f32; QN] = [std::ptr::null_mut(); QN];
        for (p, o) in ptrs.iter_mut().zip(os.iter()) {
            *p = o.as_ptr() as *mut f32;
        }
        let mut c = 0;
        while c < n16 {
            let g = match (n16 - c) / 16 {
                4.. => 4,
                2..=3 => 2,
                _ => 1,
            };
            let at: [*mut f32; QN] = std::array::from_fn(|q| ptrs[q].wrapping_add(c));
            // SAFETY: AVX-512F checked by `Isa::supported`; every `os[q]` holds `c + 16 g`
            // values and the reads stay inside `v` (checked above). The pointers come from
            // distinct `&mut` slices, so the writes do not alias.
            unsafe {
                match g {
                    4 => avx512::weighted_acc::<QN, 4, T>(at, ps, v, v0 + c, stride),
                    2 => avx512::weighted_acc::<QN, 2, T>(at, ps, v, v0 + c, stride),
                    _ => avx512::weighted_acc::<QN, 1, T>(at, ps, v, v0 + c, stride),
                }
            }
            c += 16 * g;
        }
        for (o, p) in os.into_iter().zip(ps) {
            for (d, od) in o.iter_mut().enumerate().skip(n16) {
                for (t, &pt) in p.iter().enumerate() {
                    *od = pt.mul_add(v[v0 + t * stride + d].widen(), *od);
                }
            }
        }
        return;
    }
    let Some(v) = T::as_f32(v) else {
        for (o, p) in os.into_iter().zip(ps) {
            for (t, &pt) in p.iter().enumerate() {
                for (od, vd) in o.iter_mut().zip(&v[v0 + t * stride..][..n]) {
                    *od = pt.mul_add(vd.widen(), *od);
                }
            }
        }
        return;
    };
    for (o, p) in os.into_iter().zip(ps) {
        for (t, &pt) in p.iter().enumerate() {
            let vt = &v[v0 + t * stride..][..n];
            #[cfg(target_arch = "x86_64")]
            if isa == Isa::Avx2Fma {
                // SAFETY: AVX2 and FMA checked by `Isa::supported` for this backend.
                unsafe { fma_axpy_avx2(o, pt, vt) };
                continue;
            }
            for (od, &vd) in o.iter_mut().zip(vt) {
                *od = pt.mul_add(vd, *od);
            }
        }
    }
}

/// Rows of f16 values to f32 (exact): `dst[r * hd + c] = src[off + r * stride + c]` for
/// `r < dst.len() / hd`, `c < hd`. AVX-512F converts 16 values per instruction; the other
/// paths use `half`'s slice conversion (F16C where the CPU has it).
pub(crate) fn f16_rows_to_f32(
    isa: Isa,
    src: &[half::f16],
    off: usize,
    stride: usize,
    hd: usize,
    dst: &mut [f32],
) {
    use half::slice::HalfFloatSliceExt;
    let rows = dst.len().checked_div(hd).unwrap_or(0);
    let fits = dst.len() == rows * hd && (rows == 0 || off + (rows - 1) * stride + hd <= src.len());
    if !fits {
        // Internal invariant (the caller checked the shapes); NaN makes a breach visible.
        dst.fill(f32::NAN);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: AVX-512F checked by `Isa::supported`; the reads stay inside `src` and the
        // writes inside `dst` (checked above).
        unsafe { avx512::f16_rows_to_f32(src, off, stride, hd, dst) };
        return;
    }
    let _ = isa;
    for (r, d) in dst.chunks_exact_mut(hd).enumerate() {
        src[off + r * stride..][..hd].convert_to_f32_slice(d);
    }
}

/// `o[i] = fma(p, v[i], o[i])`.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_axpy_avx2(o: &mut [f32], p: f32, v: &[f32]) {
    for (od, &vd) in o.iter_mut().zip(v) {
        *od = p.mul_add(vd, *od);
    }
}

/// Max of the non-NaN values (`-inf` if none); order-independent, so any lane split gives
/// the same value.
pub(crate) fn max_non_nan(x: &[f32]) -> f32 {
    let mut m8 = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (m, &s) in m8.iter_mut().zip(c) {
            *m = if s > *m { s } else { *m };
        }
    }
    let mut m = m8
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    for &s in chunks.remainder() {
        if s > m {
            m = s;
        }
    }
    m
}

const EXP_HI: f32 = 88.72283;
const EXP_LO: f32 = -87.33654;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `e^x` in f32 (Cephes' range reduction and polynomial, about 1 ulp; below -87.34 it
/// returns 0, above 88.72 infinity, NaN for NaN). Scalar reference of [`exp_in_place`].
#[inline]
pub(crate) fn exp_f32(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > EXP_HI {
        return f32::INFINITY;
    }
    if x < EXP_LO {
        return 0.0;
    }
    let n = x.mul_add(LOG2E, 0.5).floor();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut y = EXP_P[0];
    for &c in &EXP_P[1..] {
        y = y.mul_add(r, c);
    }
    let y = y.mul_add(r * r, r) + 1.0;
    // 2^n for n in [-126, 128]: split in two factors so that both are normal.
    let n = n as i32;
    let (a, b) = (n / 2, n - n / 2);
    y * f32::from_bits(((a + 127) as u32) << 23) * f32::from_bits(((b + 127) as u32) << 23)
}

/// `x[i] = exp_f32(x[i])` (vectorised on AVX-512 with the same operations: same bits).
pub(crate) fn exp_in_place(isa: Isa, x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: AVX-512F checked by `Isa::supported` for this backend.
        unsafe { avx512::exp_in_place(x) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2Fma {
        // SAFETY: AVX2 and FMA checked by `Isa::supported` for this backend.
        unsafe { exp_in_place_fma(x) };
        return;
    }
    let _ = isa;
    for v in x.iter_mut() {
        *v = exp_f32(*v);
    }
}

/// [`exp_f32`] over `x` compiled with FMA: its fused multiply-adds and `floor` inline as
/// instructions instead of calls into libm (the same roundings, so the same bits; the
/// drafter's SwiGLU spent ~20% of a CPU draft step in those calls on an AVX2-only CPU).
///
/// # Safety
/// AVX2 and FMA available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_in_place_fma(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v = exp_f32(*v);
    }
}

/// Softmax of one score row in place: `max = max_non_nan(x)`, `x -= max`, `exp`, `sum =
/// dot(x, ones)` (the dot kernel's order), `x *= 1 / sum`. `ones` holds at least `x.len()`
/// ones. The AVX-512 path fuses the passes with the same bits.
pub(crate) fn softmax_in_place(isa: Isa, x: &mut [f32], ones: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: AVX-512F checked by `Isa::supported` for this backend.
        unsafe { avx512::softmax_in_place(x) };
        return;
    }
    softmax_passes(isa, x, ones);
}

/// The unfused passes of [`softmax_in_place`] (every ISA; the reference of the fused one).
pub(crate) fn softmax_passes(isa: Isa, x: &mut [f32], ones: &[f32]) {
    let max = max_non_nan(x);
    for s in x.iter_mut() {
        *s -= max;
    }
    exp_in_place(isa, x);
    let sum = dot(isa, x, &ones[..x.len()]);
    let inv = 1.0 / sum;
    for s in x.iter_mut() {
        *s *= inv;
    }
}

#[inline]
fn reduce_lanes(a: &[f32; LANES]) -> f32 {
    let s0 = a[0] + a[4];
    let s1 = a[1] + a[5];
    let s2 = a[2] + a[6];
    let s3 = a[3] + a[7];
    let t0 = s0 + s2;
    let t1 = s1 + s3;
    t0 + t1
}

fn dot_tile_portable<const R: usize, const O: usize>(
    xs: [&[f32]; R],
    ws: [&[f32]; O],
    k: usize,
) -> [[f32; O]; R] {
    let n8 = k / LANES * LANES;
    let mut acc = [[[0.0f32; LANES]; O]; R];
    let mut c = 0;
    while c < n8 {
        for (r, x) in xs.iter().enumerate() {
            let xv = &x[c..c + LANES];
            for (o, w) in ws.iter().enumerate() {
                let wv = &w[c..c + LANES];
                let a = &mut acc[r][o];
                for l in 0..LANES {
                    a[l] += xv[l] * wv[l];
                }
            }
        }
        c += LANES;
    }
    let mut out = [[0.0f32; O]; R];
    for r in 0..R {
        for o in 0..O {
            let mut s = reduce_lanes(&acc[r][o]);
            for i in n8..k {
                s += xs[r][i] * ws[o][i];
            }
            out[r][o] = s;
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::LANES;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        // Same tree as `reduce_lanes`: (l0+l4, l1+l5, l2+l6, l3+l7), then (0+2, 1+3), then 0+1.
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let u = _mm_add_ss(t, _mm_shuffle_ps::<1>(t, t));
        _mm_cvtss_f32(u)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; every slice must hold at least `k` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_tile<const R: usize, const O: usize>(
        xs: [&[f32]; R],
        ws: [&[f32]; O],
        k: usize,
    ) -> [[f32; O]; R] {
        let n8 = k / LANES * LANES;
        let mut acc = [[_mm256_setzero_ps(); O]; R];
        let xp: [*const f32; R] = std::array::from_fn(|r| xs[r].as_ptr());
        let wp: [*const f32; O] = std::array::from_fn(|o| ws[o].as_ptr());
        let mut c = 0;
        while c < n8 {
            let mut wv = [_mm256_setzero_ps(); O];
            for o in 0..O {
                // SAFETY: c + 8 <= n8 <= k <= ws[o].len().
                wv[o] = unsafe { _mm256_loadu_ps(wp[o].add(c)) };
            }
            for r in 0..R {
                // SAFETY: c + 8 <= k <= xs[r].len().
                let xv = unsafe { _mm256_loadu_ps(xp[r].add(c)) };
                for o in 0..O {
                    acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]);
                }
            }
            c += LANES;
        }
        let mut out = [[0.0f32; O]; R];
        for r in 0..R {
            for o in 0..O {
                let mut s = hsum(acc[r][o]);
                for i in n8..k {
                    s = xs[r][i].mul_add(ws[o][i], s);
                }
                out[r][o] = s;
            }
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    const L: usize = 16;

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn hsum(v: __m512) -> f32 {
        // Fixed tree: (l + l+8) for l < 8, then (l + l+4), (l + l+2), (l + l+1).
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
        _mm_cvtss_f32(s1)
    }

    /// 16 cache values from `p` as f32 (f16 widened exactly by `vcvtph2ps`).
    ///
    /// # Safety
    /// AVX-512F available; `p` points at 16 readable values.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn load16<T: super::KvElem>(p: *const T) -> __m512 {
        const { assert!(std::mem::size_of::<T>() == if T::F16 { 2 } else { 4 }) };
        if T::F16 {
            let r: __m512;
            // SAFETY: 16 f16 = 32 readable bytes at p (caller), AVX-512F available. The
            // memory-source `vcvtph2ps` (as `_mm512_cvtph_ps` of a load, exact), in asm
            // because the intrinsic's masked form made LLVM spill the strip kernels'
            // accumulators to the stack (~1.5x slower calls).
            unsafe {
                std::arch::asm!(
                    "vcvtph2ps {r}, ymmword ptr [{p}]",
                    p = in(reg) p,
                    r = out(zmm_reg) r,
                    options(pure, readonly, nostack, preserves_flags),
                );
            }
            r
        } else {
            // SAFETY: 16 f32 readable at p (caller).
            unsafe { _mm512_loadu_ps(p.cast()) }
        }
    }

    /// `QN x KN = 16` dots with the bits of `hsum` + tail: the reduction levels are shared
    /// between the sums through shuffles that pair exactly the lanes `hsum` pairs.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `x` and every `ws[t]` hold at least `k` values.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn dot_grid<const QN: usize, const KN: usize>(
        xs: [&[f32]; QN],
        ws: [&[f32]; KN],
        k: usize,
    ) -> [[f32; KN]; QN] {
        const { assert!(QN * KN == 16) };
        let n16 = k / L * L;
        let mut acc = [_mm512_setzero_ps(); 16];
        let xp: [*const f32; QN] = std::array::from_fn(|t| xs[t].as_ptr());
        let wp: [*const f32; KN] = std::array::from_fn(|t| ws[t].as_ptr());
        let mut c = 0;
        while c < n16 {
            // SAFETY: c + 16 <= k <= every slice length.
            let wv: [__m512; KN] =
                std::array::from_fn(|t| unsafe { _mm512_loadu_ps(wp[t].add(c)) });
            for qi in 0..QN {
                // SAFETY: as above.
                let xv = unsafe { _mm512_loadu_ps(xp[qi].add(c)) };
                for kj in 0..KN {
                    acc[qi * KN + kj] = _mm512_fmadd_ps(xv, wv[kj], acc[qi * KN + kj]);
                }
            }
            c += L;
        }
        let f = reduce16(&acc);
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` holds 16 f32.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), f) };
        let mut out = [[0.0f32; KN]; QN];
        for (lane, &v) in lanes.iter().enumerate() {
            // Lane 4q + u holds sum 4u + q.
            let t = (lane % 4) * 4 + lane / 4;
            let (qi, kj) = (t / KN, t % KN);
            let mut o = v;
            for i in n16..k {
                o = xs[qi][i].mul_add(ws[kj][i], o);
            }
            out[qi][kj] = o;
        }
        out
    }

    /// The reduction tree of `hsum` applied to 16 accumulators at once: lane `4q + u` of the
    /// result holds the sum of `acc[4u + q]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn reduce16(acc: &[__m512; 16]) -> __m512 {
        // Level 1: lanes l + (l+8); pairs of sums share a register (8 lanes each).
        let l1: [__m512; 8] = std::array::from_fn(|i| {
            let (a, b) = (acc[2 * i], acc[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(a, b),
                _mm512_shuffle_f32x4::<0xEE>(a, b),
            )
        });
        // Level 2: l + (l+4) within each 8-lane half; four sums per register.
        let l2: [__m512; 4] = std::array::from_fn(|m| {
            let (a, b) = (l1[2 * m], l1[2 * m + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(a, b),
                _mm512_shuffle_f32x4::<0xDD>(a, b),
            )
        });
        // Level 3: l + (l+2) within each 4-lane quarter; two sums per quarter.
        let l3: [__m512; 2] = std::array::from_fn(|n| {
            let (a, b) = (_mm512_castps_pd(l2[2 * n]), _mm512_castps_pd(l2[2 * n + 1]));
            _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
            )
        });
        // Level 4: lanes 0 + 1 of each pair.
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(l3[0], l3[1]),
            _mm512_shuffle_ps::<0xDD>(l3[0], l3[1]),
        )
    }

    /// Attention scores of `QN` queries against keys `j0 .. j1` (`j1 - j0` a multiple of
    /// `KN`): `sc[rows[q] + j - j0] = dot(xs[q], key j) * scale` with exactly the bits of
    /// [`dot_grid`] (same accumulation, same reduction tree; head dims a multiple of 16, so no
    /// tail), key `j` at `k[koff + j * stride ..][.. hd]`. One call per strip instead of one per
    /// tile: the results are permuted into query-major order in a register and stored
    /// directly.
    ///
    /// # Safety
    /// AVX-512F available; every `xs[q]` holds `hd` values, `hd % 16 == 0`;
    /// `koff + (j1 - 1) * stride + hd <= k.len()`; `rows[q] + j1 - j0 <= sc.len()`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn score_strip<const QN: usize, const KN: usize, T: super::KvElem>(
        xs: [&[f32]; QN],
        k: &[T],
        koff: usize,
        stride: usize,
        j0: usize,
        j1: usize,
        scale: f32,
        sc: &mut [f32],
        rows: [usize; QN],
    ) {
        const { assert!(QN * KN == 16) };
        let hd = xs[0].len();
        let xp: [*const f32; QN] = std::array::from_fn(|t| xs[t].as_ptr());
        let kp = k.as_ptr();
        let sp = sc.as_mut_ptr();
        // Lane t = q * KN + kj after the permutation (the transpose of reduce16's order).
        let perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        let vscale = _mm512_set1_ps(scale);
        let store_mask: __mmask16 = ((1u32 << KN) - 1) as __mmask16;
        let mut j = j0;
        while j < j1 {
            let mut acc = [_mm512_setzero_ps(); 16];
            let mut c = 0;
            while c < hd {
                // SAFETY: c + 16 <= hd = xs[qi].len().
                let xv: [__m512; QN] =
                    std::array::from_fn(|qi| unsafe { _mm512_loadu_ps(xp[qi].add(c)) });
                // One key at a time: QN + 1 + 16 live vectors (loading all KN keys first made
                // LLVM spill accumulators when an f16 key needs a register of its own).
                for kj in 0..KN {
                    // SAFETY: koff + (j + kj) * stride + c + 16 <= k.len() (caller).
                    let wv = unsafe { load16(kp.add(koff + (j + kj) * stride + c)) };
                    for qi in 0..QN {
                        acc[qi * KN + kj] = _mm512_fmadd_ps(xv[qi], wv, acc[qi * KN + kj]);
                    }
                }
                c += L;
            }
            let f = _mm512_mul_ps(_mm512_permutexvar_ps(perm, reduce16(&acc)), vscale);
            for (qi, &r) in rows.iter().enumerate() {
                let part = _mm512_maskz_compress_ps(
                    (store_mask as u32).wrapping_shl((qi * KN) as u32) as __mmask16,
                    f,
                );
                // SAFETY: rows[qi] + j - j0 + KN <= rows[qi] + j1 - j0 <= sc.len() (caller).
                unsafe { _mm512_mask_storeu_ps(sp.add(r + j - j0), store_mask, part) };
            }
            j += KN;
        }
    }

    /// Vector `exp_f32` (same operations, same bits).
    ///
    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn exp_in_place(x: &mut [f32]) {
        let mut chunks = x.chunks_exact_mut(L);
        for c in &mut chunks {
            // SAFETY: c holds 16 f32.
            let v = unsafe { _mm512_loadu_ps(c.as_ptr()) };
            let res = exp16(v);
            // SAFETY: c holds 16 f32.
            unsafe { _mm512_storeu_ps(c.as_mut_ptr(), res) };
        }
        for v in chunks.into_remainder() {
            *v = super::exp_f32(*v);
        }
    }

    /// `exp_f32` on 16 lanes (same operations, same bits).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn exp16(v: __m512) -> __m512 {
        use super::{EXP_HI, EXP_LO, EXP_P, LN2_HI, LN2_LO, LOG2E};
        {
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(
                _mm512_fmadd_ps(v, _mm512_set1_ps(LOG2E), _mm512_set1_ps(0.5)),
            );
            let r = _mm512_fmadd_ps(
                n,
                _mm512_set1_ps(-LN2_LO),
                _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), v),
            );
            let mut y = _mm512_set1_ps(EXP_P[0]);
            for &c in &EXP_P[1..] {
                y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
            }
            let y = _mm512_add_ps(
                _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r),
                _mm512_set1_ps(1.0),
            );
            // n / 2 truncates toward zero like Rust's i32 division.
            let ni = _mm512_cvttps_epi32(n);
            let a = _mm512_srai_epi32::<1>(_mm512_add_epi32(ni, _mm512_srli_epi32::<31>(ni)));
            let b = _mm512_sub_epi32(ni, a);
            let bias = _mm512_set1_epi32(127);
            let pa = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(a, bias)));
            let pb = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(b, bias)));
            let mut res = _mm512_mul_ps(_mm512_mul_ps(y, pa), pb);
            // Out-of-range and NaN lanes, as the scalar code.
            let hi = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, _mm512_set1_ps(EXP_HI));
            let lo = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(v, _mm512_set1_ps(EXP_LO));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            res = _mm512_mask_mov_ps(res, hi, _mm512_set1_ps(f32::INFINITY));
            res = _mm512_mask_mov_ps(res, lo, _mm512_setzero_ps());
            res = _mm512_mask_mov_ps(res, nan, v);
            res
        }
    }

    /// Softmax of one row in place, fused: the bits of `max_non_nan`, `x -= max`,
    /// `exp_in_place`, `sum = dot(x, ones)` (one 16-lane accumulator, `hsum`, then the tail in
    /// order; `acc + e` is `fma(e, 1, acc)`), `x *= 1 / sum`. The maximum's value is that of
    /// `max_non_nan` (only the sign of a zero maximum may differ, which no later step sees:
    /// `±0 - ±0` is a zero and `exp` of either zero is 1).
    ///
    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn softmax_in_place(x: &mut [f32]) {
        let n = x.len();
        let n16 = n / L * L;
        let p = x.as_mut_ptr();
        let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut c = 0;
        while c < n16 {
            // SAFETY: c + 16 <= n.
            let v = unsafe { _mm512_loadu_ps(p.add(c)) };
            let gt = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, mv);
            mv = _mm512_mask_mov_ps(mv, gt, v);
            c += L;
        }
        let mut lanes = [0.0f32; 16];
        // SAFETY: lanes holds 16 f32.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), mv) };
        let mut max = lanes
            .iter()
            .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
        for &v in &x[n16..] {
            if v > max {
                max = v;
            }
        }
        let vmax = _mm512_set1_ps(max);
        let mut acc = _mm512_setzero_ps();
        let mut c = 0;
        while c < n16 {
            // SAFETY: c + 16 <= n.
            let e = exp16(_mm512_sub_ps(unsafe { _mm512_loadu_ps(p.add(c)) }, vmax));
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(p.add(c), e) };
            acc = _mm512_add_ps(e, acc);
            c += L;
        }
        for v in &mut x[n16..] {
            *v = super::exp_f32(*v - max);
        }
        let mut sum = hsum(acc);
        for &v in &x[n16..] {
            sum = v.mul_add(1.0, sum);
        }
        let inv = 1.0 / sum;
        let vinv = _mm512_set1_ps(inv);
        let mut c = 0;
        while c < n16 {
            // SAFETY: c + 16 <= n.
            unsafe { _mm512_storeu_ps(p.add(c), _mm512_mul_ps(_mm512_loadu_ps(p.add(c)), vinv)) };
            c += L;
        }
        for v in &mut x[n16..] {
            *v *= inv;
        }
    }

    /// `dst[r * hd + c] = src[off + r * stride + c]` as f32, `r < dst.len() / hd`.
    ///
    /// # Safety
    /// AVX-512F available; `hd > 0`, `dst.len()` a multiple of `hd`, and
    /// `off + (dst.len() / hd - 1) * stride + hd <= src.len()` when `dst` is not empty.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn f16_rows_to_f32(
        src: &[half::f16],
        off: usize,
        stride: usize,
        hd: usize,
        dst: &mut [f32],
    ) {
        let n16 = hd / L * L;
        let sp = src.as_ptr();
        for (r, d) in dst.chunks_exact_mut(hd).enumerate() {
            let s0 = off + r * stride;
            let dp = d.as_mut_ptr();
            let mut c = 0;
            while c < n16 {
                // SAFETY: s0 + c + 16 <= s0 + hd <= src.len(); c + 16 <= hd = d.len().
                unsafe {
                    let h = _mm256_loadu_si256(sp.add(s0 + c) as *const __m256i);
                    _mm512_storeu_ps(dp.add(c), _mm512_cvtph_ps(h));
                }
                c += L;
            }
            for (c, x) in d.iter_mut().enumerate().skip(n16) {
                *x = src[s0 + c].to_f32();
            }
        }
    }

    /// `os[q][d] = fma(ps[q][t], v[v0 + t stride + d], os[q][d])` for `d < 16 G`, all `t`:
    /// `QN x G` accumulators in registers, the value loads shared by the queries.
    ///
    /// # Safety
    /// AVX-512F available; each `os[q]` points at `16 G` writable values not aliasing
    /// anything else read here; every read is inside `v`; `ps[q].len()` are equal.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn weighted_acc<const QN: usize, const G: usize, T: super::KvElem>(
        os: [*mut f32; QN],
        ps: [&[f32]; QN],
        v: &[T],
        v0: usize,
        stride: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); G]; QN];
        for q in 0..QN {
            for c in 0..G {
                // SAFETY: os[q] holds 16 G values (caller).
                acc[q][c] = unsafe { _mm512_loadu_ps(os[q].add(c * L)) };
            }
        }
        let base = v.as_ptr();
        for t in 0..ps[0].len() {
            // SAFETY: v0 + t stride + 16 G <= v.len() (caller).
            let vt: [__m512; G] =
                std::array::from_fn(|c| unsafe { load16(base.add(v0 + t * stride + c * L)) });
            for q in 0..QN {
                let pb = _mm512_set1_ps(ps[q][t]);
                for c in 0..G {
                    acc[q][c] = _mm512_fmadd_ps(pb, vt[c], acc[q][c]);
                }
            }
        }
        for q in 0..QN {
            for c in 0..G {
                // SAFETY: os[q] holds 16 G values (caller).
                unsafe { _mm512_storeu_ps(os[q].add(c * L), acc[q][c]) };
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX-512F; every slice must hold at least `k` values.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn dot_tile<const R: usize, const O: usize>(
        xs: [&[f32]; R],
        ws: [&[f32]; O],
        k: usize,
    ) -> [[f32; O]; R] {
        let n16 = k / L * L;
        let mut acc = [[_mm512_setzero_ps(); O]; R];
        let xp: [*const f32; R] = std::array::from_fn(|r| xs[r].as_ptr());
        let wp: [*const f32; O] = std::array::from_fn(|o| ws[o].as_ptr());
        let mut c = 0;
        while c < n16 {
            let mut wv = [_mm512_setzero_ps(); O];
            for o in 0..O {
                // SAFETY: c + 16 <= n16 <= k <= ws[o].len().
                wv[o] = unsafe { _mm512_loadu_ps(wp[o].add(c)) };
            }
            for r in 0..R {
                // SAFETY: c + 16 <= k <= xs[r].len().
                let xv = unsafe { _mm512_loadu_ps(xp[r].add(c)) };
                for o in 0..O {
                    acc[r][o] = _mm512_fmadd_ps(xv, wv[o], acc[r][o]);
                }
            }
            c += L;
        }
        let mut out = [[0.0f32; O]; R];
        for r in 0..R {
            for o in 0..O {
                let mut s = hsum(acc[r][o]);
                for i in n16..k {
                    s = xs[r][i].mul_add(ws[o][i], s);
                }
                out[r][o] = s;
            }
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
fn l1d_from_cpuid() -> Option<usize> {
    use std::arch::x86_64::{__cpuid, __cpuid_count, CpuidResult};
    // leaves above the reported maximum are not queried
    let leaf0: CpuidResult = __cpuid(0);
    let vendor = [leaf0.ebx, leaf0.edx, leaf0.ecx];
    let amd = vendor == [0x6874_7541, 0x6974_6e65, 0x444d_4163]; // "AuthenticAMD"
    if amd {
        let ext_max = __cpuid(0x8000_0000).eax;
        if ext_max >= 0x8000_0005 {
            let kb = (__cpuid(0x8000_0005).ecx >> 24) as usize;
            return (kb > 0).then_some(kb * 1024);
        }
        return None;
    }
    if leaf0.eax < 4 {
        return None;
    }
    for sub in 0..16 {
        let r = __cpuid_count(4, sub);
        let kind = r.eax & 0x1f;
        if kind == 0 {
            break;
        }
        let level = (r.eax >> 5) & 0x7;
        if kind == 1 && level == 1 {
            let ways = ((r.ebx >> 22) & 0x3ff) as usize + 1;
            let parts = ((r.ebx >> 12) & 0x3ff) as usize + 1;
            let line = (r.ebx & 0xfff) as usize + 1;
            let sets = r.ecx as usize + 1;
            return Some(ways * parts * line * sets);
        }
    }
    None
}

#[cfg(not(target_arch = "x86_64"))]
fn l1d_from_cpuid() -> Option<usize> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_and_the_same_on_every_path() {
        let mut xs: Vec<f32> = (0..200_000)
            .map(|i| -90.0 + i as f32 * (180.0 / 200_000.0))
            .collect();
        xs.extend([
            0.0,
            -0.0,
            1.0,
            -1.0,
            88.7,
            88.8,
            -87.3,
            -87.4,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-30,
            -1e-30,
        ]);
        let mut worst = 0.0f64;
        for &x in &xs {
            let got = exp_f32(x) as f64;
            let want = (x as f64).exp();
            if x.is_nan() {
                assert!(got.is_nan());
            } else if x > 88.72283 {
                assert_eq!(got, f64::INFINITY);
            } else if x < -87.33654 {
                assert_eq!(got, 0.0);
            } else {
                worst = worst.max((got - want).abs() / want);
            }
        }
        assert!(worst < 3e-7, "max relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        for isa in [Isa::Portable, Isa::Avx2Fma, Isa::Avx512]
            .into_iter()
            .filter(|i| i.supported())
        {
            let mut v = xs.clone();
            exp_in_place(isa, &mut v);
            for (a, &x) in v.iter().zip(&xs) {
                assert_eq!(a.to_bits(), exp_f32(x).to_bits(), "{isa:?} x {x}");
            }
        }
    }

    #[test]
    fn dot_grids_equal_single_dots() {
        for k in [1usize, 15, 16, 17, 64, 100, 128] {
            let x: Vec<f32> = (0..k)
                .map(|i| ((i * 37) % 101) as f32 / 7.0 - 6.5)
                .collect();
            let w: Vec<Vec<f32>> = (0..16)
                .map(|t| {
                    (0..k)
                        .map(|i| ((i * 13 + t * 71) % 89) as f32 / 3.0 - 14.0)
                        .collect()
                })
                .collect();
            for isa in [Isa::Portable, Isa::Avx2Fma, Isa::Avx512]
                .into_iter()
                .filter(|i| i.supported())
            {
                let got = dot_grid::<1, 16>(isa, [&x], std::array::from_fn(|t| w[t].as_slice()));
                for t in 0..16 {
                    assert_eq!(
                        got[0][t].to_bits(),
                        dot(isa, &x, &w[t]).to_bits(),
                        "{isa:?} k {k} t {t}"
                    );
                }
                let g = dot_grid::<4, 4>(
                    isa,
                    std::array::from_fn(|q| w[q + 8].as_slice()),
                    std::array::from_fn(|t| w[t].as_slice()),
                );
                let h = dot_grid::<2, 8>(
                    isa,
                    [&x, &w[15]],
                    std::array::from_fn(|t| w[t + 3].as_slice()),
                );
                for a in 0..4 {
                    for b in 0..4 {
                        assert_eq!(g[a][b].to_bits(), dot(isa, &w[a + 8], &w[b]).to_bits());
                    }
                }
                for b in 0..8 {
                    assert_eq!(h[0][b].to_bits(), dot(isa, &x, &w[b + 3]).to_bits());
                    assert_eq!(h[1][b].to_bits(), dot(isa, &w[15], &w[b + 3]).to_bits());
                }
            }
        }
    }

    #[test]
    fn tiles_agree_with_single_dots() {
        let k = 77;
        let x: Vec<Vec<f32>> = (0..4)
            .map(|r| {
                (0..k)
                    .map(|i| ((r * 31 + i * 7) % 13) as f32 * 0.37 - 2.0)
                    .collect()
            })
            .collect();
        let w: Vec<Vec<f32>> = (0..3)
            .map(|o| {
                (0..k)
                    .map(|i| ((o * 17 + i * 5) % 11) as f32 * 0.21 - 1.0)
                    .collect()
            })
            .collect();
        for isa in [Isa::Portable, Isa::Avx2Fma, Isa::Avx512]
            .into_iter()
            .filter(|i| i.supported())
        {
            let t = dot_tile::<4, 3>(isa, [&x[0], &x[1], &x[2], &x[3]], [&w[0], &w[1], &w[2]], k);
            for r in 0..4 {
                for o in 0..3 {
                    assert_eq!(t[r][o].to_bits(), dot(isa, &x[r], &w[o]).to_bits());
                    let naive: f64 = x[r]
                        .iter()
                        .zip(&w[o])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    assert!(
                        (t[r][o] as f64 - naive).abs() < 1e-3,
                        "{} vs {naive}",
                        t[r][o]
                    );
                }
            }
        }
    }

    /// f16 K / V values read by the kernels give the bits of their f32 widening (score strips,
    /// value accumulation), and the row widening is exact, at odd offsets and strides too.
    #[test]
    fn f16_values_give_the_bits_of_their_widening() {
        use half::f16;
        for isa in [Isa::Portable, Isa::Avx2Fma, Isa::Avx512]
            .into_iter()
            .filter(|i| i.supported())
        {
            for hd in [1usize, 7, 16, 24, 64, 128] {
                let (stride, off, nk) = (3 * hd + 5, hd + 3, 37usize);
                let h: Vec<f16> = (0..off + (nk + 1) * stride + hd)
                    .map(|i| f16::from_f32(((i * 37 + 11) % 101) as f32 * 0.0193 - 0.97))
                    .collect();
                let w: Vec<f32> = h.iter().map(|x| x.to_f32()).collect();
                // rows widened
                let mut dst = vec![f32::NAN; nk * hd];
                f16_rows_to_f32(isa, &h, off, stride, hd, &mut dst);
                for (r, row) in dst.chunks_exact(hd).enumerate() {
                    assert_eq!(row, &w[off + r * stride..][..hd], "{isa:?} hd {hd} row {r}");
                }
                // value accumulation, 1 and 4 queries
                let ps: Vec<Vec<f32>> = (0..4)
                    .map(|q| {
                        (0..nk)
                            .map(|t| ((q * 7 + t * 3) % 13) as f32 * 0.07)
                            .collect()
                    })
                    .collect();
                let ps: [&[f32]; 4] = std::array::from_fn(|q| &ps[q][..]);
                let mut a = vec![0.5f32; 4 * hd];
                let mut b = a.clone();
                {
                    let mut it = a.chunks_exact_mut(hd);
                    let os: [&mut [f32]; 4] = std::array::from_fn(|_| it.next().unwrap());
                    weighted_acc::<4, f16>(isa, os, ps, &h, off, stride);
                    weighted_acc::<1, f16>(isa, [&mut a[..hd]], [ps[1]], &h, off, stride);
                }
                {
                    let mut it = b.chunks_exact_mut(hd);
                    let os: [&mut [f32]; 4] = std::array::from_fn(|_| it.next().unwrap());
                    weighted_acc::<4, f32>(isa, os, ps, &w, off, stride);
                    weighted_acc::<1, f32>(isa, [&mut b[..hd]], [ps[1]], &w, off, stride);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{isa:?} hd {hd} weighted_acc");
                // score strips
                let xs: Vec<Vec<f32>> = (0..4)
                    .map(|q| {
                        (0..hd)
                            .map(|i| ((q * 53 + i * 29) % 97) as f32 * 0.031 - 1.5)
                            .collect()
                    })
                    .collect();
                let xr: [&[f32]; 4] = std::array::from_fn(|q| &xs[q][..]);
                let rows: [usize; 4] = std::array::from_fn(|q| q * nk);
                let (mut s16, mut s32) = (vec![-7.0f32; 4 * nk], vec![-7.0f32; 4 * nk]);
                let n16 =
                    score_strip::<4, 4, f16>(isa, xr, &h, off, stride, 1, nk, 0.3, &mut s16, rows);
                let n32 =
                    score_strip::<4, 4, f32>(isa, xr, &w, off, stride, 1, nk, 0.3, &mut s32, rows);
                assert_eq!(n16, n32);
                assert_eq!(bits(&s16), bits(&s32), "{isa:?} hd {hd} score_strip");
            }
        }
    }

    /// The strip kernel writes, for every (query, key), the bits of `dot_grid` times the scale,
    /// in query-major order at the requested rows, and nothing else.
    #[test]
    fn score_strip_has_the_bits_of_dot_grid() {
        fn check<const QN: usize, const KN: usize>(isa: Isa, hd: usize, nk: usize) {
            let stride = 3 * hd + 16;
            let koff = hd + 16;
            let k: Vec<f32> = (0..koff + (nk + 2) * stride + hd)
                .map(|i| ((i * 37 + 11) % 101) as f32 * 0.0193 - 0.97)
                .collect();
            let xs: Vec<Vec<f32>> = (0..QN)
                .map(|q| {
                    (0..hd)
                        .map(|i| ((q * 53 + i * 29) % 97) as f32 * 0.031 - 1.5)
                        .collect()
                })
                .collect();
            let xr: [&[f32]; QN] = std::array::from_fn(|q| &xs[q][..]);
            let (j0, j1, width) = (2usize, 2 + nk, nk + 9);
            let rows: [usize; QN] = std::array::from_fn(|q| q * width + 3);
            let mut sc = vec![-7.0f32; QN * width + 3];
            let scale = 0.123f32;
            let n =
                score_strip::<QN, KN, f32>(isa, xr, &k, koff, stride, j0, j1, scale, &mut sc, rows);
            if isa != Isa::Avx512 {
                assert_eq!(n, 0);
                return;
            }
            assert_eq!(n, nk / KN * KN);
            let key = |j: usize| &k[koff + j * stride..][..hd];
            for q in 0..QN {
                for j in j0..j1 {
                    let got = sc[rows[q] + j - j0];
                    if j < j0 + n {
                        let want = dot(isa, xr[q], key(j)) * scale;
                        assert_eq!(got.to_bits(), want.to_bits(), "q {q} key {j}");
                    } else {
                        assert_eq!(got, -7.0, "q {q} key {j} written past the strip");
                    }
                }
            }
            assert_eq!(sc[0..3], [-7.0; 3]);
        }
        for isa in [Isa::Portable, Isa::Avx2Fma, Isa::Avx512]
            .into_iter()
            .filter(|i| i.supported())
        {
            for hd in [16, 64, 128] {
                for nk in [4, 19, 48] {
                    check::<4, 4>(isa, hd, nk);
                    check::<2, 8>(isa, hd, nk);
                    check::<1, 16>(isa, hd, nk);
                }
            }
        }
    }

    /// The fused AVX-512 softmax gives the bits of the unfused passes, NaN / infinities
    /// included.
    #[test]
    fn fused_softmax_has_the_bits_of_the_passes() {
        let isa = Isa::Avx512;
        if !isa.supported() {
            return;
        }
        let ones = vec![1.0f32; 200];
        let mut seed = 12345u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as u32 as f32 / u32::MAX as f32) * 40.0 - 20.0
        };
        for n in 0..200 {
            for special in 0..5 {
                let mut x: Vec<f32> = (0..n).map(|_| next()).collect();
                if n > 0 {
                    match special {
                        1 => x[n / 2] = f32::NAN,
                        2 => x[n - 1] = f32::INFINITY,
                        3 => x.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                        4 => x
                            .iter_mut()
                            .for_each(|v| *v = if *v > 0.0 { 0.0 } else { -0.0 }),
                        _ => {}
                    }
                }
                let mut a = x.clone();
                let mut b = x.clone();
                softmax_in_place(isa, &mut a, &ones);
                softmax_passes(isa, &mut b, &ones);
                let (ab, bb): (Vec<u32>, Vec<u32>) = (
                    a.iter().map(|v| v.to_bits()).collect(),
                    b.iter().map(|v| v.to_bits()).collect(),
                );
                assert_eq!(ab, bb, "n {n} special {special}");
            }
        }
    }
}
