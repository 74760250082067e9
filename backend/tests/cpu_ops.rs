//! Every CPU op against a plain scalar oracle written here (f64 loops, no shared code with
//! the backend), on random shapes; plus the per-row determinism the exactness of speculative
//! decoding relies on, and the error cases.

use dflash_backend::cpu::{Cpu, Isa};
use dflash_backend::{
    AttnParams, Backend, BackendError, DeltaParams, HostWeight, RopeSpec, WeightFormat,
};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const FORMATS: [WeightFormat; 5] = [
    WeightFormat::F32,
    WeightFormat::Bf16,
    WeightFormat::F16,
    WeightFormat::Q8_0,
    WeightFormat::Q4_0,
];

fn rand_vec(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

/// The default backend, a one-thread portable one, and multi-thread ones forced onto their
/// parallel paths even for small shapes.
fn backends() -> Vec<Cpu> {
    vec![
        Cpu::default(),
        Cpu::with_threads(1)
            .unwrap()
            .with_isa(Isa::Portable)
            .unwrap(),
        Cpu::with_threads(3).unwrap().with_par_min_work(0),
        Cpu::with_threads(2)
            .unwrap()
            .with_isa(Isa::Portable)
            .unwrap()
            .with_par_min_work(0),
    ]
}

fn backends_all_isas() -> Vec<Cpu> {
    let mut v = backends();
    for isa in [Isa::Avx2Fma, Isa::Avx512] {
        if isa.supported() {
            v.push(
                Cpu::with_threads(2)
                    .unwrap()
                    .with_isa(isa)
                    .unwrap()
                    .with_par_min_work(0),
            );
        }
    }
    v
}

/// |got - want| <= tol * scale + tiny, where scale is the sum of magnitudes of the terms.
fn close(got: f32, want: f64, scale: f64, tol: f64) -> bool {
    (got as f64 - want).abs() <= tol * scale + 1e-6
}

fn cfg(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        ..ProptestConfig::default()
    }
}

// ------------------------------------------------------------------------------- matmul

fn naive_matmul(x: &[f32], rows: usize, w: &[f32], n: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; rows * n];
    let mut mag = vec![0.0; rows * n];
    for r in 0..rows {
        for o in 0..n {
            for i in 0..k {
                out[r * n + o] += x[r * k + i] as f64 * w[o * k + i] as f64;
                mag[r * n + o] += (x[r * k + i] as f64 * w[o * k + i] as f64).abs();
            }
        }
    }
    (out, mag)
}

proptest! {
    #![proptest_config(cfg(48))]

    #[test]
    fn matmul_matches_naive_all_formats(seed in any::<u64>(), rows in 1usize..21, n in 1usize..40, kb in 1usize..6, extra in 0usize..31, fi in 0usize..5) {
        let mut rng = StdRng::seed_from_u64(seed);
        let fmt = FORMATS[fi];
        let k = if matches!(fmt, WeightFormat::Q8_0 | WeightFormat::Q4_0) { kb * 32 } else { kb * 32 - extra };
        let wv = rand_vec(&mut rng, n * k, 1.0);
        let hw = HostWeight::from_f32("w", n, k, &wv, fmt).unwrap();
        let wdec = hw.to_f32();
        let x = rand_vec(&mut rng, rows * k, 2.0);
        let (want, mag) = naive_matmul(&x, rows, &wdec, n, k);
        let mut results = Vec::new();
        for be in backends_all_isas() {
            let w = be.upload_weight(&hw).unwrap();
            // out longer than needed: only the first rows * n values are written.
            let mut out = vec![7.0f32; rows * n + 3];
            be.matmul(&x, rows, &w, &mut out).unwrap();
            for i in 0..rows * n {
                prop_assert!(close(out[i], want[i], mag[i], 1e-5), "{fmt:?} {i}: {} vs {}", out[i], want[i]);
            }
            prop_assert_eq!(&out[rows * n..], &[7.0f32; 3][..]);
            // Every format gives exactly the f32 matmul of its decoded values (the kernels
            // widen / dequantize in registers and share the f32 arithmetic).
            let wf = be.upload_weight(&HostWeight::from_f32("wf", n, k, &wdec, WeightFormat::F32).unwrap()).unwrap();
            let mut out_f = vec![0.0f32; rows * n];
            be.matmul(&x, rows, &wf, &mut out_f).unwrap();
            prop_assert_eq!(bits(&out[..rows * n]), bits(&out_f));
            results.push(out[..rows * n].to_vec());
        }
        // Every instruction set (AVX-512, AVX2, portable) and thread count gives identical
        // bits (one sequential FMA chain per output).
        for r in &results[1..] {
            prop_assert_eq!(bits(r), bits(&results[0]));
        }
    }

    #[test]
    fn matmul_rows_are_independent_of_batch(seed in any::<u64>(), rows in 2usize..40, n in 1usize..50, k in 1usize..200, fi in 0usize..5) {
        let mut rng = StdRng::seed_from_u64(seed);
        let fmt = FORMATS[fi];
        let k = if matches!(fmt, WeightFormat::Q8_0 | WeightFormat::Q4_0) { k.div_ceil(32) * 32 } else { k };
        let hw = HostWeight::from_f32("w", n, k, &rand_vec(&mut rng, n * k, 1.0), fmt).unwrap();
        let x = rand_vec(&mut rng, rows * k, 1.0);
        let reference = Cpu::default();
        let w = reference.upload_weight(&hw).unwrap();
        let mut full = vec![0.0f32; rows * n];
        reference.matmul(&x, rows, &w, &mut full).unwrap();
        // Same ISA, other thread counts: identical bits; each row alone: identical bits.
        for be in [Cpu::with_threads(1).unwrap(), Cpu::with_threads(3).unwrap().with_par_min_work(0)] {
            let w = be.upload_weight(&hw).unwrap();
            let mut again = vec![0.0f32; rows * n];
            be.matmul(&x, rows, &w, &mut again).unwrap();
            prop_assert_eq!(bits(&again), bits(&full));
            for r in 0..rows {
                let mut one = vec![0.0f32; n];
                be.matmul(&x[r * k..(r + 1) * k].to_vec(), 1, &w, &mut one).unwrap();
                prop_assert_eq!(bits(&one), bits(&full[r * n..(r + 1) * n]));
            }
            // A sub-batch starting at an odd row.
            let r0 = rows / 3;
            let m = rows - r0;
            let mut part = vec![0.0f32; m * n];
            be.matmul(&x[r0 * k..].to_vec(), m, &w, &mut part).unwrap();
            prop_assert_eq!(bits(&part), bits(&full[r0 * n..]));
        }
    }

    #[test]
    fn gather_rows_all_formats(seed in any::<u64>(), n in 1usize..30, kb in 1usize..4, fi in 0usize..5, nid in 0usize..10) {
        let mut rng = StdRng::seed_from_u64(seed);
        let fmt = FORMATS[fi];
        let k = kb * 32;
        let hw = HostWeight::from_f32("emb", n, k, &rand_vec(&mut rng, n * k, 1.0), fmt).unwrap();
        let dec = hw.to_f32();
        let ids: Vec<u32> = (0..nid).map(|_| rng.random_range(0..n as u32)).collect();
        let be = Cpu::default();
        let w = be.upload_weight(&hw).unwrap();
        let mut out = vec![0.0f32; nid * k];
        be.gather_rows(&w, &ids, &mut out).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            prop_assert_eq!(&out[i * k..(i + 1) * k], &dec[id as usize * k..(id as usize + 1) * k]);
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

// ------------------------------------------------------------------------------- norms

fn naive_rms(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
    let dim = w.len();
    let mut out = Vec::new();
    for row in x.chunks(dim) {
        let ms: f64 = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        for (v, wv) in row.iter().zip(w) {
            out.push(*v as f64 * r * *wv as f64);
        }
    }
    out
}

fn naive_silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

proptest! {
    #![proptest_config(cfg(48))]

    #[test]
    fn rms_norm_matches_naive(seed in any::<u64>(), rows in 1usize..10, dim in 1usize..130, gated in any::<bool>()) {
        let mut rng = StdRng::seed_from_u64(seed);
        let x = rand_vec(&mut rng, rows * dim, 3.0);
        let w = rand_vec(&mut rng, dim, 2.0);
        let z = rand_vec(&mut rng, rows * dim, 4.0);
        let eps = 1e-6;
        let mut want = naive_rms(&x, &w, eps);
        if gated {
            for (o, &zv) in want.iter_mut().zip(&z) {
                *o *= naive_silu(zv as f64);
            }
        }
        for be in backends() {
            let mut out = vec![0.0f32; rows * dim];
            if gated {
                be.rms_norm_gated(&x, &z, &w, dim, eps, &mut out).unwrap();
            } else {
                be.rms_norm(&x, &w, dim, eps, &mut out).unwrap();
            }
            for i in 0..out.len() {
                prop_assert!(close(out[i], want[i], want[i].abs(), 1e-5), "{i}: {} vs {}", out[i], want[i]);
            }
            // Per-row determinism: each row alone gives the same bits.
            for r in 0..rows {
                let mut one = vec![0.0f32; dim];
                let xr = x[r * dim..(r + 1) * dim].to_vec();
                if gated {
                    be.rms_norm_gated(&xr, &z[r * dim..(r + 1) * dim].to_vec(), &w, dim, eps, &mut one).unwrap();
                } else {
                    be.rms_norm(&xr, &w, dim, eps, &mut one).unwrap();
                }
                prop_assert_eq!(bits(&one), bits(&out[r * dim..(r + 1) * dim]));
            }
        }
    }
}

// ------------------------------------------------------------------------------- rope

fn naive_rope(x: &mut [f32], rows: usize, n_heads: usize, hd: usize, pos0: usize, spec: &RopeSpec) {
    let half = spec.inv_freq.len();
    for r in 0..rows {
        for h in 0..n_heads {
            let base = (r * n_heads + h) * hd;
            let old: Vec<f32> = x[base..base + hd].to_vec();
            for i in 0..2 * half {
                // cos/sin of the f32 angle, as transformers computes them (in f32).
                let ang = ((pos0 + r) as f32) * spec.inv_freq[i % half];
                let c = ang.cos() as f64 * spec.attention_scaling as f64;
                let s = ang.sin() as f64 * spec.attention_scaling as f64;
                let rot = if i < half {
                    -(old[i + half] as f64)
                } else {
                    old[i - half] as f64
                };
                x[base + i] = (old[i] as f64 * c + rot * s) as f32;
            }
        }
    }
}

proptest! {
    #![proptest_config(cfg(48))]

    #[test]
    fn rope_matches_naive(seed in any::<u64>(), rows in 1usize..8, n_heads in 1usize..5, half_hd in 1usize..17, rot_frac in 1usize..5, pos0 in 0usize..5000, scaling in 0.5f32..1.5) {
        let mut rng = StdRng::seed_from_u64(seed);
        let hd = 2 * half_hd;
        let half = (half_hd * rot_frac).div_ceil(4); // partial rotary when rot_frac < 4
        let inv_freq: Vec<f32> = (0..half).map(|i| 10000f32.powf(-(2.0 * i as f32) / (2 * half) as f32) / rng.random_range(1.0f32..4.0)).collect();
        let spec = RopeSpec { inv_freq, attention_scaling: scaling };
        let x = rand_vec(&mut rng, rows * n_heads * hd, 2.0);
        let mut want = x.clone();
        naive_rope(&mut want, rows, n_heads, hd, pos0, &spec);
        for be in backends() {
            let mut got = x.clone();
            be.rope(&mut got, rows, n_heads, hd, pos0, &spec).unwrap();
            for i in 0..got.len() {
                prop_assert!((got[i] - want[i]).abs() <= 1e-5 * (1.0 + want[i].abs()) * 4.0, "{i}: {} vs {}", got[i], want[i]);
            }
            // untouched dims beyond rot_dim
            for r in 0..rows * n_heads {
                prop_assert_eq!(&got[r * hd + 2 * half..(r + 1) * hd], &x[r * hd + 2 * half..(r + 1) * hd]);
            }
            // Row r alone at pos0 + r: identical bits.
            let w = n_heads * hd;
            for r in 0..rows {
                let mut one = x[r * w..(r + 1) * w].to_vec();
                be.rope(&mut one, 1, n_heads, hd, pos0 + r, &spec).unwrap();
                prop_assert_eq!(bits(&one), bits(&got[r * w..(r + 1) * w]));
            }
        }
    }
}

// ------------------------------------------------------------------------------- attention

#[test]
fn qk_norm_rope_kv_places_normed_rotated_rows_in_the_caches() {
    // The layer op against the oracle: q rows 0..q_rows normed per head and rotated at
    // pos0.., the kv_rows K rows likewise into the K cache from row0, V copied from row0;
    // the other cache rows untouched; more q rows than k / v rows an error.
    use dflash_backend::{KvCacheRows, KvStorage, QkNormRope};
    let mut rng = StdRng::seed_from_u64(17);
    let (nh, nkv, hd, eps) = (4usize, 2usize, 8usize, 1e-6f32);
    let (qw, kvw) = (nh * hd, nkv * hd);
    let spec = RopeSpec {
        inv_freq: vec![1.0, 0.1, 0.01],
        attention_scaling: 1.1,
    };
    for (q_rows, kv_rows, row0, pos0) in [
        (5usize, 5usize, 0usize, 0usize),
        (2, 5, 7, 30),
        (0, 3, 2, 9),
    ] {
        let q0 = rand_vec(&mut rng, kv_rows * qw, 3.0);
        let k0 = rand_vec(&mut rng, kv_rows * kvw, 3.0);
        let v = rand_vec(&mut rng, kv_rows * kvw, 3.0);
        let (qn, kn) = (rand_vec(&mut rng, hd, 1.5), rand_vec(&mut rng, hd, 1.5));
        let cap = row0 + kv_rows + 2;
        let (kc0, vc0) = (
            rand_vec(&mut rng, cap * kvw, 1.0),
            rand_vec(&mut rng, cap * kvw, 1.0),
        );
        let to32 = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
        let mut want_q = to32(naive_rms(&q0, &qn, eps));
        naive_rope(&mut want_q, q_rows, nh, hd, pos0, &spec);
        let mut want_k = to32(naive_rms(&k0, &kn, eps));
        naive_rope(&mut want_k, kv_rows, nkv, hd, pos0, &spec);
        for be in backends() {
            let p = QkNormRope {
                q_norm: &qn,
                k_norm: &kn,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                eps,
                pos0,
                rope: &spec,
            };
            let (mut q, mut k_tmp) = (vec![0.0f32; kv_rows * qw], vec![0.0f32; kv_rows * kvw]);
            let (mut kc, mut vc) = (kc0.clone(), vc0.clone());
            let cache = KvCacheRows {
                k: &mut kc,
                v: &mut vc,
                row0,
                storage: KvStorage::F32,
            };
            be.qk_norm_rope_kv(&q0, &k0, &v, q_rows, kv_rows, &p, &mut q, &mut k_tmp, cache)
                .unwrap();
            for i in 0..q_rows * qw {
                assert!(
                    close(q[i], want_q[i] as f64, 1.0, 1e-5),
                    "q {i}: {} vs {}",
                    q[i],
                    want_q[i]
                );
            }
            let (a, b) = (row0 * kvw, (row0 + kv_rows) * kvw);
            for i in 0..kv_rows * kvw {
                assert!(
                    close(kc[a + i], want_k[i] as f64, 1.0, 1e-5),
                    "k {i}: {} vs {}",
                    kc[a + i],
                    want_k[i]
                );
            }
            assert_eq!(&vc[a..b], &v[..]);
            assert_eq!((&kc[..a], &kc[b..]), (&kc0[..a], &kc0[b..]));
            assert_eq!((&vc[..a], &vc[b..]), (&vc0[..a], &vc0[b..]));
            let cache = KvCacheRows {
                k: &mut kc,
                v: &mut vc,
                row0,
                storage: KvStorage::F32,
            };
            assert!(be
                .qk_norm_rope_kv(
                    &q0,
                    &k0,
                    &v,
                    kv_rows + 1,
                    kv_rows,
                    &p,
                    &mut q,
                    &mut k_tmp,
                    cache
                )
                .is_err());
        }
    }
}

fn naive_attention(q: &[f32], k: &[f32], v: &[f32], p: &AttnParams) -> Vec<f64> {
    let hd = p.head_dim;
    let mut out = vec![0.0f64; p.n_q * p.n_heads * hd];
    for i in 0..p.n_q {
        let qpos = (p.q_pos0 + i) as i64;
        for h in 0..p.n_heads {
            let kvh = h * p.n_kv_heads / p.n_heads;
            let mut scores = Vec::new();
            for j in 0..p.n_kv {
                let kpos = (p.kv_pos0 + j) as i64;
                let vis =
                    (!p.causal || kpos <= qpos) && p.window.is_none_or(|w| qpos < kpos + w as i64);
                if !vis {
                    continue;
                }
                let mut s = 0.0f64;
                for d in 0..hd {
                    s += q[(i * p.n_heads + h) * hd + d] as f64
                        * k[(j * p.n_kv_heads + kvh) * hd + d] as f64;
                }
                scores.push((j, s * p.scale as f64));
            }
            if scores.is_empty() {
                continue;
            }
            let m = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = scores.iter().map(|s| (s.1 - m).exp()).sum();
            for &(j, s) in &scores {
                let pj = (s - m).exp() / z;
                for d in 0..hd {
                    out[(i * p.n_heads + h) * hd + d] +=
                        pj * v[(j * p.n_kv_heads + kvh) * hd + d] as f64;
                }
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(cfg(64))]

    #[test]
    fn attention_matches_naive(
        seed in any::<u64>(), n_q in 1usize..17, n_kv in 0usize..40, spare in 0usize..5,
        n_kv_heads in 1usize..4, group in 1usize..4, hd in 1usize..40,
        q_pos0 in 0usize..50, kv_pos0 in 0usize..20, causal in any::<bool>(), window in proptest::option::of(1usize..30),
    ) {
        let mut rng = StdRng::seed_from_u64(seed);
        let n_heads = n_kv_heads * group;
        let p = AttnParams { n_q, n_kv, n_heads, n_kv_heads, head_dim: hd, q_pos0, kv_pos0, causal, window, scale: 1.0 / (hd as f32).sqrt() };
        let q = rand_vec(&mut rng, n_q * n_heads * hd, 2.0);
        // K/V buffers with spare capacity after the first n_kv rows (garbage there).
        let k = rand_vec(&mut rng, (n_kv + spare) * n_kv_heads * hd, 2.0);
        let v = rand_vec(&mut rng, (n_kv + spare) * n_kv_heads * hd, 2.0);
        let want = naive_attention(&q, &k, &v, &p);
        for be in backends() {
            let mut out = vec![f32::NAN; n_q * n_heads * hd];
            be.attention(&q, &k, &v, &p, &mut out).unwrap();
            for i in 0..out.len() {
                prop_assert!(close(out[i], want[i], 2.0, 2e-6), "{i}: {} vs {}", out[i], want[i]);
            }
            // Query i alone (same absolute position, same keys): identical bits.
            let w = n_heads * hd;
            for i in 0..n_q {
                let p1 = AttnParams { n_q: 1, q_pos0: q_pos0 + i, ..p };
                let mut one = vec![0.0f32; w];
                be.attention(&q[i * w..(i + 1) * w].to_vec(), &k, &v, &p1, &mut one).unwrap();
                prop_assert_eq!(bits(&one), bits(&out[i * w..(i + 1) * w]));
            }
        }
    }
}

proptest! {
    #![proptest_config(cfg(24))]

    /// Drafter / verify shapes: head dims of 64 and 128 (the AVX-512 strip kernel) and
    /// contexts long enough to span several key blocks of the L1-sized loop.
    #[test]
    fn attention_long_context_matches_naive(
        seed in any::<u64>(), n_q in 1usize..17, n_kv in 1usize..700,
        hd in prop_oneof![Just(16usize), Just(64), Just(128), Just(80)],
        group in 1usize..3, causal in any::<bool>(), window in proptest::option::of(1usize..400),
    ) {
        let mut rng = StdRng::seed_from_u64(seed);
        let n_kv_heads = 2;
        let n_heads = n_kv_heads * group;
        let q_pos0 = n_kv.saturating_sub(n_q);
        let p = AttnParams { n_q, n_kv, n_heads, n_kv_heads, head_dim: hd, q_pos0, kv_pos0: 0, causal, window, scale: 1.0 / (hd as f32).sqrt() };
        let q = rand_vec(&mut rng, n_q * n_heads * hd, 2.0);
        let k = rand_vec(&mut rng, n_kv * n_kv_heads * hd, 2.0);
        let v = rand_vec(&mut rng, n_kv * n_kv_heads * hd, 2.0);
        let want = naive_attention(&q, &k, &v, &p);
        for be in backends_all_isas() {
            let mut out = vec![f32::NAN; n_q * n_heads * hd];
            be.attention(&q, &k, &v, &p, &mut out).unwrap();
            for i in 0..out.len() {
                prop_assert!(close(out[i], want[i], 2.0, 2e-6), "{i}: {} vs {}", out[i], want[i]);
            }
            let w = n_heads * hd;
            for i in (0..n_q).step_by(5) {
                let p1 = AttnParams { n_q: 1, q_pos0: q_pos0 + i, ..p };
                let mut one = vec![0.0f32; w];
                be.attention(&q[i * w..(i + 1) * w].to_vec(), &k, &v, &p1, &mut one).unwrap();
                prop_assert_eq!(bits(&one), bits(&out[i * w..(i + 1) * w]));
            }
        }
    }
}

#[test]
fn attention_causal_decode_equals_verify_rows() {
    // The spec == greedy situation: a 16-row verify over a cache vs 16 one-row decodes with a
    // cache that holds exactly the keys up to each position.
    let mut rng = StdRng::seed_from_u64(7);
    let (nh, nkv, hd, ctx, t) = (4, 2, 16, 21, 16);
    let total = ctx + t;
    let k = rand_vec(&mut rng, total * nkv * hd, 1.0);
    let v = rand_vec(&mut rng, total * nkv * hd, 1.0);
    let q = rand_vec(&mut rng, t * nh * hd, 1.0);
    let be = Cpu::default();
    let p = AttnParams {
        n_q: t,
        n_kv: total,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        q_pos0: ctx,
        kv_pos0: 0,
        causal: true,
        window: Some(9),
        scale: 0.25,
    };
    let mut verify = vec![0.0; t * nh * hd];
    be.attention(&q, &k, &v, &p, &mut verify).unwrap();
    for i in 0..t {
        let p1 = AttnParams {
            n_q: 1,
            n_kv: ctx + i + 1,
            q_pos0: ctx + i,
            ..p
        };
        let mut one = vec![0.0; nh * hd];
        be.attention(
            &q[i * nh * hd..(i + 1) * nh * hd].to_vec(),
            &k,
            &v,
            &p1,
            &mut one,
        )
        .unwrap();
        assert_eq!(
            bits(&one),
            bits(&verify[i * nh * hd..(i + 1) * nh * hd]),
            "row {i}"
        );
    }
}

/// The CPU's `attention_fast_kv16` (the f16 rows read where the attention reads them) gives
/// the bits of the trait's default (unpack the whole cache, then the attention), and both equal
/// the exact attention over the f16-rounded values. Shapes around the attention's key blocks
/// (ctx not a multiple of them, windows starting inside one), head_dim 128 and odd ones (a kv
/// head's values at an odd half), GQA groups 1-4, 1 to 16 queries (the AVX-512 path reads the
/// f16 cache directly up to 32 query rows per kv head, n_q x group, and widens blocks above), a cache at a position > 0, caches exactly `n_kv` rows long and longer ones whose rows past `n_kv` are
/// NaN (read by mistake they would show), on every instruction set with 1-3 threads.
#[test]
fn attention_fast_kv16_equals_the_unpacking_default() {
    let mut rng = StdRng::seed_from_u64(11);
    // (heads, kv heads, head_dim, ctx, queries, causal, window, kv_pos0, extra cache rows)
    type Case = (
        usize,
        usize,
        usize,
        usize,
        usize,
        bool,
        Option<usize>,
        usize,
        usize,
    );
    let shapes: &[Case] = &[
        (4, 2, 16, 37, 5, true, None, 0, 7),
        (8, 2, 64, 300, 1, true, Some(64), 0, 7),
        (4, 4, 32, 90, 16, false, None, 0, 0),
        (32, 8, 128, 200, 1, true, None, 0, 0),
        (32, 8, 128, 130, 16, true, None, 0, 5),
        (16, 4, 128, 500, 16, true, Some(100), 0, 3),
        (8, 2, 64, 1000, 16, true, None, 0, 1),
        (8, 2, 64, 1001, 1, true, Some(333), 40, 0),
        (4, 2, 5, 40, 3, true, None, 0, 2),
        (6, 2, 7, 150, 16, true, Some(50), 0, 0),
        (8, 2, 24, 250, 4, true, None, 3, 9),
        (4, 1, 72, 310, 16, false, Some(17), 0, 4),
        (2, 2, 200, 70, 1, true, None, 0, 0),
        (4, 2, 64, 777, 1, true, None, 0, 0),
        (6, 2, 32, 90, 1, true, None, 0, 3),
        (12, 4, 48, 333, 3, true, Some(40), 5, 0),
        (8, 4, 16, 61, 4, true, None, 0, 2),
        (2, 2, 64, 129, 1, true, None, 0, 1),
        (8, 2, 32, 200, 8, true, Some(70), 0, 2),
        (3, 1, 64, 150, 11, true, None, 7, 0),
    ];
    for be in backends_all_isas() {
        for &(nh, nkv, hd, ctx, t, causal, window, kv_pos0, extra) in shapes {
            let total = ctx + t;
            let cap = total + extra;
            let mut kvals = rand_vec(&mut rng, cap * nkv * hd, 3.0);
            let mut vvals = rand_vec(&mut rng, cap * nkv * hd, 3.0);
            kvals[total * nkv * hd..].fill(f32::NAN);
            vvals[total * nkv * hd..].fill(f32::NAN);
            let q = rand_vec(&mut rng, t * nh * hd, 1.0);
            let n = cap * nkv * hd;
            let (mut k16, mut v16) = (vec![0.0f32; n / 2], vec![0.0f32; n / 2]);
            be.f16_pack(&kvals, &mut k16, 0, n).unwrap();
            be.f16_pack(&vvals, &mut v16, 0, n).unwrap();
            let p = AttnParams {
                n_q: t,
                n_kv: total,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                q_pos0: kv_pos0 + ctx,
                kv_pos0,
                causal,
                window,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let what = format!(
                "{:?} {} threads: {nh}/{nkv} heads hd {hd} ctx {ctx} n_q {t} window {window:?}",
                be.isa(),
                be.threads()
            );
            let mut got = vec![f32::NAN; t * nh * hd];
            be.attention_fast_kv16(&q, &k16, &v16, &p, &mut got)
                .unwrap();
            assert!(got.iter().all(|x| x.is_finite()), "{what}");
            let mut want = vec![f32::NAN; t * nh * hd];
            dflash_backend::attention_fast_kv16_ops(&be, &q, &k16, &v16, &p, &mut want).unwrap();
            assert_eq!(bits(&got), bits(&want), "{what}");
            let (mut kr, mut vr) = (vec![0.0f32; n], vec![0.0f32; n]);
            be.f16_unpack(&k16, 0, n, &mut kr).unwrap();
            be.f16_unpack(&v16, 0, n, &mut vr).unwrap();
            let mut exact = vec![f32::NAN; t * nh * hd];
            be.attention(&q, &kr, &vr, &p, &mut exact).unwrap();
            assert_eq!(
                bits(&got),
                bits(&exact),
                "exact over the f16 values: {what}"
            );
        }
    }
}

/// `attention_fast_kv16`'s errors: odd f16 rows, caches shorter than `n_kv` rows, and the
/// attention's own shape errors; never a panic.
#[test]
fn attention_fast_kv16_rejects_bad_shapes() {
    let be = Cpu::default();
    let p = AttnParams {
        n_q: 2,
        n_kv: 10,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        q_pos0: 8,
        kv_pos0: 0,
        causal: true,
        window: None,
        scale: 0.25,
    };
    let q = vec![0.5f32; 2 * 4 * 8];
    let kv = vec![0.0f32; 10 * 2 * 8 / 2];
    let mut out = vec![0.0f32; 2 * 4 * 8];
    be.attention_fast_kv16(&q, &kv, &kv, &p, &mut out).unwrap();
    let short = vec![0.0f32; 10 * 2 * 8 / 2 - 1];
    for (k, v) in [(&short, &kv), (&kv, &short)] {
        assert!(matches!(
            be.attention_fast_kv16(&q, k, v, &p, &mut out),
            Err(BackendError::Shape { .. })
        ));
    }
    let odd = AttnParams {
        n_kv_heads: 1,
        n_heads: 1,
        head_dim: 3,
        ..p
    };
    assert!(matches!(
        be.attention_fast_kv16(&q, &kv, &kv, &odd, &mut out),
        Err(BackendError::Invalid { .. })
    ));
    for bad in [
        AttnParams { n_heads: 3, ..p },
        AttnParams { head_dim: 0, ..p },
        AttnParams {
            window: Some(0),
            ..p
        },
    ] {
        assert!(be
            .attention_fast_kv16(&q, &kv, &kv, &bad, &mut out)
            .is_err());
    }
    let mut small = vec![0.0f32; 2 * 4 * 8 - 1];
    assert!(be
        .attention_fast_kv16(&q, &kv, &kv, &p, &mut small)
        .is_err());
    assert!(be
        .attention_fast_kv16(&q[..2 * 4 * 8 - 1].to_vec(), &kv, &kv, &p, &mut out)
        .is_err());
}

#[test]
fn attention_query_with_no_visible_key_is_zero() {
    let be = Cpu::default();
    let p = AttnParams {
        n_q: 2,
        n_kv: 3,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 2,
        q_pos0: 0,
        kv_pos0: 5,
        causal: true,
        window: None,
        scale: 1.0,
    };
    let mut out = vec![9.0; 4];
    be.attention(&vec![1.0; 4], &vec![1.0; 6], &vec![1.0; 6], &p, &mut out)
        .unwrap();
    assert_eq!(out, vec![0.0; 4]);
}

// ------------------------------------------------------------------------------- elementwise

proptest! {
    #![proptest_config(cfg(32))]

    #[test]
    fn elementwise_ops_match_naive(seed in any::<u64>(), n in 0usize..300, off in 0usize..5, s in -3.0f32..3.0) {
        let mut rng = StdRng::seed_from_u64(seed);
        let be = Cpu::default();
        let g = rand_vec(&mut rng, n, 10.0);
        let u = rand_vec(&mut rng, n, 3.0);
        let mut out = vec![0.0; n];
        be.silu_mul(&g, &u, &mut out).unwrap();
        for i in 0..n {
            let want = naive_silu(g[i] as f64) * u[i] as f64;
            prop_assert!(close(out[i], want, want.abs(), 1e-6));
        }
        let mut dst = rand_vec(&mut rng, n + off, 1.0);
        let before = dst.clone();
        be.add_assign(&mut dst, off, &u, n).unwrap();
        for i in 0..n + off {
            let want = if i >= off { before[i] + u[i - off] } else { before[i] };
            prop_assert_eq!(dst[i], want);
        }
        let mut x = u.clone();
        be.scale(&mut x, s).unwrap();
        for i in 0..n {
            prop_assert_eq!(x[i], u[i] * s);
        }
        let mut x = u.clone();
        be.mul_sigmoid(&mut x, &g).unwrap();
        for i in 0..n {
            let want = u[i] as f64 / (1.0 + (-(g[i] as f64)).exp());
            prop_assert!(close(x[i], want, want.abs(), 1e-6));
        }
    }

    #[test]
    fn argmax_matches_naive(seed in any::<u64>(), rows in 1usize..6, cols in 1usize..50, row0 in 0usize..3) {
        let mut rng = StdRng::seed_from_u64(seed);
        // Small integer values make ties frequent; sprinkle NaNs.
        let x: Vec<f32> = (0..(row0 + rows) * cols).map(|_| if rng.random_range(0..10) == 0 { f32::NAN } else { rng.random_range(-3i32..4) as f32 }).collect();
        let got = Cpu::default().argmax_rows(&x, row0, rows, cols).unwrap();
        for r in 0..rows {
            let row = &x[(row0 + r) * cols..(row0 + r + 1) * cols];
            let mut best: Option<usize> = None;
            for (i, &v) in row.iter().enumerate() {
                if v.is_nan() { continue; }
                if best.is_none_or(|b| v > row[b]) { best = Some(i); }
            }
            prop_assert_eq!(got[r] as usize, best.unwrap_or(0));
        }
    }
}

#[test]
fn argmax_edge_cases() {
    let be = Cpu::default();
    let x = vec![
        f32::NAN,
        1.0,
        3.0,
        3.0,
        f32::NAN,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::NAN,
    ];
    assert_eq!(be.argmax_rows(&x, 0, 2, 4).unwrap(), vec![2, 1]);
    assert_eq!(
        be.argmax_rows(&vec![f32::NAN; 3], 0, 1, 3).unwrap(),
        vec![0]
    );
    assert_eq!(
        be.argmax_rows(&vec![f32::NEG_INFINITY, -1.0], 0, 1, 2)
            .unwrap(),
        vec![1]
    );
}

// ------------------------------------------------------------------------------- Gated DeltaNet

fn naive_conv(
    x: &[f32],
    t: usize,
    c: usize,
    kernel: usize,
    w: &[f32],
    state: &[f32],
) -> (Vec<f64>, Vec<f32>) {
    let sl = kernel - 1;
    let mut xpad: Vec<f32> = state.to_vec();
    xpad.extend_from_slice(x);
    let mut out = vec![0.0; t * c];
    for ti in 0..t {
        for ch in 0..c {
            let mut acc = 0.0f64;
            for j in 0..kernel {
                acc += w[ch * kernel + j] as f64 * xpad[(ti + j) * c + ch] as f64;
            }
            out[ti * c + ch] = naive_silu(acc);
        }
    }
    let new_state = xpad[t * c..(t + sl) * c].to_vec();
    (out, new_state)
}

proptest! {
    #![proptest_config(cfg(48))]

    #[test]
    fn causal_conv1d_matches_naive(seed in any::<u64>(), t in 1usize..12, c in 1usize..20, kernel in 1usize..6, split in 0usize..12) {
        let mut rng = StdRng::seed_from_u64(seed);
        let sl = kernel - 1;
        let x = rand_vec(&mut rng, t * c, 2.0);
        let w = rand_vec(&mut rng, c * kernel, 1.0);
        let state0 = rand_vec(&mut rng, sl * c, 2.0);
        let (want, want_state) = naive_conv(&x, t, c, kernel, &w, &state0);
        for be in backends() {
        let mut state = state0.clone();
        let mut out = vec![0.0; t * c];
        let mut stash = vec![0.0; t * sl * c];
        be.causal_conv1d(&x, t, c, kernel, &w, &mut state, &mut out, Some(&mut stash)).unwrap();
        for i in 0..t * c {
            prop_assert!(close(out[i], want[i], 10.0, 1e-6), "{i}: {} vs {}", out[i], want[i]);
        }
        prop_assert_eq!(&state, &want_state);
        // stash[s] = state after step s = the naive state after running the first s + 1 rows.
        for s in 0..t {
            let (_, st) = naive_conv(&x[..(s + 1) * c], s + 1, c, kernel, &w, &state0);
            prop_assert_eq!(&stash[s * sl * c..(s + 1) * sl * c], &st[..]);
        }
        // Two calls with the state carried give identical bits.
        let split = split.min(t);
        let mut st2 = state0.clone();
        let mut o1 = vec![0.0; split * c];
        let mut o2 = vec![0.0; (t - split) * c];
        be.causal_conv1d(&x[..split * c].to_vec(), split, c, kernel, &w, &mut st2, &mut o1, None).unwrap();
        be.causal_conv1d(&x[split * c..].to_vec(), t - split, c, kernel, &w, &mut st2, &mut o2, None).unwrap();
        o1.extend_from_slice(&o2);
        prop_assert_eq!(bits(&o1), bits(&out));
        prop_assert_eq!(st2, state);
        }
    }

    #[test]
    fn gdn_gates_match_naive(seed in any::<u64>(), t in 1usize..6, nh in 1usize..9) {
        let mut rng = StdRng::seed_from_u64(seed);
        let a = rand_vec(&mut rng, t * nh, 30.0); // crosses the softplus threshold of 20
        let b = rand_vec(&mut rng, t * nh, 8.0);
        let a_log = rand_vec(&mut rng, nh, 2.0);
        let dt = rand_vec(&mut rng, nh, 2.0);
        let mut g = vec![0.0; t * nh];
        let mut beta = vec![0.0; t * nh];
        Cpu::default().gdn_gates(&a, &b, &a_log, &dt, nh, &mut g, &mut beta).unwrap();
        for i in 0..t * nh {
            let h = i % nh;
            let xa = (a[i] + dt[h]) as f64;
            let sp = if xa > 20.0 { xa } else { (1.0 + xa.exp()).ln() };
            let wg = -(a_log[h] as f64).exp() * sp;
            prop_assert!(close(g[i], wg, wg.abs(), 1e-5), "g {i}: {} vs {}", g[i], wg);
            let wb = 1.0 / (1.0 + (-(b[i] as f64)).exp());
            prop_assert!(close(beta[i], wb, wb, 1e-6));
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn naive_delta(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    p: &DeltaParams,
    state: &mut [f64],
) -> (Vec<f64>, Vec<Vec<f64>>) {
    let (t, nk, nv, dk, dv) = (p.t, p.n_k_heads, p.n_v_heads, p.dk, p.dv);
    let mut out = vec![0.0; t * nv * dv];
    let mut states = Vec::new();
    let l2 = |x: &[f32]| -> Vec<f64> {
        let n: f64 = x.iter().map(|&e| e as f64 * e as f64).sum();
        let inv = 1.0 / (n + 1e-6).sqrt();
        x.iter()
            .map(|&e| {
                if p.qk_l2norm {
                    e as f64 * inv
                } else {
                    e as f64
                }
            })
            .collect()
    };
    for ti in 0..t {
        for h in 0..nv {
            let kh = h / (nv / nk);
            let qv: Vec<f64> = l2(&q[(ti * nk + kh) * dk..][..dk])
                .into_iter()
                .map(|e| e * p.q_scale as f64)
                .collect();
            let kv = l2(&k[(ti * nk + kh) * dk..][..dk]);
            let s = &mut state[h * dk * dv..(h + 1) * dk * dv];
            let decay = (g[ti * nv + h] as f64).exp();
            for e in s.iter_mut() {
                *e *= decay;
            }
            for c in 0..dv {
                let mut mem = 0.0;
                for r in 0..dk {
                    mem += s[r * dv + c] * kv[r];
                }
                let delta = (v[(ti * nv + h) * dv + c] as f64 - mem) * beta[ti * nv + h] as f64;
                for r in 0..dk {
                    s[r * dv + c] += kv[r] * delta;
                }
            }
            for c in 0..dv {
                let mut o = 0.0;
                for r in 0..dk {
                    o += s[r * dv + c] * qv[r];
                }
                out[(ti * nv + h) * dv + c] = o;
            }
        }
        states.push(state.to_vec());
    }
    (out, states)
}

proptest! {
    #![proptest_config(cfg(48))]

    #[test]
    fn gated_delta_rule_matches_naive(seed in any::<u64>(), t in 1usize..8, nk in 1usize..3, group in 1usize..3, dk in 1usize..12, dv in 1usize..12, l2 in any::<bool>(), split in 0usize..8) {
        let mut rng = StdRng::seed_from_u64(seed);
        let nv = nk * group;
        let p = DeltaParams { t, n_k_heads: nk, n_v_heads: nv, dk, dv, qk_l2norm: l2, q_scale: 1.0 / (dk as f32).sqrt() };
        let amp = if l2 { 2.0 } else { 0.5 };
        let q = rand_vec(&mut rng, t * nk * dk, amp);
        let k = rand_vec(&mut rng, t * nk * dk, amp);
        let v = rand_vec(&mut rng, t * nv * dv, 1.0);
        let g: Vec<f32> = (0..t * nv).map(|_| rng.random_range(-2.0f32..0.0)).collect();
        let beta: Vec<f32> = (0..t * nv).map(|_| rng.random_range(0.0f32..1.0)).collect();
        let state0 = rand_vec(&mut rng, nv * dk * dv, 0.5);
        let mut nstate: Vec<f64> = state0.iter().map(|&e| e as f64).collect();
        let (want, want_states) = naive_delta(&q, &k, &v, &g, &beta, &p, &mut nstate);
        for be in backends() {
        let mut state = state0.clone();
        let mut out = vec![0.0; t * nv * dv];
        let ss = dk * dv;
        let mut stash = vec![0.0; t * nv * ss];
        be.gated_delta_rule(&q, &k, &v, &g, &beta, &p, &mut state, &mut out, Some(&mut stash)).unwrap();
        for i in 0..out.len() {
            prop_assert!(close(out[i], want[i], 1.0 + want[i].abs(), 1e-5), "out {i}: {} vs {}", out[i], want[i]);
        }
        for i in 0..state.len() {
            prop_assert!(close(state[i], nstate[i], 1.0 + nstate[i].abs(), 1e-5));
        }
        for ti in 0..t {
            for i in 0..nv * ss {
                prop_assert!(close(stash[ti * nv * ss + i], want_states[ti][i], 1.0 + want_states[ti][i].abs(), 1e-5));
            }
        }
        prop_assert_eq!(bits(&stash[(t - 1) * nv * ss..]), bits(&state));
        // Split into two calls: identical bits.
        let s = split.min(t);
        let mut st2 = state0.clone();
        let mut out2 = vec![0.0; t * nv * dv];
        for (a, b) in [(0, s), (s, t)] {
            let pp = DeltaParams { t: b - a, ..p };
            let mut o = vec![0.0; (b - a) * nv * dv];
            be.gated_delta_rule(&q[a * nk * dk..].to_vec(), &k[a * nk * dk..].to_vec(), &v[a * nv * dv..].to_vec(), &g[a * nv..].to_vec(), &beta[a * nv..].to_vec(), &pp, &mut st2, &mut o, None).unwrap();
            out2[a * nv * dv..b * nv * dv].copy_from_slice(&o);
        }
        prop_assert_eq!(bits(&out2), bits(&out));
        prop_assert_eq!(bits(&st2), bits(&state));
        }
    }
}

/// `gated_delta_rule_qkv`: q, k and v read from the conv's rows (q, then k, then v), the gates
/// from `a` / `b` by the published formulas in f64, then the naive recurrence; bad shapes are
/// refused naming the operand.
#[test]
fn gated_delta_rule_qkv_reads_the_conv_rows() {
    let mut rng = StdRng::seed_from_u64(61);
    let be = Cpu::default();
    let (t, nk, nv, dk, dv) = (5usize, 2usize, 4usize, 8usize, 6usize);
    let p = DeltaParams {
        t,
        n_k_heads: nk,
        n_v_heads: nv,
        dk,
        dv,
        qk_l2norm: true,
        q_scale: 0.3,
    };
    let (kd, vd) = (nk * dk, nv * dv);
    let ch = 2 * kd + vd;
    let qkv = rand_vec(&mut rng, t * ch, 1.0);
    let a = rand_vec(&mut rng, t * nv, 3.0);
    let b = rand_vec(&mut rng, t * nv, 3.0);
    let a_log = rand_vec(&mut rng, nv, 1.0);
    let dt_bias = rand_vec(&mut rng, nv, 1.0);
    let state0 = rand_vec(&mut rng, nv * dk * dv, 0.5);
    let part = |off: usize, w: usize| -> Vec<f32> {
        qkv.chunks(ch)
            .flat_map(|r| r[off..off + w].to_vec())
            .collect()
    };
    let (q, k, v) = (part(0, kd), part(kd, kd), part(2 * kd, vd));
    let softplus = |x: f64| if x > 20.0 { x } else { x.exp().ln_1p() };
    let g: Vec<f32> = (0..t * nv)
        .map(|i| (-(a_log[i % nv] as f64).exp() * softplus((a[i] + dt_bias[i % nv]) as f64)) as f32)
        .collect();
    let beta: Vec<f32> = b
        .iter()
        .map(|&x| (1.0 / (1.0 + (-(x as f64)).exp())) as f32)
        .collect();
    let mut nstate: Vec<f64> = state0.iter().map(|&e| e as f64).collect();
    let (want, _) = naive_delta(&q, &k, &v, &g, &beta, &p, &mut nstate);
    let mut state = state0.clone();
    let mut out = vec![0.0; t * vd];
    be.gated_delta_rule_qkv(
        &qkv, &a, &b, &a_log, &dt_bias, &p, &mut state, &mut out, None,
    )
    .unwrap();
    for (i, (&o, &w)) in out.iter().zip(&want).enumerate() {
        assert!(close(o, w, 1.0 + w.abs(), 1e-5), "out {i}: {o} vs {w}");
    }
    for (i, (&s, &w)) in state.iter().zip(&nstate).enumerate() {
        assert!(close(s, w, 1.0 + w.abs(), 1e-5), "state {i}: {s} vs {w}");
    }
    let short = |x: &[f32]| x[..x.len() - 1].to_vec();
    let call = |qkv: &Vec<f32>, a: &Vec<f32>, b: &Vec<f32>| {
        let (mut s, mut o) = (state0.clone(), vec![0.0; t * vd]);
        be.gated_delta_rule_qkv(qkv, a, b, &a_log, &dt_bias, &p, &mut s, &mut o, None)
    };
    for (which, r) in [
        ("qkv", call(&short(&qkv), &a, &b)),
        ("a", call(&qkv, &short(&a), &b)),
        ("b", call(&qkv, &a, &short(&b))),
    ] {
        match r {
            Err(BackendError::Shape { operand, .. }) => assert_eq!(operand, which),
            other => panic!("a short `{which}` gave {other:?}"),
        }
    }
}

// ------------------------------------------------------------------------------- copies, markov

#[test]
fn copy2d_and_copy() {
    let be = Cpu::default();
    let src: Vec<f32> = (0..20).map(|i| i as f32).collect();
    let mut dst = vec![0.0; 20];
    be.copy2d(&src, 1, 5, &mut dst, 2, 6, 3, 4).unwrap();
    for r in 0..3 {
        for c in 0..4 {
            assert_eq!(dst[2 + r * 6 + c], src[1 + r * 5 + c]);
        }
    }
    // Nothing else written (every copied value is non-zero since src_off = 1).
    assert_eq!(dst.iter().filter(|&&v| v != 0.0).count(), 12);
    let mut d2 = vec![0.0; 5];
    be.copy(&src, 10, &mut d2, 1, 4).unwrap();
    assert_eq!(d2, vec![0.0, 10.0, 11.0, 12.0, 13.0]);
    assert!(matches!(
        be.copy(&src, 18, &mut d2, 0, 4),
        Err(BackendError::Shape {
            op: "copy2d",
            operand: "src",
            ..
        })
    ));
    assert!(matches!(
        be.copy(&src, 0, &mut d2, 2, 4),
        Err(BackendError::Shape {
            op: "copy2d",
            operand: "dst",
            ..
        })
    ));
    assert!(matches!(
        be.copy2d(&src, 0, 5, &mut dst, 0, 2, 2, 4),
        Err(BackendError::Invalid { .. })
    ));
}

#[test]
fn markov_chain_matches_naive() {
    let mut rng = StdRng::seed_from_u64(3);
    let (vocab, rank, n) = (37, 8, 6);
    let w1v = rand_vec(&mut rng, vocab * rank, 1.0);
    let w2v = rand_vec(&mut rng, vocab * rank, 1.0);
    let logits0 = rand_vec(&mut rng, n * vocab, 2.0);
    let be = Cpu::default();
    let w1 = be
        .upload_weight(&HostWeight::from_f32("w1", vocab, rank, &w1v, WeightFormat::F32).unwrap())
        .unwrap();
    let w2 = be
        .upload_weight(&HostWeight::from_f32("w2", vocab, rank, &w2v, WeightFormat::F32).unwrap())
        .unwrap();
    let mut logits = logits0.clone();
    let toks = be.markov_chain(&mut logits, n, vocab, 5, &w1, &w2).unwrap();
    let mut prev = 5usize;
    for kk in 0..n {
        let row: Vec<f64> = (0..vocab)
            .map(|o| {
                logits0[kk * vocab + o] as f64
                    + (0..rank)
                        .map(|r| w2v[o * rank + r] as f64 * w1v[prev * rank + r] as f64)
                        .sum::<f64>()
            })
            .collect();
        let best = (0..vocab).fold(0, |b, i| if row[i] > row[b] { i } else { b });
        assert_eq!(toks[kk] as usize, best, "step {kk}");
        prev = best;
    }
}

// ------------------------------------------------------------------------------- errors

#[test]
fn shape_errors_name_op_and_operand() {
    let be = Cpu::default();
    let hw = HostWeight::from_f32("w", 4, 32, &[0.5; 128], WeightFormat::Q8_0).unwrap();
    let w = be.upload_weight(&hw).unwrap();
    let x = vec![0.0; 64];
    let mut out = vec![0.0; 8];
    assert!(matches!(
        be.matmul(&x, 3, &w, &mut out),
        Err(BackendError::Shape {
            op: "matmul",
            operand: "x",
            expected: 96,
            found: 64
        })
    ));
    let mut small = vec![0.0; 7];
    assert!(matches!(
        be.matmul(&x, 2, &w, &mut small),
        Err(BackendError::Shape {
            op: "matmul",
            operand: "out",
            expected: 8,
            found: 7
        })
    ));
    let mut emb = vec![0.0; 64];
    assert!(matches!(
        be.gather_rows(&w, &[1, 4], &mut emb),
        Err(BackendError::TokenOutOfRange { id: 4, rows: 4 })
    ));
    assert!(matches!(
        be.gather_rows(&w, &[1, 2, 3], &mut emb),
        Err(BackendError::Shape {
            op: "gather_rows",
            operand: "out",
            ..
        })
    ));
    assert!(matches!(
        be.rms_norm(&vec![0.0; 8], &vec![1.0; 3], 4, 1e-6, &mut vec![0.0; 8]),
        Err(BackendError::Shape {
            op: "rms_norm",
            operand: "w",
            ..
        })
    ));
    assert!(matches!(
        be.rms_norm(&vec![0.0; 9], &vec![1.0; 4], 4, 1e-6, &mut vec![0.0; 9]),
        Err(BackendError::Invalid { op: "rms_norm", .. })
    ));
    assert!(matches!(
        be.rms_norm(&vec![0.0; 8], &vec![], 0, 1e-6, &mut vec![0.0; 8]),
        Err(BackendError::Invalid { op: "rms_norm", .. })
    ));
    assert!(matches!(
        be.rms_norm(&vec![0.0; 8], &vec![1.0; 4], 4, 1e-6, &mut vec![0.0; 4]),
        Err(BackendError::Shape {
            op: "rms_norm",
            operand: "out",
            ..
        })
    ));
    let spec = RopeSpec {
        inv_freq: vec![1.0; 3],
        attention_scaling: 1.0,
    };
    assert!(matches!(
        be.rope(&mut vec![0.0; 8], 1, 2, 4, 0, &spec),
        Err(BackendError::Invalid { op: "rope", .. })
    ));
    let spec = RopeSpec {
        inv_freq: vec![1.0; 2],
        attention_scaling: 1.0,
    };
    assert!(matches!(
        be.rope(&mut vec![0.0; 8], 2, 2, 4, 0, &spec),
        Err(BackendError::Shape {
            op: "rope",
            operand: "x",
            ..
        })
    ));
    let p = AttnParams {
        n_q: 2,
        n_kv: 3,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 2,
        q_pos0: 0,
        kv_pos0: 0,
        causal: true,
        window: None,
        scale: 1.0,
    };
    let ok = |n| vec![0.0f32; n];
    assert!(be
        .attention(&ok(16), &ok(12), &ok(12), &p, &mut ok(16))
        .is_ok());
    assert!(matches!(
        be.attention(&ok(15), &ok(12), &ok(12), &p, &mut ok(16)),
        Err(BackendError::Shape { operand: "q", .. })
    ));
    assert!(matches!(
        be.attention(&ok(16), &ok(11), &ok(12), &p, &mut ok(16)),
        Err(BackendError::Shape { operand: "k", .. })
    ));
    assert!(matches!(
        be.attention(&ok(16), &ok(12), &ok(11), &p, &mut ok(16)),
        Err(BackendError::Shape { operand: "v", .. })
    ));
    assert!(matches!(
        be.attention(&ok(16), &ok(12), &ok(12), &p, &mut ok(15)),
        Err(BackendError::Shape { operand: "out", .. })
    ));
    let bad = AttnParams { n_heads: 3, ..p };
    assert!(matches!(
        be.attention(&ok(16), &ok(12), &ok(12), &bad, &mut ok(16)),
        Err(BackendError::Invalid {
            op: "attention",
            ..
        })
    ));
    assert!(matches!(
        be.silu_mul(&ok(4), &ok(3), &mut ok(4)),
        Err(BackendError::Shape {
            op: "silu_mul",
            operand: "up",
            ..
        })
    ));
    assert!(matches!(
        be.add_assign(&mut ok(4), 2, &ok(3), 3),
        Err(BackendError::Shape {
            op: "add_assign",
            operand: "dst",
            ..
        })
    ));
    assert!(matches!(
        be.mul_sigmoid(&mut ok(4), &ok(3)),
        Err(BackendError::Shape {
            op: "mul_sigmoid",
            operand: "gate",
            ..
        })
    ));
    assert!(matches!(
        be.argmax_rows(&ok(10), 1, 2, 5),
        Err(BackendError::Shape {
            op: "argmax_rows",
            operand: "x",
            ..
        })
    ));
    assert!(matches!(
        be.causal_conv1d(&ok(6), 2, 3, 4, &ok(12), &mut ok(8), &mut ok(6), None),
        Err(BackendError::Shape {
            op: "causal_conv1d",
            operand: "state",
            expected: 9,
            found: 8
        })
    ));
    assert!(matches!(
        be.causal_conv1d(
            &ok(6),
            2,
            3,
            4,
            &ok(12),
            &mut ok(9),
            &mut ok(6),
            Some(&mut ok(17))
        ),
        Err(BackendError::Shape {
            op: "causal_conv1d",
            operand: "stash",
            expected: 18,
            ..
        })
    ));
    assert!(matches!(
        be.gdn_gates(&ok(6), &ok(6), &ok(2), &ok(3), 3, &mut ok(6), &mut ok(6)),
        Err(BackendError::Shape {
            operand: "a_log",
            ..
        })
    ));
    let dp = DeltaParams {
        t: 2,
        n_k_heads: 1,
        n_v_heads: 2,
        dk: 3,
        dv: 2,
        qk_l2norm: true,
        q_scale: 1.0,
    };
    assert!(be
        .gated_delta_rule(
            &ok(6),
            &ok(6),
            &ok(8),
            &ok(4),
            &ok(4),
            &dp,
            &mut ok(12),
            &mut ok(8),
            None
        )
        .is_ok());
    assert!(matches!(
        be.gated_delta_rule(
            &ok(6),
            &ok(6),
            &ok(8),
            &ok(4),
            &ok(4),
            &dp,
            &mut ok(11),
            &mut ok(8),
            None
        ),
        Err(BackendError::Shape {
            operand: "state",
            ..
        })
    ));
    assert!(matches!(
        be.gated_delta_rule(
            &ok(6),
            &ok(6),
            &ok(7),
            &ok(4),
            &ok(4),
            &dp,
            &mut ok(12),
            &mut ok(8),
            None
        ),
        Err(BackendError::Shape { operand: "v", .. })
    ));
}

#[test]
fn weight_errors() {
    let be = Cpu::default();
    // A HostWeight whose public fields were edited after construction.
    let mut hw = HostWeight::from_f32("w", 2, 32, &[1.0; 64], WeightFormat::Bf16).unwrap();
    hw.rows = 3;
    assert!(matches!(be.upload_weight(&hw), Err(BackendError::Weight(m)) if m.contains("w:")));
    assert!(HostWeight::from_f32("q", 1, 16, &[1.0; 16], WeightFormat::Q4_0).is_err());
}

#[test]
fn rope_cached_and_uncached_positions_agree() {
    // Positions below 65536 come from the backend's cos/sin cache, the others are computed on
    // the fly: a call crossing the boundary must match one-row calls on either side.
    let spec = RopeSpec {
        inv_freq: (0..8).map(|i| 10000f32.powf(-(i as f32) / 8.0)).collect(),
        attention_scaling: 1.1,
    };
    let (rows, nh, hd, pos0) = (12, 2, 20, 65530);
    let x: Vec<f32> = (0..rows * nh * hd)
        .map(|i| ((i * 7) % 23) as f32 * 0.1 - 1.0)
        .collect();
    let be = Cpu::default();
    let mut all = x.clone();
    be.rope(&mut all, rows, nh, hd, pos0, &spec).unwrap();
    let mut want = x.clone();
    naive_rope(&mut want, rows, nh, hd, pos0, &spec);
    let w = nh * hd;
    for r in 0..rows {
        let mut one = x[r * w..(r + 1) * w].to_vec();
        be.rope(&mut one, 1, nh, hd, pos0 + r, &spec).unwrap();
        assert_eq!(bits(&one), bits(&all[r * w..(r + 1) * w]), "row {r}");
    }
    for (a, b) in all.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()) * 4.0);
    }
}

/// A bf16 weight keeps its packed layout when another backend uses it (AVX-512 backends pack
/// bf16 in step pairs): every backend computes the same bits with it, and its rows decode
/// exactly, for even and odd inner sizes.
#[test]
fn bf16_weight_packed_by_one_isa_runs_on_every_other() {
    let mut rng = StdRng::seed_from_u64(99);
    for k in [1usize, 2, 3, 17, 32, 63, 256, 257] {
        let (rows, n) = (9usize, 37usize);
        let wv = rand_vec(&mut rng, n * k, 1.0);
        let hw = HostWeight::from_f32("w", n, k, &wv, WeightFormat::Bf16).unwrap();
        let wdec = hw.to_f32();
        let x = rand_vec(&mut rng, rows * k, 2.0);
        let all = backends_all_isas();
        let mut reference: Option<Vec<f32>> = None;
        for packer in &all {
            let w = packer.upload_weight(&hw).unwrap();
            let mut emb = vec![0.0f32; 3 * k];
            packer.gather_rows(&w, &[0, 36, 17], &mut emb).unwrap();
            for (t, &id) in [0usize, 36, 17].iter().enumerate() {
                assert_eq!(
                    bits(&emb[t * k..(t + 1) * k]),
                    bits(&wdec[id * k..(id + 1) * k])
                );
            }
            for user in &all {
                let mut out = vec![0.0f32; rows * n];
                user.matmul(&x, rows, &w, &mut out).unwrap();
                match &reference {
                    None => reference = Some(out),
                    Some(r) => assert_eq!(bits(&out), bits(r), "k {k}"),
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------- threads

/// `Cpu::run` puts the closure on a pool thread when the backend has several (so its ops fork
/// inside the pool), calls it in place with one, and ops give the same bits either way; a
/// work floor per matmul chunk (uneven chunks) changes no bit either.
#[test]
fn run_on_the_pool_gives_the_same_bits() {
    let mut rng = StdRng::seed_from_u64(0x5eed_7157);
    let one = Cpu::with_threads(1).unwrap();
    let here = std::thread::current().id();
    assert_eq!(one.run(|| std::thread::current().id()), here);
    let global = Cpu::default();
    assert_eq!(
        global.run(rayon::current_thread_index).is_some(),
        global.threads() > 1
    );
    for rows in [1usize, 3, 8, 16] {
        let (n, k) = (300usize, 64usize);
        let hw = HostWeight::from_f32(
            "w",
            n,
            k,
            &rand_vec(&mut rng, n * k, 1.0),
            WeightFormat::Bf16,
        )
        .unwrap();
        let x = rand_vec(&mut rng, rows * k, 1.0);
        let mm = |be: &Cpu| {
            let w = be.upload_weight(&hw).unwrap();
            let mut out = vec![0.0f32; rows * n];
            be.matmul(&x, rows, &w, &mut out).unwrap();
            bits(&out)
        };
        let want = mm(&one);
        // 19 panels of 16 outputs; the floor makes chunks of 3 panels (the last one shorter)
        let floored = Cpu::with_threads(3)
            .unwrap()
            .with_par_min_work(4 * 3 * rows * k * 16);
        assert!(floored.run(rayon::current_thread_index).is_some());
        assert_eq!(
            floored.run(|| mm(&floored)),
            want,
            "rows {rows}, in the pool"
        );
        assert_eq!(mm(&floored), want, "rows {rows}, from outside the pool");
        let always = Cpu::with_threads(2).unwrap().with_par_min_work(0);
        assert_eq!(
            always.run(|| mm(&always)),
            want,
            "rows {rows}, every op parallel"
        );
    }
}

/// 9-16 rows whose x outgrows L1 (the AVX-512 matmul's other tile shape): every row equals
/// its one-row matmul bit for bit and the naive product within the f32 bound.
#[test]
fn matmul_many_rows_past_l1_match_single_rows() {
    let mut rng = StdRng::seed_from_u64(0x11d_0b17e5);
    // even 9 rows of x outgrow this CPU's L1
    let k = (Isa::l1d_bytes() / (9 * 4)).next_multiple_of(32) + 32;
    let n = 40;
    for fmt in [WeightFormat::Bf16, WeightFormat::F32, WeightFormat::Q8_0] {
        let hw = HostWeight::from_f32("w", n, k, &rand_vec(&mut rng, n * k, 1.0), fmt).unwrap();
        let wdec = hw.to_f32();
        for be in backends_all_isas() {
            let w = be.upload_weight(&hw).unwrap();
            for rows in 9..=16 {
                let x = rand_vec(&mut rng, rows * k, 1.0);
                let mut out = vec![0.0f32; rows * n];
                be.matmul(&x, rows, &w, &mut out).unwrap();
                let (want, mag) = naive_matmul(&x, rows, &wdec, n, k);
                for i in 0..rows * n {
                    assert!(
                        close(out[i], want[i], mag[i], 1e-5),
                        "{fmt:?} rows {rows} {i}"
                    );
                }
                for r in 0..rows {
                    let mut one = vec![0.0f32; n];
                    be.matmul(&x[r * k..(r + 1) * k].to_vec(), 1, &w, &mut one)
                        .unwrap();
                    assert_eq!(
                        bits(&one),
                        bits(&out[r * n..(r + 1) * n]),
                        "{fmt:?} rows {rows} row {r}"
                    );
                }
            }
        }
    }
}

#[test]
fn l1d_size_is_plausible() {
    let b = Isa::l1d_bytes();
    assert!((8 * 1024..=4 * 1024 * 1024).contains(&b), "{b}");
}
