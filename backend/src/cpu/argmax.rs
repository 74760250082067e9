//! Row argmax: the index of the first maximum, NaN never winning (index 0 when every value is
//! NaN), the same answer on every path.
//!
//! Two passes: the maximum `m` over the non-NaN values (`max` is exact, so its order does not
//! matter), then the first index whose value compares equal to `m` (`-0.0 == +0.0`, as the
//! reference's `v > best` treats them). The scalar reference picks the first value that no
//! earlier value exceeds and that exceeds every earlier value, which is that same index.

use super::kernel::Isa;

/// Argmax of `row` (see the module doc).
pub(crate) fn argmax(isa: Isa, row: &[f32]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: the backend only holds an `Isa` that `Isa::supported` accepted.
        return unsafe { avx512::argmax(row) };
    }
    let _ = isa;
    argmax_portable(row)
}

/// The reference loop.
pub(crate) fn argmax_portable(row: &[f32]) -> usize {
    let mut best = 0usize;
    let mut bv = f32::NAN;
    for (i, &v) in row.iter().enumerate() {
        // NaN never wins; the first of equal maxima wins.
        if !v.is_nan() && (bv.is_nan() || v > bv) {
            best = i;
            bv = v;
        }
    }
    best
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn argmax(row: &[f32]) -> usize {
        let n = row.len();
        let p = row.as_ptr();
        // Pass 1: maximum over non-NaN values. `vmaxps a, b` returns `b` when either is NaN,
        // so `max(x, acc)` keeps `acc` for a NaN `x`; `acc` itself is never NaN.
        let mut acc = [_mm512_set1_ps(f32::NEG_INFINITY); 4];
        let mut i = 0;
        while i + 64 <= n {
            for (a, acc) in acc.iter_mut().enumerate() {
                // SAFETY: i + 16a + 16 <= n.
                let x = unsafe { _mm512_loadu_ps(p.add(i + 16 * a)) };
                *acc = _mm512_max_ps(x, *acc);
            }
            i += 64;
        }
        while i + 16 <= n {
            // SAFETY: i + 16 <= n.
            let x = unsafe { _mm512_loadu_ps(p.add(i)) };
            acc[0] = _mm512_max_ps(x, acc[0]);
            i += 16;
        }
        let v = _mm512_max_ps(_mm512_max_ps(acc[0], acc[1]), _mm512_max_ps(acc[2], acc[3]));
        let mut m = _mm512_reduce_max_ps(v);
        for &x in &row[i..] {
            if x > m {
                m = x;
            }
        }
        // Pass 2: first index equal to m (none when every value is NaN: index 0).
        let mv = _mm512_set1_ps(m);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n.
            let x = unsafe { _mm512_loadu_ps(p.add(i)) };
            let k = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(x, mv);
            if k != 0 {
                return i + k.trailing_zeros() as usize;
            }
            i += 16;
        }
        row[i..].iter().position(|&x| x == m).map_or(0, |j| i + j)
    }
}
