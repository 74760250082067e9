//! Dot-product tile kernels of the CPU backend.
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
