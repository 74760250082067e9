//! AVX2 + F16C kernels, byte-exact with the scalar reference (see `quant-exactness.md` §12).
//!
//! Every function here is `unsafe` only because of `#[target_feature]`: callers must have
//! checked `is_x86_feature_detected!("avx2")` and `("f16c")` (see [`available`]). Slice
//! lengths are the caller's contract: `x.len() == 32 * out.len()` for the block kernels
//! (checked with `debug_assert!`; the loops use `chunks_exact`/`zip`, so a violation can
//! never read or write out of bounds).
//!
//! The arithmetic, per q8_0 block:
//! * `amax` = integer max of the sign-cleared bit patterns (for non-negative floats the
//!   integer order is the float order; a pattern above `0x7F7F_FFFF` flags Inf/NaN),
//! * `d = amax / 127` and `id = 1 / d` as scalar true divisions (never `rcpps`),
//! * `t = x * id` (`mulps`), round half away from zero as
//!   `cvttps2dq(t + copysign(0.49999997, t))`, exact for every |t| <= 128,
//! * saturating packs, equal to C's int8 store because |t| <= 127 + a few ulp whenever `id` is
//!   finite; when `id` is infinite (`d < 2^-128`) C's x86 conversion gives code 0 for every
//!   element, which is handled as its own case.
//!
//! Per q4_0 block: the same `amax`, then the first index holding it (movemask + tzcnt) gives
//! the signed max (an all-zero block keeps C's `+0.0`, so `d = -0.0`); `d = max / -8`;
//! `mulps`, then a separate `addps 8.5` (never fused), `cvttps2dq`, `min 15`.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::f16;

use crate::{BlockQ4_0, BlockQ8_0, QK};

/// True when this CPU runs the kernels of this module.
#[inline]
pub(crate) fn available() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c")
}

/// Largest finite f32 bit pattern with the sign cleared.
const MAX_FINITE_BITS: i32 = 0x7F7F_FFFF;

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn hmax_epi32(m: __m256i) -> i32 {
    let m128 = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
    let m64 = _mm_max_epi32(m128, _mm_shuffle_epi32::<0b01_00_11_10>(m128));
    let m32 = _mm_max_epi32(m64, _mm_shuffle_epi32::<0b10_11_00_01>(m64));
    _mm_cvtsi128_si32(m32)
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn f32_to_f16_bits(d: f32) -> u16 {
    // imm 0 = round to nearest even: identical to ggml's software conversion for non-NaN.
    let h = _mm_cvtps_ph::<0>(_mm_set_ss(d));
    _mm_extract_epi16::<0>(h) as u16
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn f16_bits_to_f32x8(bits: u16) -> __m256 {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
    _mm256_broadcastss_ps(v)
}

/// Loads one block of 32 floats (`xb.len() >= 32`).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn load32(xb: &[f32]) -> [__m256; 4] {
    debug_assert!(xb.len() >= QK);
    let p = xb.as_ptr();
    // SAFETY: xb holds at least 32 floats (the callers pass `chunks_exact(QK)` items).
    unsafe {
        [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ]
    }
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn abs_bits(v: [__m256; 4]) -> [__m256i; 4] {
    let m = _mm256_set1_epi32(0x7FFF_FFFF);
    [
        _mm256_and_si256(_mm256_castps_si256(v[0]), m),
        _mm256_and_si256(_mm256_castps_si256(v[1]), m),
        _mm256_and_si256(_mm256_castps_si256(v[2]), m),
        _mm256_and_si256(_mm256_castps_si256(v[3]), m),
    ]
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn max4(a: [__m256i; 4]) -> __m256i {
    _mm256_max_epi32(_mm256_max_epi32(a[0], a[1]), _mm256_max_epi32(a[2], a[3]))
}

/// Round half away from zero, then C's truncating conversion (valid for |t| <= 128).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn round_away(t: __m256) -> __m256i {
    let sign = _mm256_and_ps(t, _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN)));
    let half = _mm256_or_ps(sign, _mm256_set1_ps(0.499_999_97));
    _mm256_cvttps_epi32(_mm256_add_ps(t, half))
}

/// Maxima of 8 vectors, lane `k` of the result = max over the lanes of `m[k]` (signed i32).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn hmax8(m: [__m256i; 8]) -> __m256i {
    // per 128-bit lane: [max(a0,a1), max(a2,a3), max(b0,b1), max(b2,b3)]
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn pmax(a: __m256i, b: __m256i) -> __m256i {
        let (a, b) = (_mm256_castsi256_ps(a), _mm256_castsi256_ps(b));
        let lo = _mm256_shuffle_ps::<0b10_00_10_00>(a, b);
        let hi = _mm256_shuffle_ps::<0b11_01_11_01>(a, b);
        _mm256_max_epi32(_mm256_castps_si256(lo), _mm256_castps_si256(hi))
    }
    let t0 = pmax(pmax(m[0], m[1]), pmax(m[2], m[3]));
    let t1 = pmax(pmax(m[4], m[5]), pmax(m[6], m[7]));
    _mm256_max_epi32(
        _mm256_permute2x128_si256::<0x20>(t0, t1),
        _mm256_permute2x128_si256::<0x31>(t0, t1),
    )
}

/// Per-lane `id = d != 0 ? 1 / d : 0` (true division), plus the mask of lanes where it is
/// infinite (d < 2^-128, where x86 C stores code 0 for every element).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn recip_or_zero(d: __m256) -> (__m256, __m256) {
    let nz = _mm256_cmp_ps::<_CMP_NEQ_OQ>(d, _mm256_setzero_ps());
    let id = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0), d), nz);
    let abs = _mm256_and_ps(id, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF)));
    let inf = _mm256_cmp_ps::<_CMP_EQ_OQ>(abs, _mm256_set1_ps(f32::INFINITY));
    (id, inf)
}

/// Stores the q8_0 codes of one block given its reciprocal scale.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q8_0_codes(v: [__m256; 4], id: f32, ob: &mut BlockQ8_0) {
    let idv = _mm256_set1_ps(id);
    let i0 = round_away(_mm256_mul_ps(v[0], idv));
    let i1 = round_away(_mm256_mul_ps(v[1], idv));
    let i2 = round_away(_mm256_mul_ps(v[2], idv));
    let i3 = round_away(_mm256_mul_ps(v[3], idv));
    let p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: `qs` is 32 bytes; unaligned store.
    unsafe { _mm256_storeu_si256(ob.qs.as_mut_ptr().cast::<__m256i>(), p) };
}

/// Stores the q4_0 codes of one block: `min(15, trunc(x * id + add))`, packed.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q4_0_codes(v: [__m256; 4], id: f32, add: f32, ob: &mut BlockQ4_0) {
    let idv = _mm256_set1_ps(id);
    let addv = _mm256_set1_ps(add);
    let fifteen = _mm256_set1_epi32(15);
    // mulps, then a separate addps (never fused)
    let code = |x: __m256| {
        let u = _mm256_add_ps(_mm256_mul_ps(x, idv), addv);
        _mm256_min_epi32(_mm256_cvttps_epi32(u), fifteen)
    };
    let c0 = code(v[0]);
    let c1 = code(v[1]);
    let c2 = code(v[2]);
    let c3 = code(v[3]);
    let w0 = _mm256_or_si256(c0, _mm256_slli_epi32::<4>(c2));
    let w1 = _mm256_or_si256(c1, _mm256_slli_epi32::<4>(c3));
    let p = _mm256_packs_epi32(w0, w1);
    let p = _mm256_packus_epi16(p, p);
    let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: `qs` is 16 bytes; unaligned store.
    unsafe {
        _mm_storeu_si128(
            ob.qs.as_mut_ptr().cast::<__m128i>(),
            _mm256_castsi256_si128(p),
        )
    };
}

/// Signed max of a block, first occurrence of the largest |x| (C keeps +0.0 when all |x|
/// are 0).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn signed_max(xb: &[f32], a: [__m256i; 4], amax_bits: i32) -> f32 {
    if amax_bits == 0 {
        return 0.0;
    }
    let t = _mm256_set1_epi32(amax_bits);
    let k = |ai: __m256i| _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(ai, t))) as u32;
    let mask = k(a[0]) | (k(a[1]) << 8) | (k(a[2]) << 16) | (k(a[3]) << 24);
    // mask != 0: amax_bits is one of the lanes. `& 31` keeps the index in range anyway.
    xb[(mask.trailing_zeros() & 31) as usize]
}

/// q8_0 row: returns false when a non-finite value was met (output then unspecified).
///
/// Groups of 8 blocks share one vector division for `d`, one for `id` and one `vcvtps2ph`.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn q8_0_row(x: &[f32], out: &mut [BlockQ8_0]) -> bool {
    debug_assert_eq!(x.len(), out.len() * QK);
    let mut seen = _mm256_setzero_si256();
    let c127 = _mm256_set1_ps(127.0);
    let xg = x.chunks_exact(8 * QK);
    let xr = xg.remainder();
    let mut og = out.chunks_exact_mut(8);
    for (xc, oc) in xg.zip(&mut og) {
        let mut m = [_mm256_setzero_si256(); 8];
        for (mk, xb) in m.iter_mut().zip(xc.chunks_exact(QK)) {
            *mk = max4(abs_bits(load32(xb)));
        }
        let amax = hmax8(m);
        seen = _mm256_max_epi32(seen, amax);
        let d = _mm256_div_ps(_mm256_castsi256_ps(amax), c127);
        let (id, inf) = recip_or_zero(d);
        // infinite id: every x * id is +-Inf/NaN, which x86 C stores as code 0; id = 0
        // gives the same codes
        let id = _mm256_andnot_ps(inf, id);
        let mut ids = [0.0f32; 8];
        let mut dh = [0u16; 8];
        // SAFETY: 8 floats / 8 halves to local arrays.
        unsafe {
            _mm256_storeu_ps(ids.as_mut_ptr(), id);
            _mm_storeu_si128(dh.as_mut_ptr().cast::<__m128i>(), _mm256_cvtps_ph::<0>(d));
        }
        for (k, (ob, xb)) in oc.iter_mut().zip(xc.chunks_exact(QK)).enumerate() {
            ob.d = f16::from_bits(dh[k]);
            q8_0_codes(load32(xb), ids[k], ob);
        }
    }
    let mut ok = hmax_epi32(seen) <= MAX_FINITE_BITS;
    for (xb, ob) in xr.chunks_exact(QK).zip(og.into_remainder()) {
        let v = load32(xb);
        let amax_bits = hmax_epi32(max4(abs_bits(v)));
        ok &= amax_bits <= MAX_FINITE_BITS;
        let d = f32::from_bits(amax_bits as u32) / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        ob.d = f16::from_bits(f32_to_f16_bits(d));
        q8_0_codes(v, if id.is_infinite() { 0.0 } else { id }, ob);
    }
    ok
}

/// q4_0 row: returns false when a non-finite value was met (output then unspecified).
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn q4_0_row(x: &[f32], out: &mut [BlockQ4_0]) -> bool {
    debug_assert_eq!(x.len(), out.len() * QK);
    let mut seen = _mm256_setzero_si256();
    let minus8 = _mm256_set1_ps(-8.0);
    let eight_half = _mm256_set1_ps(8.5);
    let xg = x.chunks_exact(8 * QK);
    let xr = xg.remainder();
    let mut og = out.chunks_exact_mut(8);
    for (xc, oc) in xg.zip(&mut og) {
        let mut m = [_mm256_setzero_si256(); 8];
        for (mk, xb) in m.iter_mut().zip(xc.chunks_exact(QK)) {
            *mk = max4(abs_bits(load32(xb)));
        }
        let amax = hmax8(m);
        seen = _mm256_max_epi32(seen, amax);
        let mut amaxs = [0i32; 8];
        // SAFETY: 8 ints to a local array.
        unsafe { _mm256_storeu_si256(amaxs.as_mut_ptr().cast::<__m256i>(), amax) };
        let mut maxs = [0.0f32; 8];
        for ((mx, &ab), xb) in maxs.iter_mut().zip(&amaxs).zip(xc.chunks_exact(QK)) {
            *mx = signed_max(xb, abs_bits(load32(xb)), ab);
        }
        // SAFETY: 8 floats from a local array.
        let max = unsafe { _mm256_loadu_ps(maxs.as_ptr()) };
        let d = _mm256_div_ps(max, minus8);
        let (id, inf) = recip_or_zero(d);
        // infinite id: x86 C stores nibble 0 everywhere; id = 0 with add = 0 does the same
        let id = _mm256_andnot_ps(inf, id);
        let add = _mm256_andnot_ps(inf, eight_half);
        let mut ids = [0.0f32; 8];
        let mut adds = [0.0f32; 8];
        let mut dh = [0u16; 8];
        // SAFETY: 8 floats / 8 halves to local arrays.
        unsafe {
            _mm256_storeu_ps(ids.as_mut_ptr(), id);
            _mm256_storeu_ps(adds.as_mut_ptr(), add);
            _mm_storeu_si128(dh.as_mut_ptr().cast::<__m128i>(), _mm256_cvtps_ph::<0>(d));
        }
        for (k, (ob, xb)) in oc.iter_mut().zip(xc.chunks_exact(QK)).enumerate() {
            ob.d = f16::from_bits(dh[k]);
            q4_0_codes(load32(xb), ids[k], adds[k], ob);
        }
    }
    let mut ok = hmax_epi32(seen) <= MAX_FINITE_BITS;
    for (xb, ob) in xr.chunks_exact(QK).zip(og.into_remainder()) {
        let v = load32(xb);
        let a = abs_bits(v);
        let amax_bits = hmax_epi32(max4(a));
        ok &= amax_bits <= MAX_FINITE_BITS;
        let d = signed_max(xb, a, amax_bits) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        ob.d = f16::from_bits(f32_to_f16_bits(d));
        if id.is_infinite() {
            q4_0_codes(v, 0.0, 0.0, ob);
        } else {
            q4_0_codes(v, id, 8.5, ob);
        }
    }
    ok
}

/// q8_0 -> f32 (`out.len() == 32 * b.len()`).
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn dq8_0_row(b: &[BlockQ8_0], out: &mut [f32]) {
    debug_assert_eq!(out.len(), b.len() * QK);
    for (blk, o) in b.iter().zip(out.chunks_exact_mut(QK)) {
        let d = f16_bits_to_f32x8(blk.d.to_bits());
        let q = blk.qs.as_ptr().cast::<__m128i>();
        let p = o.as_mut_ptr();
        // SAFETY: `qs` is 32 bytes (two 16-byte loads), `o` is 32 floats.
        unsafe {
            let lo = _mm_loadu_si128(q);
            let hi = _mm_loadu_si128(q.add(1));
            let y0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
            let y1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lo)));
            let y2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
            let y3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(hi)));
            _mm256_storeu_ps(p, _mm256_mul_ps(y0, d));
            _mm256_storeu_ps(p.add(8), _mm256_mul_ps(y1, d));
            _mm256_storeu_ps(p.add(16), _mm256_mul_ps(y2, d));
            _mm256_storeu_ps(p.add(24), _mm256_mul_ps(y3, d));
        }
    }
}

/// q4_0 -> f32 (`out.len() == 32 * b.len()`).
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn dq4_0_row(b: &[BlockQ4_0], out: &mut [f32]) {
    debug_assert_eq!(out.len(), b.len() * QK);
    let low = _mm_set1_epi8(0x0F);
    let eight = _mm_set1_epi8(8);
    for (blk, o) in b.iter().zip(out.chunks_exact_mut(QK)) {
        let d = f16_bits_to_f32x8(blk.d.to_bits());
        let p = o.as_mut_ptr();
        // SAFETY: `qs` is 16 bytes, `o` is 32 floats.
        unsafe {
            let q = _mm_loadu_si128(blk.qs.as_ptr().cast::<__m128i>());
            // Codes minus 8 as signed bytes: elements 0..16 from the low nibbles, 16..32 high.
            let lo = _mm_sub_epi8(_mm_and_si128(q, low), eight);
            let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16::<4>(q), low), eight);
            let y0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
            let y1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lo)));
            let y2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
            let y3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(hi)));
            _mm256_storeu_ps(p, _mm256_mul_ps(y0, d));
            _mm256_storeu_ps(p.add(8), _mm256_mul_ps(y1, d));
            _mm256_storeu_ps(p.add(16), _mm256_mul_ps(y2, d));
            _mm256_storeu_ps(p.add(24), _mm256_mul_ps(y3, d));
        }
    }
}

/// f32 -> bf16 (round to nearest even on the bits, as ggml); false on a non-finite value.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn bf16_row(x: &[f32], out: &mut [u16]) -> bool {
    debug_assert_eq!(x.len(), out.len());
    let mut seen = 0u32;
    let xs = x.chunks_exact(16);
    let xr = xs.remainder();
    let mut os = out.chunks_exact_mut(16);
    for (xc, oc) in xs.zip(&mut os) {
        for (o, &v) in oc.iter_mut().zip(xc) {
            let u = v.to_bits();
            seen = seen.max(u & 0x7FFF_FFFF);
            *o = (u.wrapping_add(0x7FFF + ((u >> 16) & 1)) >> 16) as u16;
        }
    }
    for (o, &v) in os.into_remainder().iter_mut().zip(xr) {
        let u = v.to_bits();
        seen = seen.max(u & 0x7FFF_FFFF);
        *o = (u.wrapping_add(0x7FFF + ((u >> 16) & 1)) >> 16) as u16;
    }
    seen <= MAX_FINITE_BITS as u32
}

/// f32 -> f16 with `vcvtps2ph` (round to nearest even); false on a non-finite value.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn f16_row(x: &[f32], out: &mut [u16]) -> bool {
    debug_assert_eq!(x.len(), out.len());
    let mask = _mm256_set1_epi32(0x7FFF_FFFF);
    let mut seen = _mm256_setzero_si256();
    let xs = x.chunks_exact(8);
    let xr = xs.remainder();
    let mut os = out.chunks_exact_mut(8);
    for (xc, oc) in xs.zip(&mut os) {
        // SAFETY: 8 floats in, 8 halves (16 bytes) out.
        unsafe {
            let v = _mm256_loadu_ps(xc.as_ptr());
            seen = _mm256_max_epi32(seen, _mm256_and_si256(_mm256_castps_si256(v), mask));
            let h = _mm256_cvtps_ph::<0>(v);
            _mm_storeu_si128(oc.as_mut_ptr().cast::<__m128i>(), h);
        }
    }
    let mut ok = hmax_epi32(seen) <= MAX_FINITE_BITS;
    for (o, &v) in os.into_remainder().iter_mut().zip(xr) {
        ok &= v.is_finite();
        *o = f32_to_f16_bits(v);
    }
    ok
}

/// bf16 bits -> f32.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn dbf16_row(bits: &[u16], out: &mut [f32]) {
    for (y, &b) in out.iter_mut().zip(bits) {
        *y = f32::from_bits((b as u32) << 16);
    }
}

/// f16 bits -> f32 with `vcvtph2ps` (exact).
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn df16_row(bits: &[u16], out: &mut [f32]) {
    let bs = bits.chunks_exact(8);
    let br = bs.remainder();
    let mut os = out.chunks_exact_mut(8);
    for (bc, oc) in bs.zip(&mut os) {
        // SAFETY: 8 halves (16 bytes) in, 8 floats out.
        unsafe {
            let h = _mm_loadu_si128(bc.as_ptr().cast::<__m128i>());
            _mm256_storeu_ps(oc.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
    }
    for (y, &b) in os.into_remainder().iter_mut().zip(br) {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(b as i32));
        *y = _mm_cvtss_f32(v);
    }
}
