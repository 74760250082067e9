//! `WeightFormat::Q8_0A8` on the CPU backend against a plain scalar transcription of its
//! contract (weight.rs): every row of `x` quantized with `dflash_quant::quantize_q8_0`, exact
//! integer block dots, then per chunk of 32 blocks `acc_c = fma(isum as f32, d_w * d_x, acc_c)`
//! over the chunk's blocks in order from 0, and the chunk results added in chunk order.
//! Bit-exact on every instruction set and thread count; per-row deterministic; within
//! the derived 8-bit rounding bound of the f64 product of the dequantized weight and the
//! unquantized `x`.

use dflash_backend::cpu::{avx2_supported, vnni_supported, Cpu, Isa};
use dflash_backend::{Backend, BackendError, HostData, HostWeight, WeightFormat, A8_CHUNK_BLOCKS};
use dflash_quant::{BlockQ8_0, QK};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The contract, written out with nothing shared with the backend but the quantizer.
fn oracle(w: &[BlockQ8_0], n: usize, k: usize, x: &[f32], rows: usize) -> Vec<f32> {
    assert_eq!(
        A8_CHUNK_BLOCKS, 32,
        "the contract's chunk is 32 blocks (1024 values)"
    );
    let nb = k / QK;
    let mut out = vec![0.0f32; rows * n];
    for r in 0..rows {
        let qx = dflash_quant::quantize_q8_0(&x[r * k..(r + 1) * k]).unwrap();
        for o in 0..n {
            let mut total = 0.0f32;
            let mut c = 0;
            while c * 32 < nb {
                let mut acc = 0.0f32;
                for b in 32 * c..(32 * c + 32).min(nb) {
                    let wb = &w[o * nb + b];
                    let xb = &qx[b];
                    let mut isum = 0i32;
                    for i in 0..QK {
                        isum += wb.qs[i] as i32 * xb.qs[i] as i32;
                    }
                    let s = wb.d.to_f32() * xb.d.to_f32();
                    acc = (isum as f32).mul_add(s, acc);
                }
                total = if c == 0 { acc } else { total + acc };
                c += 1;
            }
            out[r * n + o] = total;
        }
    }
    out
}

/// Every CPU configuration: default (AVX-512 VNNI here), portable, AVX2, forced parallel.
fn backends() -> Vec<(String, Cpu)> {
    let mut v = vec![
        ("default".to_string(), Cpu::default()),
        (
            "portable x1".to_string(),
            Cpu::with_threads(1)
                .unwrap()
                .with_isa(Isa::Portable)
                .unwrap(),
        ),
        (
            "portable x2 par".to_string(),
            Cpu::with_threads(2)
                .unwrap()
                .with_isa(Isa::Portable)
                .unwrap()
                .with_par_min_work(0),
        ),
    ];
    for isa in [Isa::Avx2Fma, Isa::Avx512] {
        if isa.supported() {
            v.push((
                format!("{isa:?} x1"),
                Cpu::with_threads(1).unwrap().with_isa(isa).unwrap(),
            ));
            v.push((
                format!("{isa:?} x3 par"),
                Cpu::with_threads(3)
                    .unwrap()
                    .with_isa(isa)
                    .unwrap()
                    .with_par_min_work(0),
            ));
        }
    }
    v
}

/// Rows of several kinds: uniform, zero, huge, tiny, mixed scales per block, one outlier.
fn make_x(rng: &mut StdRng, rows: usize, k: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(rows * k);
    for _ in 0..rows {
        let kind = rng.random_range(0..6);
        for i in 0..k {
            let u: f32 = rng.random_range(-1.0..1.0);
            x.push(match kind {
                0 => u,
                1 => 0.0,
                2 => u * 3.0e5,
                3 => u * 1.0e-30,
                4 => u * 10f32.powi((i / QK) as i32 % 7 - 3),
                _ => {
                    if i == k / 2 {
                        1.0e4
                    } else {
                        u * 0.01
                    }
                }
            });
        }
    }
    x
}

fn make_w(rng: &mut StdRng, n: usize, k: usize) -> Vec<f32> {
    (0..n * k)
        .map(|i| {
            let u: f32 = rng.random_range(-1.0..1.0);
            // Some rows with large or tiny scales, some zero blocks.
            match (i / k) % 5 {
                0 => u * 50.0,
                1 => u * 1.0e-6,
                2 if (i % k) / QK == 0 => 0.0,
                _ => u,
            }
        })
        .collect()
}

#[test]
fn bit_exact_vs_contract_on_every_isa_and_thread_count() {
    let bes = backends();
    let mut rng = StdRng::seed_from_u64(0x0a8);
    let mut cases: Vec<(usize, usize, usize)> = Vec::new();
    for rows in 1..=17 {
        let k = QK * rng.random_range(1..=32usize);
        let n = rng.random_range(1..=80usize);
        cases.push((rows, n, k));
    }
    cases.extend([(33, 40, 64), (16, 256, 256), (7, 33, 1024), (1, 17, 32)]);
    // Several chunks of 32 blocks, with a short last chunk (1056, 3200, 5120 + 32), whole
    // chunks (2048, 4096), the drafter's K (4096, 12288).
    cases.extend([
        (1, 20, 1056),
        (3, 17, 2048),
        (9, 33, 3200),
        (16, 40, 4096),
        (8, 18, 5152),
        (5, 16, 12288),
        (17, 9, 1088),
    ]);
    for (rows, n, k) in cases {
        let w = make_w(&mut rng, n, k);
        let x = make_x(&mut rng, rows, k);
        let hw = HostWeight::from_f32("w", n, k, &w, WeightFormat::Q8_0A8).unwrap();
        let HostData::Q8_0A8(blocks) = &hw.data else {
            unreachable!()
        };
        let want = oracle(blocks, n, k, &x, rows);
        for (name, be) in &bes {
            let wt = be.upload_weight(&hw).unwrap();
            // Longer than needed: only the first rows * n values may be written.
            let mut out = vec![f32::from_bits(0x7fc0_1234); rows * n + 5];
            be.matmul(&x, rows, &wt, &mut out).unwrap();
            for (i, (g, e)) in out[..rows * n].iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    e.to_bits(),
                    "{name}: rows {rows} n {n} k {k}: element ({}, {}) {g} vs {e}",
                    i / n,
                    i % n
                );
            }
            assert!(out[rows * n..].iter().all(|v| v.to_bits() == 0x7fc0_1234));
        }
    }
}

/// `WeightFormat::Q4_0A8` is the same contract over the q4_0 blocks' widened codes (`code - 8`,
/// the same scale): the transcription above of `widen_q4_0`'s blocks, bit for bit, on every
/// configuration (its embedding rows: `gather_rows_dequantizes_exactly`).
#[test]
fn q4_0a8_is_the_contract_over_the_widened_q4_0_codes() {
    let bes = backends();
    let mut rng = StdRng::seed_from_u64(0x4a8);
    let mut cases: Vec<(usize, usize, usize)> = (1..=16)
        .map(|rows| {
            (
                rows,
                rng.random_range(1..=48usize),
                QK * rng.random_range(1..=24usize),
            )
        })
        .collect();
    cases.extend([(16, 40, 4096), (5, 17, 3200), (1, 16, 12288), (17, 9, 1088)]);
    for (rows, n, k) in cases {
        let w = make_w(&mut rng, n, k);
        let x = make_x(&mut rng, rows, k);
        let hw = HostWeight::from_f32("w", n, k, &w, WeightFormat::Q4_0A8).unwrap();
        let HostData::Q4_0A8(q4) = &hw.data else {
            unreachable!()
        };
        let wide: Vec<BlockQ8_0> = q4.iter().map(dflash_quant::widen_q4_0).collect();
        let want = oracle(&wide, n, k, &x, rows);
        for (name, be) in &bes {
            let wt = be.upload_weight(&hw).unwrap();
            assert_eq!(wt.format, WeightFormat::Q4_0A8);
            let mut out = vec![f32::from_bits(0x7fc0_1234); rows * n];
            be.matmul(&x, rows, &wt, &mut out).unwrap();
            for (i, (g, e)) in out.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    e.to_bits(),
                    "{name}: rows {rows} n {n} k {k}: element ({}, {}) {g} vs {e}",
                    i / n,
                    i % n
                );
            }
        }
    }
}

#[test]
fn vnni_path_is_the_one_tested_on_this_cpu() {
    // The identity test above only covers the VNNI kernel where the CPU has it; say which.
    let be = Cpu::default();
    eprintln!(
        "isa {:?}, AVX-512 VNNI {}, AVX2 + FMA {}",
        be.isa(),
        if vnni_supported() { "used" } else { "absent" },
        if !avx2_supported() {
            "absent"
        } else if vnni_supported() {
            "present (VNNI used)"
        } else {
            "used"
        }
    );
    if Isa::Avx2Fma.supported() {
        assert!(avx2_supported());
    }
    if Isa::Avx512.supported() && std::arch::is_x86_feature_detected!("avx512vnni") {
        assert!(vnni_supported());
    }
}

#[test]
fn each_row_alone_gives_the_same_bits() {
    let mut rng = StdRng::seed_from_u64(7);
    let (n, k) = (70, 1312);
    let w = make_w(&mut rng, n, k);
    let hw = HostWeight::from_f32("w", n, k, &w, WeightFormat::Q8_0A8).unwrap();
    for (name, be) in backends() {
        let wt = be.upload_weight(&hw).unwrap();
        for rows in [2, 5, 9, 16, 17, 24] {
            let x = make_x(&mut rng, rows, k);
            let mut all = vec![0.0f32; rows * n];
            be.matmul(&x, rows, &wt, &mut all).unwrap();
            for r in 0..rows {
                let xr = x[r * k..(r + 1) * k].to_vec();
                let mut one = vec![0.0f32; n];
                be.matmul(&xr, 1, &wt, &mut one).unwrap();
                let a: Vec<u32> = all[r * n..(r + 1) * n]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                let b: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
                assert_eq!(a, b, "{name}: row {r} of {rows}");
            }
        }
    }
}

/// Error bound against `Σ_i w_i x_i` in f64 (`w` dequantized, `x` not quantized).
///
/// Per block of a row with `amax = max |x_i|`, q8_0 stores `d16 = f16(f32(amax / 127))` and
/// codes `q_i = round(f32(x_i · f32(1 / d)))`. Hence, with `d = amax / 127` and `u = 2^-24`:
/// * `|x_i / d - q_i| <= 1/2 + 127 · 3.01 u` (the rounding to an integer plus the three f32
///   roundings of `d`, `1 / d` and the product, each relative `u` of a value <= 127), and
///   `|q_i| <= 127`;
/// * `|d - d16| <= u d + max(2^-11 d, 2^-25) (1 + u)` (`d` to f32, then f16 rounding: relative
///   half-ulp `2^-11` in the normal range, absolute half of the subnormal step `2^-24`
///   below `2^-14`);
/// * so `e_i = |x_i - d16 q_i| <= d |x_i / d - q_i| + 127 |d - d16|`.
///
/// The f32 part is exact but for the fused multiply-adds of the block terms `t_b`
/// (`|t_b| <= Σ_{i ∈ b} |w_i| |d16 q_i|`) and the chunk adds: each term goes through at most
/// `min(nb, 32) + ceil(nb / 32) - 1 <= nb` roundings, so the error is `<= γ_nb Σ_b |t_b|`,
/// `γ_n = n u / (1 - n u)`. Total: `Σ_i |w_i| e_i + γ_nb Σ_i |w_i| (|x_i| + e_i)`.
#[test]
fn error_within_the_8_bit_rounding_bound() {
    let u = 2f64.powi(-24);
    let mut rng = StdRng::seed_from_u64(42);
    let be = Cpu::default();
    let mut worst = 0.0f64;
    for _ in 0..40 {
        let rows = rng.random_range(1..=17usize);
        // Up to 3 chunks of 32 blocks.
        let k = QK * rng.random_range(1..=96usize);
        let n = rng.random_range(1..=48usize);
        let nb = k / QK;
        let w = make_w(&mut rng, n, k);
        let x = make_x(&mut rng, rows, k);
        let hw = HostWeight::from_f32("w", n, k, &w, WeightFormat::Q8_0A8).unwrap();
        let wd = hw.to_f32();
        let wt = be.upload_weight(&hw).unwrap();
        let mut out = vec![0.0f32; rows * n];
        be.matmul(&x, rows, &wt, &mut out).unwrap();
        let gamma = nb as f64 * u / (1.0 - nb as f64 * u);
        for r in 0..rows {
            let xr = &x[r * k..(r + 1) * k];
            // Per-element quantization error bound e_i.
            let e: Vec<f64> = xr
                .chunks_exact(QK)
                .flat_map(|blk| {
                    let amax = blk.iter().fold(0.0f64, |m, &v| m.max((v as f64).abs()));
                    let d = amax / 127.0;
                    // |d - d16| <= |d - f32(d)| + |f32(d) - d16|.
                    let dd = u * d + (2f64.powi(-11) * d).max(2f64.powi(-25)) * (1.0 + u);
                    let ei = if amax == 0.0 {
                        0.0
                    } else {
                        d * (0.5 + 382.0 * u) + 127.0 * dd
                    };
                    std::iter::repeat_n(ei, QK)
                })
                .collect();
            for o in 0..n {
                let wr = &wd[o * k..(o + 1) * k];
                let exact: f64 = wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
                let quant: f64 = wr
                    .iter()
                    .zip(&e)
                    .map(|(&a, &ei)| (a as f64).abs() * ei)
                    .sum();
                let mag: f64 = wr
                    .iter()
                    .zip(xr)
                    .zip(&e)
                    .map(|((&a, &b), &ei)| (a as f64).abs() * ((b as f64).abs() + ei))
                    .sum();
                // Plus the f64 reference's own rounding (k terms, 2^-53 each).
                let bound = quant + gamma * mag + k as f64 * 2f64.powi(-53) * mag;
                let err = (out[r * n + o] as f64 - exact).abs();
                assert!(
                    err <= bound,
                    "rows {rows} n {n} k {k} ({r}, {o}): got {} want {exact}: error {err} > bound {bound}",
                    out[r * n + o]
                );
                if bound > 0.0 {
                    worst = worst.max(err / bound);
                }
            }
        }
    }
    // The bound is a bound, not a tuned constant; say how tight it came out.
    eprintln!("worst error / bound: {worst:.3}");
}

#[test]
fn gather_rows_dequantizes_exactly() {
    for fmt in [WeightFormat::Q8_0A8, WeightFormat::Q4_0A8] {
        gather_rows_dequantize_exactly(fmt);
    }
}

/// `gather_rows` of the format's table: the rows `to_f32` decodes (q8_0's or q4_0's values).
fn gather_rows_dequantize_exactly(fmt: WeightFormat) {
    let mut rng = StdRng::seed_from_u64(3);
    let (n, k) = (37, 96);
    let w = make_w(&mut rng, n, k);
    let hw = HostWeight::from_f32("emb", n, k, &w, fmt).unwrap();
    let want = hw.to_f32();
    let be = Cpu::default();
    let wt = be.upload_weight(&hw).unwrap();
    let ids: Vec<u32> = vec![0, 36, 5, 16, 15, 17, 5];
    let mut out = vec![0.0f32; ids.len() * k];
    be.gather_rows(&wt, &ids, &mut out).unwrap();
    for (t, &id) in ids.iter().enumerate() {
        let id = id as usize;
        assert_eq!(
            out[t * k..(t + 1) * k],
            want[id * k..(id + 1) * k],
            "row {id}"
        );
    }
    assert!(matches!(
        be.gather_rows(&wt, &[37], &mut out),
        Err(BackendError::TokenOutOfRange { id: 37, rows: 37 })
    ));
}

#[test]
fn errors_are_values() {
    let be = Cpu::default();
    let (n, k) = (20, 64);
    let w: Vec<f32> = (0..n * k).map(|i| (i % 13) as f32 - 6.0).collect();
    let hw = HostWeight::from_f32("w", n, k, &w, WeightFormat::Q8_0A8).unwrap();
    let wt = be.upload_weight(&hw).unwrap();
    // x too short, out too short.
    let x = vec![0.5f32; 2 * k];
    let mut out = vec![0.0f32; 3 * n];
    assert!(matches!(
        be.matmul(&x, 3, &wt, &mut out),
        Err(BackendError::Shape { operand: "x", .. })
    ));
    let mut short = vec![0.0f32; n];
    assert!(matches!(
        be.matmul(&x, 2, &wt, &mut short),
        Err(BackendError::Shape { operand: "out", .. })
    ));
    // A non-finite activation cannot be quantized: an error naming the weight and the row.
    let mut bad = x.clone();
    bad[k + 3] = f32::NAN;
    match be.matmul(&bad, 2, &wt, &mut out) {
        Err(BackendError::Invalid { op: "matmul", msg }) => {
            assert!(msg.contains("row 1") && msg.contains('w'), "{msg}")
        }
        other => panic!("expected an error, got {other:?}"),
    }
    // The backend still works after the error (the scratch was handed back).
    be.matmul(&x, 2, &wt, &mut out).unwrap();
    // Columns not a multiple of 32.
    assert!(HostWeight::from_f32("w", 2, 48, &[0.0; 96], WeightFormat::Q8_0A8).is_err());
    let forged = HostWeight {
        name: "forged".into(),
        rows: 3,
        cols: 48,
        data: HostData::Q8_0A8(vec![bytemuck_zero(); 3 * 48 / QK + 1]),
    };
    match be.upload_weight(&forged) {
        Err(BackendError::Weight(msg)) => assert!(msg.contains("forged"), "{msg}"),
        other => panic!("expected a weight error, got {other:?}"),
    }
    // Wrong number of blocks.
    let short_w = HostWeight {
        name: "short".into(),
        rows: 3,
        cols: 64,
        data: HostData::Q8_0A8(vec![bytemuck_zero(); 5]),
    };
    assert!(matches!(
        be.upload_weight(&short_w),
        Err(BackendError::Weight(_))
    ));
}

fn bytemuck_zero() -> BlockQ8_0 {
    BlockQ8_0 {
        d: half::f16::ZERO,
        qs: [0; QK],
    }
}
